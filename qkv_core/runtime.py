"""The calls: q/k/v projection and attention by groups of heads (docs/design.md §2.1-2.3, §2.8).

Hand-off: every tensor-taking entry point takes its tensors inside lists that it clears, so the runtime
holds the only references and frees each input as soon as the projections no longer need it. Nothing is
kept after a call returns.

Inference only: under grad mode, every entry point refuses an input, a projection's weight, a prefix or a mask
that requires grad with a `ValueError` naming the fix (`autograd_guard.refuse_autograd`: `torch.no_grad()`,
`torch.inference_mode()`, or the model's own attention for training); one `torch.is_grad_enabled()` otherwise.

Layout: activations `(batch, tokens, features)` (or `(tokens, features)`, taken as batch 1); q/k/v of a
head group `(batch, tokens, heads_of_group, head_dim)`; the result `(batch, tokens, heads, head_dim)`.

The units of a call (docs/dev/runtime-structure.md): `validation` (checks, `ValueError`s naming the fix),
`streams` (token streams and their projections by head range), `head_split.SplitPolicy` (how many groups),
`statistics` (per-token mean squares for a norm that spans heads), `prefix_join` (a prefix joined before a
group's keys/values) and `group_loop` (each group's projection and attention, plain or staged). `_Call` below
composes them; this module keeps the public calls and the runtime's token-count constants (`bench.py` scales
them for CPU runs, so they are read from here at every call).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Optional

import torch

from .backends import AttentionBackend, SDPABackend, StagedCore, resolve_backend
from . import inplace_attention
from .group_loop import GroupLoop
# OVER_QUERIES_GROUP_SCALE: tests and benchmarks read it beside OVER_QUERIES_MAX_TOKENS
from .head_split import OVER_QUERIES_GROUP_SCALE, HeadGroup, SplitPolicy, head_groups   # noqa: F401
from .notices import UNSPLIT, Notice, notice_once
from .tally import count_attention, count_split
from .options import AttentionOptions
from .capture import KVCapture
from .prefix_join import prefix_tokens, resolve_prefix
from .input_reuse import reuse_reason, run_in_input
from .statistics import mean_squares
from .streams import CallStreams, TokenStream
from .autograd_guard import refuse_autograd
from .validation import (hand_off, peek_activation, require_projections, unpack_stream,
                         validate_call, validate_extras, validate_kv_first, validate_mask,
                         validate_native_prefix_core, validate_prefix)

ROWS_CHUNK_ELEMENTS = 1 << 23
ROWS_MIN_CHUNK_ELEMENTS = 1 << 16
STATS_CHUNK_MULTIPLE = 256   # token chunks of the full-width statistics pass: whole tiles of 256 rows
# A split SDPA call of at most this many tokens an item attends each group with `inplace_attention` (its result
# written over its queries in the output buffer): no result transient and no copy a group, and one launch
# where cuDNN's attention takes three. Short calls are bound by the host's launches, so the kernel's slower GPU
# time is hidden; longer calls are bound by the GPU and keep SDPA (docs/benchmarks.md#split-floors).
OVER_QUERIES_MAX_TOKENS = 12288


def attends_over_queries(backend: AttentionBackend, tokens: int, device: torch.device, dtype: torch.dtype,
                         heads: int, kv_heads: int, head_dim: int) -> bool:
    """Does a split call on `backend` without a staged core, a caller's attention function, a mask or input reuse
    attend its groups over their queries (its `SplitPolicy.plan(..., over_queries=True)`)? SDPA, at most
    `OVER_QUERIES_MAX_TOKENS` tokens of one item (the longer sequence), where the kernel takes the device, dtype
    and geometry (CUDA with Triton, 16-bit, head dim 128). The planner asks it too."""
    return isinstance(backend, SDPABackend) and tokens <= OVER_QUERIES_MAX_TOKENS and \
        inplace_attention.declines(device, dtype, heads, kv_heads, head_dim) is None


def rows_(tensor: torch.Tensor, fn: Callable, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
    """Apply a per-token function (a norm, a RoPE) in place, by chunks of tokens, with bounded scratch.

    Sets ``tensor[:, a:b] = fn(tensor[:, a:b], a, b)`` for consecutive chunks ``[a, b)`` of ``[start, stop)``.
    A chunk holds at most 2^23 elements and at most a quarter of the range (at least 2^16 elements), so the
    scratch `fn` makes stays small next to the tensor whatever its size.

    Parameters
    ----------
    tensor : torch.Tensor
        ``(batch, tokens, ...)``, any dtype and device; changed in place.
    fn : callable
        ``fn(part, a, b)`` with `part` the view ``tensor[:, a:b]``. It may change `part` in place and return it
        (or None), or return a new tensor of `part`'s shape, which is copied back and dropped.
    start, stop : int, optional
        The token range (default: every token).

    Returns
    -------
    torch.Tensor
        `tensor` itself.
    """
    stop = tensor.shape[1] if stop is None else stop
    per_token = max(1, tensor[:, :1].numel())
    budget = min(ROWS_CHUNK_ELEMENTS, max(ROWS_MIN_CHUNK_ELEMENTS, (stop - start) * per_token // 4))
    step = max(1, budget // per_token)
    for a in range(start, stop, step):
        b = min(a + step, stop)
        part = tensor[:, a:b]
        result = fn(part, a, b)
        if result is not None and result is not part:
            part.copy_(result)
        del part, result
    return tensor


class _Call:
    """One call, from the hand-off to the return. Made from the inputs still in the caller's lists, it checks
    every argument (validation.py) and chooses the backend; the entry point clears the lists only then. `run`
    plans the head groups (its `head_split.SplitPolicy`, the one place that decides their count), runs the
    statistics pass when a norm spans heads (statistics.py) and the group loop (group_loop.py). Whatever happens, every
    projection and input is released and the kept keys are dropped before it returns: nothing is kept."""

    def __init__(self, q_streams: list[TokenStream], kv_streams: list[TokenStream], heads: int, head_dim: int,
                 norm_rope: Optional[Callable], options: dict):
        o = AttentionOptions.from_kwargs(options)
        self.o, self.norm_rope = o, norm_rope
        self.streams = CallStreams(q_streams, kv_streams, heads, heads if o.kv_heads is None else o.kv_heads,
                                   head_dim)
        self.backend: Optional[AttentionBackend] = None   # chosen by `staged_core()` (None with attention_fn)
        self._staged: Optional[StagedCore] = None
        self._backend_chosen = False
        validate_call(o, self.streams, norm_rope)
        o.kv_prefix = resolve_prefix(o.kv_prefix)
        s = self.streams
        validate_prefix(o, s.kv_heads, head_dim, s.batch)
        mask_shape = None if o.attention_fn is not None else \
            (s.batch, s.heads, s.q_tokens, prefix_tokens(o.kv_prefix) + s.kv_tokens)
        validate_mask(o.attention_mask, self.staged_core, mask_shape, s.dtype, s.device)
        validate_native_prefix_core(o.kv_prefix, self.staged_core())   # chooses the backend (run asks it again)

    def staged_core(self) -> Optional[StagedCore]:
        """The chosen backend's staged core, or None (a plain backend, or an `attention_fn`). Chooses the backend
        at the first call, for the call's shapes, dtype, device, tensor mask, scale and `force_attention`."""
        if not self._backend_chosen:
            self._backend_chosen = True
            if self.o.attention_fn is None:
                s = self.streams
                kv_tokens = prefix_tokens(self.o.kv_prefix) + s.kv_tokens
                spec = SimpleNamespace(shape=(s.batch, s.q_tokens, s.heads, s.head_dim), dtype=s.dtype,
                                       device=s.device)
                kv_spec = SimpleNamespace(shape=(s.batch, kv_tokens, s.kv_heads, s.head_dim), dtype=s.dtype,
                                          device=s.device)
                mask = self.o.attention_mask
                tensor_mask = mask if torch.is_tensor(mask) else None
                self.backend = resolve_backend(spec, kv_spec, kv_spec, tensor_mask, self.o.softmax_scale,
                                               self.o.force_attention)
                self._staged = self.backend.staged_core
        return self._staged

    def over_queries(self) -> bool:
        """Will a split of this call attend its groups over their queries (`inplace_attention`)? A plain SDPA
        call (no caller's attention function, no tensor or callable mask) of at most
        `OVER_QUERIES_MAX_TOKENS` tokens an item that the kernel takes (CUDA with Triton, 16-bit, head dim
        128)."""
        o, s = self.o, self.streams
        if self.staged_core() is not None or o.attention_fn is not None or o.attention_mask is not None or \
                o.reuse_input:
            return False
        return attends_over_queries(self.backend, max(s.q_tokens, s.kv_tokens), s.device, s.dtype, s.heads,
                                    s.kv_heads, s.head_dim)

    @property
    def policy(self) -> SplitPolicy:
        """The call's split policy, from its options `head_split_level` and `split_floor_tokens`."""
        return SplitPolicy.of_call(self.o.head_split_level, self.o.split_floor_tokens, self.o.head_split_group_scale)

    def plan_groups(self, over_queries: bool = False) -> list[HeadGroup]:
        """The call's groups of heads, their count from its `SplitPolicy` (the longer of the q and kv sequences, of
        one batch item: cond and uncond batched together are no longer a sequence; `over_queries`: its groups are
        attended over their queries). A projection that cannot be computed by rows, in a stream long enough to be
        split, keeps the call in one group (said once); a short stream's is projected whole and sliced."""
        o, s = self.o, self.streams
        policy = self.policy
        unsliceable = next(((name, reason) for source in s.all_streams if policy.projects_by_rows(source.tokens)
                            for name, proj in source.proj.items()   # short streams: projected whole, sliced
                            for reason in [proj.not_row_sliceable()] if reason is not None), None)
        plan = policy.plan(s.kv_heads, max(s.q_tokens, s.kv_tokens), split_heads=o.split_heads,
                           unsliceable=None if unsliceable is None else unsliceable[1], over_queries=over_queries)
        if unsliceable is not None and plan.reason == unsliceable[1]:
            name, reason = unsliceable
            notice_once(f"unsplit:{reason}", Notice(UNSPLIT, f"the {name} projection", reason,
                                                    f"[Attention] Head Split is not applied: the {name} projection "
                                                    f"cannot be computed by rows ({reason})"))
        return head_groups(s.heads, s.kv_heads, plan.groups)

    def run(self) -> torch.Tensor:
        """The output `(B, q tokens, heads, head_dim)` in the inputs' dtype."""
        o, s = self.o, self.streams
        staged = self.staged_core()
        over_queries = self.over_queries()
        groups = self.plan_groups(over_queries)
        over_queries = over_queries and len(groups) > 1   # one group returns the attention's own result
        kept_keys: dict[int, torch.Tensor] = {}   # k of the first groups, from the statistics pass
        count_split(len(groups), s.batch * max(s.q_tokens, s.kv_tokens))
        if staged is not None:   # plain backends count themselves in pay_attention, a caller's function its own
            count_attention(f"{self.backend.name} (staged)", len(groups))
        elif o.attention_fn is not None and not getattr(o.attention_fn, "counts_itself", False):
            count_attention("the caller's attention function", len(groups))
        try:
            given_up = s.q_streams[0].x if o.reuse_input else None   # before `prepare` drops the stream's own
            s.prepare(len(groups))
            if given_up is not None:
                reused = self._run_in_input(given_up, groups, staged)
                del given_up   # the prepared projections hold the input from here on, as in any call
                if reused is not None:
                    return reused
            capture = None if o.capture_kv is None else \
                KVCapture(o.capture_kv, s.batch, s.kv_heads, s.head_dim, s.dtype, s.device)
            loop = GroupLoop(s, o, self.norm_rope, self.backend, kept_keys, capture, over_queries)
            # one group, not staged: the attention's own result is returned (no buffer beside it, no copy)
            single = len(groups) == 1 and staged is None
            out = None if single else loop.empty_output()
            # Split: every group's q is projected first, into the output buffer (each group's attention then
            # overwrites its own q; a staged core quantizes it first), so q costs no memory of its own and is
            # projected once, also when a spanning norm needs its statistics before any group can be normalized.
            q_in_out = len(groups) > 1
            if o.norm_spans_heads and len(groups) > 1:
                # kept keys would sit beside a staged call's small quantized groups and set its peak: a staged
                # call projects k twice
                keep_keys = None if staged is not None else o.keep_keys
                q_ms, k_ms = mean_squares(s, groups, o.norm_stats, keep_keys, out if q_in_out else None,
                                          kept_keys, STATS_CHUNK_MULTIPLE)
                groups = [g._replace(mean_squares=(q_ms, k_ms)) for g in groups]
                del q_ms, k_ms
            elif q_in_out:
                s.project_q_into(out, groups)
            out = loop.run(groups, out, staged, q_in_out)
            if capture is not None:   # a staged core that keeps native prefixes stores it in its own layout
                capture.store(kit=staged if hasattr(staged, "cache_native_prefix") else None)
            return out
        finally:
            kept_keys.clear()
            s.release()

    def _run_in_input(self, x: torch.Tensor, groups: list[HeadGroup],
                      staged: Optional[StagedCore]) -> Optional[torch.Tensor]:
        """The call in its input `x`'s storage (`input_reuse`; the streams prepared), or None where that does
        not apply (nothing done: the usual path runs)."""
        o, s = self.o, self.streams
        settings = None
        if staged is not None and len(groups) > 1:
            settings = staged.settings((s.batch, s.q_tokens, len(groups[0].q), s.head_dim),
                                       (s.batch, s.kv_tokens, len(groups[0].kv), s.head_dim), s.dtype, s.device,
                                       o.softmax_scale)
        if self.norm_rope is None or reuse_reason(x, o, s, staged, groups, settings) is not None:
            return None
        return run_in_input(x, s, groups, o, self.norm_rope, staged, settings, STATS_CHUNK_MULTIPLE)


