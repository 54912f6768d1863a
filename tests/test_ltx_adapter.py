"""The LTX adapter (`nodes/families/ltx.py`) against a real ComfyUI: tiny random-weight LTX-Video and LTX-2 (audio-video)
models built from ComfyUI's own config classes. The patched diffusion model's output equals ComfyUI's own at
every head-split level, with and without block bounds, and the head split really runs (the split floor is
lowered to 0 so that a few hundred tokens split): both RoPE layouts (interleaved pairs, the halves of each
head), the text padding mask of the cross-attention, per-token timesteps, cross-attention AdaLN, LTX-2's audio
streams, audio-video cross-attention and per-head gates; a batch of two and bf16; sampling; a LoRA; calls the
pack leaves to ComfyUI (a guide attention mask, STG, unknown arguments, an unsupported layout); block
replacements. Skipped without ComfyUI."""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env
from support.comfy_env import model_forward as forward, rel_err, stock_fallbacks

pytestmark = pytest.mark.comfyui

HEADS = 4
CAPTION = 32
LTXV = {"image_model": "ltxv", "in_channels": 16, "cross_attention_dim": 128, "attention_head_dim": 32,
        "num_attention_heads": HEADS, "caption_channels": CAPTION, "num_layers": 2}
LTXAV = {"image_model": "ltxav", "in_channels": 16, "audio_in_channels": 128, "cross_attention_dim": 128,
         "audio_cross_attention_dim": 64, "attention_head_dim": 32, "audio_attention_head_dim": 16,
         "num_attention_heads": HEADS, "audio_num_attention_heads": HEADS, "caption_channels": CAPTION,
         "num_layers": 2, "apply_gated_attention": True, "connector_attention_head_dim": 16,
         "connector_num_attention_heads": 2, "connector_num_layers": 1}


@pytest.fixture(scope="module")
def env():
    return comfy_env.pack_modules()


@pytest.fixture(scope="module")
def ltx(env):
    return importlib.import_module(env.pack.__name__ + ".nodes.families.ltx")


def ltx_model(config: dict = LTXV, config_class: str = "LTXV", **extra):
    """A tiny LTX model; its modulation tables and gates are drawn wide enough that every attention visibly
    changes the output."""
    import torch
    import comfy.model_patcher
    import comfy.supported_models
    if not hasattr(comfy.supported_models, config_class):
        pytest.skip(f"this ComfyUI has no {config_class}")
    model_config = getattr(comfy.supported_models, config_class)({**config, **extra})
    model_config.set_inference_dtype(torch.float32, None)
    try:
        model = model_config.get_model({}, device=torch.device("cpu"))
    except Exception as error:   # noqa: BLE001 - a ComfyUI whose model takes other settings
        pytest.skip(f"this ComfyUI builds no tiny {config_class} from this config: {error}")
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.diffusion_model.named_parameters():
            if "scale_shift_table" in name or "to_gate_logits" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def text_mask(torch, batch: int, tokens: int = 12, padding: int = 3):
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[:, tokens - padding:] = 0
    return mask


def ltx_inputs(torch, latent=(1, 16, 3, 8, 8), text_tokens=12, seed=1, per_token_timestep=False):
    """LTX-Video's arguments: 3 x 8 x 8 = 192 video tokens, 12 text tokens of which the last 3 are padding."""
    g = torch.Generator().manual_seed(seed)
    batch, tokens = latent[0], latent[2] * latent[3] * latent[4]
    timestep = torch.rand(batch, tokens, generator=g) if per_token_timestep else torch.tensor([0.5] * batch)
    return dict(x=torch.randn(*latent, generator=g), timestep=timestep,
                context=torch.randn(batch, text_tokens, CAPTION, generator=g),
                attention_mask=text_mask(torch, batch, text_tokens), frame_rate=25)


def ltx2_inputs(torch, seed=1, audio_tokens=40):
    g = torch.Generator().manual_seed(seed)
    return dict(x=[torch.randn(1, 16, 3, 8, 8, generator=g), torch.randn(1, 8, audio_tokens, 16, generator=g)],
                timestep=torch.tensor([0.5]), context=torch.randn(1, 12, 2 * CAPTION, generator=g),
                attention_mask=text_mask(torch, 1), frame_rate=25, audio_length=audio_tokens)


def patched_counts(report) -> dict:
    return {what: n for (family, what), n in report.patched_counts.items()}


