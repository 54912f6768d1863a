"""LTX-Video and LTX-2 adapter (`comfy/ldm/lightricks`: `model.py`'s `CrossAttention` and `BasicTransformerBlock`,
`av_model.py`'s `BasicAVTransformerBlock`).

Every attention of the transformer blocks is LTX's `CrossAttention`: q/k/v from `to_q`/`to_k`/`to_v`, q_norm /
k_norm an RMSNorm over the whole inner width (all heads: exact per head group only through the runtime's
per-token statistics, `NORM_SPANS_HEADS`), RoPE from ComfyUI's tables sliced to each head group (per-head
rotation matrices, adjacent pairs or the halves of each head; cos/sin over the whole width in ComfyUI before
v0.33), an optional mask (the text padding of the cross-attention) and LTX-2's per-head output gate. Each is
patched through `nodes/attention.py`'s `attend()`: self-attention (`attn1`, LTX-2's `audio_attn1`), text
cross-attention (`attn2`, `audio_attn2`) and LTX-2's audio <-> video cross-attention (`audio_to_video_attn`,
`video_to_audio_attn`: queries and keys rotated by their own tables).

With block bounds on, LTX-Video's `BasicTransformerBlock` is bounded too: the modulated input is made by
token chunks and handed off, the output projections add into the residual by token chunks in place, and the
feed-forward runs by token chunks. LTX-2's audio-video block keeps ComfyUI's forward (its attention modules
are patched): its two streams, compressed timesteps and four cross-attentions are a block of their own.

Left to ComfyUI (the module runs its own forward, one log line): a self-attention with a guide attention mask
(`GuideAttentionMask`: ComfyUI partitions the queries itself), STG's skipped self-attention, an
`attn_precision` other than the default, a RoPE table of another layout. Guarded and self-checked like every
forward of the pack (`compat.guard_module`).
"""
from __future__ import annotations

from typing import Optional

import torch

import comfy.ldm.common_dit
import comfy.ldm.lightricks.model as ltx_model
import comfy.model_management

try:   # ComfyUI's fused kernels (comfy_kitchen), v0.8+
    import comfy.quant_ops as quant_ops
except ImportError:   # an older ComfyUI
    quant_ops = None

from ..attention import (AttentionForm, NORM_SPANS_HEADS, ROPE_COS_SIN, ROPE_COS_SIN_HALVES, ROPE_PAIRS,
                        ROPE_SPLIT_HALF, StreamProjections, attend)
from ..block_parts import foreign_part, mlp_residual_, output_projection_, projection_residual_
from ..comfy_ops import chunk_tokens, token_ranges
from .family import BlockList, Family, probe_heads

FAMILY = "LTX"

STREAM = StreamProjections(q="to_q", k="to_k", v="to_v", norm_q="q_norm", norm_k="k_norm")
FORMS = {kind: AttentionForm(streams=(STREAM,), norm=NORM_SPANS_HEADS, rope=kind)
         for kind in (None, ROPE_PAIRS, ROPE_SPLIT_HALF, ROPE_COS_SIN, ROPE_COS_SIN_HALVES)}
# The attention modules of LTX-Video's and LTX-2's blocks.
ATTENTION_NAMES = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
# Keys kept from the spanning norm's statistics pass in the bounded block (as Wan's: its peak stays under
# 2.5 |x| at High); attention patched alone keeps them all (the stock FFN is the block's peak then).
BLOCK_KEPT_KEYS = 0.3
ATTENTION_ONLY_KEPT_KEYS = 1.0


