"""The MiniMax H3 adapter (`nodes/families/minimax.py`) against a real ComfyUI: a tiny random-weight H3 built from
ComfyUI's own config class (4 heads of 64 channels, a RoPE table of 48 of them: partial rotary as the real model's
96 of 128). The patched model equals ComfyUI's own at every level, with and without block bounds, the head split
runs; masked rows (one modulation row per token) and a text span of several tags; KJNodes-style patches
(`MiniMaxLowVRAMAttention`'s block and attention forwards and `minimax_head_chunks`, `MiniMaxChunkFeedForward`'s
feed-forward) in both orders: no double chunking, no lost patch, the memory estimate ComfyUI's where another
node replaced the pack's block; a CPU MemTracker peak of one bounded block. Skipped without ComfyUI, or where
ComfyUI has no MiniMax H3 (before v0.33)."""
from __future__ import annotations

import importlib
import importlib.util
import types

import pytest

from support import adapter_checks
from support import comfy_env
from support.comfy_env import model_forward as forward, rel_err, stock_fallbacks

pytestmark = pytest.mark.comfyui

TEXT_DIM = 96
# MiniMax H3's layout (hidden 5376, 56 heads of 128, RoPE on 96 channels of each), scaled down
CONFIG = {"image_model": "minimax_h3", "hidden_size": 256, "num_layers": 2, "token_refiner_num_layers": 1,
          "num_attention_heads": 4, "attention_head_dim": 64, "ffn_hidden_size": 384, "text_dim": TEXT_DIM,
          "timestep_input_dim": 32, "time_embed_hidden_size": 64, "time_embed_dim": 48, "rope_inv_freq_len": 8}


def has_minimax() -> bool:
    return importlib.util.find_spec("comfy.ldm.minimax") is not None


@pytest.fixture(scope="module")
def env():
    env = comfy_env.pack_modules()
    if not has_minimax():
        pytest.skip("this ComfyUI has no MiniMax H3")
    env.minimax = importlib.import_module(env.pack.__name__ + ".nodes.families.minimax")
    return env


def minimax_model(config: dict = CONFIG, dtype=None):
    """A tiny random-weight H3 (`adapter_checks.tiny_patcher`), its RoPE frequencies set (a buffer)."""
    import torch
    patcher = adapter_checks.tiny_patcher("MiniMaxH3", config, dtype)
    inv_freq = patcher.model.diffusion_model.rope.inv_freq
    inv_freq.copy_(1.0 / 10000.0 ** (torch.arange(inv_freq.numel(), dtype=torch.float32) / inv_freq.numel()))
    return patcher


def minimax_inputs(torch, video=(1, 24, 3, 16, 16), audio_frames=8, text_tokens=12, seed=1, context=None):
    """Keyword arguments of the diffusion model: [video latent, stereo audio latent], the sampler's timestep and
    the text encoder's states (refined by the model's token refiner)."""
    g = torch.Generator().manual_seed(seed)
    return dict(x=[torch.randn(*video, generator=g), torch.randn(1, 32, 2, audio_frames, generator=g)],
                timestep=torch.tensor([600.0]),
                context=torch.randn(1, text_tokens, TEXT_DIM, generator=g) if context is None else context)


def _groups(env, heads: int, level: int) -> int:
    """The head groups of a long H3 call at `level` (0-3), with the family's `group_scale`."""
    return env.core.SplitPolicy(level, 0, group_scale=env.minimax.SPEC.measured.group_scale).plan(heads, 10**6).groups


