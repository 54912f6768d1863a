"""HiDream-I1 adapter (`comfy/ldm/hidream/model.py`): every `HiDreamAttention` of the double and single stream
blocks.

A double block's attention joins the image stream (`to_q/k/v`, norms `q_rms_norm` / `k_rms_norm`) and the text
stream (`to_q_t/k_t/v_t`, `q_rms_norm_t` / `k_rms_norm_t`) in the order [image, text]; a single block's has the
image stream alone (the text tokens are joined to it by the model). The q/k norms are RMSNorms over the whole
inner width (all heads: exact per head group through the runtime's per-token statistics, `NORM_SPANS_HEADS`),
then RoPE on adjacent pairs of every head's channels from ComfyUI's tables `(B, N, 1, D/2, 2, 2)`. Patched at
the attention (projection level: the head split through `nodes/attention.py`'s `attend()`, the output
projections by token chunks into the attention's own storage).

With block bounds on, the double and single blocks are bounded too: each stream's modulated input is made by
token chunks and handed off to the runtime, the output projections add into the residual by token chunks, and
the feed-forwards run by token chunks: the text stream's SwiGLU cast once, the image stream's routed mixture of
experts (each token sent to two of four experts, a shared expert beside them) computed as ComfyUI's
`MOEFeedForwardSwiGLU` computes it (`_bounded_moe_`): the routing once for all tokens (one wait for the GPU a
call), each expert on its rows of a token chunk, the routed sum of a chunk and the shared expert's output added as
the module rounds them, `MOE_BUDGET` x |x| beside the stream's output. A mixture it does not know (another gate
or expert forward, normalized top-k weights, layers of an unknown class) runs as ComfyUI's own module on token
chunks (`MOE_CHUNK_BUDGET`; whole where the attention is not split). The residual updates go into a new tensor
per stream (ComfyUI's block does not write its inputs).
Routing makes the block sensitive to round-off:
in 16 bits a token near a tie between two experts may take the other one (the whole block then differs on that
token by an expert's output, as it does between ComfyUI's own attention kernels), so the block's self-check
leaves out the 2% of its check tokens farthest from stock (`compat.compare(routed=True)`).

Left to ComfyUI (its forward runs, one log line): `image_tokens_masks` (a per-token key multiplier; ComfyUI's
model passes none), a RoPE table that does not cover each head's channels (the partial RoPE of other
configurations), another node's `attn1_patch` inside ComfyUI's attention call. Guarded and self-checked like
every forward of the pack (`compat.guard_module`).
"""
from __future__ import annotations

from typing import Optional

import torch

import comfy.ldm.hidream.model as hidream_model

from .. import compat
from ..attention import (AttentionForm, NORM_SPANS_HEADS, ROPE_PAIRS, StreamProjections, attend, attribute,
                        is_rms_norm)
from ..block_parts import (SWIGLU, ChunkedMLP, chunk_scale, foreign_part, mlp_residual_, output_projection_,
                          projection_residual_)
from ..comfy_ops import (chunk_tokens, even_chunk_tokens, not_row_sliceable, plain_layer_norm_eps, quantizes_inputs,
                        stored_weights, token_ranges)
from ..dispatch import attention_splits
from ..family import patch_module, unsliceable_projection
from . import measured

FAMILY = "HiDream"
MEMORY_FACTORS, WORKING_SETS, SPLIT_FLOOR_SCALE, SHORT_RUNS_STOCK = measured.constants("hidream")

IMAGE = StreamProjections(q="to_q", k="to_k", v="to_v", norm_q="q_rms_norm", norm_k="k_rms_norm")
TEXT = StreamProjections(q="to_q_t", k="to_k_t", v="to_v_t", norm_q="q_rms_norm_t", norm_k="k_rms_norm_t")
DOUBLE = AttentionForm(streams=(IMAGE, TEXT), norm=NORM_SPANS_HEADS, rope=ROPE_PAIRS)
SINGLE = AttentionForm(streams=(IMAGE,), norm=NORM_SPANS_HEADS, rope=ROPE_PAIRS)

