"""A staged call that reuses its input (`reuse_input=True`): k projected once beside a norm that spans heads.

The usual staged split of a spanning norm (Wan's RMSNorm over every head, on SageAttention 2) projects k twice:
the statistics pass projects it at full width for each token's mean square, and each group projects its own
heads again, because the core smooths k by the mean of the *normalized* keys over all tokens, so no group's keys
can be quantized before every key row has been seen. When the caller gives its input x `(B, N, heads * D)` up
for good, the call needs no second projection, and holds less:

1. v, group by group, quantized by the core as it is projected (fp8: half of v's 16 bits);
2. one pass over chunks of tokens at full width: each chunk's q and k, normalized with their per-token mean
   squares from the chunk itself (it holds every head: the norm is handed no `mean_squares` and takes them,
   in its fused pass on CUDA); q normalized, rotated and quantized (the core's q layout has tiles of
   tokens and nothing over all tokens: `StagedCore.q_row_tile`), k normalized and rotated and written into
   x's own rows of the chunk, which no projection reads again (by the norm's own pass where the caller
   offers `norm_key_into`, else copied from the chunk);
3. each group: its keys, in x's storage, smoothed and quantized by the core; the kernel writes the group's
   output into the same columns of x, which its keys have just left.

The result is x's storage viewed `(B, N, heads, D)`. Held beside x: v (1/2 |x| in fp8), q (1/2 |x| in int8) and
a chunk of tokens (|x| / `CHUNK_FRACTION`), then one group's quantized keys; the usual staged split holds x,
the output buffer and a group's 16-bit q, k and v.

Who frees what: x belongs to the call from the hand-off on (its storage becomes the output, which the caller
gets back); each group's quantized v is dropped after its group, the quantized q of every head at the end.
The norm (`norm_rope`) is called on chunks of tokens of every head here: `HeadGroup.tokens` says which tokens.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .staged_core import StagedCore
from .head_split import HeadGroup
from .options import AttentionOptions
from .streams import CallStreams

# a chunk of the full-width pass holds at most |x| / CHUNK_FRACTION elements (one product's output, reused)
CHUNK_FRACTION = 8


def reuse_reason(x: torch.Tensor, o: AttentionOptions, streams: CallStreams, core: Optional[StagedCore],
                 groups: list[HeadGroup], settings) -> Optional[str]:
    """None when the call can run in the storage of its input `x` (module docstring; the streams prepared),
    else why not."""
    if not o.reuse_input:
        return "the input is not given up"
    if core is None or len(groups) < 2 or not o.norm_spans_heads:
        return "not a staged split with a norm spanning heads"
    if core.q_row_tile(settings) is None:
        return f"the {core.name} core's quantized q is not made by chunks of tokens here"
    if len(streams.all_streams) != 1 or streams.q_streams != streams.kv_streams:
        return "not the self-attention of one stream"
    if streams.kv_heads != streams.heads:
        return "grouped-query heads"
    if o.kv_prefix is not None or o.capture_kv is not None or o.attention_fn is not None or \
            o.attention_mask is not None or o.norm_v is not None or o.norm_stats is not None:
        return "a prefix, a capture, a mask, a value norm, the model's statistics or its own attention"
    stream = streams.all_streams[0]
    if stream.shared_kv or set(stream.proj) != {"q", "k", "v"}:
        return "not three projections q, k, v"
    if not (stream.by_tokens("q") and stream.by_tokens("k")):
        return "a q or k projection that cannot be computed by token ranges"
    if x is None or x.dim() != 3 or not x.is_contiguous() or x.requires_grad or \
            x.shape[-1] != streams.heads * streams.head_dim or \
            x.untyped_storage().nbytes() != x.numel() * x.element_size():
        return "the input cannot hold the output (a view, strided, another width, or gradients)"
    return None


def run_in_input(x: torch.Tensor, streams: CallStreams, groups: list[HeadGroup], o: AttentionOptions,
                 norm_rope: Callable, core: StagedCore, settings, chunk_multiple: int) -> torch.Tensor:
    """The call (module docstring) after `reuse_reason` said None and the streams were prepared; `x` is the
    stream's input (its storage becomes the result `(B, N, heads, D)`), `settings` the core's for one group,
    `chunk_multiple` the token multiple of the chunks (`runtime.STATS_CHUNK_MULTIPLE`)."""
    s = streams
    stream = s.q_streams[0]
    batch, tokens, heads, d = s.batch, s.q_tokens, s.heads, s.head_dim
    out = x.view(batch, tokens, heads, d)
    values = []
    for index, group in enumerate(groups):   # 1. v, quantized as each group's is projected
        _, v = s.project_v(group, last=index == len(groups) - 1, k_later=False)
        values.append(core.staged_quantize_v([v], settings))
        del v
    queries = _queries_and_keys_(x, stream, s, norm_rope, o.fused_quant, o.norm_key_into, core, settings,
                                 chunk_multiple)
    for index, group in enumerate(groups):   # 3. each group's keys leave the columns its output takes
        key = out[:, :, group.kv.start:group.kv.stop]
        quantized_k = core.staged_quantize_k([key], settings)
        del key
        quantized_q = core.quantized_q_heads(queries, group.q)
        core.staged_attention(out[:, :, group.q.start:group.q.stop], (quantized_q, quantized_k, values[index]),
                              settings)
        values[index] = None
        del quantized_k, quantized_q
    return out


def _queries_and_keys_(x, stream, s: CallStreams, norm_rope: Callable, fused: Optional[Callable],
                       key_into: Optional[Callable], core: StagedCore, settings, chunk_multiple: int):
    """Step 2: the quantized q of every head (`core.empty_quantized_q`), k normalized and rotated into x's rows
    (by `key_into`'s pass where it runs, else in the chunk buffer and copied). Releases the q and k projections."""
    batch, tokens, heads, d = s.batch, s.q_tokens, s.heads, s.head_dim
    width = heads * d
    tile = core.q_row_tile(settings)
    multiple = chunk_multiple * tile // math.gcd(chunk_multiple, tile)
    step = -(-max(1, -(-tokens // CHUNK_FRACTION)) // multiple) * multiple
    queries = core.empty_quantized_q((batch, tokens, heads, d), settings)
    every = range(heads)
    buffer = torch.empty((batch, min(step, tokens), width), dtype=s.dtype, device=s.device)
    try:
        for a in range(0, tokens, step):
            n = min(step, tokens - a)
            part = buffer[:, :n]
            stream.rows_into("q", part, 0, width, a)
            q = part.unflatten(-1, (heads, d))
            # the chunk holds every head: the norm takes each token's statistics from it (no mean squares)
            group = HeadGroup(every, every, None, tokens=range(a, a + n))
            quantized = fused(q, None, group, core, settings) if fused is not None else None
            if quantized is None:
                norm_rope(q, None, group)
                quantized = core.staged_quantize_q([q], settings)
            core.place_quantized_q_rows(queries, quantized, a)
            del quantized, q
            stream.rows_into("k", part, 0, width, a)   # x's rows [a, a + n) are read for the last time here
            k = part.unflatten(-1, (heads, d))
            if key_into is None or not key_into(k, x[:, a:a + n].unflatten(-1, (heads, d)), group):
                norm_rope(None, k, group)
                x[:, a:a + n].copy_(part)
            del k, part
    finally:
        del buffer
        stream.release_projection("q")
        stream.release_projection("k")
    return queries

