"""Wan 2.x adapter (`comfy/ldm/wan`): self-attention through `nodes/attention.py`'s `attend()` (Wan's
description: q/k/v Linears, an RMSNorm spanning all heads, pair RoPE), cross-attention through
`cross_qkv_attention` with the same spanning norm (its own: the context's keys and values projected once
a layer call, CLIP image tokens beside the text for i2v, queries by token chunks in the bounded block), and
(the block switch) a bounded `WanAttentionBlock.forward`.

What is patched is decided by probing each module's structure (attributes, layer shapes). Whether the pack's
forward still computes what ComfyUI's does is decided by behaviour, not by ComfyUI's source text: every
installed forward is guarded by `compat.guarded` (a self-check against ComfyUI's own forward at the first
call of each kind, and ComfyUI's forward for calls the pack does not handle). Patches are object patches on
a cloned ModelPatcher only.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

import comfy.ldm.wan.model as wan_model
import comfy.model_management

from ...qkv_core import WholeProjection, cross_qkv_attention, kernels
from .. import compat, sequence_parallel
from ..attention import (NORM_SPANS_HEADS, ROPE_PAIRS, AttentionForm, SpanningNormRope, StreamProjections, attend,
                        attend_sequence_parallel, is_rms_norm)
from ..block_parts import foreign_part, mlp_residual_, modulated_layer_norm, output_projection_
from ..comfy_ops import CastLinear, ComfyLinearRows, chunk_tokens, even_chunk_tokens, linear_handed_off, token_ranges
from ..dispatch import attend_group, attention_kwargs
from .family import BlockList, Family, probe_linear

FAMILY = "Wan"


def _norm_ok(module, name: str, dim: int) -> Optional[str]:
    norm = getattr(module, name, None)
    if norm is None:
        return f"no {name}"
    if isinstance(norm, torch.nn.Identity):
        return None
    if not is_rms_norm(norm, dim):
        return f"{name} is not an RMSNorm over {dim} channels"
    return None


def probe_attention(module, kind: str) -> Optional[str]:
    """None when `module` (WanSelfAttention, WanT2VCrossAttention or WanI2VCrossAttention) has the structure
    the pack's forwards use (whether they compute the same is the self-check's job)."""
    heads, head_dim = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        return "no num_heads/head_dim"
    dim = heads * head_dim
    for name in ("q", "k", "v", "o"):
        reason = probe_linear(module, name, dim)
        if reason:
            return reason
    names = ["norm_q", "norm_k"] + (["norm_k_img"] if kind == "WanI2VCrossAttention" else [])
    if kind == "WanI2VCrossAttention":
        for name in ("k_img", "v_img"):
            reason = probe_linear(module, name, dim)
            if reason:
                return reason
    for name in names:
        reason = _norm_ok(module, name, dim)
        if reason:
            return reason
    return None


def probe_block(block, kind: str = "WanAttentionBlock") -> Optional[str]:
    """None when the whole block has the structure the bounded block uses."""
    self_attn, cross_attn = getattr(block, "self_attn", None), getattr(block, "cross_attn", None)
    if self_attn is None or cross_attn is None:
        return "no self_attn/cross_attn"
    reason = probe_attention(self_attn, "WanSelfAttention") or probe_attention(cross_attn, type(cross_attn).__name__)
    if reason:
        return reason
    dim = self_attn.num_heads * self_attn.head_dim
    ffn = getattr(block, "ffn", None)
    if not (isinstance(ffn, torch.nn.Sequential) and len(ffn) == 3 and isinstance(ffn[1], torch.nn.GELU)):
        return "ffn is not Linear, GELU, Linear"
    if probe_linear(ffn, "0", ffn[0].weight.shape[0] if hasattr(ffn[0], "weight") else -1, dim) or \
            probe_linear(ffn, "2", dim):
        return "ffn shapes do not match the width"
    modulation = getattr(block, "modulation", None)
    if modulation is None or tuple(modulation.shape) != (1, 6, dim):
        return "modulation is not (1, 6, dim)"
    for name in ("norm1", "norm2", "norm3"):
        if getattr(block, name, None) is None:
            return f"no {name}"
    if kind == "VaceWanAttentionBlock" and not hasattr(block, "after_proj"):
        return "no after_proj"
    return None


# --- attention ------------------------------------------------------------------------------------------
# Wan's self-attention: q/k/v Linears, norm_q / norm_k an RMSNorm over all heads (Identity without qk_norm),
# pair RoPE with one rotation per token (`freqs` `(1, N, 1, D/2, 2, 2)`, float32).
SELF_ATTENTION = AttentionForm(streams=(StreamProjections(q="q", k="k", v="v", norm_q="norm_q", norm_k="norm_k"),),
                               norm=NORM_SPANS_HEADS, rope=ROPE_PAIRS)


# Keys kept from the statistics pass of the spanning norm (`keep_keys`: that fraction of the head groups, the
# first ones, skip their second k projection). The bounded block keeps 30 %: at High (Wan 14B: 20 groups) its
# peak grows by a quarter of |x| (6 groups' keys less the statistics chunk they replace) to 2.4|x|, under the
# 2.5|x| it is held to, and k's second projection shrinks by 30 % (keeping more saves a little more time, past
# that bound). Attention patched alone keeps them all: the stock FFN's 5.4|x| is the block's peak then, far above
# the attention's.
BLOCK_KEPT_KEYS = 0.3
ATTENTION_ONLY_KEPT_KEYS = 1.0


def self_attention(module, x_list, freqs, config, transformer_options, keep_keys: float,
                   reuse_input: bool = False) -> torch.Tensor:
    """Wan self-attention of `[x]` (list cleared) without the output projection: `(B, N, heads, head_dim)`.
    `reuse_input`: x is the caller's own temporary (the runtime may return it as the result)."""
    return attend(module, SELF_ATTENTION, [x_list], module.num_heads, module.head_dim, config, transformer_options,
                  freqs=freqs, keep_keys=keep_keys, reuse_input=reuse_input)


