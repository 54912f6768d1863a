"""The norm and RoPE hooks the runtime calls on each head group's q and k (`norm_rope(query, key, group)`), for the
attention forms of `nodes/attention.py`: `PerHeadNormRope` for norms over each head's channels (any head group runs
the module's own norm), `SpanningNormRope` for an RMSNorm over all heads (exact per group through the per-token
statistics the runtime computes first); both rotate by the form's RoPE (`rope.py`'s kinds), by fused Triton
passes on CUDA where they apply, else by bounded token chunks of PyTorch ops (`rope.rotate_rows`).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from ..qkv_core import kernels, rows_
from .comfy_ops import module_rows, norm_weight, rms_norm_rows
from .rope import (PER_HEAD_ROPE_KINDS, ROPE_COS_SIN_PAIRS, ROPE_PAIRS, cos_sin_pairs_part, rope_rows,
                   rope_split_half_rows, rotate_rows)


_NOT_YET = object()   # `PerHeadNormRope._plan`: the passes per stream, not worked out yet


class PerHeadNormRope:
    """`norm_rope(query, key, group)` for norms over each head's channels: each stream's own norm on its token
    range (the module's norm, as the model runs it, rounded to the tensor's dtype), then RoPE on adjacent
    pairs (`rope` ROPE_PAIRS), on each head's halves (ROPE_SPLIT_HALF: Cosmos, MiniMax H3) or on adjacent pairs
    from per-head (cos, sin) tables (ROPE_COS_SIN_PAIRS: Mochi), all in place by bounded token chunks. `freqs`:
    `(B or 1, N, 1, D/2, 2, 2)` over the joined tokens (ROPE_COS_SIN_PAIRS: `(cos, sin)`, each `(N_rot, heads or
    1, D/2)`, over the first N_rot tokens), or None. `ranges`: (start, stop, norm_q, norm_k) per stream."""

    def __init__(self, ranges: Sequence[tuple], freqs, rope: str = ROPE_PAIRS):
        if rope not in PER_HEAD_ROPE_KINDS:
            raise ValueError(f"a per-head norm takes one of the RoPE kinds {PER_HEAD_ROPE_KINDS} here, not {rope!r}")
        self.ranges, self.freqs, self.rope = list(ranges), freqs, rope
        self._weights: dict = {}   # id(norm) -> (its weight cast for the tensors,)
        self._plans: dict = {}     # (which, device, dtype, head size) -> the fused passes' arguments (`_plan`)
        self._passes: dict = {}    # (which, start, stop) -> the last `kernels.NormRopePass` worked out for them
        # which -> the one pass over every token of the last tensor (two streams joined, or one): the next head
        # group's keys of its layout go straight to it
        self._whole: dict = {}

    def _fused_(self, t: torch.Tensor, start: int, stop: int, norm) -> bool:
        """One Triton pass (CUDA): the norm over each head's channels and the RoPE, for torch RMSNorms."""
        launch = self._fused_launch(t, start, stop, norm)
        if launch is None:
            return False
        launch()
        return True

    def query_all_heads_(self, query: torch.Tensor, group=None) -> bool:
        """q of every head at once (the runtime's buffer of all heads' q, before the head groups run): fused
        passes over every head instead of one per group. The norm over each head's own channels and the RoPE
        shared by all heads make it the same math as group by group (`group`, the runtime's: not needed, these
        norms take no statistics). Only where the fused passes can take every stream (then True); else nothing
        is done (False) and each group's q is normalized as before (the PyTorch path's scratch stays a group's)."""
        launches = self._launches(query, 0)
        if launches is None:
            return False
        for launch in launches:
            launch()
        return True

    def _launches(self, t: torch.Tensor, which: int) -> Optional[list]:
        """The fused passes over every stream of `t` (`which`: 0 queries, 1 keys), or None where one stream's
        cannot run. Two adjacent streams whose norms differ only by their weights (Flux's and Qwen-Image's
        text and image streams) take one pass, each token its stream's weight: one launch less. The passes'
        arguments are worked out once a call (`_plan`): each head group's keys only take their launches."""
        joined, separate = self._plan(t, which)
        if joined is not None:
            launch = self._pass_launch(t, which, *joined)
            if launch is not None:
                if joined[:2] == (0, t.shape[1]):
                    self._whole[which] = self._passes[(which, 0, t.shape[1])]
                return [launch]
        if separate is _NOT_YET:
            separate = self._separate(t, which)
        if separate is None:
            return None
        launches = [self._pass_launch(t, which, *planned) for planned in separate]
        return None if None in launches else launches

    def _pass_launch(self, t: torch.Tensor, which: int, start: int, stop: int, args: tuple, kwargs: dict):
        """The launch of the pass over the tokens [start, stop) of `t`, or None. The pass is worked out once a
        call and kept for the next tensor of the same layout (every head group's keys: `kernels.NormRopePass`
        holds none of them)."""
        part = t if start == 0 and stop == t.shape[1] else t[:, start:stop]
        key = (which, start, stop)
        planned = self._passes.get(key)
        if planned is None or not planned.fits(part):
            planned = kernels.norm_rope_pass(part, *args, **kwargs)
            if planned is None:
                return None
            self._passes[key] = planned
        return functools.partial(planned.run, part)

    def _plan(self, t: torch.Tensor, which: int) -> tuple:
        """`(joined, separate)`: the arguments of one pass over two adjacent streams (or None), and of one pass
        per stream (or None where one cannot run; `_NOT_YET` until `_separate` is asked: the joined pass
        usually serves), for tensors of `t`'s device, dtype and head size."""
        key = (which, t.device, t.dtype, t.shape[-1])
        if key not in self._plans:
            spans = self._spans(which)
            joined = None
            if len(spans) == 2 and spans[0][1] == spans[1][0]:
                joined = self._launch_args(t, spans[0][0], spans[1][1], spans[0][2], second=spans[1][2],
                                           split=spans[0][1])
            self._plans[key] = (joined, _NOT_YET)
        return self._plans[key]

    def _separate(self, t: torch.Tensor, which: int) -> Optional[list]:
        """`_plan`'s one pass per stream, worked out once for tensors like `t`."""
        key = (which, t.device, t.dtype, t.shape[-1])
        separate = [self._launch_args(t, start, stop, norm) for start, stop, norm in self._spans(which)]
        separate = None if None in separate else separate
        self._plans[key] = (self._plans[key][0], separate)
        return separate

    def _spans(self, which: int) -> list:
        """(start, stop, norm) of each stream that has something to do for q (`which` 0) or k (1)."""
        return [(start, stop, norms[which]) for start, stop, *norms in self.ranges
                if not (norms[which] is None and self.freqs is None)]

    def _weight_eps(self, norm, t: torch.Tensor) -> tuple:
        """A torch RMSNorm's weight cast for `t` (once a call) and its epsilon."""
        if id(norm) not in self._weights:
            self._weights[id(norm)] = (norm_weight(norm, t),)
        # torch's default: the epsilon of the type it computes in (float32 for 16-bit tensors too)
        eps = norm.eps if norm.eps is not None else torch.finfo(torch.promote_types(t.dtype, torch.float32)).eps
        return self._weights[id(norm)][0], eps

    def _fused_launch(self, t: torch.Tensor, start: int, stop: int, norm, second=False, split: int = 0):
        """The kernel launch (`kernels.norm_rope_launch`) for the tokens [start, stop) of `t` and their norm, or
        None. `second` (a norm, or None): the tokens from `split` on are another stream's, with that norm; one
        launch only where the two norms differ by their weights alone (else None: one launch each)."""
        planned = self._launch_args(t, start, stop, norm, second, split)
        if planned is None:
            return None
        _, _, args, kwargs = planned
        return kernels.norm_rope_launch(t[:, start:stop], *args, **kwargs)

    def _launch_args(self, t: torch.Tensor, start: int, stop: int, norm, second=False, split: int = 0):
        """`(start, stop, args, kwargs)`: `_fused_launch`'s kernel launch is `kernels.norm_rope_launch(t[:,
        start:stop], *args, **kwargs)`; None where the kernel cannot take these norms or this RoPE on `t`'s device."""
        if self.rope != ROPE_PAIRS and self.freqs is not None:   # the kernel rotates adjacent pairs only
            return None
        if not kernels.can_run(t) or any(n is not None and not (
                isinstance(n, torch.nn.RMSNorm) and tuple(n.normalized_shape) == (t.shape[-1],))
                for n in (norm, None if second is False else second)):
            return None
        freqs = self.freqs
        if freqs is not None and (start != 0 or stop != freqs.shape[1]):   # (a view less where it is all of them)
            freqs = freqs[:, start:stop]
        if second is not False:
            if (norm is None) != (second is None):
                return None
            if norm is not None:
                (weight, eps), (weight2, eps2) = self._weight_eps(norm, t), self._weight_eps(second, t)
                if eps != eps2 or (weight is None) != (weight2 is None):
                    return None
                if weight is not None:
                    return start, stop, (None, weight, freqs), dict(head_norm_eps=eps, weight2=weight2,
                                                                    split=split - start)
                return start, stop, (None, None, freqs), dict(head_norm_eps=eps)
            return start, stop, (None, None, freqs), {}   # RoPE alone, both streams
        weight, eps = (None, None) if norm is None else self._weight_eps(norm, t)
        return start, stop, (None, weight, freqs), dict(head_norm_eps=eps)

    def _apply_(self, t: torch.Tensor, which: int, heads: Optional[range] = None) -> None:
        if self.rope == ROPE_COS_SIN_PAIRS:   # no fused pass: the tables' rows per head group
            self._apply_cos_sin_pairs_(t, which, range(t.shape[2]) if heads is None else heads)
            return
        whole = self._whole.get(which)
        if whole is not None and whole.fits(t):   # a head group's keys laid out as the last group's
            whole.run(t)
            return
        launches = self._launches(t, which)
        if launches is not None:   # fused passes over every stream
            for launch in launches:
                launch()
            return
        freqs = self.freqs
        for start, stop, *norms in self.ranges:
            norm = norms[which]
            if norm is None and freqs is None:
                continue
            if self._fused_(t, start, stop, norm):
                continue

            rotate = rope_rows if self.rope == ROPE_PAIRS else rope_split_half_rows

            def chunk(part, a, b, norm=norm):
                out = part if norm is None else norm(part).to(part.dtype)   # over head_dim: any group
                return out if freqs is None else rotate(out, freqs[:, a:b])
            rows_(t, chunk, start, stop)

    def _apply_cos_sin_pairs_(self, t: torch.Tensor, which: int, heads: range) -> None:
        for start, stop, *norms in self.ranges:
            norm = norms[which]
            if norm is None and self.freqs is None:
                continue

            def chunk(part, a, b, norm=norm):
                out = part if norm is None else norm(part).to(part.dtype)   # over head_dim: any group
                return out if self.freqs is None else cos_sin_pairs_part(out, *self.freqs, a, b, heads)
            rows_(t, chunk, start, stop)

    def __call__(self, query, key, group) -> None:
        if query is not None:
            self._apply_(query, 0, None if group is None or query.shape[2] != len(group.q) else group.q)
        if key is not None:
            self._apply_(key, 1, None if group is None or key.shape[2] != len(group.kv) else group.kv)