# --- RoPE tables ------------------------------------------------------------------------------------------
def rope_of(pe, heads: int, head_dim: int, tokens: int):
    """`(kind, freqs, None)` for ComfyUI's LTX RoPE argument of a call with `tokens` tokens, or `(None, None,
    why not)`. v0.33+: `(rotation matrices (B, N, heads or 1, D/2, 2, 2), split)`; before: `(cos, sin[, split])`,
    cos/sin `(B, N, heads * D)` (adjacent pairs) or, split, `(B, heads, N, D/2)`."""
    if pe is None:
        return None, None, None
    if not isinstance(pe, (tuple, list)) or not pe or not torch.is_tensor(pe[0]):
        return None, None, "a RoPE argument of another layout"
    first = pe[0]
    if first.dim() == 6 and len(pe) == 2:
        ok = first.shape[1] == tokens and first.shape[2] in (1, heads) and \
            tuple(first.shape[3:]) == (head_dim // 2, 2, 2)
        kind, freqs = (ROPE_SPLIT_HALF if bool(pe[1]) else ROPE_PAIRS), first
    elif len(pe) in (2, 3) and torch.is_tensor(pe[1]) and pe[1].shape == first.shape:
        split = len(pe) == 3 and bool(pe[2])
        if split:
            ok = first.dim() == 4 and tuple(first.shape[1:]) == (heads, tokens, head_dim // 2)
            kind = ROPE_COS_SIN_HALVES
        else:
            ok = first.dim() == 3 and tuple(first.shape[1:]) == (tokens, heads * head_dim)
            kind = ROPE_COS_SIN
        freqs = (first, pe[1])
    else:
        return None, None, "a RoPE argument of another layout"
    if not ok:
        return None, None, f"a RoPE table of shape {tuple(first.shape)} for {tokens} tokens of {heads} heads"
    return kind, freqs, None


def _rope_tokens(pe, n: int):
    """ComfyUI's RoPE argument for the first `n` tokens (tensors sliced on their token dimension)."""
    if pe is None:
        return None
    first = pe[0]
    token_dim = 2 if first.dim() == 4 else 1
    return type(pe)(p.narrow(token_dim, 0, n).clone() if torch.is_tensor(p) else p for p in pe)


def _rope_layout(pe) -> Optional[tuple]:
    if pe is None:
        return None
    return tuple((p.dim(), p.shape[2] if p.dim() == 6 else None, p.dtype) if torch.is_tensor(p) else p for p in pe)


# --- attention ----------------------------------------------------------------------------------------------
def _mask_refusal(mask) -> Optional[str]:
    if mask is not None and not torch.is_tensor(mask):
        return f"a {type(mask).__name__} (ComfyUI's forward attends with it itself)"
    return None


def rope_tables(module, tokens: int, kv_tokens: int, pe, k_pe) -> tuple:
    """`(kind, query tables, key tables, None)` for a call's `pe` / `k_pe` (the keys take `k_pe`, else `pe`, as
    the model rotates them), or `(None, None, None, why not)`."""
    if pe is None:
        return None, None, None, None if k_pe is None else "keys rotated without queries (k_pe alone)"
    heads, head_dim = module.heads, module.dim_head
    kind, freqs, reason = rope_of(pe, heads, head_dim, tokens)
    key_kind, key_freqs, key_reason = rope_of(pe if k_pe is None else k_pe, heads, head_dim, kv_tokens)
    reason = reason or key_reason
    if reason is None and kind != key_kind:
        reason = "queries and keys rotated by RoPE tables of two layouts"
    return (None, None, None, reason) if reason else (kind, freqs, key_freqs, None)


def attention_refusal(module, x, context, mask, pe, k_pe, transformer_options) -> Optional[str]:
    """Why the pack's attention must not take this call (ComfyUI's forward then runs), else None."""
    if context is None and (transformer_options or {}).get("stg_skip_self_attn", False):
        return "STG skips this self-attention (its output is v)"
    kv_tokens = x.shape[1] if context is None else context.shape[1]
    return _mask_refusal(mask) or rope_tables(module, x.shape[1], kv_tokens, pe, k_pe)[3]


def attention(module, config, x_list: list, transformer_options, context=None, mask=None, pe=None, k_pe=None,
              keep_keys: float = ATTENTION_ONLY_KEPT_KEYS) -> torch.Tensor:
    """LTX attention of `[x]` (the list is cleared: handed off) without the output projection:
    `(B, N, heads, dim_head)`, LTX-2's per-head gate applied. `context` None: self-attention (a call
    `attention_refusal` passed)."""
    x = x_list[0]
    tokens = x.shape[1]
    gate_logits = module.to_gate_logits(x) if getattr(module, "to_gate_logits", None) is not None else None
    del x
    kv_tokens = tokens if context is None else context.shape[1]
    kind, freqs, key_freqs, _ = rope_tables(module, tokens, kv_tokens, pe, k_pe)
    out = attend(module, FORMS[kind], [x_list], module.heads, module.dim_head, config, transformer_options,
                 freqs=freqs, key_freqs=key_freqs, mask=mask, context_list=None if context is None else [context],
                 keep_keys=keep_keys)
    if gate_logits is not None:   # the model's per-head gate, 2 sigmoid(logits) `(B, N, heads)`, in place
        out.mul_(torch.sigmoid(gate_logits).mul_(2.0).unsqueeze(-1))
    return out


def probe_attention(module) -> Optional[str]:
    """None when `module` (LTX's `CrossAttention`) has the structure the pack's forward uses."""
    heads, head_dim, reason = probe_heads(module, "heads", "dim_head", STREAM, ("q_norm", "k_norm"),
                                          spans_heads=True)
    if reason:
        return reason
    width = heads * head_dim
    if getattr(module, "attn_precision", None) is not None:
        return f"attn_precision {module.attn_precision} (the pack's kernels keep the inputs' precision)"
    out = getattr(module, "to_out", None)
    weight = getattr(out[0], "weight", None) if isinstance(out, torch.nn.Sequential) and len(out) else None
    if weight is None or weight.dim() != 2 or weight.shape[1] != width:
        return "to_out is not a Linear over the inner width"
    if any(not isinstance(layer, torch.nn.Dropout) for layer in list(out)[1:]):
        return "to_out holds more than a Linear and Dropout"
    gate = getattr(module, "to_gate_logits", None)
    if gate is not None and getattr(getattr(gate, "weight", None), "shape", (None,))[0] != heads:
        return "to_gate_logits is not a Linear with one output per head"
    return None


# --- the bounded block (LTX-Video) ------------------------------------------------------------------------------
class _Modulation:
    """The block's modulation (`scale_shift_table + timestep`) for a range of tokens at a time: `timestep`
    `(B, 1 or N, count * C)`, entry `index` `(B, 1 or b - a, C)`, without a full-size copy when per token."""

    def __init__(self, table, timestep, x):
        self.table = comfy.model_management.cast_to(table, dtype=x.dtype, device=x.device)
        self.values = timestep.reshape(x.shape[0], timestep.shape[1], table.shape[0], -1)
        self.per_token = self.values.shape[1] != 1

    def __call__(self, index: int, a: int, b: int) -> torch.Tensor:
        values = self.values[:, a:b, index] if self.per_token else self.values[:, :, index]
        return self.table[None, None, index] + values


def _rms_adaln(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """`rms_norm(x) * (1 + scale) + shift`: ComfyUI's fused `rms_adaln` where it has one, else its RMSNorm
    and the modulation as its older blocks write it."""
    kitchen = getattr(quant_ops, "ck", None)
    if kitchen is not None and hasattr(kitchen, "rms_adaln") and \
            not getattr(comfy.model_management, "in_training", False):
        return kitchen.rms_adaln(x, scale, shift)
    y = comfy.ldm.common_dit.rms_norm(x)
    return torch.addcmul(y, y, scale).add_(shift)


def _modulated(x: torch.Tensor, scale, shift) -> torch.Tensor:
    """`_rms_adaln(x, scale(a, b), shift(a, b))` in a fresh tensor, made by token chunks."""
    out = torch.empty_like(x)
    step = chunk_tokens(x.shape[1], x[:, :1].numel(), max(1, x.numel() // 8))
    for a, b in token_ranges(x.shape[1], step):
        out[:, a:b] = _rms_adaln(x[:, a:b], scale(a, b), shift(a, b))
    return out


def _gated(gate):
    def add_(part, out, a, b):
        part += out.mul_(gate(a, b)) if gate is not None else out
    return add_


def run_block(block, config, x, context=None, attention_mask=None, timestep=None, pe=None, transformer_options={},
              self_attention_mask=None, prompt_timestep=None):
    mod = _Modulation(block.scale_shift_table, timestep, x)

    def entry(index):
        return lambda a, b: mod(index, a, b)
    # self-attention: x += attn1(modulated x) * gate, the modulated input handed off
    handed_off = [_modulated(x, entry(1), entry(0))]
    out = attention(block.attn1, config, handed_off, transformer_options, mask=self_attention_mask, pe=pe,
                    keep_keys=BLOCK_KEPT_KEYS)
    projection_residual_(x, block.attn1.to_out[0], out.flatten(2), _gated(entry(2)))
    del out
    # cross-attention (text): x += attn2(x, context) (with cross-attention AdaLN: modulated q and context, gated)
    if getattr(block, "cross_attention_adaln", False):
        shift_kv, scale_kv = (block.prompt_scale_shift_table[None, None].to(device=x.device, dtype=x.dtype)
                              + prompt_timestep.reshape(x.shape[0], prompt_timestep.shape[1], 2, -1)).unbind(dim=2)
        context = context * (1 + scale_kv) + shift_kv
        queries, gate = [_modulated(x, entry(7), entry(6))], entry(8)
    else:
        queries, gate = [x], None
    out = attention(block.attn2, config, queries, transformer_options, context=context, mask=attention_mask)
    projection_residual_(x, block.attn2.to_out[0], out.flatten(2), _gated(gate))
    del out

    # feed-forward by token chunks: x += ff(rms_norm(x) * (1 + scale) + shift) * gate
    def ffn_input(a, b):
        y = comfy.ldm.common_dit.rms_norm(x[:, a:b])
        return torch.addcmul(y, y, mod(4, a, b)).add_(mod(3, a, b))

    def add_(part, out, a, b):
        part.addcmul_(out, mod(5, a, b))
    mlp_residual_(x, feed_forward(block.ff), ffn_input, add_)
    return x


def feed_forward(ff) -> torch.nn.Sequential:
    """LTX's `FeedForward` (`net`: GELU_approx(proj) (tanh), Dropout, Linear) as the `Sequential(Linear, GELU,
    Linear)` it computes, over the model's own layers (nothing copied): `block_parts.ChunkedMLP` casts plain and
    castable weights once and runs the GELU in place on each chunk's hidden activation; layers of another
    format run their own forwards on each chunk (ComfyUI's INT8 layers then quantize the GELU's output
    themselves, where its FeedForward folds the GELU into that quantization: the same math)."""
    return torch.nn.Sequential(ff.net[0].proj, torch.nn.GELU(approximate="tanh"), ff.net[2])


def probe_block(block) -> Optional[str]:
    """None when an LTX-Video `BasicTransformerBlock` has the structure the bounded block uses."""
    for name in ("attn1", "attn2"):
        module = getattr(block, name, None)
        if module is None:
            return f"no {name}"
        reason = probe_attention(module)
        if reason:
            return f"{name}: {reason}"
    width = block.attn1.heads * block.attn1.dim_head
    table = getattr(block, "scale_shift_table", None)
    adaln = bool(getattr(block, "cross_attention_adaln", False))
    count = 9 if adaln else 6
    if table is None or tuple(table.shape) != (count, width):
        return f"scale_shift_table is not ({count}, {width})"
    if adaln and tuple(getattr(getattr(block, "prompt_scale_shift_table", None), "shape", ())) != (2, width):
        return f"prompt_scale_shift_table is not (2, {width})"
    net = getattr(getattr(block, "ff", None), "net", None)
    if not isinstance(net, torch.nn.Sequential) or len(net) != 3 or getattr(net[0], "proj", None) is None or \
            getattr(net[2], "weight", None) is None or not isinstance(net[1], torch.nn.Dropout):
        return "ff is not GELU_approx(proj), Dropout, Linear"
    return None


# --- guards and the adapter contract (family.py) ---------------------------------------------------------------
ATTENTION_ARGS = ("x", "context", "mask", "pe", "k_pe", "transformer_options")
BLOCK_ARGS = ("x", "context", "attention_mask", "timestep", "pe", "transformer_options", "self_attention_mask",
              "prompt_timestep")
BLOCK_PARTS = ("attn1", "attn2", "ff")
# Every attention of the blocks (LTX-Video's and LTX-2's) patched; LTX-Video's blocks bounded, LTX-2's audio-video
# blocks keep ComfyUI's forward (said in the report).
SPEC = Family(FAMILY, "ltx", (BlockList("transformer_blocks"),), latent_ranks=(5,), patch_size="patchifier.patch_size",
              patch_default=(1, 1, 1), kv_heads_at="block.attn1.heads",
              projections=("attn1", ("to_q", "to_k", "to_v"), "attn1."), attentions=ATTENTION_NAMES,
              attention_cls=ltx_model.CrossAttention,
              bounded=lambda block: type(block) is ltx_model.BasicTransformerBlock,
              unbounded_note="keeps ComfyUI's forward (its attention modules are patched)", stock_parts=BLOCK_PARTS,
              patch_parts=BLOCK_PARTS, first_block=("attn1", ltx_model.CrossAttention),
              names=("LTX-Video",))


def _mask_layout(mask):
    return None if mask is None else (mask.dim(), tuple(mask.shape[1:-1]) != (1,) * (mask.dim() - 2), mask.dtype)


def _attention_extra(bound: dict) -> tuple:
    return (bound.get("context") is None, _rope_layout(bound.get("pe")), _rope_layout(bound.get("k_pe")),
            _mask_layout(bound.get("mask")))


def _slice_mask(mask, n: int, tokens: int, keys_too: bool):
    """`mask` for the first `n` queries (and keys, for a self-attention) of `tokens`."""
    out = mask
    if out.dim() >= 2 and out.shape[-2] == tokens:
        out = out[..., :n, :]
    if keys_too and out.shape[-1] == tokens:
        out = out[..., :n]
    return out.clone()


def _attention_rows(bound: dict, n: int, tokens: int) -> dict:
    """The check's rows of the RoPE tables and the mask (keys of a self-attention too; a cross-attention's
    context whole)."""
    self_attention = bound.get("context") is None
    cut = {"pe": lambda pe: _rope_tokens(pe, n), "mask": lambda mask: _slice_mask(mask, n, tokens, self_attention)}
    if self_attention:
        cut["k_pe"] = lambda pe: _rope_tokens(pe, n)
    return cut


def _refuse_attention(module):
    def refuse(bound) -> Optional[str]:
        return attention_refusal(module, bound["x"], bound.get("context"), bound.get("mask"), bound.get("pe"),
                                 bound.get("k_pe"), bound.get("transformer_options"))
    return refuse


def run_attention(module, config, x, context=None, mask=None, pe=None, k_pe=None, transformer_options={}):
    """LTX `CrossAttention.forward`: the output projection of the attention of x."""
    out = attention(module, config, [x], transformer_options, context=context, mask=mask, pe=pe, k_pe=k_pe)
    return output_projection_(module.to_out[0], out)


def attention_forward(module, config):
    """The guarded forward installed on an LTX `CrossAttention` (self- or cross-attention)."""
    return SPEC.guard("attention", "attention", module, ATTENTION_ARGS, run_attention, config, x="x",
                      extra=_attention_extra, cut=_attention_rows, refuse_call=_refuse_attention(module))


def _block_extra(bound: dict) -> tuple:
    timestep = bound.get("timestep")
    return (_rope_layout(bound.get("pe")), _mask_layout(bound.get("attention_mask")),
            _mask_layout(bound.get("self_attention_mask")), None if timestep is None else timestep.shape[1] == 1,
            bound.get("prompt_timestep") is None)


def _block_rows(bound: dict, n: int, tokens: int) -> dict:
    """The check's RoPE rows, masks and per-token timesteps (the context whole)."""
    return {"pe": lambda pe: _rope_tokens(pe, n),
            "self_attention_mask": lambda mask: _slice_mask(mask, n, tokens, True),
            "attention_mask": lambda mask: _slice_mask(mask, n, tokens, False),
            "timestep": lambda t: t[:, :n].clone() if t.shape[1] == tokens else t}


def _refuse_block(block):
    def refuse(bound) -> Optional[str]:
        x, timestep = bound["x"], bound.get("timestep")
        if not torch.is_tensor(timestep) or timestep.dim() != 3 or timestep.shape[1] not in (1, x.shape[1]):
            return "a timestep neither per call nor per token"
        if getattr(block, "cross_attention_adaln", False) and not torch.is_tensor(bound.get("prompt_timestep")):
            return "cross-attention AdaLN without a prompt timestep"
        options = bound.get("transformer_options")
        return attention_refusal(block.attn1, x, None, bound.get("self_attention_mask"), bound.get("pe"), None,
                                 options) or _mask_refusal(bound.get("attention_mask"))
    return refuse


def bounded_block_forward(block, config):
    """The guarded bounded forward installed on an LTX-Video `BasicTransformerBlock`."""
    return SPEC.guard("block", "block", block, BLOCK_ARGS, run_block, config, x="x", extra=_block_extra,
                      cut=_block_rows, residual="x", refuse_call=_refuse_block(block), refuse_more=foreign_part)


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone): every attention module that probes clean; with block bounds,
    LTX-Video's blocks (LTX-2's audio-video blocks keep ComfyUI's forward around their patched attention)."""
    SPEC.patch(patcher, config, report, attention=(attention_forward, probe_attention),
               block=(bounded_block_forward, probe_block))


matches, stock_functions, tokens_per_item, kv_heads, splits_projections, block_kinds = SPEC.contract()
