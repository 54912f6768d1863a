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

    Every field defaults to None, "not set": the runtime's default behaviour. A call checks the combination
    before any work (a `ValueError` that names the fix, `qkv_core/validation.py`).

    Attributes
    ----------
    kv_heads : int, optional
        Key/value heads (grouped-query attention); `heads` must be a multiple. Default: `heads`.
    norm_spans_heads : bool, optional
        The q/k norm spans every head (Wan's RMSNorm over the width): per-token statistics over all heads are
        computed first and handed to `norm_rope` as ``group.mean_squares``.
    split_heads : bool, optional
        False: never split (one group). Default: split by `head_split_level` from the floor up.
    kv_prefix : optional
        Keys and values attended before the call's own: a ``(key, value)`` pair ``(batch or 1, tokens,
        kv_heads, head_dim)``, a `KVPrefix` (q8 or native) or a `PrefixLayer`. Read, never changed or freed.
    attention_mask : torch.Tensor or callable, optional
        A tensor broadcasting to ``(batch, heads, q tokens, kv tokens)`` (boolean, True attends, or additive
        float), or, with a staged core only, ``mask(query, key, group)`` that builds each group's.
    force_attention : str, optional
        A backend name (`backend_names`) instead of the automatic choice.
    attention_fn : callable, optional
        ``attention_fn([q, k, v(, extra)], group)`` -> ``(batch, q tokens, heads of the group, head_dim)``: the
        caller's own attention. It gets each group's disposable tensors in a list and clears it.
    norm_stats : callable, optional
        ``norm_stats(project)`` -> (q mean squares, k mean squares), float32 ``(batch, tokens, 1)``: the
        model's own statistics pass (with `norm_spans_heads` only).
    norm_v : callable, optional
        ``norm_v(v, group)``: a transform of each group's values, in place.
    softmax_scale : float, optional
        The softmax scale (the SDPA path only). Default ``1 / sqrt(head_dim)``.
    head_split_level : int or str, optional
        0-3 or "off", "low", "medium", "high" (`parse_level`). Default: High.
    fused_quant : callable, optional
        ``fused_quant(query, key, group, core, settings)`` -> q or k quantized by the `StagedCore` `core` in one
        pass with the norm and RoPE, or None to fall back to `norm_rope` and the core's quantizers (docs/design.md
        §2.5).
    norm_key_into : callable, optional
        ``norm_key_into(key, dest, group)`` -> bool: k's norm and RoPE written into `dest` (k's shape) instead of
        in place, False (nothing done) where it cannot; used by `reuse_input`.
    keep_keys : float, optional
        The fraction (0 to 1) of groups whose keys the statistics pass keeps for them (with `norm_spans_heads`).
    split_floor_tokens : int, optional
        The fewest query tokens of one batch item that are split. Default `SPLIT_FLOOR_TOKENS`.
    head_split_group_scale : float, optional
        The level's target count of head groups times this (a number > 0): above 1 for a model whose attention
        is wider than its hidden state (MiniMax H3: 7168 over 5376: the output buffer of every head takes more of
        the level's budget, each group must hold less), under 1 where a model's split calls are bound by the
        host's launches and its fewer groups still hold the level's peak (HiDream). Default 1.
    capture_kv : tuple, optional
        ``(layer, start, stop)``: the keys and values of key/value tokens ``[start, stop)``, as attention sees
        them, stored into `layer` (a `PrefixLayer`) for later calls' `kv_prefix`.
    reuse_input : bool, optional
        The caller gives its input up for good (a contiguous self-attention activation ``heads * head_dim``
        wide, no other reference to it): a staged call with a spanning norm may keep its keys in the input's
        storage and return its output there, so k is projected once. Ignored where that does not apply.
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
