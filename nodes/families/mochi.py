"""Mochi adapter (`comfy/ldm/genmo/joint_model/asymm_models_joint.py`, Genmo's Mochi 1): its `AsymmetricAttention`
and `AsymmetricJointBlock`s.

The attention joins the video stream (`qkv_x`, 3072 wide) and the text stream (`qkv_y` from its 1536-wide state to
the video's width) in the order [video, text], the text cropped to its real tokens (`crop_y`); each stream's input
is its RMSNorm (no weight) times 1 + its scale, its q and k normalized over each head's channels (`q_norm_x`, ...),
the video's q and k rotated on adjacent pairs by per-head `(cos, sin)` tables (Mochi's mixed RoPE, float32). It runs
through `nodes/attention.py` (head split, each group's q/k/v from its rows of `qkv_x` / `qkv_y`, the norms and the
group's heads of the tables); the video's output projection by token chunks. Patched always.

With block bounds on, `AsymmetricJointBlock.forward` as well: the modulated video input is made by token chunks and
handed off to the runtime, the output projection and the block's sandwich-normed, tanh-gated residual run by token
chunks into a new tensor (ComfyUI's block does not write its inputs), then the video feed-forward by token chunks
(the block's own `mlp_x` on each chunk, the gated residual in place). The text stream (a few hundred tokens) is
updated as ComfyUI's block updates it.

Guarded and self-checked like every forward of the pack (`compat.guard_module`), on the call's first video tokens
with the whole text. ComfyUI's Mochi calls no q/k/v hooks of other nodes.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

try:
    import comfy.ldm.genmo.joint_model.asymm_models_joint as mochi_model
except ImportError:   # a ComfyUI without Mochi: nothing matches
    mochi_model = None

from ..attention import AttentionForm, NORM_PER_HEAD, ROPE_COS_SIN_PAIRS, StreamProjections, attend
from ..block_parts import foreign_part, mlp_residual_, output_projection_
from ..comfy_ops import chunk_tokens, token_ranges
from .family import BlockList, Family, probe_heads, probe_linear, probe_part

FAMILY = "Mochi"

VIDEO = StreamProjections(fused="qkv_x", norm_q="q_norm_x", norm_k="k_norm_x")
TEXT = StreamProjections(fused="qkv_y", norm_q="q_norm_y", norm_k="k_norm_y")
FORM = AttentionForm(streams=(VIDEO, TEXT), norm=NORM_PER_HEAD, rope=ROPE_COS_SIN_PAIRS)

ATTENTION_ARGS = ("x", "y", "scale_x", "scale_y", "crop_y", "transformer_options", "rope_cos", "rope_sin")
BLOCK_ARGS = ("x", "c", "y", "transformer_options", "rope_cos", "rope_sin", "crop_y")

SPEC = Family(FAMILY, "mochi",
              (BlockList("blocks", cls=getattr(mochi_model, "AsymmetricJointBlock", None) or type(None)),),
              latent_ranks=(5,), patch_size=(None, "patch_size", "patch_size"), kv_heads_at="block.attn.num_heads",
              projections=("attn", ("qkv_x", "qkv_y"), "attn."), attentions=("attn",),
              attention_cls=getattr(mochi_model, "AsymmetricAttention", None), stock_parts=("attn",),
              patch_parts=None, width_names=("hidden_size_x",))   # its video's width


# --- probes -----------------------------------------------------------------------------------------------------
def probe_attention(attention) -> Optional[str]:
    """None when an `AsymmetricAttention` has the structure the pack's forward uses (whether it computes the same
    is the self-check's job)."""
    heads, head_dim, reason = probe_heads(attention, "num_heads", "head_dim", None,
                                          ("q_norm_x", "k_norm_x", "q_norm_y", "k_norm_y"))
    if reason:
        return reason
    width = heads * head_dim
    reason = FORM.probe(attention, heads, head_dim) or probe_linear(attention, "proj_x", width, width)
    if reason:
        return reason
    if attention.update_y and probe_linear(attention, "proj_y", attention.dim_y, width) is not None:
        return f"proj_y is not a Linear from {width} to {attention.dim_y} features"
    return None


def probe_block(block) -> Optional[str]:
    """None when an `AsymmetricJointBlock` has the structure the bounded forward uses."""
    reason = probe_part(block, "attn", probe_attention, mochi_model.AsymmetricAttention)
    if reason:
        return reason
    width = block.attn.num_heads * block.attn.head_dim
    reason = probe_linear(block, "mod_x", 4 * width)
    if reason:
        return reason
    if not all(hasattr(block.mlp_x, name) for name in ("w1", "w2")):
        return "its mlp_x is not w1, SiLU gate, w2"
    return None


