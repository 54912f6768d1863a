"""The statistics pass: per-token mean squares of q and k over all heads, for a norm that spans heads
(docs/design.md §2.2).

Wan's RMSNorm normalizes q and k over their full width, but a split call projects them a group of heads at a
time. So before the first group, this pass computes each token's mean of squares over every head of q and of k,
float32 `(batch, tokens, 1)`, and each group's `HeadGroup.mean_squares` carries them to the norm.

How, cheapest first: the model's own `norm_stats(project)`; else q projected into the output buffer on the way
(the split path keeps q there anyway) and k projected at full width a chunk of tokens at a time
(`sum_squares_by_tokens`), or group by group where a projection cannot take token ranges cheaply. `keep_keys`
lets the first groups' k be projected by the group's rows here and kept (`kept_keys`, by first key/value head)
for that group, so those keys are projected once, not twice.

Who frees what: the pass releases nothing but the k projections when every group's k is kept; the kept keys
belong to the `kept_keys` dict (the group loop pops them; the call clears it at its end).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .head_split import HeadGroup
from .streams import CallStreams, join_streams


def sum_squares_(t: torch.Tensor, acc: torch.Tensor) -> None:
    """`acc` `(B, N)` float32 += the sum over the last two dims of `t**2` (`t` `(B, N, heads, D)`), accumulated
    in float32 by one reduction (no float32 copy of `t`)."""
    acc += torch.linalg.vector_norm(t, dim=(-2, -1), dtype=torch.float32).square_()


def kept_key_groups(keep_keys: Optional[float], streams: CallStreams, groups: list[HeadGroup]) -> int:
    """How many of the first groups keep the k of the statistics pass: `keep_keys` of them (rounded down), where
    each group's k is projected on its own (not one module for k and v)."""
    if not keep_keys or any(s.shared_kv for s in streams.kv_streams):
        return 0
    return int(keep_keys * len(groups) + 1e-9)


def mean_squares(streams: CallStreams, groups: list[HeadGroup], norm_stats: Optional[Callable],
                 keep_keys: Optional[float], q_out: Optional[torch.Tensor], kept_keys: dict[int, torch.Tensor],
                 chunk_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token mean of squares over all heads of q and of k, float32 `(B, N, 1)` each (`N`: q tokens, kv tokens).

    `norm_stats(project)`: the model's own way (`project(which, head_range)` gives `(B, N, heads of the range *
    D)`, the projections kept). With `q_out` `(B, q tokens, heads, D)`, q is projected into it on the way, so
    only k is projected twice, except for the first `keep_keys` groups: their k (`(B, kv tokens, kv heads of the
    group, D)`, not normalized) goes to `kept_keys[group.kv.start]`. `chunk_multiple`: token chunks of the
    full-width pass are whole multiples of it (`runtime.STATS_CHUNK_MULTIPLE`)."""
    d = streams.head_dim

    def project(which: str, head_range: range) -> torch.Tensor:
        sources = streams.q_streams if which == "q" else streams.kv_streams
        tokens = streams.q_tokens if which == "q" else streams.kv_tokens
        heads = len(head_range)
        joined = join_streams(sources, lambda s: which, head_range.start * d, head_range.stop * d,
                              lambda s: False, tokens, heads, d)
        return joined.flatten(-2)

    if norm_stats is not None:
        q_ms, k_ms = norm_stats(project)
        if q_out is not None:
            streams.project_q_into(q_out, groups)
        return q_ms, k_ms
    stats = []
    for which, tokens, total_heads, attr in (("q", streams.q_tokens, streams.heads, "q"),
                                              ("k", streams.kv_tokens, streams.kv_heads, "kv")):
        acc = torch.zeros((streams.batch, tokens), dtype=torch.float32, device=streams.device)
        sources = streams.q_streams if which == "q" else streams.kv_streams
        kept = kept_key_groups(keep_keys, streams, groups) if which == "k" and q_out is not None else 0
        if which == "q" and q_out is not None:
            streams.project_q_into(q_out, groups, lambda q: sum_squares_(q, acc))
        elif all(s.by_tokens(which) for s in sources):
            for group in groups[:kept]:  # the group's own rows, as it would project them, kept for it
                key = streams.project_k(group, last=False, v_later=True)
                sum_squares_(key, acc)
                kept_keys[group.kv.start] = key
                del key
            column_start = groups[kept - 1].kv.stop * d if kept else 0
            if kept < len(groups):
                sum_squares_by_tokens(streams, which, acc, len(groups), chunk_multiple, column_start, kept > 0)
        else:
            for index, group in enumerate(groups):
                part = project(which, getattr(group, attr)).unflatten(-1, (-1, d))
                sum_squares_(part, acc)
                if index < kept:
                    kept_keys[group.kv.start] = part
                del part
        if kept == len(groups):  # every key is kept: the k projection is done with
            for source in sources:
                source.release_projection("k")
        stats.append(acc.div_(total_heads * d).unsqueeze(-1))
    return stats[0], stats[1]


def sum_squares_by_tokens(streams: CallStreams, which: str, acc: torch.Tensor, groups: int, chunk_multiple: int,
                          column_start: int = 0, beside_kept: bool = False) -> None:
    """`acc` `(B, N)` float32 += the squares of the features `[column_start:]` of `which` ("q" or "k": every head
    from there on), projected at that width a chunk of tokens at a time into one reused buffer: one wide product
    per chunk instead of one narrow product per group. A chunk holds as many elements as one group's k, v and
    attention result together (as its v and result only, `beside_kept` keys of the first groups), rounded up to
    whole `chunk_multiple`s of tokens, so the peak stays where the groups put it."""
    sources = streams.q_streams if which == "q" else streams.kv_streams
    full = (streams.heads if which == "q" else streams.kv_heads) * streams.head_dim
    width = full - column_start
    total = sum(s.tokens for s in sources)
    multiple = chunk_multiple
    units = 2 if beside_kept else 3
    step = -(-max(multiple, -(-units * total * full // (groups * width))) // multiple) * multiple
    buffer, offset = None, 0
    for source in sources:
        for a in range(0, source.tokens, step):
            n = min(step, source.tokens - a)
            if buffer is None:
                buffer = torch.empty((streams.batch, min(step, total), width), dtype=streams.dtype,
                                     device=streams.device)
            part = buffer[:, :n]
            source.rows_into(which, part, column_start, full, a)
            sum_squares_(part.unflatten(-1, (-1, streams.head_dim)), acc[:, offset + a:offset + a + n])
            del part
        offset += source.tokens
    del buffer