def _is_norm(norm) -> bool:
    return norm is not None and not isinstance(norm, torch.nn.Identity)


class SpanningNormRope:
    """`norm_rope(query, key, group)` for an RMSNorm over all heads (`NORM_SPANS_HEADS`: Wan's norm_q/norm_k,
    LTX's q_norm/k_norm): each stream's norm on its tokens, then RoPE, in place. Split, a group is normalized
    from the per-token mean squares of all heads the runtime's statistics pass hands over
    (`group.mean_squares`), their inverse RMS computed once a call, like the norm weights; unsplit (one group
    of every head), the model's own norm runs. The norm's output is rounded once, then rotated, as the models
    do: one fused Triton pass on CUDA (`qkv_core.kernels.norm_rope_`), else bounded token chunks of PyTorch ops.

    `ranges`: (start, stop, norm_q, norm_k) per stream of the joined tokens (stop None: to the end; a
    cross-attention's keys: one stream over their own tokens); a None or `Identity` norm: that side is not
    normalized (a cross-attention's keys that come normalized). `rope`: a kind of `ROPE_KINDS` with its tables
    `freqs` for the queries and `key_freqs` for the keys (default: `freqs`; see `rotate_rows`), or None.
    `whole=True`: the tensors are small chunks already (every head), so the model's own norm runs on each in
    one call. Holds the norms' weights cast for the call and the inverse RMS (float32 `(B, N, 1, 1)`) until it
    is dropped."""

    def __init__(self, ranges: Sequence[tuple], heads: int, head_dim: int, freqs=None, whole: bool = False,
                 rope: Optional[str] = ROPE_PAIRS, key_freqs=None):
        self.ranges, self.heads, self.head_dim, self.whole = list(ranges), heads, head_dim, whole
        self.rope = rope
        self.freqs = (freqs, freqs if key_freqs is None else key_freqs) if rope is not None else (None, None)
        self._weights: dict = {}   # (stream, which) -> (the norm's weight cast for the tensors,)
        self._inverse_rms: dict = {}   # (stream, which) -> (mean_squares it was made from, rsqrt(ms + eps))

    @property
    def spans_heads(self) -> bool:
        """Does any stream have a norm over all heads (the runtime's statistics pass is needed)?"""
        return any(_is_norm(norm) for _, _, *norms in self.ranges for norm in norms)

    def _weight(self, key: tuple, norm, t: torch.Tensor, heads: range) -> Optional[torch.Tensor]:
        if key not in self._weights:
            self._weights[key] = (norm_weight(norm, t),)
        weight, d = self._weights[key][0], self.head_dim
        if weight is None:
            return None
        return weight[heads.start * d:heads.stop * d].view(len(heads), d)

    def _inverse(self, key: tuple, norm, mean_squares: torch.Tensor) -> torch.Tensor:
        cached = self._inverse_rms.get(key)
        if cached is None or cached[0] is not mean_squares:
            inverse = torch.rsqrt(mean_squares.float() + norm.eps).unsqueeze(-1)
            self._inverse_rms[key] = cached = (mean_squares, inverse)
        return cached[1]

    def _tokens(self, which: int, t: torch.Tensor, group) -> tuple:
        """(the call's first token that `t` holds, the RoPE table of `which` for t's tokens): `group.tokens`
        says which when t is a chunk of them (the runtime's `reuse_input`)."""
        tokens = getattr(group, "tokens", None)
        freqs = self.freqs[which]
        if tokens is None:
            return 0, freqs
        # the chunk's own rows, the first chunk's too (a table of every token would not fit its fused pass)
        return tokens.start, freqs if freqs is None else freqs[:, tokens.start:tokens.start + t.shape[1]]

    def _kernel_rotates(self, freqs) -> bool:
        """Can the fused kernel apply this RoPE table (or none)? It rotates adjacent pairs by one float32
        rotation per token, shared by all heads."""
        return freqs is None or (self.rope == ROPE_PAIRS and freqs.shape[2] == 1)

    def _apply_(self, t: torch.Tensor, which: int, heads: range, group) -> None:
        first, freqs = self._tokens(which, t, group)
        if first == 0 and len(self.ranges) == 2 and self._one_pass_(t, which, heads, group, freqs):
            return
        end = first + t.shape[1]
        for index, (start, stop, *norms) in enumerate(self.ranges):
            start, stop = max(start, first), min(end if stop is None else stop, end)
            if start < stop:
                self._range_(t, start - first, stop - first, (index, which), norms[which], freqs, heads, group)

    def query_all_heads_(self, query: torch.Tensor, group=None) -> bool:
        """q of every head at once, in the runtime's buffer after its statistics pass (`group.mean_squares`):
        one fused pass (`_one_pass_`) instead of one a group (the same math: each token's inverse RMS times the
        weight, rounded, rotated). False (nothing done) where that does not apply: each group's q is normalized
        as before."""
        if group is None or query.shape[2] != self.heads:
            return False
        return self._one_pass_(query, 0, range(self.heads), group, self.freqs[0])

    def _one_pass_(self, t: torch.Tensor, which: int, heads: range, group, freqs) -> bool:
        """Every stream of `t` (all the call's tokens) normalized from the statistics pass and rotated in one
        fused pass: one stream, or two adjacent ones (HiDream's image and text) whose norms differ by their
        weights alone, the second stream's tokens taking its weight. False where that does not apply (nothing
        done)."""
        ranges = self.ranges
        if len(ranges) not in (1, 2) or group.mean_squares is None or getattr(group, "tokens", None) is not None \
                or not kernels.can_run(t) or not self._kernel_rotates(freqs):
            return False
        norms = [r[2 + which] for r in ranges]
        eps = {getattr(norm, "eps", None) for norm in norms}
        if ranges[0][0] != 0 or ranges[-1][1] not in (None, t.shape[1]) or None in eps or len(eps) != 1 or \
                not all(_is_norm(norm) for norm in norms) or \
                (len(ranges) == 2 and not (ranges[0][1] == ranges[1][0] and 0 < ranges[0][1] < t.shape[1])):
            return False
        weights = [self._weight((index, which), norm, t, heads) for index, norm in enumerate(norms)]
        second = weights[1] if len(weights) == 2 else None
        if (weights[0] is None) != (weights[-1] is None):
            return False
        inverse = self._inverse(("call", which), norms[0], group.mean_squares[which])
        launch = kernels.norm_rope_launch(t, inverse, weights[0], freqs, weight2=second,
                                          split=None if second is None else ranges[0][1])
        if launch is not None:
            launch()
        return launch is not None

    def _range_(self, t: torch.Tensor, start: int, stop: int, key: tuple, norm, freqs, heads: range,
                group) -> None:
        every = start == 0 and stop == t.shape[1]

        def span(u):   # the stream's tokens (the tensor itself for a single stream)
            return u if u is None or every else u[:, start:stop]
        fused_rope = self._kernel_rotates(freqs)
        kernel_freqs = span(freqs) if fused_rope else None
        normalize = None
        if not _is_norm(norm):
            pass
        elif group.mean_squares is not None:   # one group of heads: from the statistics of all heads
            inverse, weight = self._inverse(key, norm, group.mean_squares[key[1]]), self._weight(key, norm, t, heads)
            if kernels.norm_rope_(span(t), span(inverse), weight, kernel_freqs):   # one fused pass (CUDA + Triton)
                if fused_rope:
                    return
            else:
                def from_statistics(part, a, b):   # rounded once before the rotation, as the model does
                    return rms_norm_rows(part, inverse[:, a:b], weight).to(part.dtype)
                normalize = from_statistics
        elif t.is_cuda and t.shape[2] == self.heads and kernels.can_run(t):
            # t holds every head: one fused pass that takes each token's statistics itself, else the statistics
            # first, then the fused pass
            weight = self._weight(key, norm, t, heads)
            done = norm.eps is not None and kernels.norm_rope_(span(t), None, weight, kernel_freqs, span_eps=norm.eps)
            if not done:
                part = span(t)
                mean_squares = torch.linalg.vector_norm(part, dim=(-2, -1), dtype=torch.float32).square_()
                mean_squares = mean_squares.div_(part.shape[2] * part.shape[3]).unsqueeze(-1)
                del part
                done = kernels.norm_rope_(span(t), self._inverse(key, norm, mean_squares), weight, kernel_freqs)
            if done:
                if fused_rope:
                    return
            else:
                rows_(t, lambda part, a, b: module_rows(part, norm), start, stop)
        elif self.whole:   # t holds every head: the model's own norm
            span(t).copy_(module_rows(span(t), norm))
        else:
            rows_(t, lambda part, a, b: module_rows(part, norm), start, stop)
        if freqs is None and normalize is None:
            return
        if normalize is None and kernel_freqs is not None and kernels.norm_rope_(span(t), None, None, kernel_freqs):
            return

        def chunk(part, a, b):
            out = part if normalize is None else normalize(part, a, b)
            return out if freqs is None else rotate_rows(self.rope, freqs, out, a, b, heads)
        rows_(t, chunk, start, stop)

    def __call__(self, query, key, group) -> None:
        if query is not None:
            self._apply_(query, 0, group.q, group)
        if key is not None:
            self._apply_(key, 1, group.kv, group)

    def key_into(self, key, dest, group) -> bool:
        """The runtime's `norm_key_into`: k's norm and RoPE in one fused pass written into `dest` (key's shape),
        key not changed. Only where that pass takes the whole call: CUDA with Triton, key holding every head of
        one stream's tokens, an RMSNorm with its eps, the pair RoPE of one rotation per token (or none); else
        False and nothing is done."""
        if len(self.ranges) != 1 or not key.is_cuda or key.shape[2] != self.heads or not kernels.can_run(key):
            return False
        start, stop, _, norm = self.ranges[0]
        first, freqs = self._tokens(1, key, group)
        if start > first or (stop is not None and stop < first + key.shape[1]) or not _is_norm(norm) or \
                getattr(norm, "eps", None) is None or not self._kernel_rotates(freqs):
            return False
        weight = self._weight((0, 1), norm, key, group.kv)
        return kernels.norm_rope_(key, None, weight, freqs, span_eps=norm.eps, into=dest)

    def fused_quant(self, query, key, group, core, settings):
        """The runtime's `fused_quant`: a group's q normalized, rotated and quantized in one pass by the staged
        core (`core.norm_rope_quantize_q`, SageAttention 2 on sm90), for one stream whose q norm is an RMSNorm
        over all heads, from the statistics pass or, where q holds every head (unsplit, or a token chunk of
        every head: `reuse_input`), from q itself in the same pass, with pair RoPE (Wan); None otherwise, and
        always for k (its smoothing needs the mean of the normalized keys first), and the runtime's own steps
        run."""
        fuse = getattr(core, "norm_rope_quantize_q", None)
        if query is None or fuse is None or len(self.ranges) != 1:
            return None
        start, stop, norm, _ = self.ranges[0]
        _, freqs = self._tokens(0, query, group)
        if start != 0 or stop not in (None, query.shape[1]) or not _is_norm(norm) or \
                (freqs is not None and (self.rope != ROPE_PAIRS or freqs.shape[2] != 1)):
            return None
        weight = self._weight((0, 0), norm, query, group.q)
        if group.mean_squares is not None:
            return fuse(query, self._inverse((0, 0), norm, group.mean_squares[0]), weight, freqs, settings)
        if query.shape[2] != self.heads or norm.eps is None:   # no statistics, and not every head to take them
            return None
        return fuse(query, None, weight, freqs, settings, span_eps=norm.eps)   # the pass takes them itself


__all__ = ["PerHeadNormRope", "SpanningNormRope"]
