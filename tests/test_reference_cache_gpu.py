"""The reference cache on CUDA (skipped without it; run with `COMFY_ENV_GPU=1 pytest -m gpu`): the native
format through the node on SageAttention 2's staged core (sm90), and VRAM back to its level after sampling runs,
on a tiny bf16 Flux (head dim 128) in a real ComfyUI."""
from __future__ import annotations

import importlib

import pytest
import torch

from support import comfy_env
from support.comfy_env import model_forward as forward, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.comfyui,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU machine)")]

FLUX = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 32,
        "hidden_size": 256, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 2,
        "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True, "guidance_embed": False, "patch_size": 2,
        "txt_ids_dims": []}


def _sage2() -> bool:
    """SageAttention 2 on an sm90 GPU (support/sage2.py's check: its version read as the pack reads it)."""
    from support.sage2 import sage2_reason
    return sage2_reason() is None and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(scope="module")
def env():
    """The adapters and the cache inside the benchmark's package for the pack (as the other GPU tests load
    them): `nodes/__init__.py` and its `comfy_api` (PyAV, pydantic, ...) are not needed on a bare GPU machine."""
    from types import SimpleNamespace
    from benchmarks import bench
    root = comfy_env.find_comfyui()
    if root is None:
        pytest.skip("no ComfyUI checkout found ($COMFYUI_PATH, the ComfyUI above the pack, ~/ComfyUI)")
    bench.load_comfyui_workload(str(root), torch.device("cuda"))
    package = bench.PACK_PACKAGE
    return SimpleNamespace(node=importlib.import_module(f"{package}.nodes.patching"),
                           cache=importlib.import_module(f"{package}.nodes.reference_cache"))


@pytest.fixture
def base(env):
    import comfy.ldm.flux.model as flux_model
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models
    config = dict(FLUX)
    if "txt_ids_dims" not in getattr(flux_model.FluxParams, "__dataclass_fields__", {}):
        config.pop("txt_ids_dims")
    model_config = comfy.supported_models.Flux(config)
    model_config.set_inference_dtype(torch.bfloat16, None)
    model = model_config.get_model({}, device=torch.device("cuda"))
    model.diffusion_model.to(device="cuda", dtype=torch.bfloat16)
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    yield comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cuda"),
                                           offload_device=torch.device("cuda"))
    comfy.model_management.unload_all_models()


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g).bfloat16()
    return dict(x=randn(1, 16, 64, 64), timestep=torch.tensor([0.6], device="cuda"), context=randn(1, 12, 32),
                y=randn(1, 32), ref_latents=[randn(1, 16, 64, 64)])


def _options(patcher, sigma=0.6):
    return {"sample_sigmas": torch.tensor([0.6, 0.3, 0.0]), "sigmas": torch.tensor([sigma]), "cond_or_uncond": [0],
            "wrappers": patcher.wrappers}


@pytest.mark.skipif(not _sage2(), reason="the native format needs SageAttention 2 on an sm90 GPU")
def test_native_cache_through_the_node_on_the_staged_core(env, base):
    inputs = _inputs()
    patched, _ = env.node.apply_patch(base, "High", "sage", True)
    plain = forward(base, inputs, applied=patched)          # SageAttention over [image, references]
    state = env.cache.ReferenceCache(0, "vram", "native")
    cached = env.cache.add_reference_cache(patched, state)
    with state.run():
        filled = forward(base, inputs, applied=cached, options=_options(cached))
        (entry,) = state.entries.values()
        assert entry.filled and all(layer._data[0] == "native" for layer in entry.cache.layers)
        used = forward(base, inputs, applied=cached, options=_options(cached))
    assert state.counts == {"fill": 1, "use": 1, "full": 0}
    assert rel_err(filled, plain) < 1e-2          # capturing changes nothing
    assert rel_err(used, plain) < 5e-2            # the prefix pass merged by LSE: SageAttention's own error


def test_vram_returns_to_its_level_after_sampling_runs(env, base):
    import comfy.sample
    patched, _ = env.node.apply_patch(base, "High", "auto", True)
    state = env.cache.ReferenceCache(1, "vram", "q8")
    cached = env.cache.add_reference_cache(patched, state)
    g = torch.Generator().manual_seed(2)

    def cond():
        return [[torch.randn(1, 12, 32, generator=g), {"pooled_output": torch.randn(1, 32, generator=g),
                                                         "reference_latents": [torch.randn(1, 16, 64, 64, generator=g)]}]]
    positive, negative = cond(), cond()
    latent = torch.zeros(1, 16, 64, 64)
    levels = []
    for _ in range(3):
        comfy.sample.sample(cached, comfy.sample.prepare_noise(latent, 0), 3, 2.0, "euler", "simple", positive,
                            negative, latent, disable_pbar=True, seed=0)
        torch.cuda.synchronize()
        levels.append(torch.cuda.memory_allocated())
        assert state.counts["use"] >= 2 and state.last_run["bytes"] > 0 and not state.last_run["refused"]
    assert max(levels) - min(levels) < 2 ** 20, levels   # nothing of a run stays (1 MiB: allocator rounding)
