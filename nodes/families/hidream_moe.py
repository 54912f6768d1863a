"""HiDream-I1's feed-forwards in the bounded block (`hidream.py`'s `run_block`): a SwiGLU by token chunks, and the
image stream's routed mixture of experts (`MOEFeedForwardSwiGLU`: each token sent to two of four experts, a shared
expert beside them) computed as ComfyUI's module computes it, by token chunks (`bounded_moe_`): the routing once
for all tokens (one wait for the GPU a call), each expert on its rows of a token chunk, the routed sum of a chunk
and the shared expert's output added as the module rounds them, `MOE_BUDGET` x |x| beside the stream's output. A
mixture it does not know (another gate or expert forward, normalized top-k weights, layers of an unknown class:
`bounded_moe_refusal`) runs as ComfyUI's own module on token chunks (`MOE_CHUNK_BUDGET`; whole where the
attention is not split)."""
from __future__ import annotations

from typing import Optional

import torch

import comfy.ldm.hidream.model as hidream_model

from ..block_parts import SWIGLU, ChunkedMLP, mlp_residual_, modulated_layer_norm_args, run_modulated_layer_norm
from ..comfy_ops import (chunk_tokens, even_chunk_tokens, not_row_sliceable, plain_layer_norm_eps, stored_weights,
                         token_ranges)

# ComfyUI's own module on token chunks, where the pack's bounded mixture does not apply (`bounded_moe_refusal`: a
# gate, expert or layer it does not know): a chunk's transient as a multiple of |x| (a token's top-k copies and
# their outputs, an expert's hidden activations), larger chunks than a plain MLP's, as each chunk runs the whole
# routing (~50 launches and a wait for the GPU per expert: the module selects each expert's tokens by a boolean
# mask). Where the attention is not split (a sequence under the floor) that module runs whole, as ComfyUI runs it.
MOE_CHUNK_BUDGET = 3


def is_moe(ff) -> bool:
    return isinstance(ff, hidream_model.MOEFeedForwardSwiGLU) and isinstance(getattr(ff, "gate", None),
                                                                             hidream_model.MoEGate)


def moe_functions(ff) -> tuple:
    """ComfyUI's functions of a feed-forward the bounded block stands in for: its module's, and of a mixture of
    experts its gate's, its shared expert's and its experts'."""
    functions = (type(ff).forward,)
    if is_moe(ff):
        functions += (type(ff.gate).forward, type(ff.shared_experts).forward) + \
            tuple(type(expert).forward for expert in ff.experts)
    return functions


def moe_elements_per_token(ff) -> int:
    """The elements one token's pass through HiDream's mixture of experts may hold, counted generously: its
    top-k copies and their outputs (2 x top-k x width), the hidden activations of an expert (w1's, w3's and their
    product: one of the token's copies can go to any expert) and of the shared expert. (The budget of ComfyUI's
    own module on token chunks, where the bounded mixture does not apply.)"""
    width = int(ff.gate.gating_dim)
    hidden = max(int(expert.w1.weight.shape[0]) for expert in ff.experts)
    shared = int(ff.shared_experts.w1.weight.shape[0])
    return 2 * int(ff.num_activated_experts) * width + 3 * (hidden + shared)


def add_gated(gate):
    """`add_(part, out, a, b)`: `part += gate * out`, as the block adds its feed-forward's update."""
    def add_(part, out, a, b):
        part += gate * out   # as the block adds it (gate * update, then the sum)
    return add_


def add_gated_own(gate):
    """`add_gated` for an update the caller hands over (`gate * y` into `y`: the same rounding, no other chunk)."""
    def add_(part, out, a, b):
        part += out.mul_(gate) if torch.promote_types(out.dtype, gate.dtype) == out.dtype else gate * out
    return add_


def _swiglu_refusal(name: str, mlp, width: int) -> Optional[str]:
    """None when `mlp` is ComfyUI's `FeedForwardSwiGLU` over `width` channels with layers whose token rows the
    pack may run on any subset of tokens (a layer class it knows: `not_row_sliceable`)."""
    if type(mlp).forward is not hidream_model.FeedForwardSwiGLU.forward:
        return f"{name} is {type(mlp).__name__}, not ComfyUI's FeedForwardSwiGLU"
    layers = SWIGLU.linears(mlp)
    if layers is None:
        return f"{name} has no w1 / w3 / w2"
    w1, w3, w2 = (getattr(layer, "weight") for layer in layers)
    if any(w.dim() != 2 for w in (w1, w3, w2)) or w1.shape[1] != width or tuple(w3.shape) != tuple(w1.shape) or \
            tuple(w2.shape) != (width, w1.shape[0]):
        return f"{name}'s layers are not width -> hidden -> width"
    for layer_name, layer in zip(("w1", "w3", "w2"), layers):
        reason = not_row_sliceable(layer)
        if reason is not None:
            return f"{name}.{layer_name}: {reason}"
    return None


