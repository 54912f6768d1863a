"""The token streams of one call and their projections by ranges of heads (docs/design.md §2.1-2.3).

A `TokenStream` is one input `(batch, tokens, features)` and the projections that read it. `CallStreams` is all
the streams of a call (the query streams and the key/value streams; one stream may be both) and projects them by
head ranges: q (or the fourth projection, `extra`) of some query heads, k or v of some key/value heads, the
streams joined along tokens in their order.

Who frees what: `TokenStream.prepare()` drops the stream's own reference to its input (the prepared projections
hold it until they are released). A projection is released by the projection call that passes `release=True`
(`last` below: the last group that needs it), or by `CallStreams.release()` at the end of the call, whatever
happens. Every tensor returned here is new and belongs to the caller.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .head_split import HeadGroup
from .projections import PreparedProjection, WholeThenSlice, as_row_projection

# A key/value stream this short next to the call's key tokens projects its k and v whole, once (see
# `CallStreams.prepare`): held through the groups, they cost at most ~3 % of the joined stream's size. A larger
# share would let Qwen-Image 1328^2's prompt in (256 of 7,145 tokens), raising its block's peak; HunyuanVideo's
# (256 of ~76,000) is in.
SHORT_STREAM_SHARE = 1 / 64


class TokenStream:
    """One token stream: its input `x` `(batch, tokens, features)` and the projections that read it (q, k, v,
    extra: any may be None); `name` is what error messages call the input ("x", "context", "stream 1 x")."""

    def __init__(self, x: torch.Tensor, name: str = "x", **projections):
        self.x, self.name = x, name
        self.raw = {name: p for name, p in projections.items() if p is not None}
        # one module for k and v: projected once (the value gets a copy), so it is prepared once
        self.shared_kv = "k" in self.raw and self.raw.get("v") is self.raw["k"]
        self.proj = {name: as_row_projection(p) for name, p in self.raw.items()
                     if not (name == "v" and self.shared_kv)}
        self.prepared: dict[str, PreparedProjection] = {}
        self.batch, self.tokens, self.dtype, self.device = x.shape[0], x.shape[1], x.dtype, x.device

    def prepare(self, whole_kv: bool = False) -> None:
        """Prepare every projection once for this call; unsliceable ones run whole once and are sliced, and so
        do k and v with `whole_kv` (a short stream beside a long one: see `CallStreams.prepare`). The stream
        drops its input: the prepared projections hold it until they are released."""
        for name, proj in self.proj.items():
            prepared = proj.prepare(self.x)
            if proj.not_row_sliceable() is not None or (whole_kv and name in ("k", "v")):
                prepared = WholeThenSlice(prepared)
            self.prepared[name] = prepared
        self.x = None  # the prepared projections hold the input until released

    def rows(self, name: str, start: int, stop: int, release: bool) -> torch.Tensor:
        """Output features `[start, stop)` of projection `name`, `(batch, tokens, stop - start)` (a new tensor);
        `release`: the projection is released afterwards."""
        prepared = self.prepared[name]
        out = prepared.rows(start, stop)
        if release:
            self.release_projection(name)
        return out

    def rows_into(self, name: str, out: torch.Tensor, start: int, stop: int, token_start: int = 0,
                  release: bool = False) -> None:
        """Output features `[start, stop)` of projection `name` for the tokens from `token_start` on, written
        into `out` `(batch, tokens of out, stop - start)`."""
        self.prepared[name].rows_into(out, start, stop, token_start)
        if release:
            self.release_projection(name)

    def release_projection(self, name: str) -> None:
        """Drop one projection (its cast weight and its hold on the input) once nothing needs it."""
        prepared = self.prepared.pop(name, None)
        if prepared is not None:
            prepared.release()

    def writes_into(self, name: str) -> bool:
        """Whether projection `name` writes the stream's rows into a buffer in one launch (`rows_into`)."""
        return self.prepared[name].writes_into(self.batch)

    def by_tokens(self, name: str) -> bool:
        """Whether projection `name` can be computed a range of tokens at a time, cheaply."""
        return self.prepared[name].by_tokens

    def release(self) -> None:
        """Drop every projection and the input."""
        for prepared in self.prepared.values():
            prepared.release()
        self.prepared.clear()
        self.x = None


