"""MiniMax H3 adapter (`comfy/ldm/minimax/model.py`, the audio + video DiT): the `Attention` and the `DiTBlock`s
of `blocks`.

The model runs one packed sequence `[text | conditions, references | audio | video]` of shape `(S, hidden)`
(batch 1: cond and uncond are separate calls) through 50 single-stream blocks. A block's attention projects q, k
and v with one fused `qkv_proj`, normalizes q and k over each head's channels (`q_norm`, `k_norm`) and rotates the
first 96 of each head's 128 channels by split-half RoPE (comfy-kitchen's `rms_rope_split_half_` with `rot_dim`:
the table `(1, S, 1, rot/2, 2, 2)` in the model's dtype). It runs through `nodes/attention.py` (head split, each
group's q/k/v from its rows of `qkv_proj`, the norm and partial RoPE per group). Patched always. The token
refiner's blocks (text only, no RoPE) stay ComfyUI's: text is short.

With block bounds on, `DiTBlock.forward` as well, writing its input in place as ComfyUI's does: the modulated
input (`norm1`, then the shift and scale of each segment's modulation row) is made by token chunks and handed off
to the runtime, the output projection and the gated residual run by token chunks into x, then the feed-forward
by token chunks (`norm2`, modulation, the block's own `mlp` on each chunk, the gated residual). The modulation
rows of a segment are one row or one per token (masked rows); each chunk takes its part of them.

Living beside KJNodes' MiniMax nodes: `MiniMaxLowVRAMAttention` publishes `transformer_options
["minimax_head_chunks"]` and object-patches every block's and attention's forward. The pack's head split is the
one split: its attention ignores `minimax_head_chunks` (no double chunking), takes the modulated input in a list
as KJ's block hands it, and keeps KJ's patches (a block or attention another node patched stays theirs,
reported). `MiniMaxChunkFeedForward` patches each block's `mlp.forward`: the bounded block then calls that
`mlp` once on the whole modulated input, so KJ's chunking is the only one.

Guarded and self-checked like every forward of the pack (`compat.guard_module`), on the first tokens of the
call's sequence with their segments and RoPE rows.
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    import comfy.ldm.minimax.model as minimax_model
except ImportError:   # a ComfyUI from before MiniMax H3 (v0.8.0 and older): nothing matches
    minimax_model = None

from .. import compat
from ..attention import AttentionForm, NORM_PER_HEAD, ROPE_SPLIT_HALF, StreamProjections, attend
from ..block_parts import mlp_residual_, projection_residual_
from ..comfy_ops import chunk_tokens, token_ranges
from .family import BlockList, Family, layout, probe_heads, probe_linear, probe_part

FAMILY = "MiniMax H3"

FORM = AttentionForm(streams=(StreamProjections(fused="qkv_proj", norm_q="q_norm", norm_k="k_norm"),),
                     norm=NORM_PER_HEAD, rope=ROPE_SPLIT_HALF)

ATTENTION_ARGS = ("x", "rope_freqs", "transformer_options")
BLOCK_ARGS = ("x", "t_emb", "mod_segments", "rope_freqs", "transformer_options")
# The block's parts whose object patch by another node keeps the block ComfyUI's; its `mlp` is not among them:
# the bounded block calls the block's own `mlp` (another node's patch of it runs).
BLOCK_PARTS = ("attn", "norm1", "norm2", "adaln_proj")
# KJNodes' head-chunk option: the pack's head split is the one split (documented in the module's docstring)
HEAD_CHUNKS_KEY = "minimax_head_chunks"

SPEC = Family(FAMILY, "minimax",
              (BlockList("blocks", cls=getattr(minimax_model, "DiTBlock", None) or type(None)),),
              latent_ranks=(5,), kv_heads_at="block.attn.heads", projections=("attn", ("qkv_proj",), "attn."),
              attentions=("attn",), attention_cls=getattr(minimax_model, "Attention", None),
              stock_parts=("attn",), patch_parts=BLOCK_PARTS)


# --- probes -----------------------------------------------------------------------------------------------------
def probe_attention(attention) -> Optional[str]:
    """None when an `Attention` has the structure the pack's forward uses (whether it computes the same is the
    self-check's job)."""
    heads, head_dim, reason = probe_heads(attention, "heads", "head_dim", FORM.streams[0], ("q_norm", "k_norm"))
    return reason or probe_linear(attention, "out_proj", None, heads * head_dim)