HOOKS_RUN_INSIDE = ("attn1_patch",)   # ComfyUI's attention would call it on the whole joint q/k/v
ATTENTION_ARGS = ("norm_image_tokens", "image_tokens_masks", "norm_text_tokens", "rope", "transformer_options")
BLOCK_KINDS = (("double_stream_blocks", False), ("single_stream_blocks", True))
BLOCK_ARGS = ("image_tokens", "image_tokens_masks", "text_tokens", "adaln_input", "rope", "transformer_options")
# Keys kept from the spanning norm's statistics pass: all of them with the attention patched alone (the block's
# peak is then its MoE feed-forward's, far above the attention's), 30% in the bounded block (as Wan's and LTX's).
ATTENTION_KEPT_KEYS = 1.0
BLOCK_KEPT_KEYS = 0.3
# ComfyUI's own module on token chunks, where the pack's bounded mixture does not apply (`bounded_moe_refusal`: a
# gate, expert or layer it does not know): a chunk's transient as a multiple of |x| (a token's top-k copies and
# their outputs, an expert's hidden activations), larger chunks than a plain MLP's, as each chunk runs the whole
# routing (~50 launches and a wait for the GPU per expert: the module selects each expert's tokens by a boolean
# mask). Where the attention is not split (a sequence under the floor) that module runs whole, as ComfyUI runs it.
MOE_CHUNK_BUDGET = 3


def _form(attn) -> AttentionForm:
    return SINGLE if attn.single else DOUBLE


def _head_dim(attn) -> int:
    return attn.inner_dim // attn.heads


# --- probes -------------------------------------------------------------------------------------------------
def _linear_out(module, name: str, features: int, inputs: int) -> Optional[str]:
    weight = getattr(attribute(module, name), "weight", None)
    if weight is None or weight.dim() != 2 or tuple(weight.shape) != (features, inputs):
        return f"{name} is not a Linear from {inputs} to {features} features"
    return None


def probe_attention(attn) -> Optional[str]:
    """None when a `HiDreamAttention` has the structure the pack's forward uses."""
    heads, inner = getattr(attn, "heads", None), getattr(attn, "inner_dim", None)
    if not isinstance(heads, int) or not isinstance(inner, int) or heads <= 0 or inner % heads:
        return "no heads / inner_dim, or inner_dim not a multiple of heads"
    if _head_dim(attn) % 2:
        return "an odd head dim"
    if not isinstance(attn.processor, hidream_model.HiDreamAttnProcessor_flashattn):
        return f"its processor is {type(attn.processor).__name__}, not ComfyUI's"
    form = _form(attn)
    reason = form.probe(attn, heads, _head_dim(attn))
    if reason:
        return reason
    for stream in form.streams:
        for name in (stream.norm_q, stream.norm_k):
            if not is_rms_norm(attribute(attn, name), inner):
                return f"{name} is not an RMSNorm over {inner} channels"
    for name in ("to_out",) if attn.single else ("to_out", "to_out_t"):
        reason = _linear_out(attn, name, attn.out_dim, inner)
        if reason:
            return reason
    return None


# --- the forward --------------------------------------------------------------------------------------------
def run_attention(attn, config, norm_image_tokens, image_tokens_masks=None, norm_text_tokens=None, rope=None,
                  transformer_options={}):
    """`HiDreamAttention.forward`: the image output `(B, N_img, C)` of a single block's attention, or (image,
    text) outputs of a double block's (views of one buffer: the output projections write back into the
    attention's storage). `rope`: pair-RoPE matrices `(B or 1, N_img + N_txt, 1, D/2, 2, 2)` over the joined
    tokens (the runtime's layout already). (`image_tokens_masks` is refused by the guard.)"""
    image_tokens = norm_image_tokens.shape[1]
    tokens = image_tokens + (0 if attn.single else norm_text_tokens.shape[1])
    scale = chunk_scale(attention_splits(config, attn.heads, norm_image_tokens.shape[0], tokens))
    x_lists = [[norm_image_tokens]] if attn.single else [[norm_image_tokens], [norm_text_tokens]]
    del norm_image_tokens, norm_text_tokens   # the runtime holds the only references: each freed once projected
    # every group's keys kept from the spanning norm's statistics pass (each k projected once): the block's
    # peak is its MoE feed-forward's, far above the attention's
    attention = attend(attn, _form(attn), x_lists, attn.heads, _head_dim(attn), config, transformer_options,
                       freqs=rope, keep_keys=ATTENTION_KEPT_KEYS)
    if attn.single:
        return output_projection_(attn.to_out, attention, scale=scale)
    flat = attention.flatten(2)
    del attention
    return (output_projection_(attn.to_out, flat[:, :image_tokens], scale=scale),
            output_projection_(attn.to_out_t, flat[:, image_tokens:], scale=scale))