def join_streams(streams, name: Callable[["TokenStream"], str], start: int, stop: int,
                 release: Callable[["TokenStream"], bool], total_tokens: int, heads: int,
                 head_dim: int, kept: Optional[dict] = None) -> torch.Tensor:
    """Features `[start, stop)` of projection `name(stream)` of each stream, joined along tokens in order: a new
    `(B, total_tokens, heads, head_dim)` (one stream: as projected); `release(stream)`: release its projection after.
    `kept` (`CallStreams.buffers`): the buffer reused group to group (drop the last first). Prefixes: `prefix_join`."""
    if len(streams) == 1:
        stream = streams[0]
        return stream.rows(name(stream), start, stop, release(stream)).unflatten(-1, (heads, head_dim))
    names = tuple(name(stream) for stream in streams)
    found = None if kept is None else kept.get((names, heads))
    if found is None:
        found = _joined_buffer(streams, names, total_tokens, heads, head_dim, writers=kept is not None)
        if kept is not None:
            kept[(names, heads)] = found
    joined, parts = found
    released = False
    for stream, which, part, writes, write in parts:
        if write is not None:
            write(start, stop)
            if release(stream):
                stream.release_projection(which)
                released = True   # the writer holds the input: the kept entry goes too
        elif writes:
            stream.rows_into(which, part, start, stop, release=release(stream))
        else:
            (part if part.dim() == 3 else part.unsqueeze(0)).copy_(stream.rows(which, start, stop,
                                                                             release(stream)))
    if released:
        kept.pop((names, heads), None)
    return joined


def _joined_buffer(streams, names: tuple, total_tokens: int, heads: int, head_dim: int,
                   writers: bool = False) -> tuple:
    """`(joined, parts)`: a new `(B, total_tokens, heads, head_dim)` buffer and, for each stream, `(stream, its
    projection's name, its rows of the buffer, whether the projection writes into them in one launch, its
    `writer` for them or None)`; rows are `(B, tokens, heads * head_dim)`, or `(tokens, heads * head_dim)` for
    one batch item (a view less a product). `writers`: ask the projections for writers (a buffer kept for the
    next groups; a writer is worked out once for all of them)."""
    first = streams[0]
    batch = first.batch
    joined = torch.empty((batch, total_tokens, heads, head_dim), dtype=first.dtype, device=first.device)
    flat = joined.view(total_tokens, heads * head_dim) if batch == 1 else joined.flatten(2)
    parts, a = [], 0
    for stream, which in zip(streams, names):
        b = a + stream.tokens
        part = flat[a:b] if batch == 1 else flat[:, a:b]
        parts.append((stream, which, part, stream.writes_into(which),
                      stream.prepared[which].writer(part) if writers else None))
        a = b
    return joined, parts


