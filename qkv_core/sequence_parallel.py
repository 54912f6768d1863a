"""Ulysses sequence parallelism by groups of heads (docs/design.md §2.9).

Each rank of a process group holds a shard of the tokens with every head. Ulysses (DeepSpeed-Ulysses, xFuser's
USP, raylight) turns that into all tokens of `heads / P` heads by one all-to-all of q, k and v, attends, and
turns the result back by a second all-to-all: every rank holds q, k and v of all heads and their exchange
buffers at once. `ulysses_qkv_attention` runs the same exchange one group of heads at a time:

1. a norm that spans heads (Wan's RMSNorm) takes each token's mean of squares over every head first, locally:
   a rank has every head of its own tokens, so the statistics are exact (`statistics.mean_squares`);
2. for each group: v, k and q of the group are projected from their own weight rows for the local tokens,
   written straight into the send buffer of the exchange (rank p's share of the group's heads at row p),
   normalized and rotated there, and exchanged one after the other (each rank gets `heads per group / P`
   heads of all tokens); the backend attends; the result goes back by a second all-to-all into the group's
   heads of the call's output.

Peak per rank: the output, the input, and one group's exchange buffers instead of every head's.

Process group: a `torch.distributed.ProcessGroup`, None for the default group, or xFuser's sequence-parallel
coordinator (`xfuser.core.distributed.get_sp_group()`, raylight's group): its `ulysses_group` is used (ring
degree 1 only), else its `device_group`. Communication is `torch.distributed.all_to_all_single` on it; every
rank must make the same calls with the same shapes (the same number of local tokens: pad the sequence to a
multiple of the world size, as raylight does).

Who frees what: `x_list` is cleared; the call holds the only reference to `x` through its prepared projections
and releases them after the last group. Send and receive buffers are locals deleted as soon as the exchange or
the attention that reads them is done. The result belongs to the caller. Nothing is kept after the call.
"""
from __future__ import annotations

import numbers
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import runtime
from .backends import pay_attention
from .head_split import HeadGroup, SplitPolicy, head_groups
from .statistics import mean_squares
from .streams import CallStreams, TokenStream
from .tally import count_split
from .autograd_guard import refuse_autograd
from .validation import (hand_off, peek_activation, require_projections, validate_backend_name,
                         validate_callables, validate_heads, validate_inputs, validate_layer_input,
                         validate_softmax_scale, validate_split_options, validate_switches, validate_widths)

__all__ = ["ulysses_qkv_attention", "process_group_of", "exchange_group_count", "valid_group_counts"]


def process_group_of(group) -> Optional[dist.ProcessGroup]:
    """The `torch.distributed` process group of `group`: itself, None (the default group), or for xFuser's
    coordinator (`get_sp_group()`) its Ulysses group. A coordinator with a ring degree above 1 is a `ValueError`:
    the grouped exchange is Ulysses only."""
    if not dist.is_available():
        raise ValueError("torch.distributed is not available in this torch build: the exchange needs it")
    process_group = dist.ProcessGroup
    if group is None or isinstance(group, process_group):
        return group
    ring = getattr(group, "ring_world_size", 1)
    if ring is not None and ring > 1:
        raise ValueError(f"the grouped exchange runs Ulysses only, and this sequence-parallel group has a ring degree "
                         f"of {ring}: set ring_degree to 1 (ulysses_degree to the world size), or leave the "
                         f"attention to xFuser")
    for name in ("ulysses_group", "device_group"):
        found = getattr(group, name, None)
        if isinstance(found, process_group):
            return found
    raise ValueError(f"group must be a torch.distributed ProcessGroup, None (the default group) or xFuser's "
                     f"sequence-parallel coordinator (get_sp_group()), not {type(group).__name__}")


