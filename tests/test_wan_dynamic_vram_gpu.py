"""The patched Wan model under ComfyUI's Dynamic VRAM (comfy-aimdo), what ComfyUI v0.33 turns on by default on
NVIDIA: a tiny random-weight Wan in a `ModelPatcherDynamic`, loaded by ComfyUI's own `load_models_gpu` (which
applies the object patches), run through `BaseModel.apply_model`; patched equals stock, the head split runs and
the self-checks pass. Skipped without CUDA, without ComfyUI, where this ComfyUI has no Dynamic VRAM, or where
ComfyUI's own Dynamic VRAM cannot run (on the lent H200, a virtualized GPU, its stock weight load fails with
"CUDA error: invalid argument" in comfy-aimdo's buffers, or crashes the process inside comfy-aimdo, before the
pack is involved: a child process tries the stock load first, so such a crash skips this test instead of ending
the test run)."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import comfy_env

pytestmark = [pytest.mark.gpu, pytest.mark.comfyui,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU machine)")]

DIM, HEADS, LAYERS = 512, 16, 2
FRAMES, H, W = 4, 64, 64          # 4 x 32 x 32 = 4,096 tokens an item (cond + uncond), split by the floor below
RUNTIME_FLOOR = 2048              # x Wan's SPLIT_FLOOR_SCALE 2: items of 4,096 tokens split


PROBE = """
import sys
sys.path.insert(0, {tests!r})
import test_wan_dynamic_vram_gpu as t
t.set_up_dynamic_vram()
t.run(t.make_model())
print("stock load ran")
"""


def stock_load_runs() -> None:
    """Skips unless ComfyUI's own Dynamic VRAM load and one model call run in a child process (on some machines
    comfy-aimdo ends the process with a segmentation fault, which no test could catch)."""
    tests = str(Path(__file__).resolve().parent)
    done = subprocess.run([sys.executable, "-c", PROBE.format(tests=tests)], capture_output=True, text=True,
                          timeout=600, cwd=str(Path(tests).parent))
    if done.returncode != 0 or "stock load ran" not in done.stdout:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "Skipped" in line]
        why = f"signal {-done.returncode}" if done.returncode < 0 else ((errors or lines or ["no output"])[-1][:200])
        pytest.skip(f"ComfyUI's Dynamic VRAM does not run on this machine (stock load in a child process: {why})")


@pytest.fixture(scope="module")
def env():
    stock_load_runs()
    return set_up_dynamic_vram()


def set_up_dynamic_vram():
    """ComfyUI loaded the way the benchmark loads it (no comfy.sample / comfy_api), Dynamic VRAM turned on the
    way ComfyUI's main.py turns it on."""
    root = comfy_env.find_comfyui()
    if root is None:
        pytest.skip("no ComfyUI checkout found ($COMFYUI_PATH, the ComfyUI above the pack, ~/ComfyUI)")
    control = pytest.importorskip("comfy_aimdo.control")
    try:   # as ComfyUI's main.py does before it loads anything (each protocol of comfy-aimdo in turn)
        control.init(simple_vram_headroom=None, nvml_pressure=True)
    except TypeError:
        try:
            control.init(simple_vram_headroom=None)
        except TypeError:
            control.init()
    if control.lib is None:
        pytest.skip("comfy-aimdo's library does not load here")
    for name, module in list(sys.modules.items()):   # submodules imported before init bound lib = None
        if name.startswith("comfy_aimdo.") and getattr(module, "lib", control.lib) is None:
            module.lib = control.lib
    from benchmarks import bench
    try:
        bench.load_comfyui_workload(str(root), torch.device("cuda"))
    except (ImportError, SystemExit) as e:
        pytest.skip(f"ComfyUI at {root} does not load: {e}")
    import comfy.cli_args
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher
    if not hasattr(comfy.model_patcher, "ModelPatcherDynamic"):
        pytest.skip("this ComfyUI has no Dynamic VRAM")
    devices = [d for d in comfy.model_management.get_all_torch_devices() if d.type == "cuda"]
    if not devices:
        pytest.skip("ComfyUI was set up for the CPU in this process: tests/comfy_env.py does so unless "
                    "COMFY_ENV_GPU=1")
    devices = [d if d.index is not None else torch.device("cuda", torch.cuda.current_device()) for d in devices]
    headroom = getattr(comfy.cli_args.args, "vram_headroom", 0) or 0
    try:
        ready = control.init_devices((d.index, int(headroom * 1024 ** 3)) for d in devices)
    except TypeError:
        ready = control.init_devices(d.index for d in devices)
    if not ready:
        pytest.skip("comfy-aimdo could not start on this GPU")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    package = bench.PACK_PACKAGE
    modules = {name: importlib.import_module(f"{package}.nodes.{name}") for name in ("patching", "compat")}
    modules["head_split"] = importlib.import_module(f"{package}.qkv_core.head_split")
    return modules


def make_model():
    import comfy.model_management
    import comfy.model_patcher
    cls, cfg = comfy_env._wan_config("t2v", DIM, HEADS, LAYERS, None, 32, 1, {})
    model_config = cls(cfg)
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, device=torch.device("cpu"))
    comfy_env.fill_random_(model.diffusion_model, seed=0)
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


def test_patched_equals_stock_under_dynamic_vram(env, monkeypatch):
    monkeypatch.setattr(env["head_split"], "SPLIT_FLOOR_TOKENS", RUNTIME_FLOOR)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        base = make_model()
        try:
            reference = run(base)
        except RuntimeError as error:   # ComfyUI's own Dynamic VRAM loading, before the pack is involved
            pytest.skip(f"ComfyUI's Dynamic VRAM does not run on this machine (stock load failed: "
                        f"{str(error).splitlines()[0]})")
        env["compat"].forget_verdicts()
        patched, report = env["patching"].apply_patch(base, "High", "sdpa", True)
        assert report.any_patched and not report.skipped_reasons, report.lines()
        with comfy_env.SdpaHeads(torch) as spy:
            out = run(patched)
        again = run(base)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert float((out - reference).abs().max() / reference.abs().max()) <= 1e-4
    assert set(spy.self_heads) == {1}                        # 16 groups of one head
    verdicts = env["compat"]._verdicts
    assert verdicts and all(reason is None for reason in verdicts.values()), verdicts
    assert torch.equal(again, reference)                     # the input model runs stock again
