"""The Cosmos predict2 adapter (`nodes/families/cosmos.py`) against a real ComfyUI: tiny random-weight `MiniTrainDIT`s built
from ComfyUI's own config class (`CosmosT2IPredict2`). The patched diffusion model's output equals ComfyUI's own at
every head-split level, with and without block bounds, and the head split really runs (the split floor is lowered
to 0 so that a few hundred tokens split): split-half RoPE on the self-attention, per-head norms, the text
cross-attention, adaLN with and without LoRA, per-frame timesteps, the extra per-block position embedding; a batch
of two and bf16; calls the pack leaves to ComfyUI (other nodes' attn1/attn2/mlp patches, unknown arguments, a
replaced attn_op) and an unsupported layout. Skipped without ComfyUI."""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env
from support.comfy_env import model_forward as forward, rel_err, stock_fallbacks

pytestmark = pytest.mark.comfyui

HEADS = 4
TEXT_DIM = 32
COSMOS = {"image_model": "cosmos_predict2", "in_channels": 16, "out_channels": 16, "max_img_h": 240,
          "max_img_w": 240, "max_frames": 128, "patch_spatial": 2, "patch_temporal": 1, "model_channels": 128,
          "num_blocks": 2, "num_heads": HEADS, "crossattn_emb_channels": TEXT_DIM, "pos_emb_cls": "rope3d",
          "use_adaln_lora": True, "adaln_lora_dim": 32, "extra_per_block_abs_pos_emb": False,
          "concat_padding_mask": True}


@pytest.fixture(scope="module")
def env():
    return comfy_env.pack_modules()


@pytest.fixture(scope="module")
def cosmos(env):
    return importlib.import_module(env.pack.__name__ + ".nodes.families.cosmos")


def cosmos_model(dtype=None, **extra):
    """A tiny Cosmos predict2 DiT (128 channels, 4 heads of 32, 2 blocks) on CPU."""
    import torch
    import comfy.model_patcher
    import comfy.supported_models
    if not hasattr(comfy.supported_models, "CosmosT2IPredict2"):
        pytest.skip("this ComfyUI has no CosmosT2IPredict2")
    model_config = comfy.supported_models.CosmosT2IPredict2({**COSMOS, **extra})
    model_config.set_inference_dtype(dtype or torch.float32, None)
    try:
        model = model_config.get_model({}, device=torch.device("cpu"))
    except Exception as error:   # noqa: BLE001 - a ComfyUI whose model takes other settings
        pytest.skip(f"this ComfyUI builds no tiny Cosmos predict2 from this config: {error}")
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    if dtype is not None:
        model.diffusion_model.to(dtype)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def cosmos_inputs(torch, batch=1, frames=3, side=16, per_frame_timesteps=False, dtype=None, seed=1):
    """`frames` x (side/2)^2 video tokens (3 x 8 x 8 = 192 by default) and 12 text tokens."""
    g = torch.Generator().manual_seed(seed)
    timesteps = torch.rand(batch, frames, generator=g) if per_frame_timesteps else torch.full((batch,), 0.5)
    out = dict(x=torch.randn(batch, 16, frames, side, side, generator=g), timesteps=timesteps,
               context=torch.randn(batch, 12, TEXT_DIM, generator=g))
    return {k: v.to(dtype) for k, v in out.items()} if dtype is not None else out


def patched_counts(report) -> dict:
    return {what: n for (family, what), n in report.patched_counts.items()}


def check_every_level(env, base, inputs, levels=None, tolerance=1e-5, blocks=2):
    torch = env.torch
    levels = env.node.LEVELS if levels is None else levels
    reference = forward(base, inputs)
    for level in levels:
        for block in (False, True):
            patched, report = env.node.apply_patch(base, level, "sdpa", block)
            assert not report.skipped_reasons, report.lines()
            expected = {"attention": 2 * blocks, "block": blocks} if block else {"attention": 2 * blocks}
            assert patched_counts(report) == expected
            env.core.reset_notices()
            with comfy_env.SdpaHeads(torch, check_tokens=0) as spy:
                out = forward(base, inputs, applied=patched)
            assert not stock_fallbacks(env), (level, block)
            assert rel_err(out, reference) <= tolerance, (level, block, rel_err(out, reference))
            groups = env.core.group_count(HEADS, 10**6, env.node.LEVELS.index(level), split_floor_tokens=0)
            assert HEADS // groups in spy.self_heads, (level, spy.self_heads)   # the split really ran
    assert torch.equal(forward(base, inputs), reference)   # the unpatched model is stock again


@pytest.mark.parametrize("settings", [{}, {"use_adaln_lora": False}, {"extra_per_block_abs_pos_emb": True}],
                         ids=["adaln_lora", "adaln", "extra_pos_emb"])
def test_equals_stock_at_every_level(env, split_everything, settings):
    check_every_level(env, cosmos_model(**settings), cosmos_inputs(env.torch))


def test_anima_runs_on_the_cosmos_blocks(env, split_everything):
    """Anima (`comfy/ldm/anima`: a Cosmos predict2 DiT with an LLM text adapter in front) takes the Cosmos adapter:
    patched equals stock at every level, and the split runs."""
    import torch
    import comfy.model_patcher
    import comfy.supported_models
    if not hasattr(comfy.supported_models, "Anima"):
        pytest.skip("this ComfyUI has no Anima")
    model_config = comfy.supported_models.Anima({**COSMOS, "image_model": "anima"})
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, device=torch.device("cpu"))
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    base = comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))
    check_every_level(env, base, cosmos_inputs(torch))