def bounded_moe_refusal(ff, out: torch.Tensor, norm, mods) -> Optional[str]:
    """None when the pack computes HiDream's mixture of experts `ff` itself (`_bounded_moe_`) for the residual
    stream `out` (B, N, C), its norm and its (shift, scale, gate) modulation: ComfyUI's module and gate as this
    ComfyUI has them (softmax scores, top-k of 1 or 2 unnormalized), SwiGLU experts of layers it knows, a plain
    LayerNorm and modulation vectors of the stream's dtype. Else why not (ComfyUI's module then runs on token
    chunks, as before)."""
    if not is_moe(ff):
        return "not HiDream's mixture of experts"
    gate = ff.gate
    if type(ff).forward is not hidream_model.MOEFeedForwardSwiGLU.forward or \
            type(gate).forward is not hidream_model.MoEGate.forward:
        return "another forward of the mixture of experts or its gate"
    if getattr(gate, "scoring_func", None) != "softmax":
        return f"the gate's scoring function {getattr(gate, 'scoring_func', None)!r}"
    k, experts = getattr(gate, "top_k", None), ff.experts
    if not isinstance(k, int) or k not in (1, 2) or ff.num_activated_experts != k or \
            getattr(gate, "n_routed_experts", None) != len(experts) or k > len(experts):
        return "not 1 or 2 of its routed experts a token"
    if k > 1 and gate.norm_topk_prob:
        return "normalized top-k weights (norm_topk_prob)"
    batch, _, width = out.shape
    weight = getattr(gate, "weight", None)
    if not torch.is_tensor(weight) or tuple(weight.shape) != (len(experts), width):
        return "the gate's weight is not experts x width"
    if plain_layer_norm_eps(norm) is None:
        return "the norm is not a plain LayerNorm"
    if any(not torch.is_tensor(m) or m.dtype != out.dtype or m.device != out.device or m.dim() != 3 or
           m.shape[0] not in (1, batch) or m.shape[1] != 1 or m.shape[2] != width for m in mods):
        return "a modulation that is not one vector per batch item in the stream's dtype"
    for index, expert in enumerate(experts):
        reason = _swiglu_refusal(f"experts.{index}", expert, width)
        if reason is not None:
            return reason
    return _swiglu_refusal("shared_experts", ff.shared_experts, width)


# The bounded mixture of experts holds at most MOE_BUDGET x |x| (x chunk_scale) beside the stream's output: the
# routed experts' sum for one token chunk (as ComfyUI's module has it for all tokens before the shared expert is
# added) and one chunk of an expert's rows (their modulated input, w1's and w3's hidden activations) or of the
# shared expert's tokens. The token chunks are sized so that an expert's rows of one chunk (on average) fit in one
# product: with HiDream-I1's widths 4 token chunks and 16 products of ~2,000 rows at 2048^2 (near full speed,
# where a routed sum of the whole stream in the same memory would leave ~800 rows a product). 1.3 keeps the
# feed-forward, with the output and the text stream, under the split attention's own peak
# (tests/test_hidream_adapter.py; docs/benchmarks.md#planner); where the attention is not split (x
# UNSPLIT_CHUNK_SCALE: one or two token chunks, one product an expert in each, as ComfyUI runs them), under that
# attention's peak too.
MOE_BUDGET = 1.3
# The share of an average token chunk's expert rows the row budget leaves room for beyond one product (a router
# that sends more of a chunk's tokens to one expert splits that expert's rows into two products).
MOE_ROW_HEADROOM = 1.25


