"""Lumina2 / Z-Image adapter (`comfy/ldm/lumina/model.py`'s `NextDiT`: Lumina Image 2.0, Z-Image and its
Omni / pixel-space variants, NewBie): its `JointAttention` and `JointTransformerBlock`.

The attention: one fused `qkv` Linear giving [q, k, v] with grouped-query attention (`n_kv_heads` key/value
heads; query head i uses key/value head i // n_rep), RMSNorm over each head's channels (`q_norm` / `k_norm`,
or none) and RoPE on adjacent pairs in float32, over one sequence that joins whatever the model put in it
(text, image, reference tokens). It runs through `nodes/attention.py` with head groups of whole key/value
heads, each group's q/k/v computed from that group's rows of `qkv`. Patched always, at the attention level.
ComfyUI v0.33 normalizes and rotates q and k with comfy-kitchen's fused `rms_rope`: the norm module's math
(torch's RMSNorm computes in float32, with float32's epsilon where the norm has none) then pair RoPE in float32,
which is what runs here (a fused CUDA kernel may round once less: 16-bit round-off).

With block bounds on, `JointTransformerBlock.forward` as well (the modulated and the refiner blocks): the
modulated input (norm, adaLN scale) is made by token chunks and handed off to the runtime, the output
projection runs into a fresh tensor that becomes the block's output (ComfyUI's block does not write its input
and the model keeps it for other nodes' patches: `img_input`), the post-norm, gate and residual are added by
token chunks, and the SwiGLU feed-forward runs by token chunks into that output, its three layers cast once
(`block_parts.GatedMLP`). Per-token-range modulation (Z-Image Omni's `timestep_zero_index`) goes through
ComfyUI's own `modulate` / `apply_gate` on each chunk's share of the ranges.

Guarded and self-checked like every forward of the pack (`compat.guard_module`): a call with arguments the
pack's forward does not take (a newer ComfyUI handing a fused qkv product to the attention, say) runs stock.
ComfyUI's Lumina forwards call no q/k/v hooks of other nodes (the self-check, whose probes stand in for those
hooks, would tell if one did); an attention override is chained through `nodes/dispatch.py`.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

import comfy.ldm.lumina.model as lumina_model

from ..attention import AttentionForm, NORM_PER_HEAD, ROPE_PAIRS, StreamProjections, attend, is_rms_norm
from ..block_parts import GatedMLP, foreign_part, mlp_residual_
from ..comfy_ops import chunk_tokens, linear_handed_off, token_ranges
from .family import BlockList, Family, layout, probe_part

FAMILY = "Lumina2"

NORMED = AttentionForm(streams=(StreamProjections(fused="qkv", norm_q="q_norm", norm_k="k_norm"),),
                       norm=NORM_PER_HEAD, rope=ROPE_PAIRS)
UNNORMED = AttentionForm(streams=(StreamProjections(fused="qkv"),), rope=ROPE_PAIRS)

# The arguments the pack's forwards take; a ComfyUI whose forward has others is left stock (probe).
ATTENTION_ARGS = ("x", "x_mask", "freqs_cis", "transformer_options", "qkv")
BLOCK_ARGS = ("x", "x_mask", "freqs_cis", "adaln_input", "timestep_zero_index", "transformer_options")
# the block's submodules the bounded block computes itself (another node's patch on one: the block runs stock)
BLOCK_PARTS = ("attention", "feed_forward", "attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2",
               "adaLN_modulation")
# Every block list of Lumina 2's and Z-Image's (its refiners, the main layers): attention and block patched.
SPEC = Family(FAMILY, "lumina", tuple(BlockList(name, cls=lumina_model.JointTransformerBlock)
                                      for name in ("context_refiner", "siglip_refiner", "noise_refiner", "layers")),
              kv_heads_at="block.attention.n_local_kv_heads", projections=("attention", ("qkv",), ""),
              attentions=("attention",), attention_cls=lumina_model.JointAttention,
              stock_parts=("attention", "feed_forward"), patch_parts=BLOCK_PARTS, names=("Lumina 2 / Z-Image",))


def _clamp_fp16(t: torch.Tensor) -> torch.Tensor:
    """ComfyUI's float16 clamp of this block's outputs (`clamp_fp16`; versions before it have none)."""
    clamp = getattr(lumina_model, "clamp_fp16", None)
    return t if clamp is None else clamp(t)


def _swiglu_(gate_out: torch.Tensor, up_out: torch.Tensor) -> torch.Tensor:
    """`FeedForward`'s hidden activation, silu(w1 x) * w3 x (clamped in float16 as ComfyUI does), computed
    in `gate_out`'s storage."""
    return _clamp_fp16(torch.nn.functional.silu(gate_out, inplace=True).mul_(up_out))