def check_every_level(env, base, inputs, counts: dict, levels=None, skipped=()):
    """Patched == stock at `levels` with and without block bounds, the split really running. `counts`: the
    report's patched modules with block bounds on (without: the attention modules only)."""
    torch = env.torch
    levels = env.node.LEVELS if levels is None else levels
    reference = forward(base, inputs)
    for level in levels:
        for block in (False, True):
            patched, report = env.node.apply_patch(base, level, "sdpa", block)
            reasons = sorted({reason for (_, reason) in report.skipped_reasons})
            assert reasons == (sorted(skipped) if block else []), report.lines()
            expected = counts if block else {"attention": counts["attention"]}
            assert patched_counts(report) == expected
            env.core.reset_notices()
            with comfy_env.SdpaHeads(torch, check_tokens=0) as spy:
                out = forward(base, inputs, applied=patched)
            assert not stock_fallbacks(env), (level, block)
            assert rel_err(out, reference) <= 1e-5, (level, block, rel_err(out, reference))
            groups = env.core.group_count(HEADS, 10**6, env.node.LEVELS.index(level), split_floor_tokens=0)
            assert HEADS // groups in spy.self_heads, (level, spy.self_heads)   # the split really ran
    again = forward(base, inputs)   # the unpatched model is stock again
    assert all(torch.equal(a, b) for a, b in zip(again, reference)) if isinstance(again, list) else \
        torch.equal(again, reference)


@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_ltxv_equals_stock_at_every_level(env, split_everything, rope_type):
    """Both RoPE layouts (pairs of adjacent channels, the halves of each head), the text padding mask."""
    base = ltx_model(rope_type=rope_type)
    check_every_level(env, base, ltx_inputs(env.torch), {"attention": 4, "block": 2})


def test_text_padding_mask_is_honoured(env, split_everything):
    """The padding mask changes ComfyUI's output, and the pack's with it."""
    torch = env.torch
    base = ltx_model()
    inputs = ltx_inputs(torch)
    unmasked = dict(inputs, attention_mask=torch.ones_like(inputs["attention_mask"]))
    reference, reference_unmasked = forward(base, inputs), forward(base, unmasked)
    assert rel_err(reference_unmasked, reference) > 1e-3
    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    env.core.reset_notices()
    assert rel_err(forward(base, inputs, applied=patched), reference) <= 1e-5
    assert rel_err(forward(base, unmasked, applied=patched), reference_unmasked) <= 1e-5
    assert not stock_fallbacks(env)


def test_per_token_timesteps_and_cross_attention_adaln(env, split_everything):
    """A timestep per token (a denoise mask), and cross-attention AdaLN (modulated queries and context)."""
    torch = env.torch
    base = ltx_model(cross_attention_adaln=True)
    if not getattr(base.model.diffusion_model.transformer_blocks[0], "cross_attention_adaln", False):
        pytest.skip("this ComfyUI's LTX has no cross-attention AdaLN")
    check_every_level(env, base, ltx_inputs(torch, per_token_timestep=True), {"attention": 4, "block": 2},
                      levels=("Off", "High"))


@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_ltx2_audio_video_equals_stock(env, split_everything, rope_type):
    """LTX-2: video and audio self- and text cross-attention, audio <-> video cross-attention with RoPE on both
    sides, per-head gates. Its audio-video block keeps ComfyUI's forward (one report line)."""
    base = ltx_model(LTXAV, "LTXAV", rope_type=rope_type)
    check_every_level(env, base, ltx2_inputs(env.torch), {"attention": 12}, levels=("Off", "Low", "High"),
                      skipped=["BasicAVTransformerBlock keeps ComfyUI's forward (its attention modules are "
                               "patched)"])


def test_calls_left_to_comfyui(env, ltx, split_everything):
    """A guide attention mask (ComfyUI partitions the queries itself) and STG's skipped self-attention run
    ComfyUI's own forward, equal to it (an argument the pack does not know: the contract test)."""
    torch = env.torch
    import comfy.ldm.lightricks.model as ltx_model_module
    base = ltx_model()
    inputs = ltx_inputs(torch)
    attn1 = base.model.diffusion_model.transformer_blocks[0].attn1
    (x,), call = comfy_env.first_call(attn1, lambda: forward(base, inputs))
    stock = type(attn1).forward
    ours = ltx.attention_forward(attn1, env.node.QKVConfig(3, "sdpa", True))
    if hasattr(ltx_model_module, "GuideAttentionMask"):
        tokens = x.shape[1]
        weights = torch.full((1, 64), 0.5)
        mask = ltx_model_module.GuideAttentionMask(tokens, tokens - 64, 64, weights)
        with torch.no_grad():
            env.core.reset_notices()
            out = ours(x, **dict(call, mask=mask))
            assert torch.equal(out, stock(attn1, x, **dict(call, mask=mask)))
        assert [line for line in stock_fallbacks(env) if "GuideAttentionMask" in line]
    with torch.no_grad():
        env.core.reset_notices()
        out = ours(x, **dict(call, transformer_options={"stg_skip_self_attn": True}))
        assert torch.equal(out, stock(attn1, x, **dict(call, transformer_options={"stg_skip_self_attn": True})))
        assert [line for line in stock_fallbacks(env) if "STG" in line]
        out = ours(x, **call)   # an ordinary call: the pack's
        assert not stock_fallbacks(env)
        assert rel_err(out, stock(attn1, x, **call)) <= 1e-5