PROJECTION_NAMES = ("q", "k", "v", "extra")


def _option_parts(options: dict) -> list:
    """The options `refuse_autograd` looks at: what a call attends beside its own tokens (a prefix, a mask)."""
    return [(name, options.get(name)) for name in ("kv_prefix", "attention_mask")]


def _stream_parts(streams) -> list:
    """`joint_qkv_attention`'s streams as `refuse_autograd` names them ("stream 1 x", "stream 1's k projection");
    a stream of another form is looked at whole (`unpack_stream` refuses it after)."""
    parts = []
    for number, stream in enumerate(streams):
        try:
            x_list, projections = stream
            parts.append((f"stream {number} x", x_list))
            parts += [(f"stream {number}'s {name} projection", proj) for name, proj in zip(PROJECTION_NAMES,
                                                                                           projections)]
        except (TypeError, ValueError):
            parts.append((f"stream {number}", stream))
    return parts


@torch.compiler.disable
def qkv_attention(x_list, q_proj, k_proj, v_proj, heads: int, head_dim: int, norm_rope=None, extra_proj=None,
                  **options) -> torch.Tensor:
    """Self-attention of `x`: q, k and v projected and attended a group of heads at a time.

    Parameters
    ----------
    x_list : list
        ``[x]``, `x` ``(batch, tokens, features)`` or ``(tokens, features)`` (batch 1), float16, bfloat16 or
        float32. Once every argument is checked the call clears the list (a refused call leaves it as it was)
        and then holds the only reference it needs: it frees `x` as soon as the projections no longer need it,
        so the caller keeps no other reference if it wants that memory back.
    q_proj, k_proj, v_proj : torch.nn.Linear, RowProjection or callable
        The projections (docs/design.md §2.1): q gives ``heads * head_dim`` features, k and v
        ``kv_heads * head_dim``. A callable that is neither runs whole once and is sliced.
    heads, head_dim : int
        Query heads and the channels of each.
    norm_rope : callable, optional
        ``norm_rope(query, key, group)``: normalizes and rotates in place the tensors it is given (either may be
        None), each ``(batch, tokens, heads of the group, head_dim)``; `group` is a `HeadGroup`.
    extra_proj : optional
        A fourth projection (e.g. a gate), cut by head group like q and handed to ``attention_fn``.
    **options
        The fields of `AttentionOptions`.

    Returns
    -------
    torch.Tensor
        ``(batch, tokens, heads, head_dim)`` in `x`'s dtype, on its device: a new tensor the caller owns (with
        ``reuse_input``, a view of `x`'s storage). Nothing else the call allocated outlives it.

    Raises
    ------
    TypeError
        An unknown option.
    ValueError
        Before any work and before `x_list` is cleared (the message names the argument and the fix): `x_list`
        is not a one-element list of a floating-point 2-D or 3-D tensor, `heads`, `head_dim` or `kv_heads` is
        not a positive int, a projection is None, not callable or of the wrong width, `x`'s features are not a
        Linear's ``in_features``, a plain ``torch.nn.Linear`` of another dtype or device than `x`, a hook that is
        not callable, an option of the wrong type or value or a bad combination of options, a `kv_prefix` of
        the wrong shape, an `attention_mask` that is not boolean or float, on another device, or does not
        broadcast to ``(batch, heads, tokens, prefix + kv tokens)``, or, with grad mode on, an input, a weight, a
        prefix or a mask that requires grad (inference only).
    """
    if torch.is_grad_enabled():
        refuse_autograd("qkv_attention", [("x", x_list), ("the q projection", q_proj), ("the k projection", k_proj),
                                          ("the v projection", v_proj), ("the extra projection", extra_proj),
                                          ("norm_rope", norm_rope), *_option_parts(options)])
    require_projections(q_proj=q_proj, k_proj=k_proj, v_proj=v_proj)
    x = peek_activation(x_list, "x_list")
    source = TokenStream(x, q=q_proj, k=k_proj, v=v_proj, extra=extra_proj)
    del x
    call = _Call([source], [source], heads, head_dim, norm_rope, options)   # every check, the list untouched
    hand_off(x_list)
    return call.run()


