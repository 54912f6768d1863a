"""The reference cache (`nodes/reference_cache.py`, node QKV Reference Cache) on a tiny random-weight Flux with
reference latents (Kontext's `ref_latents`) in a real ComfyUI (skipped without one):
- the definition: a step that reads the cache equals the full model when the references' keys/values could not
  have changed (same latent, same sigma): 16-bit to round-off, q8 within its error, in VRAM or RAM;
- the step that fills it equals stock;
- lifecycle through `comfy.sample.sample`: filled once per conditioning, read afterwards, empty after the run,
  after an exception and after an interrupt; three runs in a row leave nothing; cond and uncond apart;
- what it cannot cache runs as before, said in the log (a model not patched by the pack).
"""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env
from support.comfy_env import model_forward as forward, rel_err

pytestmark = pytest.mark.comfyui

FLUX = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 32,
        "hidden_size": 128, "mlp_ratio": 4.0, "num_heads": 4, "depth": 2, "depth_single_blocks": 2,
        "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "guidance_embed": False, "patch_size": 2,
        "txt_ids_dims": []}
BLOCKS = 4


@pytest.fixture(scope="module")
def env():
    e = comfy_env.pack_modules()
    e.cache = importlib.import_module(e.pack.__name__ + ".nodes.reference_cache")
    e.nodes = importlib.import_module(e.pack.__name__ + ".nodes.patch_node")
    return e


@pytest.fixture
def base():
    """A fresh tiny Flux per test: sampling leaves ComfyUI's loaded model patched (as ComfyUI keeps it), which
    the next test must not see; unloaded after each test."""
    import comfy.model_management
    yield _build()
    comfy.model_management.unload_all_models()


def _build():
    import torch
    import comfy.ldm.flux.model as flux_model
    import comfy.model_patcher
    import comfy.supported_models
    config = dict(FLUX)
    if "txt_ids_dims" not in getattr(flux_model.FluxParams, "__dataclass_fields__", {}):
        config.pop("txt_ids_dims")
    if "ref_latents" not in flux_model.Flux._forward.__code__.co_varnames:
        pytest.skip("this ComfyUI's Flux takes no reference latents")
    model_config = comfy.supported_models.Flux(config)
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, device=torch.device("cpu"))
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def _inputs(torch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(1, 16, 32, 24, generator=g), timestep=torch.tensor([0.6]),
                context=torch.randn(1, 12, 32, generator=g), y=torch.randn(1, 32, generator=g),
                ref_latents=[torch.randn(1, 16, 24, 24, generator=g)])


def _cached(env, base, fmt="16-bit", storage="vram", use_from_step=1, backend="sdpa"):
    patched, report = env.node.apply_patch(base, "High", backend, True)
    assert not report.skipped_reasons, report.lines()
    state = env.cache.ReferenceCache(use_from_step, storage, fmt)
    return env.cache.add_reference_cache(patched, state), state


def _step(torch, sigma, patcher):
    """What a sampler puts in transformer_options: the run's sigmas, this call's, the batch's branches, and the
    patcher's wrappers (a sampler copies them there)."""
    return {"sample_sigmas": torch.tensor([0.6, 0.3, 0.0]), "sigmas": torch.tensor([sigma]), "cond_or_uncond": [0],
            "wrappers": patcher.wrappers}


@pytest.mark.parametrize("fmt,storage,tolerance", [("16-bit", "vram", 1e-5), ("q8", "vram", 3e-2),
                                                     ("q8", "ram", 3e-2)])
def test_a_cached_step_is_the_model_with_the_references_frozen(env, base, fmt, storage, tolerance):
    """Filled at a call, read at the next one with the same latent and sigma (where frozen references are the
    model's own): the same output as the full model; the filling call equals stock. Nothing is left after."""
    torch = env.torch
    inputs = _inputs(torch)
    stock = forward(base, inputs)
    cached, state = _cached(env, base, fmt, storage, use_from_step=0)
    with state.run():
        filled = forward(base, inputs, applied=cached, options=_step(torch, 0.6, cached))
        (entry,) = state.entries.values()
        assert entry.filled and all(layer.populated for layer in entry.cache.layers)
        assert entry.held > 0
        used = forward(base, inputs, applied=cached, options=_step(torch, 0.6, cached))
    assert state.counts == {"fill": 1, "use": 1, "full": 0}
    assert rel_err(filled, stock) < 1e-5
    assert rel_err(used, stock) < tolerance
    assert state.entries is None and not any(layer.populated for layer in entry.cache.layers)
    # a later step reads the same frozen references: not the full model any more (an approximation here)
    later = dict(inputs, timestep=torch.tensor([0.3]))
    with state.run():
        forward(base, inputs, applied=cached, options=_step(torch, 0.6, cached))
        approx = forward(base, later, applied=cached, options=_step(torch, 0.3, cached))
    assert state.counts["use"] == 1 and 0 < rel_err(approx, forward(base, later)) < 1


def _conds(torch, seed=2):
    g = torch.Generator().manual_seed(seed)

    def cond():
        return [[torch.randn(1, 12, 32, generator=g),
                 {"pooled_output": torch.randn(1, 32, generator=g),
                  "reference_latents": [torch.randn(1, 16, 16, 16, generator=g)]}]]
    return cond(), cond()