# --- the bounded block ------------------------------------------------------------------------------------------
def _is_moe(ff) -> bool:
    return isinstance(ff, hidream_model.MOEFeedForwardSwiGLU) and isinstance(getattr(ff, "gate", None),
                                                                             hidream_model.MoEGate)


def probe_block(block) -> Optional[str]:
    """None when a HiDream double or single transformer block has the structure the bounded forward uses."""
    single = isinstance(block, hidream_model.HiDreamImageSingleTransformerBlock)
    if not single and not isinstance(block, hidream_model.HiDreamImageTransformerBlock):
        return f"{type(block).__name__} is not a HiDream transformer block"
    attn = getattr(block, "attn1", None)
    if attn is None or bool(attn.single) != single:
        return "attn1 is not this block's kind of attention"
    reason = probe_attention(attn)
    if reason:
        return f"attn1: {reason}"
    width = attn.inner_dim
    if attn.out_dim != width:
        return "the attention's width is not the block's"
    mod = getattr(block, "adaLN_modulation", None)
    count = 6 if single else 12
    if not isinstance(mod, torch.nn.Sequential) or len(mod) != 2 or \
            tuple(getattr(mod[1], "weight", torch.empty(0)).shape) != (count * width, width):
        return f"adaLN_modulation is not SiLU, Linear to {count} x width"
    for name in ("norm1_i", "norm3_i") if single else ("norm1_i", "norm3_i", "norm1_t", "norm3_t"):
        norm = getattr(block, name, None)
        if not isinstance(norm, torch.nn.LayerNorm) or norm.elementwise_affine:
            return f"{name} is not a LayerNorm without weights"
    for name in ("ff_i",) if single else ("ff_i", "ff_t"):
        ff = getattr(block, name, None)
        if not _is_moe(ff) and SWIGLU.linears(ff) is None:
            return f"{name} is neither HiDream's mixture of experts nor a SwiGLU"
    return None


def moe_elements_per_token(ff) -> int:
    """The elements one token's pass through HiDream's mixture of experts may hold, counted generously: its
    top-k copies and their outputs (2 x top-k x width), the hidden activations of an expert (w1's, w3's and their
    product: one of the token's copies can go to any expert) and of the shared expert. (The budget of ComfyUI's
    own module on token chunks, where the bounded mixture does not apply.)"""
    width = int(ff.gate.gating_dim)
    hidden = max(int(expert.w1.weight.shape[0]) for expert in ff.experts)
    shared = int(ff.shared_experts.w1.weight.shape[0])
    return 2 * int(ff.num_activated_experts) * width + 3 * (hidden + shared)