@torch.compiler.disable
def joint_qkv_attention(streams, heads: int, head_dim: int, norm_rope=None, **options) -> torch.Tensor:
    """Joint attention (MMDiT): several token streams projected, joined along the tokens in their order and
    attended as one sequence.

    Parameters
    ----------
    streams : list
        ``[(x_list, (q_proj, k_proj, v_proj[, extra_proj])), ...]``, at least one. Each `x_list` is ``[x]``,
        `x` ``(batch, tokens of the stream, features)`` (one batch size and one dtype for all streams), and is
        cleared by the call, which frees each input once projected (as in `qkv_attention`). Either every
        stream carries an `extra_proj` or none does.
    heads, head_dim : int
        Query heads and the channels of each.
    norm_rope : callable, optional
        As in `qkv_attention`; it sees the joined tensors (each stream's tokens at its offset).
    **options
        The fields of `AttentionOptions`.

    Returns
    -------
    torch.Tensor
        ``(batch, sum of the streams' tokens, heads, head_dim)`` in the inputs' dtype: a new tensor the caller
        owns.

    Raises
    ------
    TypeError
        An unknown option.
    ValueError
        No stream, a stream of another form, streams of different batch sizes, dtypes or devices, and
        everything `qkv_attention` refuses; before any list is cleared.
    """
    if not streams:
        raise ValueError("joint_qkv_attention needs at least one stream")
    if torch.is_grad_enabled():
        refuse_autograd("joint_qkv_attention", [*_stream_parts(streams), ("norm_rope", norm_rope),
                                                *_option_parts(options)])
    sources, x_lists = [], []
    for number, stream in enumerate(streams):
        x_list, (q_proj, k_proj, v_proj, extra_proj) = unpack_stream(number, stream)
        sources.append(TokenStream(peek_activation(x_list, f"stream {number} x_list"), f"stream {number} x",
                                   q=q_proj, k=k_proj, v=v_proj, extra=extra_proj))
        x_lists.append(x_list)
    validate_extras(sources)
    call = _Call(sources, sources, heads, head_dim, norm_rope, options)   # every check, the lists untouched
    hand_off(*x_lists)
    return call.run()


