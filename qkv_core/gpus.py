"""What each GPU architecture gets, keyed by compute capability: the one table every kernel choice reads
(docs/design.md §2.4, "The GPU table").

`architecture(device)` is the row of a CUDA device (None off CUDA; `row(capability)` of a capability): SDPA's kernel order, SageAttention 2's staged
kernel and whether `auto` leaves its masked calls to SDPA, and whether the pack's Triton kernels, their bf16
conversions and the attention over the queries run there.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class Architecture(NamedTuple):
    """One row of `ARCHITECTURES`. `sdpa_cudnn_first`: SDPA's order puts cuDNN attention before FlashAttention
    (else FlashAttention first); `sage2_kernel`: SageAttention 2's unmasked staged kernel ("sm90", "sm80",
    "triton"; "sageattn": its own unstaged call); `sage2_masked_on_sdpa`: `auto` leaves masked calls to SDPA
    (SageAttention 2's Triton kernel, the one that takes masks, slower than cuDNN there)."""
    name: str
    sdpa_cudnn_first: bool = False
    sage2_kernel: str = "sageattn"
    sage2_masked_on_sdpa: bool = False


# (major, minor) or (major, None) for every minor of that major; anything else takes `OTHER`
ARCHITECTURES = {
    (8, 0): Architecture("Ampere (A100)", sage2_kernel="sm80"),
    (8, 6): Architecture("Ampere (RTX 30xx, A40)", sage2_kernel="triton"),
    (9, 0): Architecture("Hopper", sdpa_cudnn_first=True, sage2_kernel="sm90", sage2_masked_on_sdpa=True),
    (9, None): Architecture("Hopper (other)", sdpa_cudnn_first=True),
    (10, None): Architecture("Blackwell (data centre)", sdpa_cudnn_first=True),
}
OTHER = Architecture("other")

# the first capability each of the pack's own kernels runs on
TRITON_KERNELS_FROM = (7, 5)        # the Triton kernels' targets
BF16_KERNELS_FROM = (8, 0)          # their bf16 conversions
OVER_QUERIES_FROM = (8, 0)          # the attention over the queries (inplace_attention)


def row(capability: tuple) -> Architecture:
    """The row of compute capability `(major, minor)`."""
    found = ARCHITECTURES.get(tuple(capability))
    return found if found is not None else ARCHITECTURES.get((capability[0], None), OTHER)


def architecture(device: torch.device) -> Optional[Architecture]:
    """The row of a CUDA `device` (its index, or the current device), None off CUDA."""
    return row(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


__all__ = ["Architecture", "ARCHITECTURES", "OTHER", "TRITON_KERNELS_FROM", "BF16_KERNELS_FROM",
           "OVER_QUERIES_FROM", "row", "architecture"]