def _sample(torch, patcher, steps=3, cfg=2.0, callback=None):
    import comfy.sample
    latent = torch.zeros(1, 16, 16, 16)
    positive, negative = _conds(torch)
    return comfy.sample.sample(patcher, comfy.sample.prepare_noise(latent, 0), steps, cfg, "euler", "simple",
                               positive, negative, latent, disable_pbar=True, seed=0, callback=callback)


def test_sampling_fills_once_per_conditioning_and_frees_everything(env, base, monkeypatch):
    torch = env.torch
    cached, state = _cached(env, base, "q8")
    made = []
    new_cache = state.new_cache
    monkeypatch.setattr(state, "new_cache", lambda *a: made.append(new_cache(*a)) or made[-1])
    for _ in range(3):   # three runs in a row: each fills its own caches and frees them
        made.clear()
        _sample(torch, cached)
        assert state.entries is None and made
        assert not any(layer.populated for cache in made for layer in cache.layers)
        assert state.counts["fill"] == len(state.last_run["keys"]) and state.counts["use"] >= 2
        assert not state.last_run["refused"] and state.last_run["bytes"] > 0
    # cond and uncond: each its own entry, never one for both (they are batched or run apart, never mixed)
    branches = [key[0] for key in state.last_run["keys"]]
    assert sorted(b for key in branches for b in key) == [0, 1]


@pytest.mark.parametrize("ending", ["exception", "interrupt"])
def test_the_cache_is_freed_when_a_run_breaks_off(env, base, monkeypatch, ending):
    import comfy.model_management
    torch = env.torch
    cached, state = _cached(env, base, "q8")
    made = []
    new_cache = state.new_cache
    monkeypatch.setattr(state, "new_cache", lambda *a: made.append(new_cache(*a)) or made[-1])
    error = RuntimeError("stopped by the test") if ending == "exception" else \
        comfy.model_management.InterruptProcessingException()

    def callback(step, *args):
        if step == 1:
            assert any(layer.populated for cache in made for layer in cache.layers)   # filled by now
            raise error
    with pytest.raises(type(error)):
        _sample(torch, cached, callback=callback)
    assert state.entries is None and made
    assert not any(layer.populated for cache in made for layer in cache.layers)


def test_a_model_the_pack_does_not_patch_runs_as_before(env, base, caplog):
    """The cache node alone (no QKV Attention before it): no block takes part, so nothing is cached, the step
    runs as stock, and the log says why once."""
    torch = env.torch
    inputs = _inputs(torch)
    state = env.cache.ReferenceCache(0, "vram", "q8")
    alone = env.cache.add_reference_cache(base, state)
    with caplog.at_level("INFO"), state.run():
        first = forward(base, inputs, applied=alone, options=_step(torch, 0.6, alone))
        second = forward(base, inputs, applied=alone, options=_step(torch, 0.6, alone))
    stock = forward(base, inputs)
    assert rel_err(first, stock) < 1e-6 and rel_err(second, stock) < 1e-6   # ComfyUI's own forward both times
    assert state.counts == {"fill": 1, "use": 0, "full": 1}
    assert sum("reference cache: not used: 0 of 4 blocks ran through the pack" in r.getMessage()
               for r in caplog.records) == 1
    with pytest.raises(ValueError, match="storage one of"):
        env.cache.ReferenceCache(1, "disk", "q8")


def test_the_node_returns_a_patched_clone(env, base):
    out = env.nodes.QKVReferenceCache.execute(base, True, 1, "vram", "q8").args[0]
    from comfy.patcher_extension import WrappersMP
    assert out is not base
    for kind in (WrappersMP.OUTER_SAMPLE, WrappersMP.DIFFUSION_MODEL):
        assert len(out.get_wrappers(kind, env.cache.WRAPPER_KEY)) == 1 and not base.get_wrappers(kind,
                                                                                                 env.cache.WRAPPER_KEY)
    assert env.nodes.QKVReferenceCache.execute(base, False, 1, "vram", "q8").args[0] is base


def test_qwen_image_edit_references_are_cached_too(env):
    """Qwen-Image-Edit (its `ref_latents` joined after the image, `[text, image]` joint blocks): the same
    definition check as Flux's, on the contract test's tiny model (2 x (4,096 + 1,024) tokens, split)."""
    import comfy.model_management
    from support import family_cases
    torch = env.torch
    case = family_cases.qwen_image()
    inputs = case.inputs()
    stock = forward(case.patcher, inputs)
    cached, state = _cached(env, case.patcher, "16-bit", "vram", use_from_step=0)
    try:
        with state.run():
            filled = forward(case.patcher, inputs, applied=cached, options=_step(torch, 0.5, cached))
            used = forward(case.patcher, inputs, applied=cached, options=_step(torch, 0.5, cached))
            (entry,) = state.entries.values()
            assert entry.filled and not entry.refused
        assert state.counts == {"fill": 1, "use": 1, "full": 0}
        assert rel_err(filled, stock) < 1e-4 and rel_err(used, stock) < 1e-4
    finally:
        comfy.model_management.unload_all_models()