def test_twice_the_levels_groups(env):
    """H3's attention is 1.33x its hidden width: the family splits into twice the level's head groups (56 heads
    at High: 28 of 2, where a family of the level's own target takes 14 of 4), as the runtime's call options,
    the planner's policy and the validation of the runtime's option say."""
    dispatch = importlib.import_module(env.pack.__name__ + ".nodes.dispatch")
    config = env.minimax.SPEC.configure(dispatch.QKVConfig(3, "sdpa", True))
    assert env.minimax.SPEC.measured.group_scale == 2 and config.group_scale == 2
    assert config.policy.plan(56, 40000).groups == 28
    assert env.core.SplitPolicy(3).plan(56, 40000).groups == 14
    assert config.policy.call_options()["head_split_group_scale"] == 2
    assert dispatch.QKVConfig(3, "sdpa", True).policy.call_options() == {"head_split_level": 3}
    torch = env.torch
    x = torch.randn(1, 64, 8 * 16)
    proj = [torch.nn.Linear(128, 128, bias=False) for _ in range(3)]
    with torch.no_grad(), pytest.raises(ValueError, match="head_split_group_scale"):
        env.core.qkv_attention([x], *proj, 8, 16, head_split_group_scale=0)


def test_equals_stock_at_every_level(env, split_everything):
    base = minimax_model()
    model = base.model.diffusion_model
    heads = model.blocks[0].attn.heads
    assert 2 * model.rope.inv_freq.numel() * 3 < model.blocks[0].attn.head_dim   # partial rotary, as H3's
    blocks = len(model.blocks)
    adapter_checks.check_every_level(env, base, minimax_inputs(env.torch), heads,
                                     lambda block: {"attention": blocks, **({"block": blocks} if block else {})},
                                     groups=lambda level: _groups(env, heads, level))


def test_masked_rows_and_tagged_text(env, split_everything):
    """A denoise mask that keeps part of the video (one modulation row per token of the video segment) and text
    token tags (the text span in several segments): the bounded block takes each chunk's rows."""
    torch = env.torch
    base = minimax_model()
    inputs = minimax_inputs(torch)
    mask = torch.ones(1, 1, 3, 16, 16)
    mask[:, :, 0] = 0.0
    mask[:, :, 1, :8] = 0.5
    tags = torch.tensor([1] * 5 + [0] * 3 + [1] * 4)
    inputs.update(denoise_mask=mask, minimax_payload={"text_token_tags": tags})
    reference = forward(base, inputs)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    env.core.reset_notices()
    out = forward(base, inputs, applied=patched)
    assert not stock_fallbacks(env)
    assert rel_err(out, reference) <= 1e-5, rel_err(out, reference)