@torch.compiler.disable
def cross_qkv_attention(x_list, context_list, q_proj, k_proj, v_proj, heads: int, head_dim: int, norm_rope=None,
                        **options) -> torch.Tensor:
    """Cross-attention: queries projected from `x`, keys and values from `context`.

    Parameters
    ----------
    x_list, context_list : list
        ``[x]``, ``[context]``: `x` ``(batch, tokens, features)``, `context` ``(batch or 1, context tokens,
        context features)`` in `x`'s dtype (a batch of 1 serves every item). Once every argument is checked both
        lists are cleared and each input is freed once projected (as in `qkv_attention`).
    q_proj : torch.nn.Linear, RowProjection or callable
        Projects `x` to ``heads * head_dim`` features.
    k_proj, v_proj : torch.nn.Linear, RowProjection or callable
        Project `context` to ``kv_heads * head_dim`` features.
    heads, head_dim : int
        Query heads and the channels of each.
    norm_rope : callable, optional
        As in `qkv_attention` (query from `x`, key from `context`).
    **options
        The fields of `AttentionOptions`. The longer of the two sequences decides the head split.

    Returns
    -------
    torch.Tensor
        ``(batch, tokens of x, heads, head_dim)`` in `x`'s dtype: a new tensor the caller owns.

    Raises
    ------
    TypeError
        An unknown option.
    ValueError
        As `qkv_attention` (for `x` and `context` each), before either list is cleared.
    """
    if torch.is_grad_enabled():
        refuse_autograd("cross_qkv_attention", [("x", x_list), ("context", context_list),
                                                ("the q projection", q_proj), ("the k projection", k_proj),
                                                ("the v projection", v_proj), ("norm_rope", norm_rope),
                                                *_option_parts(options)])
    require_projections(q_proj=q_proj, k_proj=k_proj, v_proj=v_proj)
    x = peek_activation(x_list, "x_list")
    context = peek_activation(context_list, "context_list")
    if context.shape[0] != x.shape[0] and context.shape[0] == 1:
        context = context.expand(x.shape[0], -1, -1)
    q_source = TokenStream(x, q=q_proj)
    kv_source = TokenStream(context, "context", k=k_proj, v=v_proj)
    del x, context
    call = _Call([q_source], [kv_source], heads, head_dim, norm_rope, options)   # every check, the lists untouched
    hand_off(x_list, context_list)
    return call.run()


