"""Pieces of a bounded transformer block that every family shares: a residual stream's feed-forward by token
chunks, in place, with its weights cast once. A family's block (`nodes/families/wan.py`, `nodes/families/flux.py`)
composes them with what is its own (modulation, the order of its residual updates)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from . import compat, sequence_parallel
from .comfy_ops import (CastLinear, chunk_tokens, even_chunk_tokens, not_row_sliceable, plain_layer_norm_eps,
                        run_every_op, token_ranges)

# One chunk's hidden activation holds at most |x| / FFN_CHUNK_FRACTION elements: under the attention's own
# peak at High, and the chunks stay large enough for the products to run near full speed (measured on Wan).
FFN_CHUNK_FRACTION = 2
# Where the attention is not split (a sequence under the split floor) it holds q, k and v of every head at once
# (3 x |x| and more): the block's chunks may then be this many times larger and stay under that peak (the FFN's
# hidden activation up to 2 x |x|), for a quarter of the launches. Short sequences are where launches, not
# the GPU, bound the time (Qwen-Image at 1328^2, one item: 24 chunks -> 6).
UNSPLIT_CHUNK_SCALE = 4


def chunk_scale(policy, kv_heads: int, tokens: int, split_scale: int = 1) -> int:
    """The factor on the block's default chunk budgets: `split_scale` (default 1) when its attention of `tokens`
    tokens of one batch item (all streams joined) over `kv_heads` key/value heads is split into head groups
    (`policy.splits`, the `SplitPolicy` the runtime's call asks too), `UNSPLIT_CHUNK_SCALE` when it is not. A
    family passes a larger `split_scale` where its split attention's own peak leaves room for larger chunks
    (Qwen-Image: `SPLIT_CHUNK_SCALE`)."""
    return split_scale if policy.splits(kv_heads, tokens) else UNSPLIT_CHUNK_SCALE


@dataclasses.dataclass(frozen=True)
class GatedMLP:
    """A gated feed-forward, `down(combine_(gate(x), up(x)))` (SwiGLU and kin: LLaMA-style `w1`, `w3`, `w2`),
    by the names of its three Linears in the MLP module. `combine_(gate_out, up_out)` returns the hidden
    activation `(B, n, hidden)` and may overwrite `gate_out` (both are the chunk's own, freed after)."""

    gate: str
    up: str
    down: str
    combine_: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def linears(self, mlp) -> Optional[tuple]:
        """The (gate, up, down) layers of `mlp`, or None when it lacks one of them."""
        layers = tuple(getattr(mlp, name, None) for name in (self.gate, self.up, self.down))
        return layers if all(getattr(layer, "weight", None) is not None for layer in layers) else None


def silu_gate_(gate_out: torch.Tensor, up_out: torch.Tensor) -> torch.Tensor:
    """`silu(w1(x)) * w3(x)`, into the gate's chunk (its own)."""
    return torch.nn.functional.silu(gate_out, inplace=True).mul_(up_out)


# LLaMA-style SwiGLU, `w2(silu(w1(x)) * w3(x))` (SD3.5's feed-forward)
SWIGLU = GatedMLP(gate="w1", up="w3", down="w2", combine_=silu_gate_)


def _hidden_width(mlp) -> int:
    """Features of one token's hidden activation: the first layer's outputs of a Sequential; of any other MLP
    module (e.g. Flux 2's YakMLP) the widest output of its layers, so that its chunks are bounded too."""
    first = mlp[0] if isinstance(mlp, torch.nn.Sequential) and len(mlp) else None
    weight = getattr(first, "weight", None)
    if first is None and isinstance(mlp, torch.nn.Module):
        widths = [int(child.weight.shape[0]) for child in mlp.children()
                  if getattr(child, "weight", None) is not None and child.weight.dim() == 2]
        return max(widths, default=4)
    return int(getattr(first, "out_features", None) or (weight.shape[0] if weight is not None else 4))


class ChunkedMLP:
    """`mlp` for several token chunks of one call. A `Sequential(Linear, activation, Linear)` with plain or
    castable weights is cast once (`CastLinear`) and a GELU runs on the chunk's hidden activation, the only
    wide transient (in the product's epilogue on CUDA for the tanh approximation, else in place:
    `CastLinear.gelu`); a `gated` MLP (`GatedMLP`) has its three layers cast once (a layer with its own
    format runs itself) and holds two hidden activations of the chunk at most; any other MLP or weight format
    runs the module itself on each chunk (its own fused quantized matmuls, GGUF, ...). `release()` when done."""

    def __init__(self, mlp, like: torch.Tensor, gated: Optional[GatedMLP] = None,
                 hidden_per_token: Optional[int] = None):
        self.mlp = mlp
        self.gated_layers = None
        self.up = self.down = None
        self._hidden_per_token = hidden_per_token   # the caller's count, for a module whose layers do not tell it
        layers = gated.linears(mlp) if gated is not None else None
        if layers is not None:
            self.combine_ = gated.combine_
            self.hidden_width = int(layers[0].weight.shape[0])
            self.gated_layers = tuple(CastLinear(layer, like) for layer in layers)
            return
        self.hidden_width = _hidden_width(mlp)
        # a Sequential's layers read once (indexing a Sequential costs microseconds, at every chunk otherwise)
        layers = tuple(mlp._modules.values()) if isinstance(mlp, torch.nn.Sequential) else ()
        plain = len(layers) == 3 and not_row_sliceable(layers[0]) is None and not_row_sliceable(layers[2]) is None
        # probed just above: CastLinear need not ask again
        self.up = CastLinear(layers[0], like, sliceable=None) if plain else None
        self.down = CastLinear(layers[2], like, sliceable=None) if plain else None
        self._activation = layers[1] if plain else None

    @property
    def hidden_per_token(self) -> int:
        """Hidden activations of one token held at once (a gated MLP holds its gate's and its up's)."""
        if self._hidden_per_token is not None:
            return self._hidden_per_token
        return self.hidden_width * (2 if self.gated_layers is not None else 1)

    def __call__(self, handed_off: list) -> torch.Tensor:
        """The MLP of the chunk `handed_off[0]` `(B, n, C)`, a new tensor. The list is cleared: the chunk's input
        is freed once the first layer has read it (an argument passed as such stays referenced by the caller's
        frame until the call returns, beside the hidden activation)."""
        t = handed_off.pop()
        if self.gated_layers is not None:
            gate, up, down = self.gated_layers
            gate_out = gate(t)
            up_out = up(t)
            del t
            hidden = self.combine_(gate_out, up_out)
            del gate_out, up_out
            return down(hidden)
        if self.up is None:
            return self.mlp(t)
        activation = self._activation
        if type(activation) is torch.nn.GELU:
            hidden = self.up.gelu(t, activation.approximate)
        else:
            hidden = activation(self.up(t))
        del t
        return self.down(hidden)

    def release(self) -> None:
        for cast in (self.up, self.down) + (self.gated_layers or ()):
            if cast is not None:
                cast.release()
        self.up = self.down = self.gated_layers = None


def modulated_layer_norm(norm, x: torch.Tensor, shift: Optional[torch.Tensor],
                         scale_plus_one: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`norm(x) * scale_plus_one + shift` (the adaLN modulation of Wan's, Qwen-Image's blocks) in one launch: a
    new tensor like `x` from `F.layer_norm` with the modulation as its weight and bias. Only where `norm` is a
    plain LayerNorm (`comfy_ops.plain_layer_norm_eps`) and the modulation is one vector for every token of every
    batch item (`(C,)`, or `(1, ..., 1, C)`) in `x`'s dtype and device; else None (the caller runs the norm,
    then the modulation). It rounds once, where the two steps round the norm's output first: within a rounding
    of `x`'s dtype of their result. `F.layer_norm` holds nothing of x's size but its output, so a whole
    stream needs no token chunks."""
    planned = modulated_layer_norm_args(norm, x, shift, scale_plus_one)
    return None if planned is None else run_modulated_layer_norm(x, planned)


def modulated_layer_norm_args(norm, x: torch.Tensor, shift: Optional[torch.Tensor],
                              scale_plus_one: Optional[torch.Tensor]) -> Optional[tuple]:
    """`modulated_layer_norm`'s checks: the arguments of its `F.layer_norm` for tensors of `x`'s width, dtype
    and device, or None where it does not apply. (A caller with several token chunks checks once and runs
    `run_modulated_layer_norm` on each.)"""
    eps = plain_layer_norm_eps(norm)
    width = x.shape[-1]
    if eps is None or shift is None or scale_plus_one is None or \
            any(t.numel() != width or t.shape[-1] != width or t.dtype != x.dtype or t.device != x.device
                for t in (shift, scale_plus_one)):
        return None
    return (width,), scale_plus_one.reshape(width), shift.reshape(width), eps


def run_modulated_layer_norm(x: torch.Tensor, planned: tuple) -> torch.Tensor:
    """`modulated_layer_norm` of `x` with the arguments `modulated_layer_norm_args` gave for its kind of tensor."""
    run_every_op()
    return torch.nn.functional.layer_norm(x, *planned)


def mlp_residual_(residual: torch.Tensor, mlp, mlp_input: Callable[[int, int], torch.Tensor],
                  add_: Callable[[torch.Tensor, torch.Tensor, int, int], None],
                  fraction: int = FFN_CHUNK_FRACTION, gated: Optional[GatedMLP] = None,
                  like: Optional[torch.Tensor] = None, scale: int = 1,
                  hidden_per_token: Optional[int] = None) -> None:
    """`residual` (B, N, C) += its feed-forward, by token chunks, in place: for each chunk [a, b),
    `add_(residual[:, a:b], mlp(mlp_input(a, b)), a, b)` (the family's gate and sum). `mlp_input(a, b)` makes
    the chunk's input (e.g. norm + modulation of `residual[:, a:b]`); it is freed once the MLP has read it.
    `gated`: the MLP's layout when it is a gated one (see `ChunkedMLP`). `like`: a tensor of the dtype the MLP
    computes in, where it is not the residual's (Cosmos keeps a float32 residual around 16-bit layers). `scale`:
    chunks that many times larger (`chunk_scale`). `hidden_per_token`: the elements one token's pass through
    `mlp` holds, where its layers do not tell it (a mixture of experts)."""
    batch, tokens, _ = residual.shape
    chunked = ChunkedMLP(mlp, residual if like is None else like, gated, hidden_per_token)
    step = even_chunk_tokens(tokens, batch * chunked.hidden_per_token, max(1, residual.numel() * scale // fraction))
    try:
        for a, b in token_ranges(tokens, step):
            out = chunked([mlp_input(a, b)])
            add_(residual[:, a:b], out, a, b)
            del out
    finally:
        chunked.release()


def projection_residual_(residual: torch.Tensor, linear, attention: torch.Tensor,
                         add_: Callable[[torch.Tensor, torch.Tensor, int, int], None], fraction: int = 8,
                         scale: int = 1) -> None:
    """`residual` (B, N, C) += the output projection `linear` of `attention` (B, N, C') by token chunks: for
    each chunk, `add_(residual[:, a:b], linear(attention[:, a:b]), a, b)`. The weight is cast once; each
    chunk's product is the only transient. `scale`: chunks that many times larger (`chunk_scale`)."""
    batch, tokens, width = residual.shape
    cast = CastLinear(linear, attention)
    step = even_chunk_tokens(tokens, batch * width, max(1, residual.numel() * scale // fraction))
    try:
        for a, b in token_ranges(tokens, step):
            out = cast(attention[:, a:b])
            add_(residual[:, a:b], out, a, b)
            del out
    finally:
        cast.release()


def output_projection_(linear, attention: torch.Tensor, cast: Optional[CastLinear] = None,
                       scale: int = 1) -> torch.Tensor:
    """`linear(attention)` by token chunks, `attention` `(B, N, heads, head_dim)` or `(B, N, C)`: `(B, N, C')`.
    Into the attention's own storage when C' == C (each output token depends only on the same input token,
    so writing back in place is exact), else into a new tensor. `cast`: the weight already cast (kept), else
    cast here once. `scale`: chunks that many times larger (`chunk_scale`)."""
    flat = attention.flatten(2)
    own = cast is None
    cast = CastLinear(linear, flat) if own else cast
    features = getattr(linear, "out_features", None) or linear.weight.shape[0]
    out = flat if features == flat.shape[-1] else flat.new_empty(*flat.shape[:2], features)
    try:
        step = chunk_tokens(flat.shape[1], flat[:, :1].numel(), max(1, flat.numel() * scale // 8))
        for a, b in token_ranges(flat.shape[1], step):
            out[:, a:b] = cast(flat[:, a:b])
    finally:
        if own:
            cast.release()
    return out


def foreign_part(block, parallel: Optional[dict] = None) -> Optional[str]:
    """Another node's forward or module hook on a part of `block` the pack's bounded block computes itself
    (then ComfyUI's block runs, calling it), else None. Asked at every guarded call: read from the walk that
    also makes the call's layer signature (`compat.module_tree`). `parallel`: {part: role} of the block's own
    parts whose sequence-parallel forward of that role (`sequence_parallel.recognised`: raylight's) the bounded
    block runs itself; any other bound forward is foreign."""
    tree = compat.module_tree(block)
    if tree.foreign is None or not parallel:
        return tree.foreign
    for part, module in tree.bound:
        known = sequence_parallel.recognised(module)
        if module is not getattr(block, part, None) or known is None or parallel.get(part) != known.role:
            return f"another node patched its {part}"
    return tree.hooked


__all__ = ["ChunkedMLP", "GatedMLP", "mlp_residual_", "modulated_layer_norm_args", "run_modulated_layer_norm",
           "projection_residual_", "output_projection_", "foreign_part", "FFN_CHUNK_FRACTION", "UNSPLIT_CHUNK_SCALE",
           "chunk_scale", "SWIGLU", "silu_gate_"]