def modulate_(x: torch.Tensor, factor: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """`x * factor + shift` in place on `x` (a fresh norm output of the modulation's dtype): the block's two
    roundings."""
    return x.mul_(factor).add_(shift)


class ModulatedNorm:
    """`norm(x) * factor + shift` for the stream's LayerNorm `norm` and its modulation `factor`, `shift` `(B or 1,
    1, C)`: where the norm is plain, one launch a batch item (`block_parts.modulated_layer_norm`: the modulation
    as the norm's affine weight and bias, one rounding where the block's three operations round thrice, at most
    an ulp or two of bf16 apart): two launches less for every product of the mixture of experts. Else, and for
    tokens of several items with modulations of their own, the block's own operations. The routing and the
    attention's input keep the block's operations (a token near a routing tie meets the gate's logits as
    ComfyUI computes them)."""

    def __init__(self, norm, factor: torch.Tensor, shift: torch.Tensor, like: torch.Tensor):
        self.norm, self.factor, self.shift = norm, factor, shift
        # one F.layer_norm's arguments per batch item (None where it does not apply): the modulation of a batch
        # of one, or one shared by the batch, serves every item in one launch
        items = 1 if factor.shape[0] == shift.shape[0] == 1 else like.shape[0]
        self.items = [modulated_layer_norm_args(norm, like, shift[i % shift.shape[0]], factor[i % factor.shape[0]])
                      for i in range(items)]

    def rows(self, source: torch.Tensor, rows: torch.Tensor, item: int) -> torch.Tensor:
        """Batch item `item`'s modulated input for the token rows `rows` of its stream `source` `(N, C)`:
        `(len(rows), C)`, a new tensor."""
        planned = self.items[item % len(self.items)]
        x = source.index_select(0, rows)
        if planned is not None:
            return run_modulated_layer_norm(x, planned)
        return modulate_(self.norm(x).to(dtype=x.dtype), self.factor[item % self.factor.shape[0]],
                         self.shift[item % self.shift.shape[0]])

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The modulated input of the tokens `x` `(B, n, C)` (a view of the stream): a new tensor."""
        if len(self.items) == 1 and self.items[0] is not None:
            return run_modulated_layer_norm(x, self.items[0])
        return modulate_(self.norm(x).to(dtype=x.dtype), self.factor, self.shift)


def _row_elements(mlp) -> int:
    """Elements one row's pass through a SwiGLU expert holds at once (its input, w1's and w3's outputs)."""
    return int(mlp.w1.weight.shape[1]) + 2 * int(mlp.w1.weight.shape[0])


def bounded_moe_(out: torch.Tensor, norm, ff, shift: torch.Tensor, scale: torch.Tensor, chunks: int, add_) -> None:
    """`ff(norm(out) * (1 + scale) + shift)` for HiDream's mixture of experts `ff` (`bounded_moe_refusal` is
    None) by token chunks [a, b), each handed to `add_(out[:, a:b], y, a, b)` (the block's gated residual update,
    which may overwrite `y`), computing what ComfyUI's `MOEFeedForwardSwiGLU.forward` computes:

    1. routing once for all tokens: the gate's own forward on token chunks of the modulated input (recomputed
       from `out` by the block's operations); the (token, slot) pairs sorted by (token chunk, expert, batch item)
       and every segment's bounds read back in one device -> host copy (the only one of the call);
    2. for each token chunk, each expert on its rows of the chunk (by row chunks where they exceed the budget):
       the rows of `out` gathered, their modulated input recomputed in one pass (`ModulatedNorm`), the
       expert's w1 / w3 / SiLU / w2 (its layers cast once, or their own forward: `ChunkedMLP`), the output in
       the compute dtype times the slot's top-k weight (ComfyUI's `y * topk_weight`, one rounding), added into
       the chunk's routed sum (zeros) by `index_add_`. A token's slots go to distinct experts, each added once:
       0 + a is a, then a + b rounds once, which is ComfyUI's `.sum(dim=1)` over its two slots (one slot: the
       product itself);
    3. then, by sub-chunks of the chunk, `y = routed sum + shared_experts(x)` as the module rounds it (x by
       `ModulatedNorm` too), and `add_`."""
    batch, tokens, width = out.shape
    dtype, device = out.dtype, out.device
    moe_gate, experts = ff.gate, ff.experts
    k, count = int(moe_gate.top_k), len(experts)
    factor = 1 + scale
    budget = max(1, int(out.numel() * chunks * MOE_BUDGET))
    per_row = max(_row_elements(expert) for expert in experts)
    # Weights used as stored (no cast, no dequantized copy: the common case) are held for the whole call, and the
    # token chunks are sized so that the routed sum of a chunk (batch x n x width) and one product over an
    # expert's average share of its rows (n x batch x k / count rows, with headroom) fit in the budget together.
    # Weights cast or dequantized at each use (offloaded, LoRA, GGUF, quantized formats) are cast once a call:
    # each expert over all its rows in turn, one cast held at a time, into one routed sum of the stream's size.
    held = all(stored_weights(layer, out) is not None
               for mlp in (*experts, ff.shared_experts) for layer in SWIGLU.linears(mlp))
    share = batch * width + MOE_ROW_HEADROOM * batch * k * per_row / count
    step = even_chunk_tokens(tokens, max(1, int(share)), budget) if held else tokens
    row_budget = max(budget - batch * step * width, 256 * per_row)

    def modulated(a: int, b: int) -> torch.Tensor:
        return modulate_(norm(out[:, a:b]).to(dtype=dtype), factor, shift)
    inputs = ModulatedNorm(norm, factor, shift, out)

    # 1. routing: the gate on token chunks (their modulated input the only transient of the stream's width)
    route = torch.empty(batch, tokens, k, dtype=torch.long, device=device)
    weights = torch.empty(batch, tokens, k, dtype=dtype, device=device)
    for a, b in token_ranges(tokens, chunk_tokens(tokens, batch * width, budget)):
        index, weight, _ = moe_gate(modulated(a, b))
        route[:, a:b] = index.view(batch, b - a, k)
        weights[:, a:b] = weight.view(batch, b - a, k)
        del index, weight
    pair = torch.arange(batch * tokens * k, device=device)
    token = pair.div_(k, rounding_mode="floor")   # each pair's token, batch items one after the other
    item = token.div(tokens, rounding_mode="floor")
    token.remainder_(tokens)                      # ... within its item
    key = (token.div(step, rounding_mode="floor").mul_(count).add_(route.view(-1))).mul_(batch).add_(item)
    del route, item
    key, order = key.sort(stable=True)   # stable: each segment's tokens in order
    segments = (tokens + step - 1) // step * count * batch
    bounds = torch.searchsorted(key, torch.arange(segments + 1, device=device)).tolist()   # the one sync
    del key
    pair_weights = weights.view(-1)[order].unsqueeze(-1)
    rows_of = token[order].remainder_(step).to(torch.int32)   # each pair's row within its token chunk
    del weights, order, token

    mlps, shared = [None] * count, None
    try:
        for c, (a, b) in enumerate(token_ranges(tokens, step)):
            # 2. the routed experts' sum over this token chunk
            acc = torch.zeros(batch, b - a, width, dtype=dtype, device=device)
            for e, expert in enumerate(experts):
                for i in range(batch):
                    s = (c * count + e) * batch + i
                    start, stop = bounds[s], bounds[s + 1]
                    if start == stop:
                        continue
                    if mlps[e] is None:
                        mlps[e] = ChunkedMLP(expert, out, SWIGLU)
                    source, target = out[i, a:b], acc[i]
                    rows_step = even_chunk_tokens(stop - start, per_row, row_budget)
                    for r in range(start, stop, rows_step):
                        q = min(r + rows_step, stop)
                        rows = rows_of[r:q]
                        x = inputs.rows(source, rows, i)
                        y = mlps[e]([x]).to(dtype=dtype)
                        target.index_add_(0, rows, y.mul_(pair_weights[r:q]))
                        del x, y
                if not held and mlps[e] is not None:
                    mlps[e].release()
                    mlps[e] = None
            # 3. the shared expert, the routed sum added, the residual update
            if shared is None:
                shared = ChunkedMLP(ff.shared_experts, out, SWIGLU)
            sub = even_chunk_tokens(b - a, batch * _row_elements(ff.shared_experts), row_budget)
            for u, v in token_ranges(b - a, sub):
                y = shared([inputs.tokens(out[:, a + u:a + v])])
                part = acc[:, u:v]
                y = y.add_(part) if y.dtype == dtype else part + y   # ComfyUI's y + shared(x)
                add_(out[:, a + u:a + v], y, a + u, a + v)
                del y, part
            del acc
    finally:
        for mlp in (*mlps, shared):
            if mlp is not None:
                mlp.release()


def feed_forward_(out: torch.Tensor, norm, ff, shift, scale, gate, chunks: int) -> None:
    """`out += gate * ff(norm(out) * (1 + scale) + shift)` by token chunks, in place."""
    factor = 1 + scale

    def ffn_input(a, b):
        return norm(out[:, a:b]).to(dtype=out.dtype) * factor + shift
    if is_moe(ff) and bounded_moe_refusal(ff, out, norm, (shift, scale, gate)) is None:
        bounded_moe_(out, norm, ff, shift, scale, chunks, add_gated_own(gate))
    elif is_moe(ff) and chunks > 1:   # attention not split (a short sequence): the module whole, as ComfyUI runs it
        out += gate * ff(ffn_input(0, out.shape[1]))
    elif is_moe(ff):   # the module itself on each chunk (its routing is per token)
        mlp_residual_(out, ff, ffn_input, add_gated(gate), fraction=1, scale=MOE_CHUNK_BUDGET,
                      hidden_per_token=moe_elements_per_token(ff))
    else:
        mlp_residual_(out, ff, ffn_input, add_gated(gate), gated=SWIGLU, scale=chunks)


__all__ = ["MOE_BUDGET", "MOE_CHUNK_BUDGET", "MOE_ROW_HEADROOM", "ModulatedNorm", "modulate_", "is_moe",
           "moe_functions", "moe_elements_per_token", "add_gated", "add_gated_own", "bounded_moe_refusal",
           "bounded_moe_", "feed_forward_"]