class CallStreams:
    """The streams of one call and its geometry: `heads` query heads, `kv_heads` key/value heads of `head_dim`,
    `batch`, `q_tokens` and `kv_tokens` (each the sum over its streams), and the `device` and `dtype` of the
    inputs (taken at construction: this object keeps no reference to an input).

    Projections by head range, each `(B, tokens, heads of the range, head_dim)` in the inputs' dtype, new tensors
    for the caller; `last=True`: the projections read are released afterwards (the last group that needs them).
    """

    def __init__(self, q_streams: list[TokenStream], kv_streams: list[TokenStream], heads: int, kv_heads: int,
                 head_dim: int):
        self.q_streams, self.kv_streams = q_streams, kv_streams
        self.all_streams = list(dict.fromkeys(q_streams + kv_streams))   # each stream once (self-attention: one)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        x0 = self.all_streams[0].x
        self.batch, self.device, self.dtype = x0.shape[0], x0.device, x0.dtype
        del x0
        self.q_tokens = sum(s.tokens for s in q_streams)
        self.kv_tokens = sum(s.tokens for s in kv_streams)
        # one module for k and v in every key/value stream: each group projects it once (v is a copy of k)
        self.shared_kv = all(s.shared_kv for s in kv_streams)
        # the joined k and v buffers of the groups, reused from one group to the next (`join_streams`' `kept`),
        # where the group loop sets a dict: it hands each group's k and v to nothing that keeps them
        self.buffers: Optional[dict] = None

    def prepare(self, groups: int = 1) -> None:
        """Prepare every stream's projections; the streams drop their inputs. With more than one head group,
        a key/value stream of at most `SHORT_STREAM_SHARE` of the call's key tokens beside others (a text
        stream beside an image's) projects its k and v whole, once, and each group copies its columns: two
        launches less a group where a batched product with a bias takes two (cond + uncond), for at most a few
        hundredths of |x| held through the groups."""
        for stream in self.all_streams:
            short = groups > 1 and len(self.kv_streams) > 1 and stream in self.kv_streams and \
                stream.tokens <= SHORT_STREAM_SHARE * self.kv_tokens
            stream.prepare(whole_kv=short)

    def release(self) -> None:
        """Release every projection and input (the end of the call, or a call that stops early)."""
        self.buffers = None
        for stream in self.all_streams:
            stream.release()

    def project(self, which: str, head_range: range, last: bool) -> torch.Tensor:
        """`which` ("q" or "extra") of the query heads `head_range`, `(B, q tokens, heads of the range, D)`, from
        the query streams that have that projection."""
        d = self.head_dim
        streams = [s for s in self.q_streams if which in s.proj]
        return join_streams(streams, lambda s: which, head_range.start * d, head_range.stop * d, lambda s: last,
                            sum(s.tokens for s in streams), len(head_range), d)

    def project_q_into(self, out: torch.Tensor, groups: list[HeadGroup],
                       on_projected: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """q of every group into its heads of `out` `(B, q tokens, heads, D)`; the q projections are released
        after the last group. `on_projected(q)` sees what was projected, `(B, q tokens, some heads, D)`: all of
        `out` at once, or each group's q before it is copied in and freed (the statistics pass sums its squares).
        Where the projections can, all heads in one product written straight into `out` (no temporary, the GEMM
        at its most efficient)."""
        streams = [s for s in self.q_streams if "q" in s.proj]
        if all(s.by_tokens("q") for s in streams):
            flat, offset, width = out.flatten(2), 0, self.heads * self.head_dim
            for stream in streams:
                stream.rows_into("q", flat[:, offset:offset + stream.tokens], 0, width, release=True)
                offset += stream.tokens
            del flat
            if on_projected is not None:
                on_projected(out)
            return
        for index, group in enumerate(groups):
            q = self.project("q", group.q, last=index == len(groups) - 1)
            if on_projected is not None:
                on_projected(q)
            out[:, :, group.q.start:group.q.stop] = q
            del q

    def project_k(self, group: HeadGroup, last: bool, v_later: bool) -> torch.Tensor:
        """k of a group, `(B, kv tokens, kv heads of the group, D)` (not normalized, no prefix); `v_later`: v of
        this group is projected after k (a stream whose k and v share one module keeps it until then)."""
        d = self.head_dim
        a, b = group.kv.start * d, group.kv.stop * d
        return join_streams(self.kv_streams, lambda s: "k", a, b, lambda s: last and not (s.shared_kv and v_later),
                            self.kv_tokens, len(group.kv), d, self.buffers)

    def project_v(self, group: HeadGroup, last: bool, k_later: bool) -> tuple[Optional[torch.Tensor],
                                                                            torch.Tensor]:
        """`(k, v)` of a group, each `(B, kv tokens, kv heads of the group, D)`, neither normalized nor joined
        with a prefix. With a shared k/v module in every key/value stream (`shared_kv`) it is projected once: k
        is returned and v is an independent copy; otherwise k is None (`project_k`). `k_later`: k of this group
        is projected after v (a stream whose k and v share one module, beside others that do not, keeps that
        module until then)."""
        d, hk = self.head_dim, len(group.kv)
        a, b = group.kv.start * d, group.kv.stop * d
        if self.shared_kv:
            k = join_streams(self.kv_streams, lambda s: "k", a, b, lambda s: last, self.kv_tokens, hk, d)
            return k, k.clone()
        # a stream whose k and v share one module (beside others that do not) projects it twice here
        v = join_streams(self.kv_streams, lambda s: "k" if s.shared_kv else "v", a, b,
                         lambda s: last and not (s.shared_kv and k_later), self.kv_tokens, hk, d, self.buffers)
        return None, v
