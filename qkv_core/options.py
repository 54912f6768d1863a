"""The options of the attention calls (`qkv_attention`, `joint_qkv_attention`, `cross_qkv_attention`), typed.

Callers pass them as keyword arguments; `AttentionOptions.from_kwargs` turns them into this record (an unknown
name is a `TypeError` that lists the known ones) and the call validates their combinations (`ValueError`s that
name the fix). Every field defaults to "not set": the runtime's default behaviour.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

Level = Union[int, str]


@dataclasses.dataclass
class AttentionOptions:
    # grouped-query attention: heads of k and v (heads must be a multiple); default: heads
    kv_heads: Optional[int] = None
    # the q/k norm spans all heads (Wan's RMSNorm over the width): per-token statistics are computed first
    norm_spans_heads: Optional[bool] = None
    # False: never split (one group); default: split by `head_split_level` above the floor
    split_heads: Optional[bool] = None
    # keys/values attended before the call's own: a (key, value) pair (batch, tokens, kv_heads, head_dim),
    # a `KVPrefix` (q8 or native) or a `PrefixLayer`
    kv_prefix: Any = None
    # a tensor (batch, heads or 1, q_tokens, kv_tokens), or a callable per group (staged cores only)
    attention_mask: Any = None
    # a backend name ("sdpa", "flash", "sage", ...) instead of the automatic choice
    force_attention: Optional[str] = None
    # attention_fn([q, k, v], group) -> (batch, tokens, group heads, head_dim): the caller's own attention
    attention_fn: Optional[Callable] = None
    # norm_stats(project) -> (q mean squares, k mean squares): the model computes them its own way
    norm_stats: Optional[Callable] = None
    # norm_v(v, group): a transform of each group's values in place
    norm_v: Optional[Callable] = None
    # the softmax scale (SDPA path only); default 1 / sqrt(head_dim)
    softmax_scale: Optional[float] = None
    # 0-3 or "off", "low", "medium", "high"; default: High (`head_split.DEFAULT_LEVEL`)
    head_split_level: Optional[Level] = None
    # fused norm + RoPE + quantize for staged cores (docs/design.md §2.5)
    fused_quant: Optional[Callable] = None
    # norm_key_into(key, dest, group) -> bool: k's norm and RoPE written into `dest` (key's shape) instead of
    # in place, False (nothing done) where it cannot; a call that reuses its input (`reuse_input`) then writes
    # its keys straight into the input's rows instead of copying them there
    norm_key_into: Optional[Callable] = None
    # the fraction (0-1) of groups whose keys the statistics pass keeps for them
    keep_keys: Optional[float] = None
    # the fewest tokens (of one batch item) that are split; default `head_split.SPLIT_FLOOR_TOKENS`
    split_floor_tokens: Optional[int] = None
    # (layer, start, stop): the keys/values of key/value tokens [start, stop) stored into `layer` (a
    # `PrefixLayer`) for later calls' `kv_prefix` (capture.py)
    capture_kv: Optional[tuple] = None
    # the caller gives up its input for good (a self-attention's activation, contiguous, heads * head_dim wide,
    # no other reference to it): a staged call with a spanning norm may then keep its keys in the input's
    # storage and write the output there, so k is projected once (input_reuse.py); ignored where that does
    # not apply
    reuse_input: Optional[bool] = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, options: dict) -> "AttentionOptions":
        unknown = options.keys() - _NAMES
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; the options are {list(cls.names())}")
        return cls(**options)


_NAMES = frozenset(AttentionOptions.names())   # every call checks its options against them
