"""Pieces of a bounded transformer block that every family shares: a residual stream's feed-forward by token
chunks, in place, with its weights cast once. A family's block (`nodes/wan.py`, `nodes/flux.py`) composes them
with what is its own (modulation, the order of its residual updates)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import compat
from .comfy_ops import CastLinear, even_chunk_tokens, not_row_sliceable, token_ranges

# One chunk's hidden activation holds at most |x| / FFN_CHUNK_FRACTION elements: under the attention's own
# peak at High, and the chunks stay large enough for the products to run near full speed (measured on Wan).
FFN_CHUNK_FRACTION = 2


def _hidden_width(mlp) -> int:
    first = mlp[0] if isinstance(mlp, torch.nn.Sequential) and len(mlp) else None
    weight = getattr(first, "weight", None)
    return int(getattr(first, "out_features", None) or (weight.shape[0] if weight is not None else 4))


class ChunkedMLP:
    """`mlp` for several token chunks of one call. A `Sequential(Linear, activation, Linear)` with plain or
    castable weights is cast once (`CastLinear`) and a GELU runs in place on the chunk's hidden activation, the
    only wide transient; any other MLP or weight format runs the module itself on each chunk (its own fused
    quantized matmuls, GGUF, ...). `release()` when done."""

    def __init__(self, mlp, like: torch.Tensor):
        self.mlp = mlp
        self.hidden_width = _hidden_width(mlp)
        plain = isinstance(mlp, torch.nn.Sequential) and len(mlp) == 3 and hasattr(mlp[0], "weight") and \
            hasattr(mlp[2], "weight") and not_row_sliceable(mlp[0]) is None and not_row_sliceable(mlp[2]) is None
        self.up = CastLinear(mlp[0], like) if plain else None
        self.down = CastLinear(mlp[2], like) if plain else None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.up is None:
            return self.mlp(t)
        hidden = self.up(t)
        del t
        activation = self.mlp[1]
        if type(activation) is torch.nn.GELU:
            torch.ops.aten.gelu_(hidden, approximate=activation.approximate)
        else:
            hidden = activation(hidden)
        return self.down(hidden)

    def release(self) -> None:
        for cast in (self.up, self.down):
            if cast is not None:
                cast.release()
        self.up = self.down = None


def mlp_residual_(residual: torch.Tensor, mlp, mlp_input: Callable[[int, int], torch.Tensor],
                  add_: Callable[[torch.Tensor, torch.Tensor, int, int], None],
                  fraction: int = FFN_CHUNK_FRACTION) -> None:
    """`residual` (B, N, C) += its feed-forward, by token chunks, in place: for each chunk [a, b),
    `add_(residual[:, a:b], mlp(mlp_input(a, b)), a, b)` (the family's gate and sum). `mlp_input(a, b)` makes
    the chunk's input (e.g. norm + modulation of `residual[:, a:b]`); it is freed once the MLP has read it."""
    batch, tokens, _ = residual.shape
    chunked = ChunkedMLP(mlp, residual)
    step = even_chunk_tokens(tokens, batch * chunked.hidden_width, max(1, residual.numel() // fraction))
    try:
        for a, b in token_ranges(tokens, step):
            out = chunked(mlp_input(a, b))
            add_(residual[:, a:b], out, a, b)
            del out
    finally:
        chunked.release()


def projection_residual_(residual: torch.Tensor, linear, attention: torch.Tensor,
                         add_: Callable[[torch.Tensor, torch.Tensor, int, int], None], fraction: int = 8) -> None:
    """`residual` (B, N, C) += the output projection `linear` of `attention` (B, N, C') by token chunks: for
    each chunk, `add_(residual[:, a:b], linear(attention[:, a:b]), a, b)`. The weight is cast once; each
    chunk's product is the only transient."""
    batch, tokens, width = residual.shape
    cast = CastLinear(linear, attention)
    step = even_chunk_tokens(tokens, batch * width, max(1, residual.numel() // fraction))
    try:
        for a, b in token_ranges(tokens, step):
            out = cast(attention[:, a:b])
            add_(residual[:, a:b], out, a, b)
            del out
    finally:
        cast.release()


def foreign_part(block) -> Optional[str]:
    """Another node's forward or module hook on a part of `block` the pack's bounded block computes itself
    (then ComfyUI's block runs, calling it), else None."""
    for name, part in block.named_children():
        for module in part.modules():
            if compat.foreign_forward(module):
                return f"another node patched its {name}"
            if module._forward_hooks or module._forward_pre_hooks:
                return f"another node hooks its {name}"
    return None


__all__ = ["ChunkedMLP", "mlp_residual_", "projection_residual_", "foreign_part", "FFN_CHUNK_FRACTION"]
