"""The SD3-layout adapter (`nodes/families/sd3.py`) against a real ComfyUI: tiny random-weight MMDiTs built from ComfyUI's
own SD3 config class (SD3 Medium's layout, SD3.5 Large's per-head RMSNorm, SD3.5 Medium's `x_block_self_attn`
blocks, and the other layouts the block takes: LayerNorm q/k, RMSNorm blocks, SwiGLU, scale-only modulation):
the patched diffusion model's output equals ComfyUI's own at every head-split level, with and without block
bounds, and the head split really runs (the split floor is lowered to 0). The last block's context is
`pre_only` in each. Skipped without ComfyUI."""
from __future__ import annotations

import pytest

from support import comfy_env
from support.comfy_env import model_forward as forward, rel_err, stock_fallbacks

pytestmark = pytest.mark.comfyui

DEPTH = 4          # MMDiT: depth heads of 64 channels (hidden 256)
HEADS = DEPTH
CONTEXT = 32

SD3_MEDIUM = {"in_channels": 16, "pos_embed_scaling_factor": None, "depth": DEPTH, "num_blocks": 3,
              "patch_size": 2, "out_channels": 16, "adm_in_channels": 32, "pos_embed_max_size": 32,
              "num_patches": 32 * 32, "qkv_bias": True,
              "context_embedder_config": {"target": "torch.nn.Linear",
                                          "params": {"in_features": CONTEXT, "out_features": 64 * DEPTH}}}
LAYOUTS = {
    "sd3_medium": {},
    "sd35_large": {"qk_norm": "rms"},
    "sd35_medium": {"qk_norm": "rms", "x_block_self_attn_layers": [0, 1]},
    "ln_rmsnorm_swiglu": {"qk_norm": "ln", "rmsnorm": True, "swiglu": True},
    "scale_mod_only": {"scale_mod_only": True},
}


@pytest.fixture(scope="module")
def env():
    return comfy_env.pack_modules()


def sd3_adapter(env):
    """The SD3 adapter module (nodes/families/sd3.py) of the pack under test."""
    import importlib
    return importlib.import_module(env.pack.__name__ + ".nodes.families.sd3")


