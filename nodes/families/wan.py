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
from .. import compat
from ..attention import (NORM_SPANS_HEADS, ROPE_PAIRS, AttentionForm, SpanningNormRope, StreamProjections, attend,
                        is_rms_norm)
from ..block_parts import modulated_layer_norm, output_projection_
from ..comfy_ops import (CastLinear, ComfyLinearRows, chunk_tokens, even_chunk_tokens, linear_handed_off,
                        not_row_sliceable, quantizes_inputs, token_ranges)
from ..dispatch import attend_group, attention_kwargs, split_floor
from ..family import patch_module, unsliceable_projection
from . import measured

FAMILY = "Wan"
MEMORY_FACTORS, WORKING_SETS, SPLIT_FLOOR_SCALE, SHORT_RUNS_STOCK = measured.constants("wan")


def _linear_shape(module, name: str, out_features: int, in_features: Optional[int] = None) -> Optional[str]:
    linear = getattr(module, name, None)
    weight = getattr(linear, "weight", None)
    if weight is None or weight.dim() != 2 or weight.shape[0] != out_features or \
            (in_features is not None and weight.shape[1] != in_features):
        return f"{name} is not a Linear with {out_features} outputs"
    return None


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
        reason = _linear_shape(module, name, dim)
        if reason:
            return reason
    names = ["norm_q", "norm_k"] + (["norm_k_img"] if kind == "WanI2VCrossAttention" else [])
    if kind == "WanI2VCrossAttention":
        for name in ("k_img", "v_img"):
            reason = _linear_shape(module, name, dim)
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
    if _linear_shape(ffn, "0", ffn[0].weight.shape[0] if hasattr(ffn[0], "weight") else -1, dim) or \
            _linear_shape(ffn, "2", dim):
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
# 2.5|x| it is held to, and k's second projection shrinks by 30 % (measured on an H200 at 720p: 1.028 -> 1.025
# x stock at 25 %, 1.019 at 50 %, 1.007 keeping all). Attention patched alone keeps them all: the stock FFN's
# 5.4|x| is the block's peak then, far above the attention's.
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
        self.module, self.level = module, config.level
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
        if context.shape[0] * context.shape[1] < split_floor(config):
            # the text keys (normalized) and values, computed once: the runtime slices them per group
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
                                   head_split_level=self.level, split_heads=split_heads, **self.kwargs)

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
# Token chunks of the phases after self-attention, as fractions of |x|: their transients stay under the
# self-attention's own peak at High (cross-attention holds several chunk-sized tensors, a float32 norm scratch
# among them where rms_norm is not fused; the FFN's hidden activation is 2.7x wider than x), and the chunks
# stay large enough for the products to run near full speed.
CROSS_CHUNK_FRACTION = 8
# On CUDA with Triton the chunk's norm runs fused and no attention holds a score matrix: chunks twice as large
# keep the block's peak (H200, Wan 14B 720p x 81: 2.20 x |x| either way) in half the cross-attention launches,
# whose short tails cost time (block 226.6 -> 225.8 ms interleaved, H200, 2026-12-02).
CUDA_CROSS_CHUNK_FRACTION = 4
FFN_CHUNK_FRACTION = 2   # one FFN chunk's hidden activation holds at most |x| / 2 elements


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


