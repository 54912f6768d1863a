"""Attention forwards shared by the family adapters, built from a small description of each family's attention.

A family describes where its q, k and v come from (`StreamProjections`: three Linears, or one fused Linear that
gives [q, k, v] and maybe more), which norm they get (`NORM_PER_HEAD`: over each head's channels, any head group
runs the module's own norm, `PerHeadNormRope`; `NORM_SPANS_HEADS`: an RMSNorm over all heads, exact per group
through the per-token statistics the runtime computes first, `SpanningNormRope`) and which RoPE (`ROPE_KINDS`:
rotation matrices of adjacent pairs or of each head's halves, or cos/sin tables; each head group takes its own rows
and columns of them, `rotate_rows`; those hooks are in `nodes/norm_rope.py`). `attend()` turns that into one call
of the runtime (`qkv_core.joint_qkv_attention`, or `cross_qkv_attention` for queries and keys of two sequences: the
head split, the hand-off of the inputs) and returns `(B, N, heads, head_dim)` for the family's own output
projection. What is truly a family's own (its block: modulation, residuals, MLP) stays in its adapter; the pieces
of a bounded block every family shares are in `nodes/block_parts.py`.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from ..qkv_core import FusedRows, cross_qkv_attention, joint_qkv_attention, ulysses_qkv_attention
from ..qkv_core.notices import PASSED_OVER, Notice, notice_once
from .comfy_ops import ComfyLinearRows
from .dispatch import COMFY, attention_kwargs, choose_backend
from .norm_rope import PerHeadNormRope, SpanningNormRope
from .rope import (NORM_KINDS, NORM_PER_HEAD, NORM_SPANS_HEADS, PER_HEAD_ROPE_KINDS, ROPE_COS_SIN, ROPE_COS_SIN_HALVES,
                   ROPE_COS_SIN_PAIRS, ROPE_KINDS, ROPE_PAIRS, ROPE_SPLIT_HALF, rope_cos_sin_halves_rows,
                   rope_cos_sin_rows, rope_rows, rope_split_half_rows, rotate_rows)
from .reference_cache import STATE_KEY as REFERENCE_CACHE_KEY


def attribute(module, path: Optional[str]):
    """`module.a.b` for path "a.b" (None for None or a missing attribute)."""
    if path is None:
        return None
    for name in path.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def is_rms_norm(norm, channels: int) -> bool:
    """Is `norm` an RMSNorm-like module over `channels` (an `eps`, and a weight of that size or none)? The
    probe every adapter runs on its q/k and block norms (whether it computes what ComfyUI's does is the
    self-check's job)."""
    weight = getattr(norm, "weight", None)
    return hasattr(norm, "eps") and (weight is None or tuple(weight.shape) == (channels,))


def _out_features(linear) -> Optional[int]:
    weight = getattr(linear, "weight", None)
    if weight is None or weight.dim() != 2:
        return None
    return int(weight.shape[0])


@dataclasses.dataclass(frozen=True)
class StreamProjections:
    """Where one token stream's q, k and v come from inside the attention's module (dotted attribute paths).

    Either three Linears `q`, `k`, `v`, or one `fused` Linear whose output is [q, k, v] along features,
    followed by `rest` more features (Flux's single block: the MLP's input). `norm_q` / `norm_k`: the
    modules that normalize this stream's queries and keys (None: none)."""

    q: Optional[str] = None
    k: Optional[str] = None
    v: Optional[str] = None
    fused: Optional[str] = None
    rest: int = 0
    norm_q: Optional[str] = None
    norm_k: Optional[str] = None

    def __post_init__(self):
        separate = (self.q, self.k, self.v)
        if self.fused is None and None in separate:
            raise ValueError(f"{self}: name q, k and v, or one fused Linear")
        if self.fused is not None and any(name is not None for name in separate):
            raise ValueError(f"{self}: a fused Linear and separate q/k/v at once; name one of the two")

    def probe(self, module, width: int, kv_width: int) -> Optional[str]:
        """None when `module` has these layers with these widths (q: `width`, k and v: `kv_width`)."""
        if self.fused is not None:
            expected = width + 2 * kv_width + self.rest
            if _out_features(attribute(module, self.fused)) != expected:
                return f"{self.fused} is not a Linear with {expected} outputs"
        else:
            for name, features in ((self.q, width), (self.k, kv_width), (self.v, kv_width)):
                if _out_features(attribute(module, name)) != features:
                    return f"{name} is not a Linear with {features} outputs"
        for name in (self.norm_q, self.norm_k):
            if name is not None and attribute(module, name) is None:
                return f"no {name}"
        return None

    def projections(self, module, width: int, kv_width: int) -> tuple:
        """The row projections (q, k, v) of this stream in `module`."""
        if self.fused is None:
            return tuple(ComfyLinearRows(attribute(module, name)) for name in (self.q, self.k, self.v))
        fused = ComfyLinearRows(attribute(module, self.fused))
        sizes = (width, kv_width, kv_width) + ((self.rest,) if self.rest else ())
        return tuple(FusedRows(fused, index, sizes=sizes) for index in range(3))


@dataclasses.dataclass(frozen=True)
class AttentionForm:
    """A family's attention: its streams (joined along tokens in this order), norm kind and RoPE."""

    streams: tuple
    norm: Optional[str] = None
    rope: Optional[str] = None

    def __post_init__(self):
        if not self.streams or not all(isinstance(s, StreamProjections) for s in self.streams):
            raise ValueError("an AttentionForm needs one or more StreamProjections")
        if self.norm not in NORM_KINDS:
            raise ValueError(f"norm must be one of {NORM_KINDS}, not {self.norm!r}")
        if self.rope not in ROPE_KINDS:
            raise ValueError(f"rope must be one of {ROPE_KINDS}, not {self.rope!r}")
        if self.norm == NORM_PER_HEAD and self.rope not in (None,) + PER_HEAD_ROPE_KINDS:
            raise ValueError(f"a per-head norm takes one of the RoPE kinds {PER_HEAD_ROPE_KINDS} here, not "
                             f"{self.rope!r}")
        if self.rope == ROPE_COS_SIN_PAIRS and self.norm != NORM_PER_HEAD:
            raise ValueError(f"the RoPE kind {ROPE_COS_SIN_PAIRS!r} comes with norm={NORM_PER_HEAD!r} here")

    def probe(self, module, heads: int, head_dim: int, kv_heads: Optional[int] = None) -> Optional[str]:
        kv_width = (heads if kv_heads is None else kv_heads) * head_dim
        for stream in self.streams:
            reason = stream.probe(module, heads * head_dim, kv_width)
            if reason is not None:
                return reason
        return None


def token_freqs(freqs: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Pair-RoPE frequencies in the heads-first layout `(B, 1, N, D/2, 2, 2)` (Flux's `pe`) as the runtime's
    token layout `(B, N, 1, D/2, 2, 2)`: a view."""
    return None if freqs is None else freqs.transpose(1, 2)


def attend(module, form: AttentionForm, x_lists: Sequence[list], heads: int, head_dim: int, config,
           transformer_options: dict, freqs: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
           kv_heads: Optional[int] = None, stream_modules: Optional[Sequence] = None,
           keep_keys: Optional[float] = None, key_freqs=None, context_list: Optional[list] = None,
           reuse_input: bool = False) -> torch.Tensor:
    """The attention `form` describes, of `module`: `x_lists` holds one `[x]` per stream (each cleared: the
    runtime holds the only reference and frees x once projected), x `(B, n_i, C)`. `freqs`: the tables of
    the form's RoPE over the joined tokens (pairs: `(B or 1, sum n_i, 1 or heads, D/2, 2, 2)`; see
    `rotate_rows`), `key_freqs` the keys' when they differ; `mask`: additive or boolean `(B or 1, heads or 1,
    N, N)` (or 2-/3-D, broadcast as ComfyUI does). `stream_modules`: the module each stream's names are looked
    up in (default: `module` for all). `keep_keys`: with a norm spanning heads, the share of head groups whose
    keys the statistics pass keeps for them (see `qkv_core.statistics`). `context_list`: `[context]` (cleared)
    `(B, M, C')`: a cross-attention of one stream, queries from x and keys/values from the context (mask
    `(B or 1, heads or 1, N, M)`). `reuse_input=True`: the caller's x is its own temporary, which the runtime
    may turn into the result (the runtime's `reuse_input`; never for a cross-attention). Returns `(B, sum n_i,
    heads, head_dim)`."""
    if len(x_lists) != len(form.streams):
        raise ValueError(f"{len(form.streams)} streams described, {len(x_lists)} given")
    if context_list is not None:
        return _cross_attend(module, form, x_lists[0], context_list, heads, head_dim, config, transformer_options,
                             freqs, key_freqs, mask, kv_heads, keep_keys)
    modules = list(stream_modules) if stream_modules is not None else [module] * len(x_lists)
    width, kv_width = heads * head_dim, (heads if kv_heads is None else kv_heads) * head_dim
    streams, ranges, start = [], [], 0
    for stream, x_list, owner in zip(form.streams, x_lists, modules):
        tokens = x_list[0].shape[-2]
        streams.append((x_list, stream.projections(owner, width, kv_width)))
        ranges.append((start, start + tokens, attribute(owner, stream.norm_q), attribute(owner, stream.norm_k)))
        start += tokens
    norm_rope = None
    options = attention_kwargs(config, transformer_options, module, mask=mask)
    per_head_rope = form.rope in PER_HEAD_ROPE_KINDS and form.norm == NORM_PER_HEAD
    if form.norm == NORM_SPANS_HEADS or (form.rope not in (None, ROPE_PAIRS) and freqs is not None
                                         and not per_head_rope):
        norm_rope = _spanning(form, ranges, heads, head_dim, freqs, key_freqs, options, keep_keys)
    elif form.norm == NORM_PER_HEAD or (form.rope == ROPE_PAIRS and freqs is not None):
        if form.norm is None:
            ranges = [(a, b, None, None) for a, b, _, _ in ranges]
        norm_rope = PerHeadNormRope(ranges, freqs if form.rope in PER_HEAD_ROPE_KINDS else None,
                                    rope=form.rope or ROPE_PAIRS)
    if kv_heads is not None and kv_heads != heads:
        options["kv_heads"] = kv_heads
    references = transformer_options.get(REFERENCE_CACHE_KEY)
    if references is not None:   # the reference cache's step: capture the references' keys, or attend them
        options.update(references.attention_options(start, mask is not None))
    if reuse_input:
        options["reuse_input"] = True
    return joint_qkv_attention(streams, heads, head_dim, norm_rope, **options)


def attend_sequence_parallel(module, form: AttentionForm, x_list: list, heads: int, head_dim: int, config,
                             freqs: Optional[torch.Tensor], group) -> torch.Tensor:
    """The self-attention `form` describes (one stream, q/k/v of every head, a norm spanning heads or none, pair
    RoPE) of a rank's shard of the tokens `[x]` (cleared) `(B, n, C)`, sequence-parallel over `group` (another
    pack's Ulysses group: `sequence_parallel.ulysses_group`): `qkv_core.ulysses_qkv_attention`, its heads
    exchanged one group at a time in the split `config.policy` gives the whole sequence. `freqs`: this rank's rows
    of the RoPE table. Returns `(B, n, heads, head_dim)`. The pack's own backends attend each group (ComfyUI's
    dispatcher takes no exchanged group: `comfy` attends as `auto` here, said once)."""
    if len(form.streams) != 1 or form.norm == NORM_PER_HEAD:
        raise ValueError("the sequence-parallel self-attention takes one stream with a norm over all heads or none")
    stream = form.streams[0]
    q, k, v = stream.projections(module, heads * head_dim, heads * head_dim)
    norm_rope = SpanningNormRope([(0, None, attribute(module, stream.norm_q), attribute(module, stream.norm_k))],
                                 heads, head_dim, freqs if form.rope is not None else None, rope=form.rope)
    options = config.policy.call_options() | choose_backend(config.backend, dispatcher=False).call_options()
    if config.backend == COMFY:
        notice_once("sequence-parallel:comfy", Notice(
            PASSED_OVER, "attention_backend=comfy", "the sequence-parallel exchange attends with the pack's own",
            "[QKV] attention_backend=comfy: the sequence-parallel exchange attends each head group with the "
            "pack's own backends (as auto)"))
    return ulysses_qkv_attention(x_list, q, k, v, heads, head_dim, norm_rope, group=group,
                                 norm_spans_heads=norm_rope.spans_heads, **options)


def _spanning(form, ranges, heads, head_dim, freqs, key_freqs, options: dict, keep_keys) -> SpanningNormRope:
    """The form's spanning norm (no norm: its RoPE alone) and RoPE; the runtime's statistics pass is asked for
    in `options` when a norm spans heads."""
    if form.norm != NORM_SPANS_HEADS:
        ranges = [(start, stop, None, None) for start, stop, _, _ in ranges]
    norm_rope = SpanningNormRope(ranges, heads, head_dim, freqs, rope=form.rope, key_freqs=key_freqs)
    if norm_rope.spans_heads:
        options.update(norm_spans_heads=True, keep_keys=keep_keys)
        if "attention_fn" not in options:   # a staged core may quantize q in the norm's pass
            options["fused_quant"] = norm_rope.fused_quant
        options["norm_key_into"] = norm_rope.key_into   # a call that reuses its input: k's pass into its rows
    return norm_rope


def _cross_attend(module, form, x_list, context_list, heads, head_dim, config, transformer_options, freqs,
                  key_freqs, mask, kv_heads, keep_keys) -> torch.Tensor:
    """`attend()` of one stream's queries over a context's keys/values (`cross_qkv_attention`)."""
    if len(form.streams) != 1 or form.streams[0].fused is not None:
        raise ValueError("a cross-attention takes one stream of separate q, k and v Linears")
    stream = form.streams[0]
    width, kv_width = heads * head_dim, (heads if kv_heads is None else kv_heads) * head_dim
    projections = stream.projections(module, width, kv_width)
    ranges = [(0, None, attribute(module, stream.norm_q), attribute(module, stream.norm_k))]
    options = attention_kwargs(config, transformer_options, module, mask=mask)
    if kv_heads is not None and kv_heads != heads:
        options["kv_heads"] = kv_heads
    norm_rope = None
    if form.norm == NORM_PER_HEAD:
        if form.rope is not None and freqs is not None:
            raise ValueError("a cross-attention with per-head norms takes no RoPE here")
        norm_rope = PerHeadNormRope(ranges, None)
    elif form.norm == NORM_SPANS_HEADS or (form.rope is not None and freqs is not None):
        norm_rope = _spanning(form, ranges, heads, head_dim, freqs, key_freqs, options, keep_keys)
    return cross_qkv_attention(x_list, context_list, *projections, heads, head_dim, norm_rope, **options)


__all__ = ["is_rms_norm", "NORM_PER_HEAD", "NORM_SPANS_HEADS", "ROPE_PAIRS", "ROPE_SPLIT_HALF", "ROPE_COS_SIN",
           "ROPE_COS_SIN_HALVES", "ROPE_COS_SIN_PAIRS", "ROPE_KINDS", "StreamProjections", "AttentionForm", "attend",
           "rope_rows", "rope_split_half_rows", "rope_cos_sin_rows", "rope_cos_sin_halves_rows", "rotate_rows",
           "PerHeadNormRope", "SpanningNormRope", "token_freqs", "attribute", "attend_sequence_parallel"]