SWIGLU = GatedMLP(gate="w1", up="w3", down="w2", combine_=_swiglu_)


# --- probes -----------------------------------------------------------------------------------------------------
def _forward_args(module) -> tuple:
    """The parameter names of the module's own (class) forward, without self."""
    return tuple(inspect.signature(type(module).forward).parameters)[1:]


def _heads(attention) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim)."""
    return attention.n_local_heads, attention.n_local_kv_heads, attention.head_dim


def _normed(attention) -> bool:
    """q/k norms, or none (ComfyUI puts an Identity there; older versions keep no `qk_norm` flag)."""
    return not isinstance(getattr(attention, "q_norm", None), torch.nn.Identity)


def _form(attention) -> AttentionForm:
    return NORMED if _normed(attention) else UNNORMED


def _linear_ok(linear, out_features: int, in_features: int) -> bool:
    weight = getattr(linear, "weight", None)
    return weight is not None and weight.dim() == 2 and tuple(weight.shape) == (out_features, in_features)


def probe_attention(attention) -> Optional[str]:
    """None when a `JointAttention` has the structure the pack's forward uses (whether it computes the same
    is the self-check's job)."""
    unknown = [name for name in _forward_args(attention) if name not in ATTENTION_ARGS]
    if unknown:
        return f"its forward takes arguments the pack's does not ({', '.join(unknown)})"
    for name in ("n_local_heads", "n_local_kv_heads", "head_dim"):
        if not isinstance(getattr(attention, name, None), int) or getattr(attention, name) <= 0:
            return f"no {name}"
    heads, kv_heads, head_dim = _heads(attention)
    if heads % kv_heads:
        return f"{heads} heads are not a multiple of {kv_heads} key/value heads"
    if head_dim % 2:
        return "an odd head_dim (RoPE rotates pairs)"
    reason = _form(attention).probe(attention, heads, head_dim, kv_heads)
    if reason:
        return reason
    if _normed(attention) and not all(is_rms_norm(norm, head_dim) for norm in (attention.q_norm, attention.k_norm)):
        return f"q_norm/k_norm are not RMSNorms over {head_dim} channels"
    if not _normed(attention) and not isinstance(getattr(attention, "k_norm", None), torch.nn.Identity):
        return "a k_norm without a q_norm"
    out = getattr(attention, "out", None)
    if getattr(getattr(out, "weight", None), "shape", (None,))[-1] != heads * head_dim:
        return f"out is not a Linear from {heads * head_dim} features"
    return None


def probe_block(block) -> Optional[str]:
    """None when a `JointTransformerBlock` has the structure the bounded forward uses."""
    unknown = [name for name in _forward_args(block) if name not in BLOCK_ARGS]
    if unknown:
        return f"its forward takes arguments the pack's does not ({', '.join(unknown)})"
    reason = probe_part(block, "attention", probe_attention, lumina_model.JointAttention)
    if reason:
        return reason
    attention = block.attention
    dim = getattr(block, "dim", None)
    if not isinstance(dim, int) or not _linear_ok(attention.out, dim, attention.n_local_heads * attention.head_dim):
        return "attention.out does not map the heads back to the block's width"
    for name in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2"):
        if not is_rms_norm(getattr(block, name, None), dim):
            return f"{name} is not an RMSNorm over {dim} channels"
    layers = SWIGLU.linears(getattr(block, "feed_forward", None))
    if layers is None:
        return "its feed_forward is not w1, w3, w2"
    w1, w3, w2 = layers
    hidden = w1.weight.shape[0]
    if not (_linear_ok(w1, hidden, dim) and _linear_ok(w3, hidden, dim) and _linear_ok(w2, dim, hidden)):
        return "its feed_forward's w1, w3, w2 are not dim -> hidden, dim -> hidden, hidden -> dim"
    if not isinstance(getattr(block, "modulation", None), bool):
        return "no modulation flag"
    if block.modulation:
        modulation = getattr(block, "adaLN_modulation", None)
        last = modulation[-1] if isinstance(modulation, torch.nn.Sequential) and len(modulation) else None
        if getattr(getattr(last, "weight", None), "shape", (None,))[0] != 4 * dim:
            return "its adaLN_modulation does not give four modulations"
    return None


