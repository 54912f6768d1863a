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
    """The keyword options of `qkv_attention`, `joint_qkv_attention` and `cross_qkv_attention`.

    Every field defaults to None, "not set": the runtime's default. A call checks the combination before any work
    (a `ValueError` that names the fix, `qkv_core/validation.py`). Tensors are ``(batch, tokens, heads, head_dim)``
    unless said; those passed here stay the caller's: read, never freed (the inputs' hand-off: docs/design.md §2.1).

    Attributes
    ----------
    kv_heads : int, optional
        Key/value heads (grouped-query attention); `heads` must be a multiple. Default: `heads`.
    norm_spans_heads : bool, optional
        The q/k norm spans every head (Wan): each token's statistics over all heads reach `norm_rope` as
        ``group.mean_squares``, float32 ``(batch, tokens, 1)``.
    split_heads : bool, optional
        False: never split (one group). Default: split by `head_split_level` from the floor up.
    kv_prefix : tuple, KVPrefix or PrefixLayer, optional
        Keys and values attended before the call's own: a pair ``(batch or 1, tokens, kv_heads, head_dim)``, a q8
        or native `KVPrefix`, or a `PrefixLayer`; never changed.
    attention_mask : torch.Tensor or callable, optional
        Broadcasting to ``(batch, heads, q tokens, kv tokens)``, boolean (True attends) or additive float; with a
        staged core also ``mask(query, key, group)``, building each group's.
    force_attention : str, optional
        A backend name (`backend_names`) instead of the automatic choice.
    attention_fn : callable, optional
        ``attention_fn([q, k, v(, extra)], group)`` -> ``(batch, q tokens, heads of the group, head_dim)``: the
        caller's own attention; it owns the list's tensors (disposable) and clears the list.
    norm_stats : callable, optional
        ``norm_stats(project)`` -> (q mean squares, k mean squares), float32 ``(batch, tokens, 1)``: the model's
        own statistics pass (with `norm_spans_heads` only).
    norm_v : callable, optional
        ``norm_v(v, group)``: transforms each group's values in place.
    softmax_scale : float, optional
        The softmax scale (the SDPA path only). Default: ``1 / sqrt(head_dim)``.
    head_split_level : int or str, optional
        0-3 or "off", "low", "medium", "high" (`parse_level`). Default: High.
    split_floor_tokens : int, optional
        The fewest query tokens of one batch item that are split. Default: `SPLIT_FLOOR_TOKENS`.
    capture_kv : tuple, optional
        ``(layer, start, stop)``: the keys and values of key/value tokens ``[start, stop)``, as attention sees
        them, stored into the `PrefixLayer` `layer` (which then holds them) for later calls' `kv_prefix`.
    reuse_input : bool, optional
        The caller gives up its contiguous self-attention input (``heads * head_dim`` wide, no other reference):
        a staged spanning-norm call may keep its keys there and return its output in that storage; else ignored.
    fused_quant, norm_key_into, keep_keys, head_split_group_scale
        Internal: the adapters' fused-pass hooks and memory/launch tuning (docs/design.md §2.2, §2.5, §3.2).
    """

    kv_heads: Optional[int] = None
    norm_spans_heads: Optional[bool] = None
    split_heads: Optional[bool] = None
    kv_prefix: Any = None
    attention_mask: Any = None
    force_attention: Optional[str] = None
    attention_fn: Optional[Callable] = None
    norm_stats: Optional[Callable] = None
    norm_v: Optional[Callable] = None
    softmax_scale: Optional[float] = None
    head_split_level: Optional[Level] = None
    fused_quant: Optional[Callable] = None
    norm_key_into: Optional[Callable] = None
    keep_keys: Optional[float] = None
    split_floor_tokens: Optional[int] = None
    head_split_group_scale: Optional[float] = None
    capture_kv: Optional[tuple] = None
    reuse_input: Optional[bool] = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in field order."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, options: dict) -> "AttentionOptions":
        """The record of a call's keyword `options`; a `TypeError` listing the known names for an unknown one."""
        unknown = options.keys() - _NAMES
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; the options are {list(cls.names())}")
        return cls(**options)


_NAMES = frozenset(AttentionOptions.names())   # every call checks its options against them