# --- KJNodes-style patches (the behaviour of its MiniMax nodes, written here) -----------------------------------
class KJStyle:
    """What KJNodes' MiniMax nodes install, the way they install it: `low_vram` a block forward that hands the
    modulated input to `self.attn` in a list, an attention forward (where none is patched yet) that takes the list
    and attends `minimax_head_chunks` head groups one call each, and the option itself; `chunk_ffn` an
    `mlp.forward` that runs token chunks. Counts each kind of call."""

    def __init__(self, minimax_model_module):
        self.m = minimax_model_module
        self.calls = {"block": 0, "attention": 0, "mlp": 0, "mlp_chunks": 0}

    def low_vram(self, patcher, head_chunks=2):
        m, calls = self.m, self.calls
        patcher = patcher.clone()
        patcher.model_options.setdefault("transformer_options", {})["minimax_head_chunks"] = head_chunks

        def block_forward(block, x, t_emb, mod_segments, rope_freqs, transformer_options={}):
            calls["block"] += 1
            shift, scale, gate, shift2, scale2, gate2 = block.adaln_proj(t_emb)
            h = m._mod_scale_shift(block.norm1(x), shift, scale, mod_segments)
            x = m._mod_gate(x, gate, block.attn([h], rope_freqs=rope_freqs, transformer_options=transformer_options),
                            mod_segments)
            h = m._mod_scale_shift(block.norm2(x), shift2, scale2, mod_segments)
            return m._mod_gate(x, gate2, block.mlp(h), mod_segments)

        def attention_forward(attention, x, rope_freqs=None, transformer_options={}):
            import torch
            calls["attention"] += 1
            x = x.pop() if isinstance(x, list) else x
            n = min(transformer_options.get("minimax_head_chunks", 1), attention.heads)
            if n <= 1:
                return m.Attention.forward(attention, x, rope_freqs, transformer_options)
            saved = m.optimized_attention
            outs = []

            def grouped(q, k, v, heads, **kwargs):   # the stock forward's one call, as n calls of heads / n
                q, k, v = (c.take() if hasattr(c, "take") else c for c in (q, k, v))
                step = heads // n
                for a in range(0, heads, step):
                    outs.append(saved(q[:, a:a + step], k[:, a:a + step], v[:, a:a + step], step, **kwargs))
                return torch.cat(outs, dim=-1)
            m.optimized_attention = grouped
            try:
                return m.Attention.forward(attention, x, rope_freqs, transformer_options)
            finally:
                m.optimized_attention = saved

        for index, block in enumerate(patcher.model.diffusion_model.blocks):
            patcher.add_object_patch(f"diffusion_model.blocks.{index}.forward", types.MethodType(block_forward, block))
            key = f"diffusion_model.blocks.{index}.attn.forward"
            if key not in patcher.object_patches:
                patcher.add_object_patch(key, types.MethodType(attention_forward, block.attn))
        return patcher

    def chunk_ffn(self, patcher, chunks=3):
        m, calls = self.m, self.calls
        patcher = patcher.clone()

        def mlp_forward(mlp, x):
            import torch
            calls["mlp"] += 1
            parts = []
            for part in torch.chunk(x, chunks, dim=0):
                calls["mlp_chunks"] += 1
                parts.append(m.MLP.forward(mlp, part))
            return torch.cat(parts)

        for index, block in enumerate(patcher.model.diffusion_model.blocks):
            patcher.add_object_patch(f"diffusion_model.blocks.{index}.mlp.forward",
                                     types.MethodType(mlp_forward, block.mlp))
        return patcher


def _kj(env):
    import comfy.ldm.minimax.model as minimax_model_module
    return KJStyle(minimax_model_module)