# --- the attention ------------------------------------------------------------------------------------------------
def attention_heads(attention, config, x_list: list, mask, freqs, transformer_options) -> torch.Tensor:
    """The attention of `[x]` (cleared: the runtime frees x once projected), x `(B, N, dim)`: `(B, N, heads,
    head_dim)`, head groups of whole key/value heads. `freqs` `(B or 1, N, 1, D/2, 2, 2)` float32 (the
    model's `freqs_cis`), `mask` as the model passes it."""
    heads, kv_heads, head_dim = _heads(attention)
    return attend(attention, _form(attention), [x_list], heads, head_dim, config, transformer_options,
                  freqs=freqs, mask=mask, kv_heads=kv_heads)


def run_attention(attention, config, x, x_mask, freqs_cis, transformer_options={}, qkv=None):
    """`JointAttention.forward`: the output projection of the attention of x."""
    handed_off = [x]
    del x   # the caller (ComfyUI's block) still holds its modulated input: nothing to free here
    out = attention_heads(attention, config, handed_off, x_mask, freqs_cis, transformer_options)
    return attention.out(out.flatten(2))


# --- the block -----------------------------------------------------------------------------------------------------
def _ranges_in(ranges, a: int, b: int) -> list:
    """Token ranges [(start, stop), ...] (`timestep_zero_index`) as seen from the chunk [a, b)."""
    out = []
    for start, stop in ranges:
        lo, hi = max(start, a), min(stop, b)
        if lo < hi:
            out.append((lo - a, hi - a))
    return out


def _modulate(t: torch.Tensor, scale, ranges, a: int, b: int) -> torch.Tensor:
    """ComfyUI's `modulate` on the chunk [a, b) (t: the chunk's normed input, may be scaled in place); no
    modulation for the refiner blocks (scale None)."""
    if scale is None:
        return t
    if ranges is None:
        return lumina_model.modulate(t, scale)
    return lumina_model.modulate(t, scale, timestep_zero_index=_ranges_in(ranges, a, b))


def _gate(gate, t: torch.Tensor, ranges, a: int, b: int) -> torch.Tensor:
    """ComfyUI's `apply_gate` on the chunk [a, b) (gate `(B, 1, C)`, already tanh'd); none without modulation."""
    if gate is None:
        return t
    if ranges is None:
        return gate * t
    return lumina_model.apply_gate(gate, t, timestep_zero_index=_ranges_in(ranges, a, b))


