"""A call's `kv_prefix` joined in front of one group's keys or values (docs/design.md §2.6, §2.7).

The prefix forms (prefix.py): a 16-bit pair `(key, value)`, each `(1 or batch, prefix tokens, kv_heads, head_dim)`;
a q8 `KVPrefix` (int8 values, float16 scales `(..., head_dim // 32)`), dequantized straight into the joined
tensor; a native `KVPrefix` (a staged core's layout), which is never joined here: the staged core attends it in
a pass of its own. A `PrefixLayer` is read once per call (`resolve_prefix`).

Nothing here keeps a reference: the joined tensor is new and belongs to the caller, who drops the unjoined one.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .prefix import KVPrefix, PrefixLayer
from .q8 import dequantize_q8_into


def resolve_prefix(kv_prefix: Any) -> Any:
    """What a call attends before its own keys: a `PrefixLayer` gives its `kv_prefix()` (a pair or a `KVPrefix`;
    from a RAM cache, streamed to the device now); anything else is returned as passed (checked by
    `validation.validate_prefix`)."""
    if isinstance(kv_prefix, PrefixLayer):
        return kv_prefix.kv_prefix()
    return kv_prefix


def prefix_tokens(kv_prefix: Any) -> int:
    """Tokens of the prefix (0 without one)."""
    return 0 if kv_prefix is None else kv_prefix[0].shape[1]


def prefix_writer(kv_prefix: Any, which: str,
                  kv_range: range) -> tuple[int, Optional[Callable[[torch.Tensor], None]]]:
    """`(prefix tokens, write)`: `write(view)` fills `view` `(B, prefix tokens, heads of kv_range, D)` with the
    key (`which="k"`) or value (`"v"`) heads `kv_range` of the prefix: dequantized from q8, or copied from 16
    bits (a batch-1 prefix broadcast over the batch). Without a prefix `(0, None)`."""
    if kv_prefix is None:
        return 0, None
    if isinstance(kv_prefix, KVPrefix):
        values, scales = (kv_prefix.k, kv_prefix.k_scale) if which == "k" else (kv_prefix.v, kv_prefix.v_scale)

        def write(view):
            dequantize_q8_into(view, values[:, :, kv_range.start:kv_range.stop],
                               scales[:, :, kv_range.start:kv_range.stop])
        return values.shape[1], write
    tensor = kv_prefix[0] if which == "k" else kv_prefix[1]

    def write(view):
        view.copy_(tensor[:, :, kv_range.start:kv_range.stop].expand_as(view))
    return tensor.shape[1], write


def join_prefix(kv_prefix: Any, which: str, tensor: torch.Tensor, kv_range: range, batch: int) -> torch.Tensor:
    """The prefix's key or value heads `kv_range` followed by `tensor` `(B, tokens, heads of kv_range, D)` (the
    group's own, normalized): a new `(B, prefix tokens + tokens, heads, D)` tensor. Without a prefix `tensor`
    itself. The caller's reference to `tensor` is the one to drop (`k = join_prefix(..., k, ...)`): both are
    live only while the new one is filled."""
    tokens, write = prefix_writer(kv_prefix, which, kv_range)
    if not tokens:
        return tensor
    joined = torch.empty((batch, tokens + tensor.shape[1], *tensor.shape[2:]), dtype=tensor.dtype,
                         device=tensor.device)
    write(joined[:, :tokens])
    joined[:, tokens:] = tensor
    return joined