def probe_block(block) -> Optional[str]:
    """None when a `DiTBlock` has the structure the bounded forward uses."""
    reason = probe_part(block, "attn", probe_attention, minimax_model.Attention)
    if reason:
        return reason
    for name in ("norm1", "norm2", "mlp", "adaln_proj"):
        if not isinstance(getattr(block, name, None), torch.nn.Module):
            return f"no {name}"
    if getattr(block.adaln_proj, "expand", None) != 6:
        return "its adaln_proj does not give six modulations"
    return None


# --- the attention ----------------------------------------------------------------------------------------------
def attention_heads(attention, config, x_list: list, rope_freqs, transformer_options) -> torch.Tensor:
    """The attention of `[x]` (cleared: the runtime frees x once projected), x `(S, hidden)`: `(1, S, heads,
    head_dim)`. `rope_freqs`: `(1, S, 1, rot/2, 2, 2)` in the model's dtype (rot <= head_dim), or None."""
    x_list[0] = x_list[0].unsqueeze(0)
    return attend(attention, FORM, [x_list], attention.heads, attention.head_dim, config, transformer_options,
                  freqs=rope_freqs)


def run_attention(attention, config, x, rope_freqs=None, transformer_options={}):
    """`Attention.forward`: the output projection of the attention of x `(S, hidden)` (or `[x]`, as KJNodes'
    low-VRAM block hands it; the list is cleared)."""
    handed_off = x if isinstance(x, list) else [x]
    del x
    heads = attention_heads(attention, config, handed_off, rope_freqs, transformer_options)
    return attention.out_proj(heads[0].flatten(1))


# --- the block --------------------------------------------------------------------------------------------------
def _segment_rows(vecs: torch.Tensor, row, a: int, b: int, start: int, dtype) -> torch.Tensor:
    """The modulation of the tokens [a, b) of a segment starting at `start`: ComfyUI's `_mod_row` of its row (one
    row index, or one index per token of the segment)."""
    if torch.is_tensor(row) and row.dim() > 0:
        row = row[a - start:b - start]
    return minimax_model._mod_row(vecs, row, dtype)


def _pieces(segments, a: int, b: int):
    """(start, stop, segment start, row) of each segment's part of the tokens [a, b)."""
    for start, stop, row in segments:
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            yield lo, hi, start, row


def modulate_(h: torch.Tensor, shift, scale, segments, a: int) -> torch.Tensor:
    """ComfyUI's `_mod_scale_shift` on the chunk `h` of the tokens [a, a + len(h)), in place."""
    for lo, hi, start, row in _pieces(segments, a, a + h.shape[0]):
        h[lo - a:hi - a].mul_(1.0 + _segment_rows(scale, row, lo, hi, start, h.dtype)).add_(
            _segment_rows(shift, row, lo, hi, start, h.dtype))
    return h


def gate_(x: torch.Tensor, gate, other: torch.Tensor, segments, a: int) -> None:
    """ComfyUI's `_mod_gate` on the chunk `x` of the tokens [a, a + len(x)), `other` the chunk's update."""
    for lo, hi, start, row in _pieces(segments, a, a + x.shape[0]):
        x[lo - a:hi - a].addcmul_(other[lo - a:hi - a], _segment_rows(gate, row, lo, hi, start, x.dtype))