def _cross_norm(module, key_norm: Optional[str], whole: bool = False) -> SpanningNormRope:
    """The spanning norm of a cross-attention (no RoPE): norm_q on the queries, `key_norm` on the keys (None:
    they come normalized)."""
    key = None if key_norm is None else getattr(module, key_norm)
    return SpanningNormRope([(0, None, module.norm_q, key)], module.num_heads, module.head_dim, whole=whole)


class CrossAttention:
    """Wan cross-attention (text; plus CLIP image tokens for i2v) for one layer call, over `x` whole or by
    token chunks: the weights are cast once, the context's keys/values (text, and CLIP image tokens)
    projected once, whatever the chunks. `release()` when done (hands back offloaded weights)."""

    def __init__(self, module, context, context_img_len, config, transformer_options, like: torch.Tensor):
        self.module = module
        query = ComfyLinearRows(module.q)
        query.hold(like)
        self.out = CastLinear(module.o, like)
        self.kwargs = choice = attention_kwargs(config, transformer_options, module)
        if hasattr(module, "k_img"):
            context_img, context = context[:, :context_img_len], context[:, context_img_len:]
            heads, d = module.num_heads, module.head_dim
            # 257 image tokens: projected whole with the model's own layers, sliced per head group
            k_img = module.norm_k_img(module.k_img(context_img)).unflatten(-1, (heads, d))
            v_img = module.v_img(context_img).unflatten(-1, (heads, d))
            del context_img

            def text_plus_image(qkv, group):
                q, k, v = qkv
                qkv.clear()
                text = attend_group(q, k, v, choice, group)
                del k, v
                # the model keeps the (tiny) image attention off 8-bit kernels: NaNs there
                image = attend_group(q, k_img[:, :, group.kv.start:group.kv.stop],
                                     v_img[:, :, group.kv.start:group.kv.stop], choice, group, full_precision=True)
                return text.add_(image)  # x = x + img_x, as the model sums them
            text_plus_image.counts_itself = True   # attend_group counts each kernel call
            self.kwargs = {key: value for key, value in choice.items() if key != "force_attention"}
            self.kwargs["attention_fn"] = text_plus_image
        self.context = context
        if not config.policy.projects_by_rows(context.shape[1]):
            # a short stream (tokens of one item, as the runtime counts them): the text keys (normalized) and
            # values computed once, which the runtime slices per group
            self.rows = [query, _projected_once(module.k, context, module.norm_k), _projected_once(module.v, context)]
            key_norm = None
        else:  # a context long enough to be split itself is projected by head group
            self.rows = [query, ComfyLinearRows(module.k), ComfyLinearRows(module.v)]
            for rows in self.rows[1:]:
                rows.hold(like)
            key_norm = "norm_k"
        self.norm_rope = _cross_norm(module, key_norm)
        self.chunk_norm_rope = _cross_norm(module, key_norm, whole=True)

    def __call__(self, x_list, split_heads: bool = True) -> torch.Tensor:
        """Attention of `[x]` (list cleared) without `o`: `(B, N, heads, head_dim)`. `split_heads=False` for
        token chunks, which are small already."""
        module = self.module
        norm_rope = self.norm_rope if split_heads else self.chunk_norm_rope
        return cross_qkv_attention(x_list, [self.context], *self.rows, module.num_heads, module.head_dim,
                                   norm_rope, norm_spans_heads=not isinstance(module.norm_q, torch.nn.Identity),
                                   split_heads=split_heads, **self.kwargs)

    def release(self) -> None:
        for rows in self.rows:
            if isinstance(rows, ComfyLinearRows):
                rows.release_hold()
        self.rows = []
        self.out.release()