def run_block(block, config, x, x_mask, freqs_cis, adaln_input=None, timestep_zero_index=None,
              transformer_options={}):
    """`JointTransformerBlock.forward` with every transient bounded; returns a new tensor (x is not written:
    the model keeps the first block's input for other nodes' patches)."""
    attention, ranges = block.attention, timestep_zero_index
    if block.modulation:
        scale_msa, gate_msa, scale_mlp, gate_mlp = block.adaLN_modulation(adaln_input).chunk(4, dim=1)
        gate_msa, gate_mlp = gate_msa.unsqueeze(1).tanh(), gate_mlp.unsqueeze(1).tanh()
    else:
        scale_msa = gate_msa = scale_mlp = gate_mlp = None
    batch, tokens, width = x.shape
    step = chunk_tokens(tokens, batch * width, max(1, x.numel() // 8))
    modulated = torch.empty_like(x)
    for a, b in token_ranges(tokens, step):
        modulated[:, a:b] = _modulate(block.attention_norm1(x[:, a:b]), scale_msa, ranges, a, b)
    handed_off = [modulated]
    del modulated   # the runtime holds the only reference and frees it once q/k/v are projected
    heads = attention_heads(attention, config, handed_off, x_mask, freqs_cis, transformer_options)
    handed_off = [heads.flatten(2)]
    del heads
    out = linear_handed_off(attention.out, handed_off, x)   # the block's output from here on
    for a, b in token_ranges(tokens, step):
        update = _gate(gate_msa, block.attention_norm2(_clamp_fp16(out[:, a:b])), ranges, a, b)
        torch.add(x[:, a:b], update, out=out[:, a:b])
        del update

    def ffn_input(a, b):
        return _modulate(block.ffn_norm1(out[:, a:b]), scale_mlp, ranges, a, b)

    def add_(part, ffn_out, a, b):
        if block.modulation:   # ComfyUI clamps the modulated blocks' FFN output in float16
            ffn_out = _clamp_fp16(ffn_out)
        part += _gate(gate_mlp, block.ffn_norm2(ffn_out), ranges, a, b)

    mlp_residual_(out, block.feed_forward, ffn_input, add_, gated=SWIGLU)
    return out


# --- guards and the adapter contract (family.py) ----------------------------------------------------------------------
def _refuse_attention_call(bound) -> Optional[str]:
    if bound.get("qkv") is not None:
        return "the block handed in its own q/k/v product"
    return None


def _extra(bound: dict) -> tuple:
    freqs = bound.get("freqs_cis")
    return (layout(bound.get("x_mask")), None if freqs is None else freqs.dim(), bound.get("adaln_input") is None,
            bound.get("timestep_zero_index") is None)


def _first_tokens_mask(mask, tokens: int, n: int):
    """`mask` restricted to the first `n` of `tokens` tokens, on its query and key dims where they span them."""
    out = mask
    for dim in (-1, -2):
        if out.dim() >= -dim and out.shape[dim] == tokens:
            out = out.narrow(dim, 0, n)
    return out.clone()


def _check_rows(bound: dict, n: int, tokens: int) -> dict:
    """The check's first tokens (all batch items: Z-Image Omni's modulation has twice the batch of x) with their
    RoPE rows, mask entries and modulation ranges."""
    return {"x_mask": lambda mask: _first_tokens_mask(mask, tokens, n), "freqs_cis": lambda freqs: freqs[:, :n].clone(),
            "timestep_zero_index": lambda ranges: _ranges_in(ranges, 0, n)}


def attention_forward(attention, config):
    """The guarded forward installed on a `JointAttention`."""
    return SPEC.guard("attention", "attention", attention, _forward_args(attention), run_attention, config, x="x",
                      extra=_extra, cut=_check_rows, refuse_call=_refuse_attention_call)


def block_forward(block, config):
    """The guarded bounded forward installed on a `JointTransformerBlock` (block bounds on)."""
    return SPEC.guard("block", "block", block, _forward_args(block), run_block, config, x="x", extra=_extra,
                      cut=_check_rows, residual="x", refuse_more=foreign_part)


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone): every attention that probes clean, and with block bounds every
    block. A module another node patched keeps that patch (its block then runs stock, calling it)."""
    SPEC.patch(patcher, config, report, attention=(attention_forward, probe_attention),
               block=(block_forward, probe_block))


matches, stock_functions, tokens_per_item, kv_heads, splits_projections, _ = SPEC.contract()


def block_kinds(diffusion_model) -> tuple:
    """Z-Image's blocks (a modulation from at most 256 channels) or Lumina 2's."""
    modulation = getattr(SPEC.first(diffusion_model), "adaLN_modulation", None)
    first = modulation[0] if isinstance(modulation, torch.nn.Sequential) and len(modulation) else None
    width = getattr(diffusion_model, "dim", None)
    zimage = first is not None and width is not None and getattr(first, "in_features", width) < width
    return ("zimage",) if zimage else ("lumina2",)
