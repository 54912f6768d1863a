"""The calls: q/k/v projection and attention by groups of heads (SPEC §1.1-1.3, §1.8).

Hand-off: every tensor-taking entry point takes its tensors inside lists that it clears, so the runtime
holds the only references and frees each input as soon as the projections no longer need it. Nothing is
kept after a call returns.

Layout: activations `(batch, tokens, features)` (or `(tokens, features)`, taken as batch 1); q/k/v of a
head group `(batch, tokens, heads_of_group, head_dim)`; the result `(batch, tokens, heads, head_dim)`.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Optional

import torch

from .backends import StagedCore, pay_attention, resolve_backend
from . import head_split
from .head_split import HeadGroup, head_groups, parse_level, split_plan
from .notices import notice_once
from .options import AttentionOptions
from .prefix import KVPrefix, PrefixLayer
from .projections import PreparedProjection, WholeThenSlice, as_row_projection
from .q8 import dequantize_q8_into

ROWS_CHUNK_ELEMENTS = 1 << 23
ROWS_MIN_CHUNK_ELEMENTS = 1 << 16
STATS_CHUNK_MULTIPLE = 256   # token chunks of the full-width statistics pass: whole tiles of 256 rows



def rows_(tensor: torch.Tensor, fn: Callable, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
    """Sets `tensor[:, a:b] = fn(tensor[:, a:b], a, b)` by chunks of tokens (dim 1) of `[start, stop)`: a
    per-token function (norm, RoPE) applied in place with bounded scratch. A chunk holds at most 2^23
    elements and at most a quarter of the range (at least 2^16 elements), so the scratch stays small next to
    the tensor itself whatever its size. `fn` may change its argument in place and return it, or return a
    new tensor (copied back)."""
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


def _take(tensor_list, what: str) -> torch.Tensor:
    if not isinstance(tensor_list, list) or len(tensor_list) != 1 or not torch.is_tensor(tensor_list[0]):
        raise ValueError(f"{what} must be a one-element list holding the tensor (the runtime clears it, so it "
                         f"holds the only reference): pass [{what.removesuffix('_list')}]")
    tensor = tensor_list[0]
    tensor_list.clear()
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(0)
    if tensor.dim() != 3:
        raise ValueError(f"{what}: expected (batch, tokens, features) or (tokens, features), got "
                         f"{tuple(tensor.shape)}")
    return tensor


def _require_projections(**projections) -> None:
    for name, projection in projections.items():
        if projection is None:
            raise ValueError(f"{name} is None: q, k and v projections are all needed (a layer, a RowProjection "
                             f"or a callable)")


class _Source:
    """One token stream: its input and the projections that read it (q, k, v, extra: any may be None)."""

    def __init__(self, x: torch.Tensor, **projections):
        self.x = x
        self.raw = {name: p for name, p in projections.items() if p is not None}
        # one module for k and v: projected once (the value gets a copy), so it is prepared once
        self.shared_kv = "k" in self.raw and self.raw.get("v") is self.raw["k"]
        self.proj = {name: as_row_projection(p) for name, p in self.raw.items()
                     if not (name == "v" and self.shared_kv)}
        self.prepared: dict[str, PreparedProjection] = {}
        self.tokens = x.shape[1]

    def prepare(self) -> None:
        """Prepare every projection once for this call; unsliceable ones run whole once and are sliced."""
        for name, proj in self.proj.items():
            prepared = proj.prepare(self.x)
            if proj.not_row_sliceable() is not None:
                prepared = WholeThenSlice(prepared)
            self.prepared[name] = prepared
        self.x = None  # the prepared projections hold the input until released

    def rows(self, name: str, start: int, stop: int, release: bool) -> torch.Tensor:
        prepared = self.prepared[name]
        out = prepared.rows(start, stop)
        if release:
            self.release_projection(name)
        return out

    def rows_into(self, name: str, out: torch.Tensor, start: int, stop: int, token_start: int = 0,
                  release: bool = False) -> None:
        self.prepared[name].rows_into(out, start, stop, token_start)
        if release:
            self.release_projection(name)

    def release_projection(self, name: str) -> None:
        """Drop one projection (its cast weight and its hold on the input) once nothing needs it."""
        prepared = self.prepared.pop(name, None)
        if prepared is not None:
            prepared.release()

    def by_tokens(self, name: str) -> bool:
        return self.prepared[name].by_tokens

    def release(self) -> None:
        for prepared in self.prepared.values():
            prepared.release()
        self.prepared.clear()
        self.x = None


def _join(parts_fn, sources, total_tokens: int, heads: int, head_dim: int) -> torch.Tensor:
    """Projections of several streams joined along tokens: `(B, N, heads, D)`. A single stream is returned
    as projected (no copy). (A prefix is joined later, after the norms: `_Call._join_k_prefix`.)"""
    if len(sources) == 1:
        return parts_fn(sources[0]).unflatten(-1, (heads, head_dim))
    joined, a = None, 0
    for source in sources:
        part = parts_fn(source).unflatten(-1, (heads, head_dim))
        if joined is None:
            joined = torch.empty((part.shape[0], total_tokens, heads, head_dim), dtype=part.dtype,
                                 device=part.device)
        joined[:, a:a + part.shape[1]] = part
        a += part.shape[1]
        del part
    return joined


def _sum_squares(t: torch.Tensor, acc: torch.Tensor) -> None:
    """acc (B, N) float32 += sum over the last two dims of t**2, accumulated in float32 by one reduction
    (no float32 copy of t)."""
    acc += torch.linalg.vector_norm(t, dim=(-2, -1), dtype=torch.float32).square_()


class _Call:
    """State of one call, from the hand-off to the return."""

    def __init__(self, q_sources, kv_sources, heads, head_dim, norm_rope, options):
        o = AttentionOptions.from_kwargs(options)
        self.q_sources, self.kv_sources = q_sources, kv_sources
        self.sources = list(dict.fromkeys(q_sources + kv_sources))
        self.heads, self.head_dim, self.norm_rope = heads, head_dim, norm_rope
        self.kv_heads = heads if o.kv_heads is None else o.kv_heads
        self.o = o
        self._validate()

    # --- checks ----------------------------------------------------------------------------------------
    def _validate(self) -> None:
        o, heads = self.o, self.heads
        if heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"heads ({heads}) and head_dim ({self.head_dim}) must be positive")
        if self.kv_heads <= 0 or heads % self.kv_heads:
            raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({self.kv_heads}) for grouped-query "
                             f"attention; pass kv_heads=heads for plain attention")
        self._validate_widths()
        batches = {s.x.shape[0] for s in self.sources}
        if len(batches) != 1:
            raise ValueError(f"all token streams must have the same batch size, got {sorted(batches)}")
        dtypes = {s.x.dtype for s in self.sources}
        if len(dtypes) != 1:
            raise ValueError(f"all token streams must have one dtype, got {sorted(map(str, dtypes))}: cast them "
                             f"to the model's compute dtype first")
        if o.head_split_level is not None:
            parse_level(o.head_split_level)
        if o.split_floor_tokens is not None and (isinstance(o.split_floor_tokens, bool) or
                                                 not isinstance(o.split_floor_tokens, int) or
                                                 o.split_floor_tokens < 0):
            raise ValueError(f"split_floor_tokens is the fewest tokens (all batch items) that are split, an int "
                             f">= 0, not {o.split_floor_tokens!r}; leave it out for the default")
        if o.softmax_scale is not None and (o.force_attention != "sdpa" or o.attention_fn is not None):
            raise ValueError("softmax_scale is only honoured by the SDPA path: pass force_attention='sdpa' and no "
                             "attention_fn (an attention_fn applies its own scale)")
        if o.norm_stats is not None and not o.norm_spans_heads:
            raise ValueError("norm_stats is only used with norm_spans_heads=True: pass both, or neither")
        if o.keep_keys is not None:
            if isinstance(o.keep_keys, bool) or not isinstance(o.keep_keys, (int, float)) or \
                    not 0 <= o.keep_keys <= 1:
                raise ValueError(f"keep_keys is the fraction (0 to 1) of the keys the statistics pass may keep, "
                                 f"not {o.keep_keys!r}")
            if not o.norm_spans_heads:
                raise ValueError("keep_keys only applies to the statistics pass of a norm that spans heads: pass "
                                 "norm_spans_heads=True, or drop keep_keys")
        if o.attention_fn is None and any("extra" in s.proj for s in self.sources):
            raise ValueError("a fourth projection (extra_proj) is only handed to attention_fn: pass attention_fn, "
                             "or drop the fourth projection")
        if o.fused_quant is not None and o.attention_fn is not None:
            raise ValueError("fused_quant needs the staged quantizers, which attention_fn turns off: pass one "
                             "of them")
        prefix = o.kv_prefix
        if isinstance(prefix, PrefixLayer):
            prefix = o.kv_prefix = prefix.kv_prefix()
        if isinstance(prefix, KVPrefix) and prefix.is_native:
            if o.attention_mask is not None or o.attention_fn is not None:
                raise ValueError("a native prefix is attended in a pass of its own, unmasked: drop attention_mask/"
                                 "attention_fn, or cache the prefix with native=False (q8)")
        elif prefix is not None and not isinstance(prefix, KVPrefix):
            if not (isinstance(prefix, (tuple, list)) and len(prefix) == 2 and all(map(torch.is_tensor, prefix))):
                raise ValueError("kv_prefix must be a (key, value) pair of tensors, a KVPrefix or a PrefixLayer")
        if prefix is not None:
            k = prefix[0]
            if k.dim() != 4 or k.shape[2] != self.kv_heads or k.shape[3] != self.head_dim:
                raise ValueError(f"kv_prefix keys must be (batch, tokens, kv_heads={self.kv_heads}, "
                                 f"head_dim={self.head_dim}), got {tuple(k.shape)}")
            if not isinstance(prefix, KVPrefix):
                v = prefix[1]
                if v.dim() != 4 or v.shape[2] != self.kv_heads or v.shape[3] != self.head_dim:
                    raise ValueError(f"kv_prefix values must be (batch, tokens, kv_heads={self.kv_heads}, "
                                     f"head_dim={self.head_dim}), got {tuple(v.shape)}")
                if v.shape[:2] != k.shape[:2]:
                    raise ValueError(f"kv_prefix keys {tuple(k.shape)} and values {tuple(v.shape)} must have the "
                                     f"same batch and tokens: one value per key")
            batch = self.sources[0].x.shape[0]
            if k.shape[0] not in (1, batch):
                raise ValueError(f"kv_prefix batch {k.shape[0]} must be 1 or the call's batch {batch}")
        if callable(o.attention_mask) and not torch.is_tensor(o.attention_mask) and self.staged is None:
            raise ValueError("a callable attention_mask needs a staged SageAttention core: pass a tensor mask "
                             "(batch, heads or 1, q_tokens, kv_tokens) instead, or use force_attention with a "
                             "staged backend")

    def _validate_widths(self) -> None:
        """Each projection's output width against heads x head_dim (k and v: kv_heads x head_dim), where the
        projection knows its width: rows are sliced by those numbers, so another width gives wrong results
        silently."""
        d = self.head_dim
        for source in self.sources:
            raw = source.raw
            if "q" in raw and raw.get("q") is raw.get("k"):
                width = getattr(source.proj["q"], "out_features", None)
                fused = f" ({width} features)" if width else ""
                raise ValueError(f"one projection{fused} was passed as q and k: a fused qkv layer must be passed as "
                                 f"its parts, qkv_core.FusedRows(layer, 0, 3), FusedRows(layer, 1, 3), "
                                 f"FusedRows(layer, 2, 3)")
            for name, proj in source.proj.items():
                width = getattr(proj, "out_features", None)
                if width is None or name == "extra":
                    continue
                heads = self.heads if name == "q" else self.kv_heads
                if width == heads * d:
                    continue
                hint = ""
                if name in ("k", "v") and width % d == 0 and width // d != heads and self.heads % (width // d) == 0:
                    hint = f"; for grouped-query attention pass kv_heads={width // d}"
                elif width % (heads * d) == 0 and width // (heads * d) > 1:
                    hint = (f"; a fused layer ({width // (heads * d)} parts): pass its rows, "
                            f"qkv_core.FusedRows(layer, index, {width // (heads * d)})")
                raise ValueError(f"the {name} projection has {width} output features, not "
                                 f"{'heads' if name == 'q' else 'kv_heads'} x head_dim = {heads} x {d} = "
                                 f"{heads * d}{hint}")

    @property
    def staged(self) -> Optional[StagedCore]:
        if not hasattr(self, "_staged"):
            self._staged = None
            if self.o.attention_fn is None:
                x = self.sources[0].x
                spec = SimpleNamespace(shape=(x.shape[0], 1, self.heads, self.head_dim), dtype=x.dtype,
                                       device=x.device)
                kv_spec = SimpleNamespace(shape=(x.shape[0], 1, self.kv_heads, self.head_dim), dtype=x.dtype,
                                          device=x.device)
                mask = self.o.attention_mask
                tensor_mask = mask if torch.is_tensor(mask) else None
                self.backend = resolve_backend(spec, kv_spec, kv_spec, tensor_mask, self.o.softmax_scale,
                                               self.o.force_attention)
                self._staged = self.backend.staged_core
        return self._staged

    # --- split plan ------------------------------------------------------------------------------------
    @property
    def floor(self) -> int:
        """The fewest tokens (all batch items) that are split: the option, else the module's constant."""
        return head_split.SPLIT_FLOOR_TOKENS if self.o.split_floor_tokens is None else self.o.split_floor_tokens

    def _plan(self) -> list[HeadGroup]:
        o = self.o
        batch = self.sources[0].x.shape[0]
        q_tokens = sum(s.tokens for s in self.q_sources)
        kv_tokens = sum(s.tokens for s in self.kv_sources)
        self.q_tokens, self.kv_tokens, self.batch = q_tokens, kv_tokens, batch
        unsliceable = next(((name, reason) for source in self.sources if batch * source.tokens >= self.floor
                            for name, proj in source.proj.items()   # short streams: projected whole, sliced
                            for reason in [proj.not_row_sliceable()] if reason is not None), None)
        plan = split_plan(self.kv_heads, batch * max(q_tokens, kv_tokens), o.head_split_level, self.floor,
                          o.split_heads, None if unsliceable is None else unsliceable[1])
        if unsliceable is not None and plan.reason == unsliceable[1]:
            name, reason = unsliceable
            notice_once(f"unsplit:{reason}", f"[Attention] Head Split is not applied: the {name} projection "
                                             f"cannot be computed by rows ({reason})")
        return head_groups(self.heads, self.kv_heads, plan.groups)

    # --- norm statistics -------------------------------------------------------------------------------
    def _mean_squares(self, groups, q_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token mean of squares over all heads of q and of k, float32 `(B, N, 1)`: from the model's
        `norm_stats(project)`, else by projecting at full width a chunk of tokens at a time (group by group
        where a projection cannot take token ranges cheaply). With `q_out`, q is projected into it on
        the way (the split path keeps q there), so only k is projected twice, except for the first groups
        that `keep_keys` allows: their k is projected by the group's rows here and kept (`self.kept_keys`)
        for the group, so each key is projected once for them."""
        d = self.head_dim

        def project(which: str, head_range: range) -> torch.Tensor:
            sources = self.q_sources if which == "q" else self.kv_sources
            tokens = self.q_tokens if which == "q" else self.kv_tokens
            heads = len(head_range)
            joined = _join(lambda s: s.rows(which, head_range.start * d, head_range.stop * d, release=False),
                           sources, tokens, heads, d)
            return joined.flatten(-2)

        if self.o.norm_stats is not None:
            q_ms, k_ms = self.o.norm_stats(project)
            if q_out is not None:
                self._project_q_into(q_out, groups)
            return q_ms, k_ms
        stats = []
        for which, tokens, total_heads, attr in (("q", self.q_tokens, self.heads, "q"),
                                                  ("k", self.kv_tokens, self.kv_heads, "kv")):
            acc = torch.zeros((self.batch, tokens), dtype=torch.float32, device=self._device)
            sources = self.q_sources if which == "q" else self.kv_sources
            kept = self._kept_key_groups(groups) if which == "k" and q_out is not None else 0
            if which == "q" and q_out is not None:
                self._project_q_into(q_out, groups, acc)
            elif all(s.by_tokens(which) for s in sources):
                for group in groups[:kept]:  # the group's own rows, as it would project them, kept for it
                    key = self._project_k(group, last=False, v_later=True)
                    _sum_squares(key, acc)
                    self.kept_keys[group.kv.start] = key
                    del key
                column_start = groups[kept - 1].kv.stop * d if kept else 0
                if kept < len(groups):
                    self._sum_squares_by_tokens(which, sources, acc, len(groups), column_start, kept > 0)
            else:
                for index, group in enumerate(groups):
                    part = project(which, getattr(group, attr)).unflatten(-1, (-1, d))
                    _sum_squares(part, acc)
                    if index < kept:
                        self.kept_keys[group.kv.start] = part
                    del part
            if kept == len(groups):  # every key is kept: the k projection is done with
                for source in sources:
                    source.release_projection("k")
            stats.append(acc.div_(total_heads * d).unsqueeze(-1))
        return stats[0], stats[1]

    def _sum_squares_by_tokens(self, which: str, sources, acc: torch.Tensor, groups: int, column_start: int = 0,
                               beside_kept: bool = False) -> None:
        """acc (B, N) float32 += the squares of the features `[column_start:]` of `which` (every head from
        there on), projected at that width a chunk of tokens at a time: one wide product per chunk instead of
        one narrow product per group. A chunk holds as many elements as one group's k, v and attention result
        together (as its v and result only, `beside_kept` keys of the first groups), so the peak stays where
        the groups put it."""
        full = (self.heads if which == "q" else self.kv_heads) * self.head_dim
        width = full - column_start
        total = sum(s.tokens for s in sources)
        multiple = STATS_CHUNK_MULTIPLE
        units = 2 if beside_kept else 3
        step = -(-max(multiple, -(-units * total * full // (groups * width))) // multiple) * multiple
        buffer, offset = None, 0
        for source in sources:
            for a in range(0, source.tokens, step):
                n = min(step, source.tokens - a)
                if buffer is None:
                    buffer = torch.empty((self.batch, min(step, total), width), dtype=self._dtype,
                                         device=self._device)
                part = buffer[:, :n]
                source.rows_into(which, part, column_start, full, a)
                _sum_squares(part.unflatten(-1, (-1, self.head_dim)), acc[:, offset + a:offset + a + n])
                del part
            offset += source.tokens
        del buffer

    def _kept_key_groups(self, groups) -> int:
        """How many of the first groups keep the k of the statistics pass: `keep_keys` of them (rounded
        down), where each group's k is projected on its own (not one module for k and v)."""
        if not self.o.keep_keys or any(s.shared_kv for s in self.kv_sources):
            return 0
        return int(self.o.keep_keys * len(groups) + 1e-9)

    # --- prefix ----------------------------------------------------------------------------------------
    def _prefix_writer(self, which: str, kv_range: range):
        prefix = self.o.kv_prefix
        if prefix is None:
            return 0, None
        if isinstance(prefix, KVPrefix):
            values, scales = (prefix.k, prefix.k_scale) if which == "k" else (prefix.v, prefix.v_scale)

            def write(view):
                dequantize_q8_into(view, values[:, :, kv_range.start:kv_range.stop],
                                   scales[:, :, kv_range.start:kv_range.stop])
            return values.shape[1], write
        tensor = prefix[0] if which == "k" else prefix[1]

        def write(view):
            view.copy_(tensor[:, :, kv_range.start:kv_range.stop].expand_as(view))
        return tensor.shape[1], write

    def _group_mask(self, group: HeadGroup):
        mask = self.o.attention_mask
        if mask is None or not torch.is_tensor(mask):
            return mask
        if mask.dim() == 3:
            mask = mask.unsqueeze(1)
        if mask.dim() == 4 and mask.shape[1] == self.heads and self.heads > 1:
            mask = mask[:, group.q.start:group.q.stop]
        return mask

    # --- the run ---------------------------------------------------------------------------------------
    def run(self) -> torch.Tensor:
        o, d = self.o, self.head_dim
        x0 = self.sources[0].x
        self._device, self._dtype = x0.device, x0.dtype
        dtype = x0.dtype
        del x0
        groups = self._plan()
        self.kept_keys: dict[int, torch.Tensor] = {}   # k of the first groups, from the statistics pass
        staged = self.staged
        if isinstance(o.kv_prefix, KVPrefix) and o.kv_prefix.is_native and staged is None:
            for source in self.sources:
                source.release()
            raise ValueError("a native prefix needs a staged SageAttention core: use a staged backend, or cache "
                             "the prefix with native=False (q8)")
        try:
            for source in self.sources:
                source.prepare()
            shape = (self.batch, self.q_tokens, self.heads, d)
            # one group, not staged: the attention's own result is returned (no buffer beside it, no copy)
            single = len(groups) == 1 and staged is None
            out = None if single else torch.empty(shape, dtype=dtype, device=self._device)
            # Split and not staged: every group's q is projected first, into the output buffer (each group's
            # attention then overwrites its own q), so q costs no memory of its own and is projected once,
            # also when a spanning norm needs its statistics before any group can be normalized.
            q_in_out = len(groups) > 1 and staged is None
            if o.norm_spans_heads and len(groups) > 1:
                q_ms, k_ms = self._mean_squares(groups, out if q_in_out else None)
                groups = [g._replace(mean_squares=(q_ms, k_ms)) for g in groups]
                del q_ms, k_ms
            elif q_in_out:
                self._project_q_into(out, groups)
            shared_kv = all(s.shared_kv for s in self.kv_sources)
            for index, group in enumerate(groups):
                last = index == len(groups) - 1
                if staged is not None:
                    self._group_staged(staged, group, out, last, shared_kv)
                    continue
                result = self._group(group, out, last, shared_kv, q_in_out)
                if single and tuple(result.shape) == shape and result.dtype == dtype:
                    return result
                if out is None:
                    out = torch.empty(shape, dtype=dtype, device=self._device)
                out[:, :, group.q.start:group.q.stop] = result
                del result
            return out
        finally:
            self.kept_keys.clear()
            for source in self.sources:
                source.release()

    def _project_q_into(self, out: torch.Tensor, groups, sum_squares: Optional[torch.Tensor] = None) -> None:
        """q of every group into its heads of `out` (`sum_squares` (B, Nq) float32 += their squares); the q
        projections are released after the last group. Where the projections can, all heads in one product
        written straight into `out` (no temporary, the GEMM at its most efficient)."""
        sources = [s for s in self.q_sources if "q" in s.proj]
        if all(s.by_tokens("q") for s in sources):
            flat, offset, width = out.flatten(2), 0, self.heads * self.head_dim
            for source in sources:
                source.rows_into("q", flat[:, offset:offset + source.tokens], 0, width, release=True)
                offset += source.tokens
            del flat
            if sum_squares is not None:
                _sum_squares(out, sum_squares)
            return
        for index, group in enumerate(groups):
            q = self._project("q", group.q, last=index == len(groups) - 1)
            if sum_squares is not None:
                _sum_squares(q, sum_squares)
            out[:, :, group.q.start:group.q.stop] = q
            del q

    def _project_v(self, group: HeadGroup, last: bool, shared_kv: bool, k_later: bool):
        """(k, v) of a group: v normalized by norm_v and joined with the prefix. With a shared k/v module in
        every key/value stream it is projected once: k (not normalized) is returned and v is an independent
        copy; otherwise k is None (`_project_k`). `k_later`: k of this group is projected after v (a stream
        whose k and v share one module, beside others that do not, keeps that module until then)."""
        d, hk = self.head_dim, len(group.kv)
        a, b = group.kv.start * d, group.kv.stop * d
        if shared_kv:
            k = _join(lambda s: s.rows("k", a, b, release=last), self.kv_sources, self.kv_tokens, hk, d)
            v = k.clone()
        else:
            # a stream whose k and v share one module (beside others that do not) projects it twice here
            v = _join(lambda s: s.rows("k" if s.shared_kv else "v", a, b,
                                       release=last and not (s.shared_kv and k_later)),
                      self.kv_sources, self.kv_tokens, hk, d)
            k = None
        if self.o.norm_v is not None:
            self.o.norm_v(v, group)
        prefix_tokens, write = self._prefix_writer("v", group.kv)
        if prefix_tokens:
            joined = torch.empty((self.batch, prefix_tokens + self.kv_tokens, hk, d), dtype=v.dtype, device=v.device)
            write(joined[:, :prefix_tokens])
            joined[:, prefix_tokens:] = v
            v = joined
            del joined
        return k, v

    def _project_k(self, group: HeadGroup, last: bool, v_later: bool) -> torch.Tensor:
        """k of a group (not normalized); `v_later`: v of this group is projected after k."""
        d = self.head_dim
        a, b = group.kv.start * d, group.kv.stop * d
        return _join(lambda s: s.rows("k", a, b, release=last and not (s.shared_kv and v_later)),
                     self.kv_sources, self.kv_tokens, len(group.kv), d)

    def _join_k_prefix(self, k: torch.Tensor, group: HeadGroup) -> torch.Tensor:
        prefix_tokens, write = self._prefix_writer("k", group.kv)
        if not prefix_tokens:
            return k
        joined = torch.empty((self.batch, prefix_tokens + k.shape[1], *k.shape[2:]), dtype=k.dtype, device=k.device)
        write(joined[:, :prefix_tokens])
        joined[:, prefix_tokens:] = k
        return joined

    def _project(self, which: str, group_range: range, last: bool) -> torch.Tensor:
        d = self.head_dim
        sources = [s for s in self.q_sources if which in s.proj]
        return _join(lambda s: s.rows(which, group_range.start * d, group_range.stop * d, release=last),
                     sources, sum(s.tokens for s in sources), len(group_range), d)

    def _group(self, group: HeadGroup, out: Optional[torch.Tensor], last: bool, shared_kv: bool,
               q_in_out: bool) -> torch.Tensor:
        """The attention of one group, `(B, Nq, heads of the group, D)`, for the caller to place. q, then k,
        then v, each normalized as soon as it is projected: the norm's scratch is live beside at most two of
        the three (q, k, v and the scratch together would raise the peak). `q_in_out`: q was projected into
        this group's heads of `out` (normalized here in place, a strided view)."""
        o = self.o
        norm = self.norm_rope
        heads = slice(group.q.start, group.q.stop)
        q = out[:, :, heads] if q_in_out else self._project("q", group.q, last)
        if norm is not None:
            norm(q, None, group)
        if shared_kv:
            k, v = self._project_v(group, last, shared_kv, k_later=False)
            if norm is not None:
                norm(None, k, group)
            k = self._join_k_prefix(k, group)
        else:
            k = self.kept_keys.pop(group.kv.start, None)
            if k is None:
                k = self._project_k(group, last, v_later=True)
            if norm is not None:
                norm(None, k, group)
            k = self._join_k_prefix(k, group)
            _, v = self._project_v(group, last, shared_kv, k_later=False)
        extra = self._project("extra", group.q, last) if "extra" in self.q_sources[0].proj else None
        if o.attention_fn is not None:
            qkv = [q, k, v] if extra is None else [q, k, v, extra]
            del q, k, v, extra
            result = o.attention_fn(qkv, group)
            qkv.clear()
        else:
            del extra
            result = pay_attention(q, k, v, mask=self._group_mask(group), force_attention=self.backend.name,
                                   softmax_scale=o.softmax_scale)
            del q, k, v
        return result

    def _group_staged(self, core: StagedCore, group: HeadGroup, out: torch.Tensor, last: bool,
                      shared_kv: bool) -> None:
        """v, k and q are quantized as each is projected: at most one of them exists in 16 bits."""
        o = self.o
        mask = o.attention_mask
        callable_mask = mask is not None and not torch.is_tensor(mask)
        fused = o.fused_quant if not callable_mask else None
        prefix = o.kv_prefix
        if isinstance(prefix, KVPrefix) and prefix.is_native:
            raise NotImplementedError("native prefixes are attended by the SageAttention staged cores (GPU issue)")
        # v is quantized before k is projected (unless one module made both): one of them in 16 bits at a time
        k, v = self._project_v(group, last, shared_kv, k_later=True)
        prefix_tokens = 0 if prefix is None else prefix[0].shape[1]
        settings = core.settings((self.batch, self.q_tokens, len(group.q), self.head_dim),
                                 (self.batch, prefix_tokens + self.kv_tokens, len(group.kv), self.head_dim),
                                 v.dtype, v.device, o.softmax_scale)
        quantized_v = core.staged_quantize_v([v], settings)
        del v
        if k is None:
            k = self._project_k(group, last, v_later=False)
        quantized_k = None
        if fused is not None and prefix is None:
            quantized_k = fused(None, k, group, core, settings)
        if quantized_k is None:
            if self.norm_rope is not None:
                self.norm_rope(None, k, group)
            k = self._join_k_prefix(k, group)
            if callable_mask:
                mask(None, k, group)
            quantized_k = core.staged_quantize_k([k], settings)
        del k
        q = self._project("q", group.q, last)
        quantized_q = fused(q, None, group, core, settings) if fused is not None else None
        group_mask = self._group_mask(group)
        if quantized_q is None:
            if self.norm_rope is not None:
                self.norm_rope(q, None, group)
            if callable_mask:
                group_mask = mask(q, None, group)
            quantized_q = core.staged_quantize_q([q], settings)
        del q
        core.staged_attention(out[:, :, group.q.start:group.q.stop], (quantized_q, quantized_k, quantized_v),
                              settings, mask=group_mask)


@torch.compiler.disable
def qkv_attention(x_list, q_proj, k_proj, v_proj, heads: int, head_dim: int, norm_rope=None, extra_proj=None,
                  **options) -> torch.Tensor:
    """Self-attention of the q/k/v projections of `x` -> `(batch, tokens, heads, head_dim)`.

    `x_list`: `[x]`, `x` `(batch, tokens, features)` or `(tokens, features)` (batch 1); the list is cleared.
    `q_proj`, `k_proj`, `v_proj`: `torch.nn.Linear`, `RowProjection` or any callable (run whole). k and v
    produce `kv_heads * head_dim` features. `norm_rope(query, key, group)` normalizes and rotates in place
    (either may be None). `extra_proj`: a fourth projection (e.g. a gate) whose head-group rows
    `attention_fn` also receives. Options: the fields of `AttentionOptions` (qkv_core/options.py), SPEC §1.1.
    """
    _require_projections(q_proj=q_proj, k_proj=k_proj, v_proj=v_proj)
    x = _take(x_list, "x_list")
    source = _Source(x, q=q_proj, k=k_proj, v=v_proj, extra=extra_proj)
    del x
    return _Call([source], [source], heads, head_dim, norm_rope, options).run()


@torch.compiler.disable
def joint_qkv_attention(streams, heads: int, head_dim: int, norm_rope=None, **options) -> torch.Tensor:
    """Several token streams projected and joined along tokens in their order, attended as one sequence
    (MMDiT joint attention). `streams`: `[(x_list, (q_proj, k_proj, v_proj[, extra_proj])), ...]`; each
    `x_list` is cleared. Returns `(batch, sum of tokens, heads, head_dim)`; `norm_rope` sees the joined
    tensors (each stream's tokens at its offset)."""
    if not streams:
        raise ValueError("joint_qkv_attention needs at least one stream")
    sources = []
    for number, stream in enumerate(streams):
        try:
            x_list, projections = stream
            q_proj, k_proj, v_proj, *rest = projections
        except (TypeError, ValueError):
            raise ValueError(f"stream {number} must be (x_list, (q_proj, k_proj, v_proj[, extra_proj]))") from None
        if len(rest) > 1:
            raise ValueError(f"stream {number} has {3 + len(rest)} projections; at most 4 (q, k, v, extra)")
        sources.append(_Source(_take(x_list, f"stream {number} x_list"), q=q_proj, k=k_proj, v=v_proj,
                               extra=rest[0] if rest else None))
    extras = {"extra" in s.proj for s in sources}
    if len(extras) > 1:
        raise ValueError("either every stream carries a fourth projection or none does")
    return _Call(sources, sources, heads, head_dim, norm_rope, options).run()


@torch.compiler.disable
def cross_qkv_attention(x_list, context_list, q_proj, k_proj, v_proj, heads: int, head_dim: int, norm_rope=None,
                        **options) -> torch.Tensor:
    """Queries from `x`, keys/values from `context` -> `(batch, tokens of x, heads, head_dim)`. Both lists
    are cleared. The longer of the two sequences decides the head split."""
    _require_projections(q_proj=q_proj, k_proj=k_proj, v_proj=v_proj)
    x = _take(x_list, "x_list")
    context = _take(context_list, "context_list")
    if context.shape[0] != x.shape[0] and context.shape[0] == 1:
        context = context.expand(x.shape[0], -1, -1)
    q_source = _Source(x, q=q_proj)
    kv_source = _Source(context, k=k_proj, v=v_proj)
    del x, context
    return _Call([q_source], [kv_source], heads, head_dim, norm_rope, options).run()


@torch.compiler.disable
def kv_first_attention(qkv_list, force_attention: Optional[str] = None) -> torch.Tensor:
    """For models that already hold q, k, v `(batch, tokens, heads, head_dim)`: `qkv_list` `[q, k, v]` is
    cleared. With a staged core, k is quantized and released before v is quantized (the peak drops by half
    of k); otherwise the plain attention call. Same results either way."""
    if not isinstance(qkv_list, list) or len(qkv_list) != 3:
        raise ValueError("kv_first_attention takes [q, k, v] in a three-element list that it clears")
    shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in qkv_list]
    if not all(torch.is_tensor(t) and t.dim() == 4 for t in qkv_list):
        raise ValueError(f"kv_first_attention takes q, k, v as (batch, tokens, heads, head_dim), got {shapes}: "
                         f"unflatten (batch, tokens, heads * head_dim) with .unflatten(-1, (heads, head_dim))")
    q, k, v = qkv_list
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"kv_first_attention: k and v must match, and q share their batch and head_dim with "
                         f"a multiple of their heads; got {shapes}")
    qkv_list.clear()
    backend = resolve_backend(q, k, v, None, None, force_attention)
    core = backend.staged_core
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