def run_block(block, config, x, t_emb, mod_segments, rope_freqs, transformer_options={}):
    """`DiTBlock.forward` with every transient bounded; x `(S, hidden)` is written in place and returned, as
    ComfyUI's block does."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaln_proj(t_emb)
    tokens, width = x.shape
    step = chunk_tokens(tokens, width, max(1, x.numel() // 8))
    modulated = torch.empty_like(x)
    for a, b in token_ranges(tokens, step):
        modulate_(modulated[a:b].copy_(block.norm1(x[a:b])), shift_msa, scale_msa, mod_segments, a)
    handed_off = [modulated]
    del modulated   # the runtime holds the only reference and frees it once q/k/v are projected
    heads = attention_heads(block.attn, config, handed_off, rope_freqs, transformer_options)
    attended = heads.flatten(2)
    del heads

    def add_attention(part, out, a, b):
        gate_(part[0], gate_msa, out[0], mod_segments, a)

    projection_residual_(x.unsqueeze(0), block.attn.out_proj, attended, add_attention)
    del attended

    def ffn_input(a, b):
        return modulate_(block.norm2(x[a:b]), shift_mlp, scale_mlp, mod_segments, a)

    if compat.foreign_forward(block.mlp):   # another node's feed-forward (KJNodes' chunking): one call, its chunks
        gate_(x, gate_mlp, block.mlp(ffn_input(0, tokens)), mod_segments, 0)
        return x

    def add_ffn(part, out, a, b):
        gate_(part[0], gate_mlp, out[0], mod_segments, a)

    hidden = getattr(block.mlp.fc1, "out_features", None) or block.mlp.fc1.weight.shape[0]
    # the chunk's fc1 output and its SwiGLU product are held at once
    mlp_residual_(x.unsqueeze(0), _PackedMLP(block.mlp), lambda a, b: ffn_input(a, b).unsqueeze(0), add_ffn,
                  hidden_per_token=hidden + hidden // 2)
    return x


class _PackedMLP:
    """The block's `mlp` on a chunk `(1, n, hidden)` of the packed sequence (ComfyUI's takes `(n, hidden)`)."""

    def __init__(self, mlp):
        self.mlp = mlp

    def __call__(self, x):
        return self.mlp(x[0]).unsqueeze(0)


def _refuse_block(block) -> Optional[str]:
    """Another node's forward or hook on a part the bounded block computes itself (its `mlp` it calls)."""
    for name in BLOCK_PARTS:
        part = getattr(block, name)
        reason = "patched" if compat.foreign_forward(part) else (
            "hooks" if part.__dict__.get("_forward_hooks") or part.__dict__.get("_forward_pre_hooks") else None)
        if reason is not None:
            return f"another node {reason} its {name}"
        below = compat.module_tree(part).foreign
        if below is not None:
            return f"{below} (in its {name})"
    return None


# --- guards and the adapter contract (family.py) ----------------------------------------------------------------
def _cut_segments(segments, n: int) -> list:
    """The segments of the first `n` tokens (a per-token row: its first rows)."""
    cut = []
    for start, stop, row in segments:
        if start >= n:
            break
        if torch.is_tensor(row) and row.dim() > 0:
            row = row[:min(stop, n) - start].clone()
        cut.append((start, min(stop, n), row))
    return cut


def _first_tokens(x_name: str, segments: bool):
    """The check inputs: the call's first `compat.CHECK_TOKENS` tokens of the packed sequence, with their RoPE
    rows (and segments)."""
    def check(bound: dict) -> dict:
        x = bound[x_name]
        x = x[0] if isinstance(x, list) else x
        n = compat.check_tokens(x.shape[0])
        out = dict(bound)
        out[x_name] = x[:n].clone()
        if bound.get("rope_freqs") is not None:
            out["rope_freqs"] = bound["rope_freqs"][:, :n].clone()
        if segments:
            out["mod_segments"] = _cut_segments(bound["mod_segments"], n)
        out["transformer_options"] = compat.probe_options(bound.get("transformer_options") or {})
        return out
    return check


def _extra(bound: dict) -> tuple:
    return (layout(bound.get("rope_freqs")),)


def attention_forward(attention, config):
    """The guarded forward installed on an `Attention`; it takes x as a tensor or in a list (KJNodes' block)."""
    guarded = SPEC.guard("attention", "attention", attention, ATTENTION_ARGS, run_attention, config, x="x",
                         extra=_extra, check_inputs=_first_tokens("x", segments=False))

    def forward(x, *args, **kwargs):
        if isinstance(x, list):   # handed off by the caller: the runtime's forward takes the list itself
            if len(x) != 1:
                raise ValueError(f"MiniMax H3 attention: a list input holds one tensor, not {len(x)}")
            return guarded(x.pop(), *args, **kwargs)
        return guarded(x, *args, **kwargs)

    return compat.mark_ours(forward)


def block_forward(block, config):
    """The guarded bounded forward installed on a `DiTBlock` (block bounds on)."""
    return SPEC.guard("block", "block", block, BLOCK_ARGS, run_block, config, x="x", extra=_extra,
                      check_inputs=_first_tokens("x", segments=True), residual="x", refuse_more=_refuse_block)


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone): every block's attention that probes clean, and with block bounds
    every block. A module another node patched keeps that patch (its block then runs ComfyUI's or their forward)."""
    SPEC.patch(patcher, config, report, attention=(attention_forward, probe_attention),
               block=(block_forward, probe_block))
    options = patcher.model_options.get("transformer_options", {})
    if options.get(HEAD_CHUNKS_KEY, 1) > 1 and report.any_patched:
        report.note(f"{FAMILY}: {HEAD_CHUNKS_KEY}={options[HEAD_CHUNKS_KEY]} (KJNodes) is not applied again in the "
                    f"pack's attention: its head split is the one split")


matches, stock_functions, tokens_per_item, kv_heads, splits_projections, block_kinds = SPEC.contract()