def test_unsupported_layout_passes_through(env, split_everything):
    """An attention module the pack's forward does not describe (here: an attention precision of its own) keeps
    ComfyUI's forward, and so does its block (one report line each); the rest is patched, equal to stock."""
    torch = env.torch
    base = ltx_model()
    inputs = ltx_inputs(torch)
    base.model.diffusion_model.transformer_blocks[1].attn2.attn_precision = torch.float32
    reference = forward(base, inputs)
    patched, report = env.node.apply_patch(base, "High", "sdpa", True)
    assert patched_counts(report) == {"attention": 3, "block": 1}
    lines = sorted(line for line in report.lines() if "runs as before" in line)
    reason = "attn_precision torch.float32 (the pack's kernels keep the inputs' precision)"
    assert lines == [f"LTX: diffusion_model.transformer_blocks.1 (block) runs as before: attn2: {reason}",
                     f"LTX: diffusion_model.transformer_blocks.1.attn2 runs as before: {reason}"]
    env.core.reset_notices()
    assert rel_err(forward(base, inputs, applied=patched), reference) <= 1e-5
    assert not stock_fallbacks(env)


@pytest.mark.parametrize("bounds", [False, True], ids=["attention", "block"])
def test_a_dit_block_replacement_wraps_the_pack_block(env, split_everything, bounds):
    """`patches_replace["dit"]` (block swap, caching nodes): the replacement calls the original block, which
    runs the pack's forwards."""
    torch = env.torch
    base = ltx_model()
    inputs = ltx_inputs(torch)
    calls = []

    def replace(args, extra):
        calls.append(1)
        out = extra["original_block"](args)
        return {"img": out["img"] * 0.9}
    hooked = base.clone()
    hooked.set_model_patch_replace(replace, "dit", "double_block", 0)
    reference = forward(hooked, inputs)
    assert calls == [1]
    patched, _ = env.node.apply_patch(hooked, "High", "sdpa", bounds)
    env.core.reset_notices()
    with comfy_env.SdpaHeads(torch, check_tokens=0) as spy:
        assert rel_err(forward(base, inputs, applied=patched), reference) <= 1e-5
    assert calls == [1, 1]
    assert not stock_fallbacks(env)
    assert 1 in spy.self_heads


def test_short_sequences_run_comfyuis_own_blocks(env, ltx):
    """Under LTX's split floor (3x the runtime's default, not the tests' 0) LTX's blocks and attention run
    ComfyUI's own forwards (the pack's were 1.6x slower on a whole model at 768x512 x 97 on an H200, 2.8x at
    1216x704 x 121, for a saving of ~0.3-0.8 GiB): the output is stock's exactly, and the log says why (the
    other tests, with a floor of 0, run the pack's forwards on the same tiny model)."""
    import torch
    assert env.core.head_split.SPLIT_FLOOR_TOKENS == 8192 and ltx.SPEC.measured.split_floor_scale == 3
    base = ltx_model()
    inputs = ltx_inputs(torch)
    reference = forward(base, inputs)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    env.core.reset_notices()
    out = forward(base, inputs, applied=patched)
    assert torch.equal(out, reference)
    said = comfy_env.lines_of_kind(env.core.drain_notices(), env.core.notices.SHORT_CALL)
    assert {line.split(":")[0] for line in said} == {"[QKV] LTX block", "[QKV] LTX attention"}   # once each
    assert all("tokens, under the split floor of 24576: faster there" in line for line in said), said


def test_the_split_floor_is_three_times_the_runtimes(env, ltx):
    """LTX's calls split from its `split_floor_scale` x the runtime's floor (`Family.configure`): the runtime is told so, and the planner
    and the memory estimate decide as the runtime does (1216x704 x 121 whole, x 257 split)."""
    import importlib
    dispatch = importlib.import_module(env.pack.__name__ + ".nodes.dispatch")
    planner = importlib.import_module(env.pack.__name__ + ".nodes.planner")
    config = dispatch.QKVConfig(3, "sdpa", True)
    ltx_config = ltx.SPEC.configure(config)
    assert config.policy.effective_split_floor_tokens == 8192
    assert ltx_config.policy.effective_split_floor_tokens == 24576
    assert ltx_config.policy.short_runs_stock and not config.policy.short_runs_stock
    assert dispatch.attention_kwargs(ltx_config, {})["split_floor_tokens"] == 24576
    assert "split_floor_tokens" not in dispatch.attention_kwargs(config, {})
    kandinsky5 = importlib.import_module(env.pack.__name__ + ".nodes.families.kandinsky5")
    assert kandinsky5.SPEC.configure(config) is config
    model = ltx_model().model.diffusion_model
    short = planner.plan(ltx, model, (2, 16, 16, 22, 38), config)      # 13,376 tokens an item
    long = planner.plan(ltx, model, (2, 16, 33, 22, 38), config)       # 27,588
    assert [level.groups for level in short.levels] == [1, 1, 1, 1]
    assert "under 24576" in short.levels[3].why
    assert all(level.bytes == short.stock_bytes for level in short.levels)   # ComfyUI's own blocks run there
    assert long.levels[3].groups > 1 and long.levels[3].bytes < long.stock_bytes / 3