def _projected_once(linear, context: torch.Tensor, norm=None) -> WholeProjection:
    """`linear(context)` (then `norm`) computed now through the layer's cast, as a projection that hands
    back the result (the runtime projects a short stream whole once and slices it: nothing runs twice)."""
    prepared = ComfyLinearRows(linear).prepare(context)
    try:
        projected = prepared.full()
    finally:
        prepared.release()
    if norm is not None and not isinstance(norm, torch.nn.Identity):
        projected = norm(projected)
    return WholeProjection(lambda _context: projected, "projected once per layer call")


# --- the bounded block ----------------------------------------------------------------------------------
# Token chunks of the cross-attention after self-attention, as a fraction of |x|: its transients stay under the
# self-attention's own peak at High (it holds several chunk-sized tensors, a float32 norm scratch among them where
# rms_norm is not fused), and the chunks stay large enough for the products to run near full speed. (The FFN's,
# whose hidden activation is 2.7x wider than x, are block_parts' `FFN_CHUNK_FRACTION`.)
CROSS_CHUNK_FRACTION = 8
# On CUDA with Triton the chunk's norm runs fused and no attention holds a score matrix: chunks twice as large
# keep the block's peak in half the cross-attention launches, whose short tails cost time.
CUDA_CROSS_CHUNK_FRACTION = 4


def cross_chunk_fraction(x: torch.Tensor) -> int:
    """The cross-attention's token chunks as a fraction of |x| (`CUDA_CROSS_CHUNK_FRACTION` where it applies)."""
    return CUDA_CROSS_CHUNK_FRACTION if x.is_cuda and kernels.can_run(x) else CROSS_CHUNK_FRACTION


class _Modulation:
    """Wan's six modulation vectors (`block.modulation + e`) for a range of tokens at a time. `e` is
    `(B, 6, C)`, `(B, 1, 6, C)`, per token `(B, N, 6, C)` or per frame `(B, T, 6, C)` (Wan 2.2 5B), repeated
    to the frame's tokens as the model's `repeat_e` does, without a full-size copy of any of them."""

    def __init__(self, block, e, x):
        modulation = comfy.model_management.cast_to(block.modulation, dtype=x.dtype, device=x.device)
        tokens = x.shape[1]
        if e.ndim < 4:
            self.parts, self.stride = (modulation + e).chunk(6, dim=1), None   # (B, 1, C) each
            return
        entries = e.shape[1]
        if entries == tokens and tokens > 1:  # per token: added a chunk at a time
            self.parts, self.stride, self.e, self.modulation = None, 1, e, modulation
            return
        self.parts = (modulation.unsqueeze(0) + e).unbind(2)                 # (B, T, C) each, T small
        if entries == 1:
            self.stride = None
        else:  # token t uses entry t // stride (repeat_e: repeats, or repeats + 1 when it does not divide)
            repeats = tokens // entries
            self.stride = repeats if repeats * entries == tokens else repeats + 1

    def uniform(self, index: int) -> Optional[torch.Tensor]:
        """Vector `index` `(B, 1, C)` where every token takes the same one, else None."""
        return self.parts[index] if self.parts is not None and self.stride is None else None

    def __call__(self, index: int, a: int, b: int) -> torch.Tensor:
        if self.parts is None:
            return self.modulation[:, index] + self.e[:, a:b, index]
        part = self.parts[index]
        if self.stride is None:
            return part
        entries = torch.arange(a, b, device=part.device) // self.stride
        return part.index_select(1, entries)