def fill_norms_(module, seed=5):
    """Per-head q/k norm weights near 1 (comfy_env.fill_random_ takes `ln_q.weight` for a bias), and the
    position table (a buffer ComfyUI leaves uninitialised) seeded."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if getattr(module, "pos_embed", None) is not None:
            module.pos_embed.copy_(0.5 * torch.randn(module.pos_embed.shape, generator=g))
        for name, p in module.named_parameters():
            if ".ln_q." in name or ".ln_k." in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))


def sd3_model(layout: str = "sd3_medium", **config):
    """A float32 ModelPatcher of the tiny MMDiT of `layout` (`config`: more settings on top)."""
    import torch
    import comfy.model_patcher
    import comfy.supported_models
    model_config = comfy.supported_models.SD3({**SD3_MEDIUM, **LAYOUTS[layout], **config})
    model_config.set_inference_dtype(torch.float32, None)
    try:
        model = model_config.get_model({}, device=torch.device("cpu"))
    except Exception as error:   # noqa: BLE001 - a ComfyUI whose model takes other settings
        pytest.skip(f"this ComfyUI builds no tiny SD3 ({layout}): {type(error).__name__}: {error}")
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    fill_norms_(model.diffusion_model)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def sd3_inputs(torch, latent=(1, 16, 32, 24), text_tokens=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(*latent, generator=g), timesteps=torch.tensor([500.0] * latent[0]),
                context=torch.randn(latent[0], text_tokens, CONTEXT, generator=g),
                y=torch.randn(latent[0], 32, generator=g))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_equals_stock_at_every_level(env, split_everything, layout):
    torch = env.torch
    base = sd3_model(layout)
    inputs = sd3_inputs(torch)
    reference = forward(base, inputs)
    for level in env.node.LEVELS:
        for block in (False, True):
            patched, report = env.node.apply_patch(base, level, "sdpa", block)
            assert not report.skipped_reasons, report.lines()
            assert {what: n for (family, what), n in report.patched_counts.items()} == {"joint block": 3}
            env.core.reset_notices()
            with comfy_env.SdpaHeads(torch, check_tokens=0) as spy:
                out = forward(base, inputs, applied=patched)
            assert not stock_fallbacks(env), (layout, level, block)
            assert rel_err(out, reference) <= 1e-5, (layout, level, block, rel_err(out, reference))
            groups = env.core.group_count(HEADS, 10**6, env.node.LEVELS.index(level), split_floor_tokens=0)
            assert HEADS // groups in spy.self_heads, (level, spy.self_heads)   # the split really ran
    assert torch.equal(forward(base, inputs), reference)   # the unpatched model is stock again


def test_block_inputs_are_not_written(env, split_everything):
    """ComfyUI's block returns new tensors: the patched one leaves its inputs as they were (a context straight
    from the conditioning, a patches_replace wrapper reading its arguments)."""
    torch = env.torch
    base = sd3_model("sd35_medium")
    sd3 = sd3_adapter(env)
    config = env.node.QKVConfig(level=3, backend="sdpa", block=True)
    g = torch.Generator().manual_seed(3)
    for index in (0, 2):   # an x_block_self_attn block and the pre_only one
        block = base.model.diffusion_model.joint_blocks[index]
        context, x, c = torch.randn(1, 12, 256, generator=g), torch.randn(1, 300, 256, generator=g), \
            torch.randn(1, 256, generator=g)
        kept = (context.clone(), x.clone())
        with torch.no_grad():
            stock = block(context.clone(), x.clone(), c=c)
            ours = sd3.block_forward(block, config)(context, x, c=c, transformer_options={})
        assert torch.equal(context, kept[0]) and torch.equal(x, kept[1])
        assert (ours[0] is None) == (stock[0] is None) == (index == 2)
        assert rel_err(ours[1], stock[1]) <= 1e-5


def test_patches_replace_blocks_keep_working(env, split_everything):
    """A `patches_replace["dit"]` block (e.g. another node's wrapper) calls the patched forward through
    ComfyUI's `original_block`."""
    torch = env.torch
    base = sd3_model("sd35_large")
    inputs = sd3_inputs(torch)
    calls = []

    def replace(args, extra):
        calls.append(1)
        out = extra["original_block"](args)
        return {"txt": out["txt"], "img": out["img"] * 0.5 + args["img"] * 0.5}   # reads its input after
    base.set_model_patch_replace(replace, "dit", "double_block", 1)
    reference = forward(base, inputs)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    env.core.reset_notices()
    out = forward(base, inputs, applied=patched)
    assert not stock_fallbacks(env)
    assert len(calls) == 2
    assert rel_err(out, reference) <= 1e-5


def test_unknown_argument_and_layout_run_stock(env, split_everything):
    torch = env.torch
    base = sd3_model("sd3_medium")
    block = base.model.diffusion_model.joint_blocks[0]
    forward_ = sd3_adapter(env).block_forward(block, env.node.QKVConfig(level=3, backend="sdpa", block=True))
    g = torch.Generator().manual_seed(4)
    context, x, c = torch.randn(1, 12, 256, generator=g), torch.randn(1, 64, 256, generator=g), \
        torch.randn(1, 256, generator=g)
    env.core.reset_notices()
    with torch.no_grad():
        with pytest.raises(TypeError):   # ComfyUI's own block does not take it either: its error, not ours
            forward_(context, x, c=c, new_argument=1)
    assert any("new_argument" in line for line in stock_fallbacks(env))

    class OtherMLP(torch.nn.Module):
        def forward(self, t):
            return t
    block.x_block.mlp = OtherMLP()
    patched, report = env.node.apply_patch(base, "High", "sdpa", True)
    assert any("MLP" in reason and any("joint_blocks.0" in path for path in paths)
               for (_, reason), paths in report.skipped_reasons.items()), report.lines()
    assert {what: n for (_, what), n in report.patched_counts.items()} == {"joint block": 2}


def test_compare_takes_none_pairs_as_equal(env):
    """The last block's context is None in both outputs: equal; None against a tensor is not."""
    torch = env.torch
    compat = env.compat
    x = torch.randn(2, 8, 16)
    assert compat.compare((None, x), (None, x.clone()), base=(None, torch.zeros_like(x))) is None
    assert compat.compare((None, x), (x.clone(), x.clone())) is not None
    assert compat.compare((x, x), (None, x.clone())) is not None