# --- the attention ----------------------------------------------------------------------------------------------
def modulated(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """ComfyUI's `modulated_rmsnorm(x, scale)` in a new tensor, by token chunks."""
    out = torch.empty_like(x)
    step = chunk_tokens(x.shape[1], x.shape[0] * x.shape[2], max(1, x.numel() // 8))
    for a, b in token_ranges(x.shape[1], step):
        out[:, a:b] = mochi_model.modulated_rmsnorm(x[:, a:b], scale)
    return out


def attention_heads(attention, config, x_list: list, y_list: list, rope_cos, rope_sin,
                    transformer_options) -> torch.Tensor:
    """The joint attention of `[x]` (the modulated video, `(B, N, 3072)`) and `[y]` (the modulated text, cropped),
    both lists cleared: `(B, N + crop, heads, head_dim)`. `rope_cos`, `rope_sin`: `(N, heads, head_dim / 2)`."""
    freqs = None if rope_cos is None else (rope_cos, rope_sin)
    return attend(attention, FORM, [x_list, y_list], attention.num_heads, attention.head_dim, config,
                  transformer_options, freqs=freqs)


def text_output(attention, attended_text: torch.Tensor, text_tokens: int) -> torch.Tensor:
    """ComfyUI's text output: the attention's text rows, zeros for the cropped ones, through `proj_y`."""
    out = attended_text.new_zeros(attended_text.shape[0], text_tokens, attended_text.shape[-1])
    out[:, :attended_text.shape[1]] = attended_text
    return attention.proj_y(out)


def run_attention(attention, config, x, y, scale_x, scale_y, crop_y, transformer_options={}, rope_cos=None,
                  rope_sin=None):
    """`AsymmetricAttention.forward`: (the video's output projection `(B, N, 3072)`, the text's `(B, L, 1536)`)."""
    tokens = x.shape[1]
    handed_off = [modulated(x, scale_x)]
    del x   # the caller still holds the block's input: only the modulated copy goes
    attended = attention_heads(attention, config, handed_off, [mochi_model.modulated_rmsnorm(y, scale_y)[:, :crop_y]],
                               rope_cos, rope_sin, transformer_options).flatten(2)
    text = text_output(attention, attended[:, tokens:], y.shape[1])
    # the video's projection by token chunks into the attention's own rows (proj_x keeps the width)
    return output_projection_(attention.proj_x, attended[:, :tokens]), text


# --- the block --------------------------------------------------------------------------------------------------
def run_block(block, config, x, c, y, transformer_options={}, rope_cos=None, rope_sin=None, crop_y=None):
    """`AsymmetricJointBlock.forward` with every transient of the video stream bounded; returns (x, y), new
    tensors (x a view of the attention's output buffer: its video rows)."""
    attention = block.attn
    c = F.silu(c)
    scale_msa_x, gate_msa_x, scale_mlp_x, gate_mlp_x = block.mod_x(c).chunk(4, dim=1)
    mod_y = block.mod_y(c)
    if block.update_y:
        scale_msa_y, gate_msa_y, scale_mlp_y, gate_mlp_y = mod_y.chunk(4, dim=1)
    else:
        scale_msa_y = mod_y
    tokens = x.shape[1]
    crop = y.shape[1] if crop_y is None else crop_y
    handed_off = [modulated(x, scale_msa_x)]
    attended = attention_heads(attention, config, handed_off,
                               [mochi_model.modulated_rmsnorm(y, scale_msa_y)[:, :crop]], rope_cos, rope_sin,
                               transformer_options).flatten(2)
    y_attention = text_output(attention, attended[:, tokens:], y.shape[1])
    # the block's video output, in the attention's own rows (as wide as x): each token's output depends on its own
    # attention row alone, read just before it is written
    out = attended[:, :tokens]
    del attended
    step = chunk_tokens(tokens, x.shape[0] * x.shape[2], max(1, x.numel() // 8))
    for a, b in token_ranges(tokens, step):   # ComfyUI's sandwich-normed, tanh-gated residual, by chunks
        projected = attention.proj_x(out[:, a:b])
        out[:, a:b] = mochi_model.residual_tanh_gated_rmsnorm(x[:, a:b], projected, gate_msa_x)
        del projected

    def add_(part, ffn_out, a, b):
        part.copy_(mochi_model.residual_tanh_gated_rmsnorm(part, ffn_out, gate_mlp_x))

    # w1's output (both halves), the SiLU of one and the gated product are held at once
    hidden = 2 * block.mlp_x.w1.weight.shape[0]
    mlp_residual_(out, block.mlp_x, lambda a, b: mochi_model.modulated_rmsnorm(out[:, a:b], scale_mlp_x), add_,
                  hidden_per_token=hidden)
    if block.update_y:
        y = mochi_model.residual_tanh_gated_rmsnorm(y, y_attention, gate_msa_y)
        y = block.ff_block_y(y, scale_mlp_y, gate_mlp_y)
    return out, y


# --- guards and the adapter contract (family.py) ----------------------------------------------------------------
def _rope_rows(bound: dict, n: int, tokens: int) -> dict:
    """The check's RoPE rows: those of its first video tokens."""
    return {"rope_cos": lambda t: t[:n].clone(), "rope_sin": lambda t: t[:n].clone()}


def _extra(bound: dict) -> tuple:
    rope = bound.get("rope_cos")
    return (None if rope is None else (rope.dim(), rope.dtype), bound["y"].dtype, bound.get("crop_y"))


def attention_forward(attention, config):
    """The guarded forward installed on an `AsymmetricAttention`."""
    return SPEC.guard("attention", "attention", attention, ATTENTION_ARGS, run_attention, config, x="x",
                      extra=_extra, cut=_rope_rows)


def block_forward(block, config):
    """The guarded bounded forward installed on an `AsymmetricJointBlock` (block bounds on)."""
    return SPEC.guard("block", "block", block, BLOCK_ARGS, run_block, config, x="x", extra=_extra, cut=_rope_rows,
                      residual=("x", "y"), refuse_more=foreign_part)


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone): every attention that probes clean, and with block bounds every
    block. A module another node patched keeps that patch (its block then runs stock)."""
    SPEC.patch(patcher, config, report, attention=(attention_forward, probe_attention),
               block=(block_forward, probe_block))


matches, stock_functions, tokens_per_item, kv_heads, splits_projections, block_kinds = SPEC.contract()