def _modulated_norm(norm, mod: _Modulation, shift_index: int) -> Callable[[torch.Tensor], Optional[torch.Tensor]]:
    """`fused(x)`: `norm(x) * (1 + e[shift_index + 1]) + e[shift_index]` in one launch
    (`block_parts.modulated_layer_norm`), or None where it does not apply (a norm of another kind, a
    modulation per token or per frame, or several batch items: the caller's two steps then)."""
    shift, scale = mod.uniform(shift_index), mod.uniform(shift_index + 1)
    scale_plus_one = None if scale is None else 1 + scale
    return lambda x: modulated_layer_norm(norm, x, shift, scale_plus_one)


def run_block(block, config, x, e, freqs, context, context_img_len=257, transformer_options={}):
    """`WanAttentionBlock.forward` with every transient bounded: a new tensor (x is not written)."""
    x = x.contiguous()
    mod = _Modulation(block, e, x)
    batch, tokens, width = x.shape
    step = chunk_tokens(tokens, batch * width, max(1, x.numel() // 8))
    residual = self_attention_phase(block, x, mod, freqs, config, transformer_options, step)
    cross_step = even_chunk_tokens(tokens, batch * width, max(1, x.numel() // cross_chunk_fraction(x)))
    cross_attention_phase(block, residual, context, context_img_len, config, transformer_options, cross_step)
    for patch in transformer_options.get("patches", {}).get("attn2_patch", ()):
        # other nodes' hook after cross-attention (ComfyUI v0.33+ runs it here); the self-check verifies that
        # this ComfyUI does too
        residual = patch({"x": residual, "transformer_options": transformer_options})
    ffn_phase_(block, residual, mod)
    return residual


def self_attention_phase(block, x, mod, freqs, config, transformer_options, step: int) -> torch.Tensor:
    """x + self_attn(modulated x) * e2 in a fresh tensor (the block's output buffer; x is not written).
    The modulated input is made (see below) and handed off; the output projection runs whole into a
    new tensor (the modulated input is gone by then, so the attention result and the projection together
    stay under the split's own peak), and the residual is added into the projection's storage. With a plain
    LayerNorm and one modulation for every token, the modulated input is one `F.layer_norm` launch over all
    tokens (its only transient is its output), else made by token chunks."""
    tokens = x.shape[1]
    modulated = _modulated_norm(block.norm1, mod, 0)(x)   # whole, in one launch, where it applies
    if modulated is None:
        modulated = torch.empty_like(x)
        for a, b in token_ranges(tokens, step):
            torch.addcmul(mod(0, a, b), block.norm1(x[:, a:b]), 1 + mod(1, a, b), out=modulated[:, a:b])
    handed_off = [modulated]
    del modulated   # the runtime holds the only reference: a projection that no longer needs it frees it
    group = sequence_parallel.ulysses_group(block.self_attn)
    if group is not None:   # raylight's Ulysses: this rank's tokens, the heads exchanged one group at a time
        attention = attend_sequence_parallel(block.self_attn, SELF_ATTENTION, handed_off, block.self_attn.num_heads,
                                             block.self_attn.head_dim, config, freqs, group)
    else:   # (with SageAttention 2 staged, the runtime may keep the keys and the result in its storage instead)
        attention = self_attention(block.self_attn, handed_off, freqs, config, transformer_options,
                                   BLOCK_KEPT_KEYS, reuse_input=True)
    handed_off = [attention.flatten(2)]
    del attention
    y = linear_handed_off(block.self_attn.o, handed_off, x)
    for a, b in token_ranges(tokens, step):
        torch.addcmul(x[:, a:b], y[:, a:b], mod(2, a, b), out=y[:, a:b])
    return y


def cross_attention_phase(block, residual, context, context_img_len, config, transformer_options,
                          step: int) -> None:
    """residual += cross_attn(norm3(residual)), by token chunks (queries are independent; the context is
    short), the weights cast and the context's keys/values projected once."""
    cross = CrossAttention(block.cross_attn, context, context_img_len, config, transformer_options, like=residual)
    try:
        for a, b in token_ranges(residual.shape[1], step):
            part = cross([block.norm3(residual[:, a:b])], split_heads=False)
            residual[:, a:b] += cross.out(part.flatten(2))  # the chunk is small: one product, not sub-chunks
            del part
    finally:
        cross.release()


def ffn_phase_(block, residual, mod) -> None:
    """residual += ffn(modulated norm2(residual)) * e5, by token chunks, in place (`block_parts.mlp_residual_`:
    plain weights cast once and the GELU on the chunk's hidden activation, any other weight format through
    ComfyUI's own FFN on each chunk), the chunk's norm and modulation in one launch where they allow
    (`_modulated_norm`)."""
    fused_norm = _modulated_norm(block.norm2, mod, 3)

    def ffn_input(a, b):
        part = residual[:, a:b]
        modulated = fused_norm(part)
        return torch.addcmul(mod(3, a, b), block.norm2(part), 1 + mod(4, a, b)) if modulated is None else modulated

    def add_(part, out, a, b):
        torch.addcmul(part, out, mod(5, a, b), out=part)
    mlp_residual_(residual, block.ffn, ffn_input, add_)


# --- the forwards the pack installs: guarded, self-checked (family.py) ------------------------------------
SELF_ATTENTION_ARGS = ("x", "freqs", "transformer_options")
CROSS_ATTENTION_ARGS = ("x", "context", "context_img_len", "transformer_options")
BLOCK_ARGS = ("x", "e", "freqs", "context", "context_img_len", "transformer_options")
VACE_BLOCK_ARGS = ("c",) + BLOCK_ARGS
# submodules the bounded block computes itself: another node's patch on any of them means the block runs stock
BLOCK_PARTS = ("self_attn", "cross_attn", "ffn", "norm1", "norm2", "norm3")
# Wan's blocks and VACE's: self- and cross-attention patched, the blocks bounded.
SPEC = Family(FAMILY, "wan", (BlockList("blocks"), BlockList("vace_blocks")), latent_ranks=(5,),
              patch_default=(1, 2, 2), projections=("self_attn", ("q", "k", "v"), "self_attn."),
              attentions=("self_attn", "cross_attn"), attention_label=None, stock_parts=BLOCK_PARTS[:3],
              patch_parts=BLOCK_PARTS, first_block=("self_attn", wan_model.WanSelfAttention))


def _extra(bound: dict) -> tuple:
    x = bound["c"] if "c" in bound else bound["x"]
    e, img_len = bound.get("e"), bound.get("context_img_len")
    e_layout = None if e is None else (e.ndim, e.shape[1] == 1, e.shape[1] == x.shape[1])
    # a zeroed text context (ConditioningZeroOut's negative: one embedded row repeated) is a case of its own:
    # attention over identical keys cannot show its queries' errors, so a call of only such items is checked apart
    # from one with others (`compat.uniform_case`)
    text = bound.get("context")
    if torch.is_tensor(text) and img_len and text.dim() == 3 and text.shape[1] > img_len:
        text = text[:, img_len:]
    return (e_layout, img_len is None, bound.get("freqs") is None, compat.uniform_case(text))


def _check_inputs(bound: dict) -> dict:
    """The first `compat.CHECK_TOKENS` tokens of the call's inputs for each distinct conditioning of the batch
    (`compat.check_items` on the context: cond and a zeroed uncond both, never only the zeroed one; the first items
    for the self-attention, whose call has no context), fresh tensors, with probes for the patch hooks in its
    transformer_options."""
    x = bound["c"] if "c" in bound else bound["x"]
    batch, tokens = x.shape[0], x.shape[1]
    n = compat.check_tokens(tokens)
    items = compat.check_items(bound.get("context"), batch)
    index = torch.tensor(items, device=x.device)

    def take(value):
        return value.index_select(0, index) if value.shape[0] == batch else value
    out = {}
    for name, value in bound.items():
        if name == "transformer_options":
            out[name] = compat.probe_options(value or {})
        elif not torch.is_tensor(value) or value.dim() < 2 or name == "context":
            out[name] = take(value).clone() if torch.is_tensor(value) and value.dim() >= 1 else value
        elif name == "e" and value.dim() == 4 and value.shape[1] not in (1, tokens):
            out[name] = take(value)[:, :1].clone()   # per frame: one frame's modulation for every check token
        else:
            first = take(value)
            out[name] = first[:, :n].clone() if first.shape[1] == tokens else first.clone()
    return out


def run_self_attention(module, config, x, freqs, transformer_options={}):
    return output_projection_(module.o, self_attention(module, [x], freqs, config, transformer_options,
                                                       ATTENTION_ONLY_KEPT_KEYS))


def run_cross_attention(module, config, x, context, context_img_len=None, transformer_options={}):
    cross = CrossAttention(module, context, context_img_len, config, transformer_options, like=x)
    try:
        return output_projection_(module.o, cross([x]), cast=cross.out)
    finally:
        cross.release()


def run_vace_block(block, config, c, x, e, freqs, context, context_img_len=257, transformer_options={}):
    if block.block_id == 0:
        c = block.before_proj(c) + x
    c = run_block(block, config, c, e, freqs, context, context_img_len, transformer_options)
    return block.after_proj(c), c


def self_attention_forward(module, config):
    """The guarded forward installed on a `WanSelfAttention`."""
    return SPEC.guard("self_attn", "self-attention", module, SELF_ATTENTION_ARGS, run_self_attention, config, x="x",
                      extra=_extra, check_inputs=_check_inputs)


def cross_attention_forward(module, config):
    """The guarded forward installed on a Wan cross-attention (text, or text + CLIP image)."""
    return SPEC.guard("cross_attn", "cross-attention", module, CROSS_ATTENTION_ARGS, run_cross_attention, config,
                      x="x", extra=_extra, check_inputs=_check_inputs)


# The block's parts whose sequence-parallel forward (raylight's Ulysses, `nodes/sequence_parallel.py`) the bounded
# block runs itself: its self-attention through the grouped exchange over that forward's group, its cross-attention
# on the rank's own tokens (every rank holds the whole context: the same numbers without an exchange)
PARALLEL_PARTS = {"self_attn": sequence_parallel.SELF_ATTENTION, "cross_attn": sequence_parallel.CROSS_ATTENTION}


def _parallel_refusal(block) -> Optional[str]:
    """Why the bounded block cannot run: another node's forward or hook on a part it computes (raylight's Ulysses
    forwards are its own to run), or a sequence-parallel group the grouped exchange does not take (xFuser's ring
    attention), else None."""
    reason = foreign_part(block, PARALLEL_PARTS)
    if reason is not None:
        return reason
    group = sequence_parallel.ulysses_group(block.self_attn)
    return None if group is None else sequence_parallel.refusal(group)


def _parallel_signature(block) -> tuple:
    """The block's sequence-parallel world (0 without one): a sharded call is checked on its own."""
    group = sequence_parallel.ulysses_group(block.self_attn)
    return (0 if group is None else sequence_parallel.world_of(group),)


def _parallel_agreement(block):
    """`agree(bound)` for the block's guard: a sequence-parallel block's path is its group's (every reason to run
    ComfyUI's own, the verdict's cache and the verdict, `sequence_parallel.Agreement`). None outside a group, or
    for one the grouped exchange refuses (a ring degree: every rank runs ComfyUI's block alike)."""
    def agree(bound):
        group = sequence_parallel.ulysses_group(block.self_attn)
        if group is None or sequence_parallel.refusal(group) is not None:
            return None
        return sequence_parallel.agreement(group)
    return agree


def bounded_block_forward(block, config):
    """The guarded bounded `WanAttentionBlock.forward`: every transient bounded (see `run_block`); a part another
    node patched or hooks keeps the block ComfyUI's (`block_parts.foreign_part`), but for raylight's Ulysses
    forwards, which it runs itself (`PARALLEL_PARTS`)."""
    return SPEC.guard("block", "block", block, BLOCK_ARGS, run_block, config, x="x",
                      extra=lambda bound: _extra(bound) + _parallel_signature(block), check_inputs=_check_inputs,
                      residual="x", refuse_more=_parallel_refusal, agree=_parallel_agreement(block))


def bounded_vace_block_forward(block, config):
    """The guarded `VaceWanAttentionBlock.forward` around the bounded block."""
    return SPEC.guard("vace_block", "VACE block", block, VACE_BLOCK_ARGS, run_vace_block, config, x="c",
                      extra=lambda bound: _extra(bound) + _parallel_signature(block), check_inputs=_check_inputs,
                      residual="c", refuse_more=_parallel_refusal, agree=_parallel_agreement(block))


# --- patching and the adapter contract --------------------------------------------------------------------
def patch(patcher, config, report) -> None:
    """Adds object patches to `patcher` (a clone) for every Wan module that probes clean: the attention
    modules always (they serve a block that runs stock too), the blocks with block bounds. A module another
    node already patched keeps that patch (its block then runs stock, calling it)."""
    SPEC.patch(patcher, config, report,
               attention={"self_attn": (self_attention_forward,
                                        lambda module: probe_attention(module, "WanSelfAttention")),
                          "cross_attn": (cross_attention_forward,
                                         lambda module: probe_attention(module, type(module).__name__))},
               block={"blocks": (bounded_block_forward, probe_block),
                      "vace_blocks": (bounded_vace_block_forward,
                                      lambda block: probe_block(block, "VaceWanAttentionBlock"))})


matches, stock_functions, tokens_per_item, kv_heads, splits_projections, block_kinds = SPEC.contract()
