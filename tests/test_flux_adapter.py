"""The Flux-layout adapter (`nodes/families/flux.py`) against a real ComfyUI: tiny random-weight models built from
ComfyUI's own config classes (Flux 1, Flux 2, Chroma, HunyuanVideo): the patched diffusion model's output
equals ComfyUI's own at every head-split level, with and without block bounds, and the head split really
runs (the split floor is lowered to 0 so that a few hundred tokens split). Skipped without ComfyUI."""
from __future__ import annotations

import pytest

from support import comfy_env
from support.comfy_env import model_forward as forward, rel_err, stock_fallbacks

pytestmark = pytest.mark.comfyui

HEADS = 4

FLUX1 = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 32,
         "hidden_size": 128, "mlp_ratio": 4.0, "num_heads": HEADS, "depth": 1, "depth_single_blocks": 2,
         "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "guidance_embed": False, "patch_size": 2,
         "txt_ids_dims": []}


@pytest.fixture(scope="module")
def env():
    return comfy_env.pack_modules()


def _flux_model(config: dict, config_class: str = "Flux"):
    import torch
    import comfy.ldm.flux.model as flux_model
    import comfy.supported_models
    config = dict(config)
    if "txt_ids_dims" not in getattr(flux_model.FluxParams, "__dataclass_fields__", {}):
        config.pop("txt_ids_dims", None)
    model_config = getattr(comfy.supported_models, config_class)(config)
    model_config.set_inference_dtype(torch.float32, None)
    try:
        model = model_config.get_model({}, device=torch.device("cpu"))
    except Exception as error:   # noqa: BLE001 - a ComfyUI whose model takes other settings
        pytest.skip(f"this ComfyUI builds no tiny {config_class} from this config: {error}")
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    import comfy.model_patcher
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def _flux_inputs(torch, latent=(1, 16, 32, 24), text_tokens=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(*latent, generator=g), timestep=torch.tensor([0.5] * latent[0]),
                context=torch.randn(latent[0], text_tokens, 32, generator=g),
                y=torch.randn(latent[0], 32, generator=g))


def _check_every_level(env, base, inputs, blocks: dict):
    torch = env.torch
    reference = forward(base, inputs)
    for level in env.node.LEVELS:
        for block in (False, True):
            patched, report = env.node.apply_patch(base, level, "sdpa", block)
            assert not report.skipped_reasons, report.lines()
            assert {what: n for (family, what), n in report.patched_counts.items()} == blocks
            env.core.reset_notices()
            with comfy_env.SdpaHeads(torch, check_tokens=0) as spy:
                out = forward(base, inputs, applied=patched)
            assert not stock_fallbacks(env), (level, block)
            assert rel_err(out, reference) <= 1e-5, (level, block, rel_err(out, reference))
            groups = env.core.group_count(HEADS, 10**6, env.node.LEVELS.index(level), split_floor_tokens=0)
            assert HEADS // groups in spy.self_heads, (level, spy.self_heads)   # the split really ran
    assert torch.equal(forward(base, inputs), reference)   # the unpatched model is stock again


def test_flux1_equals_stock_at_every_level(env, split_everything):
    base = _flux_model(FLUX1)
    _check_every_level(env, base, _flux_inputs(env.torch), {"double block": 1, "single block": 2})


def test_flux1_batch_of_two_and_bf16(env, split_everything):
    torch = env.torch
    base = _flux_model(FLUX1)
    inputs = _flux_inputs(torch, latent=(2, 16, 16, 16))
    reference = forward(base, inputs)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    env.core.reset_notices()
    assert rel_err(forward(base, inputs, applied=patched), reference) <= 1e-5
    assert not stock_fallbacks(env)
    base.model.diffusion_model.to(torch.bfloat16)
    inputs16 = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in inputs.items()}
    stock16 = forward(base, inputs16).float()
    ours16 = forward(base, inputs16, applied=patched).float()
    assert not stock_fallbacks(env)
    # bf16 round-off of a reordered computation, next to stock's own distance from float32
    assert rel_err(ours16, reference) <= 2 * rel_err(stock16, reference) + 1e-2


def test_another_nodes_attn1_patch_runs_the_stock_block(env, split_everything):
    torch = env.torch
    base = _flux_model(FLUX1)
    inputs = _flux_inputs(torch)
    seen = []

    def hook(q, k, v, pe=None, attn_mask=None, extra_options=None):
        seen.append(q.shape)
        return {"q": q * 1.5}
    base.set_model_attn1_patch(hook)
    reference = forward(base, inputs)
    count = len(seen)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    env.core.reset_notices()
    out = forward(base, inputs, applied=patched)
    assert any("attn1_patch hook needs whole q/k/v" in line for line in stock_fallbacks(env))
    assert len(seen) == 2 * count   # the hook ran in every block again
    assert rel_err(out, reference) <= 1e-5