def valid_group_counts(heads: int, world: int) -> list[int]:
    """The head group counts a grouped exchange of `heads` heads over `world` ranks can run in: each group's heads
    split evenly over the ranks."""
    if world <= 0 or heads % world:
        return []
    return [g for g in range(1, heads // world + 1) if (heads // world) % g == 0]


def exchange_group_count(heads: int, world: int, tokens: int, level=None,
                         split_floor_tokens: Optional[int] = None, split_heads: Optional[bool] = None,
                         unsliceable: Optional[str] = None, group_scale: Optional[float] = None) -> int:
    """How many head groups the exchange of `tokens` tokens of one item (the whole sequence, all ranks) runs in:
    the call's `head_split.SplitPolicy` (`level`, `split_floor_tokens`, `group_scale`; None: the defaults) for
    `heads / world` exchange units (each group's heads a multiple of the world size), so the level's target
    count is met as closely as the head count allows."""
    policy = SplitPolicy.of_call(level, split_floor_tokens, group_scale)
    return policy.plan(heads // world, tokens, split_heads=split_heads, unsliceable=unsliceable).groups


def _check(heads: int, head_dim: int, kv_heads: Optional[int], world: int, groups: Optional[int],
           o_proj, o_columns: bool, force_attention: Optional[str], softmax_scale, group_scale=None, level=None,
           split_floor_tokens=None, split_heads=None, norm_spans_heads=False, norm_rope=None) -> None:
    """`ValueError`s naming the fix, before any work or communication (the shared ones: `validation`)."""
    validate_heads(heads, head_dim, kv_heads)
    validate_split_options(level, split_floor_tokens, group_scale)
    validate_switches(split_heads=split_heads, norm_spans_heads=norm_spans_heads, o_columns=o_columns)
    validate_callables(norm_rope=norm_rope)
    validate_softmax_scale(softmax_scale)
    validate_backend_name(force_attention)
    if kv_heads is not None and kv_heads != heads:
        raise ValueError(f"the grouped exchange takes as many key/value heads as query heads (got {kv_heads} and "
                         f"{heads}): repeat the key/value heads in the projection, or call qkv_attention per rank")
    if heads % world:
        raise ValueError(f"{heads} heads do not split over a sequence-parallel world of {world} ranks: use a world "
                         f"size (ulysses_degree) that divides {heads}")
    if groups is not None:
        valid = valid_group_counts(heads, world)
        if not _is_count(groups):
            raise ValueError(f"groups is a count of head groups, an int, not {groups!r}: use one of {valid} (or "
                             f"head_split_level)")
        if groups not in valid:
            raise ValueError(f"{groups} head groups of {heads} heads over {world} ranks: a group's heads "
                             f"({heads}/{groups}) must be a multiple of the world size; use one of {valid} "
                             f"(or head_split_level)")
    if o_columns:
        weight = getattr(o_proj, "weight", None)
        if not torch.is_tensor(weight) or weight.dim() != 2 or weight.shape[1] != heads * head_dim:
            raise ValueError(f"o_columns=True needs o_proj with a weight (out_features, {heads * head_dim}) "
                             f"(a torch.nn.Linear); pass o_columns=False to apply o_proj after the groups")
    if o_proj is not None and not callable(o_proj) and not o_columns:
        raise ValueError("o_proj must be callable (a torch.nn.Linear or any module taking (batch, tokens, "
                         "heads * head_dim)), or None to get the attention itself")
    if softmax_scale is not None and force_attention != "sdpa":
        raise ValueError("softmax_scale is only taken with force_attention='sdpa'")


def _is_count(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _send_views(buffer: torch.Tensor) -> list[torch.Tensor]:
    """Each rank's part of an exchange buffer `(P, n, B, heads, D)` as `(B, n, heads, D)` views."""
    return [buffer[p].transpose(0, 1) for p in range(buffer.shape[0])]


class _Exchange:
    """`all_to_all_single` over one process group of buffers `(P, ...)`: part p goes to rank p, and the part
    received from rank p lands at p. A world of one hands the buffer back."""

    def __init__(self, group: Optional[dist.ProcessGroup], world: int):
        self.group, self.world = group, world

    def __call__(self, send_list: list) -> torch.Tensor:
        """The exchanged buffer (new); `send_list` `[buffer]` is cleared, the buffer freed once sent."""
        send = send_list.pop()
        if self.world == 1:
            return send
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        del send
        return received


@torch.compiler.disable
def ulysses_qkv_attention(x_list, q_proj, k_proj, v_proj, heads: int, head_dim: int,
                          norm_rope: Optional[Callable] = None, *, group=None, o_proj=None, o_columns: bool = False,
                          norm_spans_heads: bool = False, kv_heads: Optional[int] = None,
                          head_split_level=None, groups: Optional[int] = None,
                          split_floor_tokens: Optional[int] = None, split_heads: Optional[bool] = None,
                          head_split_group_scale: Optional[float] = None, force_attention: Optional[str] = None,
                          softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Self-attention of a rank's shard of the tokens, sequence-parallel over `group` (Ulysses), by head groups.

    Parameters
    ----------
    x_list : list
        `[x]`, `x` `(batch, n, features)` or `(n, features)`, floating point: this rank's `n` tokens (rank r
        holds tokens `[r * n, (r + 1) * n)` of the sequence; every rank the same `n`). Once every argument is
        checked the list is cleared (a refused call leaves it as it was); the call releases `x` after the last
        group's projections.
    q_proj, k_proj, v_proj : torch.nn.Linear, RowProjection or callable
        Each `features -> heads * head_dim`; Linears and `RowProjection`s are computed by the rows of a group's
        heads, any other callable runs whole once and is sliced.
    heads, head_dim : int
        Query (and key/value) heads and their width. `heads` must be a multiple of the world size.
    norm_rope : callable, optional
        `norm_rope(query, key, group)` as for `qkv_attention`: normalizes and rotates in place tensors
        `(batch, n, heads of the part, head_dim)` of this rank's tokens (its RoPE table already sliced to them);
        `group` is a `HeadGroup` whose `q` and `kv` ranges name the heads handed over (one rank's share of a head
        group) and, with `norm_spans_heads`, whose `mean_squares` hold every token's statistics over all heads.
    group : torch.distributed.ProcessGroup, xFuser coordinator or None
        The sequence-parallel group (None: the default group). xFuser's `get_sp_group()` gives its Ulysses group;
        a ring degree above 1 is refused.
    o_proj : callable, optional
        The output projection. None: the attention `(batch, n, heads, head_dim)` is returned. Otherwise
        `(batch, n, out_features)`: by default applied after the groups by token chunks, in the attention's own
        storage when `out_features == heads * head_dim` (exact, one product per chunk); with `o_columns=True`
        each group's share (its columns of the weight, a `torch.nn.Linear`'s) is added into the output as the
        group comes back, so no buffer of every head's attention exists (16-bit outputs round once per group).
    norm_spans_heads : bool
        The norm spans all heads (Wan): each token's mean of squares over every head of q and of k, float32
        `(batch, n, 1)`, is computed before any exchange (exact: a rank has all heads of its tokens).
    kv_heads : int, optional
        Must equal `heads` (grouped-query attention is not exchanged here).
    head_split_level, split_floor_tokens, split_heads, head_split_group_scale : optional
        As for `qkv_attention`; the count comes from the call's `head_split.SplitPolicy` for `heads / world`
        exchange units and the whole sequence (`world * n` tokens an item), so each group's heads split evenly over the ranks.
    groups : int, optional
        An explicit group count instead (one of `valid_group_counts(heads, world)`); 1 is Ulysses' single
        exchange of every head.
    force_attention, softmax_scale :
        The backend (`pay_attention`) of each group's attention; `softmax_scale` with `"sdpa"` only.

    Returns
    -------
    torch.Tensor
        `(batch, n, heads, head_dim)` or `(batch, n, out_features)` in `x`'s dtype, for this rank's tokens.

    Raises
    ------
    ValueError
        Before any work or communication, and before `x_list` is cleared (the message names the argument and
        the fix): heads or head_dim not a positive int, heads not divisible by the world size, a group count
        that is not an int or whose groups do not split over the ranks, a level, split floor or group scale of
        the wrong type or value, grouped-query heads, an xFuser group with a ring degree, `x` not a
        floating-point 2-D or 3-D tensor with tokens, `x`'s features not the projections' ``in_features``, a
        plain ``torch.nn.Linear`` (q, k, v or o) of another dtype or device than `x`, an `o_proj` that
        `o_columns` cannot slice or whose ``in_features`` are not ``heads * head_dim``, an unknown backend, a
        `softmax_scale` that is not a number, a `norm_rope` that is not callable, inputs requiring grad in grad
        mode.
    """
    if torch.is_grad_enabled():
        refuse_autograd("ulysses_qkv_attention", [("x", x_list), ("the q projection", q_proj),
                                                  ("the k projection", k_proj), ("the v projection", v_proj),
                                                  ("the o projection", o_proj), ("norm_rope", norm_rope)])
    require_projections(q_proj=q_proj, k_proj=k_proj, v_proj=v_proj)
    pg = process_group_of(group)
    world = dist.get_world_size(pg)
    rank = dist.get_rank(pg)
    _check(heads, head_dim, kv_heads, world, groups, o_proj, o_columns, force_attention, softmax_scale,
           head_split_group_scale, head_split_level, split_floor_tokens, split_heads, norm_spans_heads, norm_rope)
    x = peek_activation(x_list, "x_list")
    if x.shape[-1] == 0 or x.shape[1] == 0:
        raise ValueError(f"x: expected tokens and features, got {tuple(x.shape)}")
    source = TokenStream(x, q=q_proj, k=k_proj, v=v_proj)
    streams = CallStreams([source], [source], heads, heads, head_dim)
    validate_widths(streams)
    validate_inputs(streams)
    if o_proj is not None and not o_columns:   # applied to the attention, (batch, n, heads * head_dim)
        validate_layer_input("the attention", x, "o", o_proj, heads * head_dim)
    del x
    hand_off(x_list)   # every check done: the call holds the only reference from here
    batch, n, d = streams.batch, streams.q_tokens, head_dim
    total = world * n
    if groups is None:
        unsliceable = next((r for p in source.proj.values() for r in [p.not_row_sliceable()] if r is not None), None)
        groups = exchange_group_count(heads, world, total, head_split_level, split_floor_tokens, split_heads,
                                      unsliceable, head_split_group_scale)
    plan = head_groups(heads, heads, groups)
    count_split(groups, batch * total)
    exchange = _Exchange(pg, world)
    part = heads // groups // world   # heads of one group on one rank after the exchange
    try:
        streams.prepare(groups)
        # every head's attention comes back into this buffer, unless each group's share of o_proj is added as it
        # comes (o_columns); a spanning norm's statistics pass projects q of every head into it on the way
        result = None if o_columns else torch.empty((batch, n, heads, d), dtype=streams.dtype, device=streams.device)
        stats = None
        if norm_spans_heads:
            stats = mean_squares(streams, plan, None, None, result, {}, runtime.STATS_CHUNK_MULTIPLE)
        q_in_result = norm_spans_heads and result is not None
        out = None
        if o_columns:
            out = _columns_output(o_proj, batch, n, streams)
        for index, g in enumerate(plan):
            last = index == len(plan) - 1
            parts = [range(g.q.start + p * part, g.q.start + (p + 1) * part) for p in range(world)]

            def exchanged(which: str) -> torch.Tensor:
                """The group's `which` for this rank's tokens, written into the send buffer by rank parts,
                normalized there; then exchanged: `(P, n, B, part, D)`, part p from rank p's tokens."""
                send = torch.empty((world, n, batch, part, d), dtype=streams.dtype, device=streams.device)
                for heads_p, view in zip(parts, _send_views(send)):
                    flat = view.flatten(2)
                    if which == "q" and q_in_result:
                        view.copy_(result[:, :, heads_p.start:heads_p.stop])
                    else:
                        source.rows_into(which, flat, heads_p.start * d, heads_p.stop * d)
                    if norm_rope is not None and which != "v":
                        hg = HeadGroup(heads_p, heads_p, stats)
                        norm_rope(view if which == "q" else None, view if which == "k" else None, hg)
                    del flat, view
                if last and not (which == "q" and q_in_result):
                    source.release_projection(which)
                send_list = [send]
                del send
                return exchange(send_list)

            values = exchanged("v")
            keys = exchanged("k")
            queries = exchanged("q")
            attended = pay_attention(_sequence(queries), _sequence(keys), _sequence(values),
                                     force_attention=force_attention, softmax_scale=softmax_scale)
            del keys, values
            # the result goes back from q's buffer (q is spent): part p to rank p, its tokens
            queries.view(total, batch, part, d).copy_(attended.transpose(0, 1))
            del attended
            back_list = [queries]
            del queries
            back = exchange(back_list)   # (P, n, B, part, D): this rank's tokens, rank p's share of the group
            if out is None:
                result[:, :, g.q.start:g.q.stop].view(batch, n, world, part, d).copy_(back.permute(2, 1, 0, 3, 4))
            else:
                _add_columns_(out, o_proj, back, parts, d)
            del back
        if out is not None:
            return out
        if o_proj is None:
            return result
        result_list = [result]
        del result
        return _project_by_tokens(o_proj, result_list)
    finally:
        streams.release()


def _sequence(buffer: torch.Tensor) -> torch.Tensor:
    """An exchanged buffer `(P, n, B, part, D)` as the whole sequence `(B, P * n, part, D)` (a view)."""
    world, n, batch = buffer.shape[:3]
    return buffer.view(world * n, batch, *buffer.shape[3:]).transpose(0, 1)


def _columns_output(o_proj, batch: int, n: int, streams: CallStreams) -> torch.Tensor:
    """The `o_columns` output `(B, n, out_features)`, holding the bias (or zeros) before the groups add in."""
    weight, bias = o_proj.weight, getattr(o_proj, "bias", None)
    out = torch.empty((batch, n, weight.shape[0]), dtype=streams.dtype, device=streams.device)
    if bias is None:
        out.zero_()
    else:
        out.copy_(bias.to(out.dtype).expand_as(out))
    return out


def _add_columns_(out: torch.Tensor, o_proj, back: torch.Tensor, parts: list, d: int) -> None:
    """`out` += each rank part's attention `back[p]` `(n, B, part, D)` times its columns of `o_proj.weight`."""
    weight = o_proj.weight
    for p, heads_p in enumerate(parts):
        columns = weight[:, heads_p.start * d:heads_p.stop * d].to(out.dtype).t()
        for b in range(out.shape[0]):
            out[b].addmm_(back[p][:, b].flatten(1), columns)
        del columns


def _project_by_tokens(o_proj, result_list: list) -> torch.Tensor:
    """`o_proj` of `[result]` `(B, n, heads, D)` (list cleared) by token chunks of about an eighth of it: into its
    own storage when the width is kept (each token's output depends on that token only), else a new tensor."""
    result = result_list.pop()
    flat = result.flatten(2)
    batch, n, width = flat.shape
    step = max(1, n // 8)
    out = None
    for a in range(0, n, step):
        b = min(a + step, n)
        chunk = o_proj(flat[:, a:b])
        if out is None:
            out = flat if chunk.shape[-1] == width and chunk.dtype == flat.dtype else \
                flat.new_empty((batch, n, chunk.shape[-1]), dtype=chunk.dtype)
        out[:, a:b] = chunk
        del chunk
    return out