def test_kj_low_vram_attention_after_the_pack(env, split_everything):
    """KJ's low-VRAM node applied after the pack: its block forward replaces the pack's block, keeps the pack's
    attention (called with a list) and publishes `minimax_head_chunks`, which the pack's split does not apply
    again: the SDPA calls hold one group of the pack's heads. The run keeps ComfyUI's estimate (a patch of the
    pack's was replaced)."""
    torch = env.torch
    base = minimax_model()
    model = base.model.diffusion_model
    inputs = minimax_inputs(torch)
    reference = forward(base, inputs)
    patched, _ = env.node.apply_patch(base, "Low", "sdpa", True)
    kj = _kj(env)
    both = kj.low_vram(patched, head_chunks=4)
    env.core.reset_notices()
    with comfy_env.SdpaHeads(torch, check_tokens=0) as spy:
        out = forward(base, inputs, applied=both)
    assert not stock_fallbacks(env)
    assert kj.calls["block"] == len(model.blocks) and kj.calls["attention"] == 0   # the pack's attention ran
    heads = model.blocks[0].attn.heads
    assert set(spy.self_heads) - {heads} == {heads // _groups(env, heads, 1)}, spy.self_heads
    assert rel_err(out, reference) <= 1e-5
    patching = importlib.import_module(env.pack.__name__ + ".nodes.patching")
    own = tuple(key for key, value in patched.object_patches.items() if env.compat.is_ours(value))
    replaced = patching.replaced_patches(both, own)
    assert replaced == [f"diffusion_model.blocks.{i}.forward" for i in range(len(model.blocks))]
    assert patching.replaced_patches(patched, own) == []


def test_kj_low_vram_attention_before_the_pack(env, split_everything):
    """KJ's node first: its block and attention patches are kept (reported), its head chunks run as its own."""
    torch = env.torch
    base = minimax_model()
    inputs = minimax_inputs(torch)
    reference = forward(base, inputs)
    kj = _kj(env)
    patched, report = env.node.apply_patch(kj.low_vram(base, head_chunks=2), "High", "sdpa", True)
    reasons = {reason: paths for (_, reason), paths in report.skipped_reasons.items()}
    assert list(reasons) == ["another node patched it (its patch is kept)"], report.lines()
    assert len(reasons["another node patched it (its patch is kept)"]) == 2 * len(base.model.diffusion_model.blocks)
    out = forward(base, inputs, applied=patched)
    assert kj.calls["attention"] == len(base.model.diffusion_model.blocks)
    assert rel_err(out, reference) <= 1e-5


@pytest.mark.parametrize("kj_first", [True, False])
def test_kj_chunked_feed_forward_in_either_order(env, split_everything, kj_first):
    """KJ's chunked feed-forward before or after the pack: the pack's bounded block runs and calls that mlp once
    per block on the whole sequence (its own chunks, not the pack's as well), and the output is stock's."""
    torch = env.torch
    base = minimax_model()
    blocks = len(base.model.diffusion_model.blocks)
    inputs = minimax_inputs(torch)
    reference = forward(base, inputs)
    kj = _kj(env)
    if kj_first:
        patched, report = env.node.apply_patch(kj.chunk_ffn(base), "High", "sdpa", True)
    else:
        patched, report = env.node.apply_patch(base, "High", "sdpa", True)
        patched = kj.chunk_ffn(patched)
    assert not report.skipped_reasons, report.lines()
    assert {what: n for (_, what), n in report.patched_counts.items()} == {"attention": blocks, "block": blocks}
    env.core.reset_notices()
    forward(base, inputs, applied=patched)   # the self-checks of the first call (both forwards call the mlp)
    kj.calls.update(mlp=0, mlp_chunks=0)
    out = forward(base, inputs, applied=patched)
    assert not stock_fallbacks(env)
    assert kj.calls["mlp"] == blocks and kj.calls["mlp_chunks"] == 3 * blocks, kj.calls
    assert rel_err(out, reference) <= 1e-5


# --- peak memory (CPU, MemTracker) ---------------------------------------------------------------------------
WIDTH, HEADS, TOKENS = 512, 16, 16384   # twice the runtime's split floor


def test_bounded_block_peak(env):
    """One DiTBlock of 16,384 tokens (2x the split floor) x width 512 in bf16 (16 heads of 32, RoPE on 24 of each
    head's channels, H3's FFN ratio 2.67 in SwiGLU), text, audio and video segments: stock vs bounded (High, block
    bounds on), within the planner's working set."""
    torch = env.torch
    import comfy.ops
    minimax_model_module = importlib.import_module("comfy.ldm.minimax.model")
    block = minimax_model_module.DiTBlock(WIDTH, HEADS, WIDTH // HEADS, WIDTH * 8 // 3, 48, 1e-5, 1e-5,
                                          dtype=torch.bfloat16, device=torch.device("cpu"),
                                          operations=comfy.ops.disable_weight_init)
    comfy_env.fill_random_(block, seed=0)
    block.eval().requires_grad_(False)   # as ComfyUI loads a model (comfy-kitchen's in-place RoPE refuses grads)
    g = torch.Generator().manual_seed(1)
    angles = torch.randn(TOKENS, 12, generator=g)
    inp = dict(x=torch.randn(TOKENS, WIDTH, generator=g).to(torch.bfloat16),
               t_emb=torch.randn(2, 48, generator=g).to(torch.bfloat16),
               mod_segments=[(0, 64, 1), (64, 320, 5), (320, TOKENS, 3)],
               rope_freqs=minimax_model_module.rope_rotation_table(torch.cat((angles, angles), dim=-1),
                                                                   torch.bfloat16))
    adapter_checks.check_block_peak(env, env.minimax, block, inp, "x", HEADS, TOKENS,
                                    f"MiniMax H3 block {TOKENS} tokens x {WIDTH}")