def test_attention_changes_the_output(env):
    """The tiny model's attention matters: its output moves visibly when a self-attention is dropped (so the
    equality above is not that of a model that ignores its attention)."""
    torch = env.torch
    base = cosmos_model()
    inputs = cosmos_inputs(torch)
    reference = forward(base, inputs)
    attn = base.model.diffusion_model.blocks[0].self_attn
    handle = attn.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
    try:
        assert rel_err(forward(base, inputs), reference) > 1e-2
    finally:
        handle.remove()
    cross = base.model.diffusion_model.blocks[1].cross_attn
    handle = cross.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
    try:
        assert rel_err(forward(base, inputs), reference) > 1e-2
    finally:
        handle.remove()


def test_per_frame_timesteps_and_rows_of_a_frame(env, split_everything):
    """Per-frame timesteps (a modulation per frame: token chunks that straddle frames) and frames of more than
    the self-check's tokens (it takes the first rows of the first frame)."""
    torch = env.torch
    check_every_level(env, cosmos_model(), cosmos_inputs(torch, frames=3, per_frame_timesteps=True),
                      levels=("High",))
    check_every_level(env, cosmos_model(), cosmos_inputs(torch, frames=2, side=40), levels=("Medium",))


@pytest.mark.parametrize("hook", ["attn1_patch", "attn2_patch", "mlp_patch"])
def test_other_nodes_hooks_run_stock(env, split_everything, hook):
    """Other nodes' hooks ComfyUI calls on whole inputs (v0.33+): the modules that call them run as ComfyUI's,
    with one notice, and the output equals stock with the hook."""
    torch = env.torch
    base = cosmos_model()
    inputs = cosmos_inputs(torch)
    calls = []

    def attention_hook(q, k, v, pe=None, attn_mask=None, extra_options=None):
        calls.append(hook)
        return {"q": q * 1.5}

    def mlp_hook(args):
        calls.append(hook)
        return {**args, "x": args["x"] * 1.5}
    hooked = base.clone()
    hooked.model_options.setdefault("transformer_options", {}).setdefault("patches", {})[hook] = \
        [mlp_hook if hook == "mlp_patch" else attention_hook]
    reference = forward(hooked, inputs)
    if not calls:
        pytest.skip(f"this ComfyUI's Cosmos calls no {hook}")
    patched, _ = env.node.apply_patch(hooked, "High", "sdpa", True)
    env.core.reset_notices()
    out = forward(base, inputs, applied=patched)
    assert [line for line in stock_fallbacks(env) if hook in line]
    assert rel_err(out, reference) <= 1e-5


def test_calls_left_to_comfyui(env, cosmos, split_everything):
    """A replaced attn_op and a self-attention called with a context run ComfyUI's own forward, equal to it; an
    ordinary call runs the pack's (an argument the pack does not know: the contract test)."""
    torch = env.torch
    base = cosmos_model()
    inputs = cosmos_inputs(torch)
    attn = base.model.diffusion_model.blocks[0].self_attn
    args, call = comfy_env.first_call(attn, lambda: forward(base, inputs))
    x = args[0]
    call = dict(call, **({"rope_emb": args[2]} if len(args) > 2 else {}))
    stock = type(attn).forward
    ours = cosmos.attention_forward(attn, env.node.QKVConfig(3, "sdpa", True))
    with torch.no_grad():
        env.core.reset_notices()
        out = ours(x, **dict(call, context=x))
        assert torch.equal(out, stock(attn, x, **dict(call, context=x)))
        assert [line for line in stock_fallbacks(env) if "with a context" in line]
        out = ours(x, **call)   # an ordinary call: the pack's
        assert not stock_fallbacks(env)
        assert rel_err(out, stock(attn, x, **call)) <= 1e-5
        op = attn.attn_op
        attn.attn_op = lambda q, k, v, transformer_options={}: op(q, k, v, transformer_options=transformer_options)
        try:
            out = ours(x, **call)
            assert torch.equal(out, stock(attn, x, **call))
            assert [line for line in stock_fallbacks(env) if "attn_op" in line]
        finally:
            attn.attn_op = op


def test_unsupported_layout_passes_through(env, split_everything):
    """An attention module the pack's forward does not describe (here: a v_norm of its own) keeps ComfyUI's
    forward, and so does its block (one report line each); the rest is patched, equal to stock."""
    torch = env.torch
    base = cosmos_model()
    inputs = cosmos_inputs(torch)
    base.model.diffusion_model.blocks[1].cross_attn.v_norm = torch.nn.LayerNorm(32, elementwise_affine=False)
    reference = forward(base, inputs)
    patched, report = env.node.apply_patch(base, "High", "sdpa", True)
    assert patched_counts(report) == {"attention": 3, "block": 1}
    lines = sorted(line for line in report.lines() if "runs as before" in line)
    assert lines == ["Cosmos: diffusion_model.blocks.1 (block) runs as before: cross_attn: v_norm is not an Identity",
                     "Cosmos: diffusion_model.blocks.1.cross_attn runs as before: v_norm is not an Identity"]
    env.core.reset_notices()
    assert rel_err(forward(base, inputs, applied=patched), reference) <= 1e-5
    assert not stock_fallbacks(env)


def test_adapter_contract(env, cosmos):
    import torch
    model = cosmos_model().model.diffusion_model
    assert cosmos.matches(model)
    assert cosmos.tokens_per_item(model, (1, 16, 3, 17, 16)) == 3 * 9 * 8
    assert cosmos.kv_heads(model) == HEADS
    assert cosmos.splits_projections(model) is None
    assert not cosmos.matches(torch.nn.Linear(2, 2))