@torch.compiler.disable
def kv_first_attention(qkv_list, force_attention: Optional[str] = None) -> torch.Tensor:
    """Attention of q, k and v a model already holds, with k freed before v is quantized where it can be.

    With a staged SageAttention core k is quantized and released before v is quantized (the peak drops by
    half of k); otherwise the backend's plain call. The results are the same either way.

    Parameters
    ----------
    qkv_list : list
        ``[q, k, v]``: q ``(batch, q tokens, heads, head_dim)``, k and v ``(batch, kv tokens, kv heads,
        head_dim)``, 16-bit or float32, one dtype and device. Once they are checked the call clears the list
        (a refused call leaves it as it was) and frees each tensor once it is used.
    force_attention : str, optional
        A backend name (`backend_names`) instead of the automatic choice.

    Returns
    -------
    torch.Tensor
        ``(batch, q tokens, heads, head_dim)`` in q's dtype: a new tensor the caller owns.

    Raises
    ------
    ValueError
        Before the list is cleared: `qkv_list` is not a three-element list of floating-point 4-D tensors of
        matching shapes, one dtype and one device, an unknown backend name, or, with grad mode on, a tensor
        that requires grad.
    """
    if torch.is_grad_enabled():
        parts = zip("qkv", qkv_list) if isinstance(qkv_list, list) and len(qkv_list) == 3 else [("qkv_list", qkv_list)]
        refuse_autograd("kv_first_attention", list(parts))
    validate_kv_first(qkv_list, force_attention)
    q, k, v = qkv_list
    hand_off(qkv_list)
    backend = resolve_backend(q, k, v, None, None, force_attention)
    core = backend.staged_core
    count_attention(backend.name if core is None else f"{backend.name} (staged)")
    if core is None:
        result = backend.attend(q, k, v)
        del q, k, v
        return result
    settings = core.settings(tuple(q.shape), tuple(k.shape), q.dtype, q.device)
    quantized_k = core.staged_quantize_k([k], settings)
    del k
    quantized_v = core.staged_quantize_v([v], settings)
    del v
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    quantized_q = core.staged_quantize_q([q], settings)
    del q
    core.staged_attention(out, (quantized_q, quantized_k, quantized_v), settings)
    return out
