"""The patched Wan model under ComfyUI's Dynamic VRAM (comfy-aimdo), what ComfyUI v0.33 turns on by default on
NVIDIA: a tiny random-weight Wan in a `ModelPatcherDynamic`, loaded by ComfyUI's own `load_models_gpu` (which
applies the object patches), run through `BaseModel.apply_model`; patched equals stock, the head split runs and
the self-checks pass.

comfy-aimdo must load before torch does (as ComfyUI's main.py starts it: `benchmarks/dynamic_vram.py`), and a
pytest process has imported torch long before, so the test runs in a child process that starts comfy-aimdo
first and prints its findings; this process checks them. Skipped without CUDA, without ComfyUI, where this
ComfyUI has no Dynamic VRAM or comfy-aimdo cannot start on the GPU (the child says why)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import comfy_env

pytestmark = [pytest.mark.gpu, pytest.mark.comfyui,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU machine)")]

DIM, HEADS, LAYERS = 512, 16, 2
FRAMES, H, W = 4, 64, 64          # 4 x 32 x 32 = 4,096 tokens an item (cond + uncond), split by the floor below
RUNTIME_FLOOR = 2048              # x Wan's split_floor_scale 2: items of 4,096 tokens split
TESTS = Path(__file__).resolve().parent

CHILD = """
import sys
sys.path[:0] = [{tests!r}, {repo!r}]
from benchmarks import dynamic_vram
problem = dynamic_vram.start()   # before torch, as ComfyUI's main.py
if problem:
    print("SKIP " + problem)
    sys.exit(0)
import test_wan_dynamic_vram_gpu as t
t.in_child()
"""


def test_patched_equals_stock_under_dynamic_vram():
    root = comfy_env.find_comfyui()
    if root is None:
        pytest.skip("no ComfyUI checkout found ($COMFYUI_PATH, the ComfyUI above the pack, ~/ComfyUI)")
    pytest.importorskip("comfy_aimdo.control")
    done = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(TESTS), repo=str(TESTS.parent))],
                          capture_output=True, text=True, timeout=600, cwd=str(TESTS.parent),
                          env={**__import__("os").environ, "COMFYUI_PATH": str(root), "COMFY_ENV_GPU": "1"})
    lines = done.stdout.splitlines()
    skip = [line[5:] for line in lines if line.startswith("SKIP ")]
    if skip:
        pytest.skip(f"Dynamic VRAM does not run here: {skip[0]}")
    results = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    assert done.returncode == 0 and results, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    result = results[0]
    assert result["dynamic"] and result["loaded_dynamic"], result
    assert result["rel_err"] <= 1e-4, result
    assert result["self_heads"] == [1], result                 # 16 groups of one head
    assert result["verdicts"] and all(v is None for v in result["verdicts"]), result
    assert result["again_equal"], result                       # the input model runs stock again


def in_child():
    """The test's body, in a process where comfy-aimdo started before torch: prints `RESULT {json}` or `SKIP`."""
    import importlib
    root = comfy_env.find_comfyui()
    from benchmarks import bench, dynamic_vram
    try:
        bench.load_comfyui_workload(str(root), torch.device("cuda"))
    except (ImportError, SystemExit) as e:
        print(f"SKIP ComfyUI at {root} does not load: {e}")
        return
    state = float_state_dict()   # before Dynamic VRAM: its layers take their weights from a state dict
    problem = dynamic_vram.enable()
    if problem:
        print(f"SKIP {problem}")
        return
    package = bench.PACK_PACKAGE
    patching = importlib.import_module(f"{package}.nodes.patching")
    compat = importlib.import_module(f"{package}.nodes.compat")
    head_split = importlib.import_module(f"{package}.qkv_core.head_split")
    head_split.SPLIT_FLOOR_TOKENS = RUNTIME_FLOOR
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    base = make_model(state)
    try:
        reference = run(base)
    except RuntimeError as error:   # ComfyUI's own Dynamic VRAM loading, before the pack is involved
        print(f"SKIP ComfyUI's own Dynamic VRAM load failed: {str(error).splitlines()[0]}")
        return
    compat.forget_verdicts()
    patched, report = patching.apply_patch(base, "High", "sdpa", True)
    assert report.any_patched and not report.skipped_reasons, report.lines()
    with comfy_env.SdpaHeads(torch) as spy:
        out = run(patched)
    again = run(base)
    import comfy.memory_management
    print("RESULT " + json.dumps({
        "dynamic": bool(comfy.memory_management.aimdo_enabled), "loaded_dynamic": bool(base.is_dynamic()),
        "rel_err": float((out - reference).abs().max() / reference.abs().max()),
        "self_heads": sorted(set(spy.self_heads)), "verdicts": list(compat._verdicts.values()),
        "again_equal": bool(torch.equal(again, reference))}), flush=True)


def _model():
    cls, cfg = comfy_env._wan_config("t2v", DIM, HEADS, LAYERS, None, 32, 1, {})
    model_config = cls(cfg)
    model_config.set_inference_dtype(torch.float32, None)
    return model_config.get_model({}, device=torch.device("cpu"))


def float_state_dict() -> dict:
    """The tiny Wan's random weights as a diffusion model file holds them (made with ComfyUI's eager layers)."""
    model = _model()
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    return {f"diffusion_model.{k}": v for k, v in model.diffusion_model.state_dict().items()}


def make_model(state: dict):
    """The model built and loaded as ComfyUI's loader does under Dynamic VRAM (`load_model_weights` of a state
    dict: its layers' weights stay where aimdo puts them), in a `ModelPatcherDynamic`."""
    import comfy.model_management
    import comfy.model_patcher
    model = _model()
    model.load_model_weights(state, "diffusion_model.")
    model.eval()
    patcher = comfy.model_patcher.ModelPatcherDynamic(model, load_device=comfy.model_management.get_torch_device(),
                                                      offload_device=torch.device("cpu"))
    assert patcher.is_dynamic()
    return patcher


def run(patcher):
    """ComfyUI loads `patcher` (its object patches applied) and runs one model call of cond + uncond."""
    import comfy.model_management
    comfy.model_management.load_models_gpu([patcher])
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, FRAMES, H, W, generator=generator).cuda()
    context = torch.randn(2, 16, 32, generator=generator).cuda()
    sigma = torch.full((2,), 0.7, device="cuda")
    options = dict(patcher.model_options.get("transformer_options", {}))
    with torch.no_grad():
        return patcher.model.apply_model(x, sigma, c_crossattn=context, transformer_options=options).float()
