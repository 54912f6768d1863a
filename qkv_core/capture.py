"""`capture_kv`: the keys and values of a range of a call's key/value tokens, kept for later calls
(docs/design.md §2.7).

A model that runs its reference tokens (reference images, a history) with the rest of the sequence at the first
sampler step passes `capture_kv=(layer, start, stop)`; the call gathers those tokens' keys and values, normalized
and rotated as its attention sees them, group by group, and stores them into `layer` (a `PrefixLayer`, which
keeps them in 16 bits, q8 or a staged core's native layout). Later steps leave the tokens out of the sequence and
pass `kv_prefix=layer`: the same keys and values, attended before the call's own.

Who frees what: the buffers belong to the `KVCapture` until `store` hands them to the layer (which keeps only
their quantized form for a quantized cache).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .head_split import HeadGroup


class KVCapture:
    """Buffers `(B, stop - start, kv_heads, D)` for k and v, filled by `take` as each group's keys (after their
    norm and RoPE, before a staged core smooths or quantizes them) and values (after `norm_v`) exist."""

    def __init__(self, spec: tuple, batch: int, kv_heads: int, head_dim: int, dtype, device):
        self.layer, self.start, self.stop = spec
        shape = (batch, self.stop - self.start, kv_heads, head_dim)
        self.k: Optional[torch.Tensor] = torch.empty(shape, dtype=dtype, device=device)
        self.v: Optional[torch.Tensor] = torch.empty(shape, dtype=dtype, device=device)

    def take(self, which: str, t: torch.Tensor, group: HeadGroup) -> None:
        """Copies tokens [start, stop) of `t` `(B, kv tokens, kv heads of the group, D)` into the buffer."""
        buffer = self.k if which == "k" else self.v
        buffer[:, :, group.kv.start:group.kv.stop] = t[:, self.start:self.stop]

    def store(self, kit: Any = None) -> None:
        """Hands the buffers to the layer (`PrefixLayer.store(k, v, kit=kit)`; `kit`: a staged core that keeps
        native prefixes, or None)."""
        k, v = self.k, self.v
        self.k = self.v = None
        self.layer.store(k, v, kit=kit)