def run_bounded_block(block, x, e, freqs, context, context_img_len, config, transformer_options):
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
    # (with SageAttention 2 staged, the runtime may keep the keys and the result in its storage instead)
    attention = self_attention(block.self_attn, handed_off, freqs, config, transformer_options, BLOCK_KEPT_KEYS,
                               reuse_input=True)
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
    """residual += ffn(modulated norm2(residual)) * e5, by token chunks, in place. Plain weights are cast
    once and the GELU runs on the chunk's hidden activation (the only wide transient; on CUDA in the up
    projection's epilogue: `CastLinear.gelu`), the chunk's norm and modulation in one launch where they allow
    (`_modulated_norm`); any other
    weight format runs ComfyUI's own FFN on each chunk (its fused int8 activation, GGUF, ...)."""
    batch, tokens, _ = residual.shape
    ffn = block.ffn
    hidden_width = getattr(ffn[0], "out_features", None) or ffn[0].weight.shape[0]
    ffn_step = even_chunk_tokens(tokens, batch * hidden_width, max(1, residual.numel() // FFN_CHUNK_FRACTION))
    plain = type(ffn[1]) is torch.nn.GELU and not_row_sliceable(ffn[0]) is None and \
        not_row_sliceable(ffn[2]) is None
    up = CastLinear(ffn[0], residual) if plain else None
    down = CastLinear(ffn[2], residual) if plain else None
    fused_norm = _modulated_norm(block.norm2, mod, 3)
    try:
        for a, b in token_ranges(tokens, ffn_step):
            part = residual[:, a:b]
            modulated = fused_norm(part)
            if modulated is None:
                modulated = torch.addcmul(mod(3, a, b), block.norm2(part), 1 + mod(4, a, b))
            if plain:
                hidden = up.gelu(modulated, ffn[1].approximate)
                del modulated
                out = down(hidden)
                del hidden
            else:
                out = ffn(modulated)
                del modulated
            torch.addcmul(part, out, mod(5, a, b), out=part)
            del out, part
    finally:
        if plain:
            up.release()
            down.release()


# --- the forwards the pack installs: guarded, self-checked --------------------------------------------------
SELF_ATTENTION_ARGS = ("x", "freqs", "transformer_options")
CROSS_ATTENTION_ARGS = ("x", "context", "context_img_len", "transformer_options")
BLOCK_ARGS = ("x", "e", "freqs", "context", "context_img_len", "transformer_options")
VACE_BLOCK_ARGS = ("c",) + BLOCK_ARGS
# submodules the bounded block computes itself: another node's patch on any of them means the block runs stock
BLOCK_PARTS = ("self_attn", "cross_attn", "ffn", "norm1", "norm2", "norm3")


def _stock_functions(module) -> tuple:
    """ComfyUI's forward functions whose math a forward of the pack replaces."""
    parts = [getattr(module, name, None) for name in BLOCK_PARTS[:3]]
    return (type(module).forward,) + tuple(type(part).forward for part in parts if part is not None)


def _signature(kind: str, module, config, bound: dict) -> tuple:
    options = bound.get("transformer_options") or {}
    x = bound["c"] if "c" in bound else bound["x"]
    e, img_len = bound.get("e"), bound.get("context_img_len")
    e_layout = None if e is None else (e.ndim, e.shape[1] == 1, e.shape[1] == x.shape[1])
    return (kind, _stock_functions(module), compat.layers_signature(module), x.dtype, x.device.type, config,
            compat.hooks_set(options),
            "optimized_attention_override" in options, e_layout, img_len is None, bound.get("freqs") is None)


def _check_inputs(bound: dict) -> dict:
    """The first `compat.CHECK_TOKENS` tokens of one batch item of the call's inputs (fresh tensors), with
    probes for the patch hooks in its transformer_options."""
    x = bound["c"] if "c" in bound else bound["x"]
    batch, tokens = x.shape[0], x.shape[1]
    n = compat.check_tokens(tokens)
    out = {}
    for name, value in bound.items():
        if name == "transformer_options":
            out[name] = compat.probe_options(value or {})
        elif not torch.is_tensor(value) or value.dim() < 2 or name == "context":
            out[name] = value[:1].clone() if torch.is_tensor(value) and value.dim() >= 1 and \
                value.shape[0] == batch else value
        elif name == "e" and value.dim() == 4 and value.shape[1] not in (1, tokens):
            out[name] = value[:1, :1].clone()   # per frame: one frame's modulation for every check token
        else:
            first = value[:1] if value.shape[0] == batch else value
            out[name] = first[:, :n].clone() if first.shape[1] == tokens else first.clone()
    return out


def _guard(kind: str, what: str, module, names, ours_factory, config, refuse_more=None):
    """`compat.guard_module` with Wan's call signature and check inputs."""
    return compat.guard_module(
        what, module, names, ours_factory, config, functions=lambda: _stock_functions(module),
        signature=lambda bound: _signature(kind, module, config, bound), check_inputs=_check_inputs,
        residual=("c" if "c" in names else "x") if kind.endswith("block") else None,
        quantized=lambda: quantizes_inputs(module), refuse_more=refuse_more)


def foreign_part(block) -> Optional[str]:
    """Why the bounded block must not run: another node's forward or module hook on a part it computes
    itself (ComfyUI's block calls those parts, so it keeps their patches working), else None."""
    for name in BLOCK_PARTS:
        part = getattr(block, name, None)
        if part is None:
            continue
        if compat.foreign_forward(part):
            return f"another node patched its {name}"
        if part._forward_hooks or part._forward_pre_hooks:
            return f"another node hooks its {name}"
    return None


def _self_attention_forward(module, config):
    def forward(x, freqs, transformer_options={}):
        return output_projection_(module.o, self_attention(module, [x], freqs, config, transformer_options,
                                                           ATTENTION_ONLY_KEPT_KEYS))
    return forward


def _cross_attention_forward(module, config):
    def forward(x, context, context_img_len=None, transformer_options={}):
        cross = CrossAttention(module, context, context_img_len, config, transformer_options, like=x)
        try:
            return output_projection_(module.o, cross([x]), cast=cross.out)
        finally:
            cross.release()
    return forward


def _block_forward(block, config):
    def forward(x, e, freqs, context, context_img_len=257, transformer_options={}):
        return run_bounded_block(block, x, e, freqs, context, context_img_len, config, transformer_options)
    return forward


def _vace_block_forward(block, config):
    def forward(c, x, e, freqs, context, context_img_len=257, transformer_options={}):
        if block.block_id == 0:
            c = block.before_proj(c) + x
        c = run_bounded_block(block, c, e, freqs, context, context_img_len, config, transformer_options)
        return block.after_proj(c), c
    return forward


def self_attention_forward(module, config):
    """The guarded forward installed on a `WanSelfAttention`."""
    return _guard("self_attn", f"{FAMILY} self-attention", module, SELF_ATTENTION_ARGS, _self_attention_forward,
                  config)


def cross_attention_forward(module, config):
    """The guarded forward installed on a Wan cross-attention (text, or text + CLIP image)."""
    return _guard("cross_attn", f"{FAMILY} cross-attention", module, CROSS_ATTENTION_ARGS,
                  _cross_attention_forward, config)


def bounded_block_forward(block, config):
    """The guarded bounded `WanAttentionBlock.forward`: every transient bounded (see `run_bounded_block`)."""
    return _guard("block", f"{FAMILY} block", block, BLOCK_ARGS, _block_forward, config, foreign_part)


def bounded_vace_block_forward(block, config):
    """The guarded `VaceWanAttentionBlock.forward` around the bounded block."""
    return _guard("vace_block", f"{FAMILY} VACE block", block, VACE_BLOCK_ARGS, _vace_block_forward, config,
                  foreign_part)


# --- patching ---------------------------------------------------------------------------------------------
def matches(diffusion_model) -> bool:
    """Is this a Wan model (by structure: a list of blocks with Wan's attention modules)?"""
    blocks = getattr(diffusion_model, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        return False
    first = blocks[0]
    return isinstance(getattr(first, "self_attn", None), wan_model.WanSelfAttention)


def _block_lists(model):
    for list_name in ("blocks", "vace_blocks"):
        blocks = getattr(model, list_name, None)
        if isinstance(blocks, torch.nn.ModuleList):
            for index, block in enumerate(blocks):
                yield f"diffusion_model.{list_name}.{index}", list_name, block


def patch(patcher, config, report) -> None:
    """Adds object patches to `patcher` (a clone) for every Wan module that probes clean: the attention
    modules always (they serve a block that runs stock too), the blocks with block bounds. A module another
    node already patched keeps that patch (its block then runs stock, calling it)."""
    model = patcher.model.diffusion_model
    for path, list_name, block in _block_lists(model):
        kind = "VaceWanAttentionBlock" if list_name == "vace_blocks" else "WanAttentionBlock"
        for name, factory in (("self_attn", self_attention_forward), ("cross_attn", cross_attention_forward)):
            module = getattr(block, name, None)
            if module is None:
                continue
            expected = "WanSelfAttention" if name == "self_attn" else type(module).__name__
            patch_module(patcher, report, FAMILY, f"{path}.{name}", name,
                         lambda module=module, factory=factory: factory(module, config),
                         lambda module=module, expected=expected: probe_attention(module, expected))
        if config.block:
            factory = bounded_vace_block_forward if kind == "VaceWanAttentionBlock" else bounded_block_forward
            patch_module(patcher, report, FAMILY, path, "block", lambda: factory(block, config),
                         lambda: probe_block(block, kind), parts=BLOCK_PARTS)


def stock_functions(diffusion_model) -> set:
    """ComfyUI's forward functions this adapter's patches stand in for (the run's memory estimate is lowered
    only once each has passed a self-check)."""
    functions = set()
    for _, _, block in _block_lists(diffusion_model):
        functions.update(_stock_functions(block))
        for name in ("self_attn", "cross_attn"):
            if getattr(block, name, None) is not None:
                functions.update(_stock_functions(getattr(block, name)))
    return functions


def tokens_per_item(diffusion_model, latent_shape) -> Optional[int]:
    """Tokens of one batch item for a latent `(B, C, T, H, W)`, or None for another shape."""
    if latent_shape is None or len(latent_shape) != 5:
        return None
    patch_size = tuple(getattr(diffusion_model, "patch_size", (1, 2, 2)))
    count = 1
    for size, step in zip(latent_shape[2:], patch_size):
        count *= -(-int(size) // int(step))
    return count


def kv_heads(diffusion_model) -> Optional[int]:
    """Key/value heads of the model's self-attention (Wan: all heads), or None if it does not say."""
    heads = getattr(diffusion_model, "num_heads", None)
    return heads if isinstance(heads, int) else None


def splits_projections(diffusion_model) -> Optional[str]:
    """None when the self-attention projections can be computed by rows (the head split can run), else why not."""
    block = next(_block_lists(diffusion_model), (None, None, None))[2]
    return unsliceable_projection(getattr(block, "self_attn", None), ("q", "k", "v"), "self_attn.")


def block_kinds(diffusion_model) -> tuple:
    return ("block",)