def _modulated_input(norm, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, chunks: int) -> torch.Tensor:
    """`norm(x) * (1 + scale) + shift` in a fresh tensor, by token chunks, with the block's own operations (the
    same roundings: the routing downstream sees the same numbers)."""
    out = torch.empty_like(x)
    factor = 1 + scale
    tokens = x.shape[1]
    for a, b in token_ranges(tokens, chunk_tokens(tokens, x[:, :1].numel(), max(1, x.numel() * chunks // 8))):
        out[:, a:b] = norm(x[:, a:b]).to(dtype=x.dtype) * factor + shift
    return out


def _gated(gate):
    def add_(part, out, a, b):
        part += gate * out   # as the block adds it (gate * update, then the sum)
    return add_


def _gated_own(gate):
    """`_gated` for an update the caller hands over (`gate * y` into `y`: the same rounding, no other chunk)."""
    def add_(part, out, a, b):
        part += out.mul_(gate) if torch.promote_types(out.dtype, gate.dtype) == out.dtype else gate * out
    return add_


# --- the bounded mixture of experts ---------------------------------------------------------------------------
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
    if not _is_moe(ff):
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
# product: with HiDream-I1's widths 4 token chunks and 16 products of ~2,000 rows at 2048^2 (near full speed on an
# H200, where a routed sum of the whole stream in the same memory would leave ~800 rows a product). 1.3: measured
# with the output and the text stream, the feed-forward holds 2.25 |x|, under the split attention's own peak
# (2.45; tests/test_hidream_adapter.py). Where the attention is not split (x UNSPLIT_CHUNK_SCALE: one or two token
# chunks, one product an expert in each, as ComfyUI runs them) 3.9 |x|, under that attention's 4.6 (same block).
MOE_BUDGET = 1.3
# The share of an average token chunk's expert rows the row budget leaves room for beyond one product (a router
# that sends more of a chunk's tokens to one expert splits that expert's rows into two products).
MOE_ROW_HEADROOM = 1.25


def _modulate_(x: torch.Tensor, factor: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """`x * factor + shift` in place on `x` (a fresh norm output of the modulation's dtype): the block's two
    roundings."""
    return x.mul_(factor).add_(shift)


def _row_elements(mlp) -> int:
    """Elements one row's pass through a SwiGLU expert holds at once (its input, w1's and w3's outputs)."""
    return int(mlp.w1.weight.shape[1]) + 2 * int(mlp.w1.weight.shape[0])


def _bounded_moe_(out: torch.Tensor, norm, ff, shift: torch.Tensor, scale: torch.Tensor, chunks: int,
                  add_) -> None:
    """`ff(norm(out) * (1 + scale) + shift)` for HiDream's mixture of experts `ff` (`bounded_moe_refusal` is
    None) by token chunks [a, b), each handed to `add_(out[:, a:b], y, a, b)` (the block's gated residual update,
    which may overwrite `y`), computing what ComfyUI's `MOEFeedForwardSwiGLU.forward` computes:

    1. routing once for all tokens: the gate's own forward on token chunks of the modulated input (recomputed
       from `out` by the block's operations); the (token, slot) pairs sorted by (token chunk, expert, batch item)
       and every segment's bounds read back in one device -> host copy (the only one of the call);
    2. for each token chunk, each expert on its rows of the chunk (by row chunks where they exceed the budget):
       the rows of `out` gathered, their modulated input recomputed, the expert's w1 / w3 / SiLU / w2 (its
       layers cast once, or their own forward: `ChunkedMLP`), the output in the compute dtype times the slot's
       top-k weight (ComfyUI's `y * topk_weight`, one rounding), added into the chunk's routed sum (zeros) by
       `index_add_`. A token's slots go to distinct experts, each added once: 0 + a is a, then a + b rounds
       once, which is ComfyUI's `.sum(dim=1)` over its two slots (one slot: the product itself);
    3. then, by sub-chunks of the chunk, `y = routed sum + shared_experts(x)` as the module rounds it, and
       `add_`."""
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
        return _modulate_(norm(out[:, a:b]).to(dtype=dtype), factor, shift)

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
                    item_factor, item_shift = factor[i % factor.shape[0]], shift[i % shift.shape[0]]
                    rows_step = even_chunk_tokens(stop - start, per_row, row_budget)
                    for r in range(start, stop, rows_step):
                        q = min(r + rows_step, stop)
                        rows = rows_of[r:q]
                        x = _modulate_(norm(source.index_select(0, rows)).to(dtype=dtype), item_factor, item_shift)
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
                y = shared([modulated(a + u, a + v)])
                part = acc[:, u:v]
                y = y.add_(part) if y.dtype == dtype else part + y   # ComfyUI's y + shared(x)
                add_(out[:, a + u:a + v], y, a + u, a + v)
                del y, part
            del acc
    finally:
        for mlp in (*mlps, shared):
            if mlp is not None:
                mlp.release()


def _feed_forward_(out: torch.Tensor, norm, ff, shift, scale, gate, chunks: int) -> None:
    """`out += gate * ff(norm(out) * (1 + scale) + shift)` by token chunks, in place."""
    factor = 1 + scale

    def ffn_input(a, b):
        return norm(out[:, a:b]).to(dtype=out.dtype) * factor + shift
    if _is_moe(ff) and bounded_moe_refusal(ff, out, norm, (shift, scale, gate)) is None:
        _bounded_moe_(out, norm, ff, shift, scale, chunks, _gated_own(gate))
    elif _is_moe(ff) and chunks > 1:   # attention not split (a short sequence): the module whole, as ComfyUI runs it
        out += gate * ff(ffn_input(0, out.shape[1]))
    elif _is_moe(ff):   # the module itself on each chunk (its routing is per token)
        mlp_residual_(out, ff, ffn_input, _gated(gate), fraction=1, scale=MOE_CHUNK_BUDGET,
                      hidden_per_token=moe_elements_per_token(ff))
    else:
        mlp_residual_(out, ff, ffn_input, _gated(gate), gated=SWIGLU, scale=chunks)


def run_block(block, config, image_tokens, image_tokens_masks=None, text_tokens=None, adaln_input=None, rope=None,
              transformer_options={}):
    """The bounded forward of a HiDream double block (returns (image, text)) or single block (returns image):
    new tensors; the inputs are not written. (`image_tokens_masks` is refused by the guard.)"""
    attn = block.attn1
    single = bool(attn.single)
    mods = block.adaLN_modulation(adaln_input)[:, None].chunk(6 if single else 12, dim=-1)
    streams = [(image_tokens, block.norm1_i, block.norm3_i, block.ff_i, mods[:6])]
    if not single:
        streams.append((text_tokens, block.norm1_t, block.norm3_t, block.ff_t, mods[6:]))
    tokens = sum(x.shape[1] for x, *_ in streams)
    chunks = chunk_scale(attention_splits(config, attn.heads, image_tokens.shape[0], tokens))
    handed_off = [[_modulated_input(norm1, x, m[0], m[1], chunks)] for x, norm1, _, _, m in streams]
    attention = attend(attn, _form(attn), handed_off, attn.heads, _head_dim(attn), config, transformer_options,
                       freqs=rope, keep_keys=BLOCK_KEPT_KEYS).flatten(2)
    outs, start = [], 0
    for (x, _, _, _, m), to_out in zip(streams, ("to_out", "to_out_t")):
        out = x.clone()   # the stream's output: the updates are added into it in place
        projection_residual_(out, getattr(attn, to_out), attention[:, start:start + x.shape[1]], _gated(m[2]),
                             scale=chunks)
        start += x.shape[1]
        outs.append(out)
    del attention, streams[:]
    image = outs[0]
    _feed_forward_(image, block.norm3_i, block.ff_i, mods[3], mods[4], mods[5], chunks)
    if single:
        return image
    _feed_forward_(outs[1], block.norm3_t, block.ff_t, mods[9], mods[10], mods[11], chunks)
    return image, outs[1]


# --- guards ---------------------------------------------------------------------------------------------------
def _stock_functions(attn) -> tuple:
    return (type(attn).forward, type(attn.processor).__call__)


def rope_refusal(rope, tokens: int, head_dim: int) -> Optional[str]:
    """Why a call's `rope` cannot be taken (None when it can): pair matrices over every joined token, shared by
    the heads, that rotate every channel of a head."""
    if rope is None:
        return "no RoPE table"
    if not torch.is_tensor(rope) or rope.dim() != 6 or tuple(rope.shape[-2:]) != (2, 2) or rope.shape[2] != 1:
        return f"a RoPE table of shape {tuple(getattr(rope, 'shape', ()))} (the pack takes (B, N, 1, D/2, 2, 2))"
    if rope.shape[1] != tokens:
        return f"a RoPE table over {rope.shape[1]} tokens for {tokens}"
    if rope.shape[-3] * 2 != head_dim:
        return (f"RoPE over {rope.shape[-3] * 2} of the head's {head_dim} channels (partial RoPE: ComfyUI's "
                f"forward rotates the first ones)")
    return None


def _refuse_call(attn):
    def refuse(bound) -> Optional[str]:
        reason = compat.hooks_refusal(bound.get("transformer_options"), HOOKS_RUN_INSIDE)
        if reason is not None:
            return reason
        if bound.get("image_tokens_masks") is not None:
            return "image_tokens_masks (a per-token key multiplier; ComfyUI's model passes none)"
        img, txt = bound["norm_image_tokens"], bound.get("norm_text_tokens")
        if not attn.single and (not torch.is_tensor(txt) or txt.dim() != 3 or txt.shape[0] != img.shape[0]):
            return "no text stream (batch, tokens, width)"
        tokens = img.shape[1] + (0 if attn.single else txt.shape[1])
        return rope_refusal(bound.get("rope"), tokens, _head_dim(attn))
    return refuse


def _signature(attn, config, bound: dict) -> tuple:
    img, rope = bound["norm_image_tokens"], bound.get("rope")
    options = bound.get("transformer_options") or {}
    return ("attention", _stock_functions(attn), compat.layers_signature(attn), img.dtype, img.device.type,
            config, compat.hooks_set(options), "optimized_attention_override" in options,
            None if rope is None else (rope.dtype, rope.shape[0]))


def _check_inputs(attn):
    def check(bound: dict) -> dict:
        """The call's check inputs: its first image tokens (and the first text tokens), with their RoPE rows."""
        img, txt, rope = bound["norm_image_tokens"], bound.get("norm_text_tokens"), bound["rope"]
        n = compat.check_tokens(img.shape[1])
        out = dict(bound)
        out["norm_image_tokens"] = img[:, :n].clone()
        rows = torch.arange(n)
        if not attn.single:
            m = min(txt.shape[1], max(1, compat.CHECK_TOKENS // 4))
            out["norm_text_tokens"] = txt[:, :m].clone()
            rows = torch.cat((rows, img.shape[1] + torch.arange(m)))
        out["rope"] = rope.index_select(1, rows.to(rope.device))
        out["transformer_options"] = compat.probe_options(bound.get("transformer_options") or {})
        return out
    return check


def _block_functions(block) -> tuple:
    """ComfyUI's functions the bounded block stands in for: the block's, its attention's, its feed-forwards' (a
    mixture of experts': the module's, its gate's and its experts')."""
    functions = (type(block).forward,) + _stock_functions(block.attn1)
    for name in ("ff_i", "ff_t"):
        ff = getattr(block, name, None)
        if ff is None:
            continue
        functions += (type(ff).forward,)
        if _is_moe(ff):
            functions += (type(ff.gate).forward, type(ff.shared_experts).forward) + \
                tuple(type(expert).forward for expert in ff.experts)
    return tuple(dict.fromkeys(functions))


def _block_signature(block, config, bound: dict) -> tuple:
    img, rope = bound["image_tokens"], bound.get("rope")
    options = bound.get("transformer_options") or {}
    return ("block", _block_functions(block), compat.layers_signature(block), img.dtype, img.device.type, config,
            compat.hooks_set(options), "optimized_attention_override" in options,
            None if rope is None else (rope.dtype, rope.shape[0]))


def _refuse_block(block):
    attention = _refuse_call(block.attn1)

    def refuse(bound) -> Optional[str]:
        if not torch.is_tensor(bound.get("adaln_input")):
            return "no adaln_input"
        return attention({"norm_image_tokens": bound["image_tokens"], "norm_text_tokens": bound.get("text_tokens"),
                          "image_tokens_masks": bound.get("image_tokens_masks"), "rope": bound.get("rope"),
                          "transformer_options": bound.get("transformer_options")})
    return refuse


def _check_block(block):
    check_attention = _check_inputs(block.attn1)

    def check(bound: dict) -> dict:
        """The call's first image (and text) tokens with their RoPE rows, the modulation input whole."""
        cut = check_attention({"norm_image_tokens": bound["image_tokens"],
                               "norm_text_tokens": bound.get("text_tokens"), "rope": bound["rope"],
                               "transformer_options": bound.get("transformer_options")})
        out = dict(bound)
        out.update(image_tokens=cut["norm_image_tokens"], rope=cut["rope"],
                   transformer_options=cut["transformer_options"])
        if not block.attn1.single:
            out["text_tokens"] = cut["norm_text_tokens"]
        return out
    return check


def block_forward(block, config):
    """The guarded bounded forward installed on a HiDream double or single transformer block."""
    def ours_factory(module, config):
        def forward(*args, **kwargs):
            return run_block(module, config, **compat.bind_args(BLOCK_ARGS, args, kwargs))
        return forward
    return compat.guard_module(
        f"{FAMILY} block", block, BLOCK_ARGS, ours_factory, config, functions=lambda: _block_functions(block),
        signature=lambda bound: _block_signature(block, config, bound), check_inputs=_check_block(block),
        residual="image_tokens" if block.attn1.single else ("image_tokens", "text_tokens"),
        quantized=lambda: quantizes_inputs(block), refuse_call=_refuse_block(block), refuse_more=foreign_part,
        routed=True)


def attention_forward(attn, config):
    """The guarded forward installed on a `HiDreamAttention`."""
    def ours_factory(module, config):
        def forward(*args, **kwargs):
            return run_attention(module, config, **compat.bind_args(ATTENTION_ARGS, args, kwargs))
        return forward
    return compat.guard_module(
        f"{FAMILY} attention", attn, ATTENTION_ARGS, ours_factory, config,
        functions=lambda: _stock_functions(attn), signature=lambda bound: _signature(attn, config, bound),
        check_inputs=_check_inputs(attn), quantized=lambda: quantizes_inputs(attn), refuse_call=_refuse_call(attn))


# --- the adapter contract (nodes/family.py) ---------------------------------------------------------------------
def _blocks(model):
    """(path, transformer block) of every HiDream block, double stream blocks first."""
    for name, _ in BLOCK_KINDS:
        blocks = getattr(model, name, None)
        if not isinstance(blocks, torch.nn.ModuleList):
            continue
        for index, wrapper in enumerate(blocks):
            block = getattr(wrapper, "block", None)
            if isinstance(getattr(block, "attn1", None), hidream_model.HiDreamAttention):
                yield f"diffusion_model.{name}.{index}.block", block


def _attentions(model):
    for path, block in _blocks(model):
        yield f"{path}.attn1", block.attn1


def matches(diffusion_model) -> bool:
    """A HiDream-I1 model: its blocks' attention is `HiDreamAttention`."""
    return isinstance(diffusion_model, hidream_model.HiDreamImageTransformer2DModel) and \
        next(_attentions(diffusion_model), None) is not None


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone): every attention that probes clean; with block bounds, every block
    too (its attention patch then serves the calls the block hands to ComfyUI's own forward)."""
    for path, block in _blocks(patcher.model.diffusion_model):
        patch_module(patcher, report, FAMILY, f"{path}.attn1", "attention",
                     lambda block=block: attention_forward(block.attn1, config),
                     lambda block=block: probe_attention(block.attn1))
        if config.block:
            patch_module(patcher, report, FAMILY, path, "block", lambda block=block: block_forward(block, config),
                         lambda block=block: probe_block(block), parts=("attn1",))


def stock_functions(diffusion_model) -> set:
    functions = set()
    for _, block in _blocks(diffusion_model):
        functions.update(_block_functions(block))
    return functions


def tokens_per_item(diffusion_model, latent_shape) -> Optional[int]:
    """Image tokens of one batch item for a latent `(B, C, H, W)` (the text comes on top; not known here)."""
    if latent_shape is None or len(latent_shape) != 4:
        return None
    step = int(getattr(diffusion_model, "patch_size", 2))
    return -(-int(latent_shape[-2]) // step) * -(-int(latent_shape[-1]) // step)


def kv_heads(diffusion_model) -> Optional[int]:
    attn = next(_attentions(diffusion_model), (None, None))[1]
    return None if attn is None else attn.heads


def splits_projections(diffusion_model) -> Optional[str]:
    return unsliceable_projection(next(_attentions(diffusion_model), (None, None))[1], ("to_q", "to_k", "to_v"))


def block_kinds(diffusion_model) -> tuple:
    return ("block",)
