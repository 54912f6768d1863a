"""Float64 reference for the qkv_core tests, and the helpers they share (not a test module).

`reference(...)` projects q/k/v with float64 copies of the weights, applies the same norm/RoPE in float64,
joins the prefix, repeats the key/value heads for grouped-query attention and attends by an explicit softmax
(additive or boolean masks), returning `(batch, tokens, heads, head_dim)` in float64.

The norm/RoPE callables (`SpanningNormRope`, `PerHeadNormRope`) are what a model hands the runtime: they work
in place, in float32, through `qkv_core.rows_`, and carry their own float64 twin (`ref_q`, `ref_k`).
RoPE: Wan/Flux-style rotation of interleaved channel pairs (2i, 2i+1) by per-token angles `pos * base**(-2i/D)`.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from qkv_core import rows_

ROPE_BASE = 10000.0


# --- layers --------------------------------------------------------------------------------------------
def make_linear(in_features: int, out_features: int, seed: int, bias: bool = True,
                dtype=torch.float32) -> torch.nn.Linear:
    """A `torch.nn.Linear` with deterministic weights scaled so that outputs are O(1); no autograd."""
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features, generator=g) / math.sqrt(in_features))
        if bias:
            lin.bias.copy_(torch.randn(out_features, generator=g) * 0.1)
    return lin.requires_grad_(False)


def make_qkv(features: int, heads: int, head_dim: int, kv_heads: Optional[int] = None, seed: int = 0,
             dtype=torch.float32):
    kv_heads = heads if kv_heads is None else kv_heads
    return (make_linear(features, heads * head_dim, seed, dtype=dtype),
            make_linear(features, kv_heads * head_dim, seed + 1, dtype=dtype),
            make_linear(features, kv_heads * head_dim, seed + 2, dtype=dtype))


class Unsliceable:
    """A plain callable projection (not a Linear): the runtime cannot compute it by rows."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear = linear
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


def project64(projection, x: torch.Tensor) -> torch.Tensor:
    """The projection in float64 (`(batch, tokens, out)`; 2-D x taken as batch 1)."""
    lin = getattr(projection, "linear", projection)
    if x.dim() == 2:
        x = x.unsqueeze(0)
    bias = None if lin.bias is None else lin.bias.double()
    return F.linear(x.double(), lin.weight.double(), bias)


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# --- RoPE ----------------------------------------------------------------------------------------------
def rope_angles(start: int, stop: int, head_dim: int) -> torch.Tensor:
    """float64 `(stop - start, head_dim // 2)` angles of tokens `start..stop-1`."""
    pos = torch.arange(start, stop, dtype=torch.float64)
    freqs = ROPE_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return pos[:, None] * freqs[None, :]


class RopeTable:
    """Precomputed float32 cos/sin `(tokens, head_dim // 2)` (a model's constant frequency table)."""

    def __init__(self, tokens: int, head_dim: int):
        angles = rope_angles(0, tokens, head_dim)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    def ensure(self, tokens: int, head_dim: int) -> None:
        if self.cos.shape[0] < tokens:
            self.__init__(tokens, head_dim)


_TABLES: dict = {}


def _cached_table(stop: int, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of tokens 0..stop-1 (at least), computed in float64 once and cast once per dtype."""
    key = (head_dim, dtype)
    cached = _TABLES.get(key)
    if cached is None or cached[0].shape[0] < stop:
        size = max(stop, 16384)
        angles = rope_angles(0, size, head_dim)
        cached = _TABLES[key] = (angles.cos().to(dtype), angles.sin().to(dtype))
    return cached


def rope_(t: torch.Tensor, start: int, table: Optional[RopeTable] = None) -> torch.Tensor:
    """Rotates `t` `(batch, n, heads, D)` (float) in place: pairs (2i, 2i+1) of tokens `start..start+n-1`."""
    n, d = t.shape[1], t.shape[-1]
    if table is not None:
        cos, sin = table.cos[start:start + n], table.sin[start:start + n]
    else:
        cos, sin = _cached_table(start + n, d, t.dtype)
        cos, sin = cos[start:start + n], sin[start:start + n]
    cos, sin = cos.to(t.dtype)[None, :, None, :], sin.to(t.dtype)[None, :, None, :]
    pairs = t.unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    old0 = x0.clone()
    x0.mul_(cos).addcmul_(x1, sin, value=-1.0)  # x0 cos - x1 sin
    x1.mul_(cos).addcmul_(old0, sin)            # x1 cos + x0 sin
    return t


def rope64(t: torch.Tensor) -> torch.Tensor:
    """float64 rotation of a whole `(batch, tokens, heads, D)` tensor (new tensor)."""
    t = t.double().clone()
    return rope_(t, 0)


# --- norms ---------------------------------------------------------------------------------------------
class SpanningNormRope:
    """Wan-like: RMSNorm over all heads' features (`heads * head_dim`) with a weight per feature, then RoPE.

    Split calls pass `group.mean_squares` (per-token mean of squares over all heads): each group is then
    normalized by `x * rsqrt(ms + eps) * weight[rows of the group]`. Without it the tensor is normalized over
    its own last two dims (the full width when unsplit). Records the groups it saw in `.groups`.
    """

    def __init__(self, heads: int, kv_heads: int, head_dim: int, seed: int = 100, eps: float = 1e-6,
                 rope: bool = True, table: Optional[RopeTable] = None):
        self.heads, self.kv_heads, self.head_dim, self.eps, self.rope = heads, kv_heads, head_dim, eps, rope
        self.q_weight = 1.0 + 0.2 * randn(heads * head_dim, seed=seed)
        self.k_weight = 1.0 + 0.2 * randn(kv_heads * head_dim, seed=seed + 1)
        self.table = table
        self.groups = []

    def _norm(self, t: torch.Tensor, weight: torch.Tensor, heads: range, ms: Optional[torch.Tensor],
              first: int = 0):
        d = self.head_dim
        w = weight[heads.start * d:heads.stop * d].view(len(heads), d)

        def fn(part, a, b):
            y = part.float()
            if ms is None:
                scale = y.square().mean(dim=(-2, -1), keepdim=True).add_(self.eps).rsqrt_()
            else:
                scale = ms[:, a:b].add(self.eps).rsqrt_().unsqueeze(-1)
            y.mul_(scale).mul_(w)  # y is part itself (float32) or a fresh float32 copy
            del scale
            if self.rope:
                rope_(y, first + a, self.table)
            return y
        rows_(t, fn)

    def __call__(self, query, key, group) -> None:
        self.groups.append(group)
        ms = group.mean_squares
        first = 0 if group.tokens is None else group.tokens.start   # a chunk of the call's tokens (reuse_input)
        if query is not None:
            self._norm(query, self.q_weight, group.q, None if ms is None else ms[0], first)
        if key is not None:
            self._norm(key, self.k_weight, group.kv, None if ms is None else ms[1], first)

    def _ref(self, t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        t = t.double()
        ms = t.square().mean(dim=(-2, -1), keepdim=True)
        t = t * torch.rsqrt(ms + self.eps) * weight.double().view(t.shape[-2], t.shape[-1])
        return rope64(t) if self.rope else t

    def ref_q(self, q: torch.Tensor) -> torch.Tensor:
        return self._ref(q, self.q_weight)

    def ref_k(self, k: torch.Tensor) -> torch.Tensor:
        return self._ref(k, self.k_weight)

    def norm_stats(self, project):
        """The `norm_stats` hook: mean squares over all heads, from `project(which, head_range)` two heads at
        a time (float32 `(batch, tokens, 1)`)."""
        self.stats_calls = []
        out = []
        for which, total in (("q", self.heads), ("k", self.kv_heads)):
            acc = None
            for h in range(0, total, 2):
                heads = range(h, min(h + 2, total))
                self.stats_calls.append((which, heads))
                part = project(which, heads)
                assert part.shape[-1] == len(heads) * self.head_dim
                s = part.float().square().sum(-1, keepdim=True)
                acc = s if acc is None else acc.add_(s)
            out.append(acc.div_(total * self.head_dim))
        return out[0], out[1]


class WanNorm(SpanningNormRope):
    """`SpanningNormRope` without recording the groups (a model keeps nothing: for memory tests)."""

    def __call__(self, query, key, group):
        ms = group.mean_squares
        first = 0 if group.tokens is None else group.tokens.start
        if query is not None:
            self._norm(query, self.q_weight, group.q, None if ms is None else ms[0], first)
        if key is not None:
            self._norm(key, self.k_weight, group.kv, None if ms is None else ms[1], first)


class PerHeadNormRope:
    """RMSNorm over each head's `head_dim` (Flux/Qwen style) with a `(head_dim,)` weight, then RoPE."""

    def __init__(self, head_dim: int, seed: int = 200, eps: float = 1e-6, rope: bool = True):
        self.head_dim, self.eps, self.rope = head_dim, eps, rope
        self.q_weight = 1.0 + 0.2 * randn(head_dim, seed=seed)
        self.k_weight = 1.0 + 0.2 * randn(head_dim, seed=seed + 1)
        self.groups = []

    def _norm(self, t, weight):
        def fn(part, a, b):
            y = part.float()
            scale = y.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
            y.mul_(scale).mul_(weight)
            if self.rope:
                rope_(y, a)
            return y
        rows_(t, fn)

    def __call__(self, query, key, group) -> None:
        self.groups.append(group)
        if query is not None:
            self._norm(query, self.q_weight)
        if key is not None:
            self._norm(key, self.k_weight)

    def _ref(self, t, weight):
        t = t.double()
        t = t * torch.rsqrt(t.square().mean(-1, keepdim=True) + self.eps) * weight.double()
        return rope64(t) if self.rope else t

    def ref_q(self, q):
        return self._ref(q, self.q_weight)

    def ref_k(self, k):
        return self._ref(k, self.k_weight)


class ValueNorm:
    """A `norm_v(value, group)`: scales each key/value head in place by its own factor (and adds a shift)."""

    def __init__(self, kv_heads: int, seed: int = 300):
        self.scale = 1.0 + 0.5 * randn(kv_heads, seed=seed)
        self.shift = 0.1 * randn(kv_heads, seed=seed + 1)
        self.groups = []

    def __call__(self, value: torch.Tensor, group) -> None:
        self.groups.append(group)
        r = slice(group.kv.start, group.kv.stop)
        value.mul_(self.scale[r].to(value.dtype)[:, None]).add_(self.shift[r].to(value.dtype)[:, None])

    def ref(self, v: torch.Tensor) -> torch.Tensor:
        return v * self.scale.double()[:, None] + self.shift.double()[:, None]


# --- reference attention ---------------------------------------------------------------------------------
def _batch(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0) if x.dim() == 2 else x


def reference(q_streams: Sequence, kv_streams: Sequence, heads: int, head_dim: int,
              kv_heads: Optional[int] = None, norm=None, norm_v=None, kv_prefix=None, mask=None,
              softmax_scale: Optional[float] = None, rows: Optional[torch.Tensor] = None,
              shared_kv_raw: bool = False, return_parts: bool = False, chunk: int = 128):
    """float64 attention.

    `q_streams`: `[(x, q_proj), ...]`; `kv_streams`: `[(x, k_proj, v_proj), ...]` (joined along tokens in
    order; self-attention passes the same x in both). `norm`: an object with `ref_q`/`ref_k` (float64) or None.
    `norm_v`: an object with `ref`. `kv_prefix`: `(key, value)` float tensors `(1 or batch, P, kv_heads, D)`,
    put before the keys/values as given. `mask`: bool (True attends) or additive, broadcastable to
    `(batch, heads, q_tokens, kv_tokens)` (3-D `(batch, q, k)` masks get a heads dim). `rows`: only these
    query positions (index tensor). Returns `(batch, q_tokens or len(rows), heads, head_dim)` float64, and with
    `return_parts` also `dict(q, k, v, extra=None)` (k/v with the prefix, before the GQA repeat).
    """
    kv_heads = heads if kv_heads is None else kv_heads
    d = head_dim
    q = torch.cat([project64(p, _batch(x)) for x, p in q_streams], dim=1)
    batch = q.shape[0]
    ks, vs = [], []
    for x, kp, vp in kv_streams:
        x = _batch(x)
        ks.append(project64(kp, x).expand(batch, -1, -1))
        vs.append(project64(vp, x).expand(batch, -1, -1))
    k, v = torch.cat(ks, dim=1), torch.cat(vs, dim=1)
    q = q.unflatten(-1, (heads, d))
    k = k.unflatten(-1, (kv_heads, d))
    v = v.unflatten(-1, (kv_heads, d))
    if norm is not None:
        q, k = norm.ref_q(q), norm.ref_k(k)
    if norm_v is not None:
        v = norm_v.ref(v)
    if kv_prefix is not None:
        kp, vp = kv_prefix
        k = torch.cat([kp.double().expand(batch, -1, -1, -1), k], dim=1)
        v = torch.cat([vp.double().expand(batch, -1, -1, -1), v], dim=1)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    rep = heads // kv_heads
    kr = k.repeat_interleave(rep, dim=2) if rep > 1 else k
    vr = v.repeat_interleave(rep, dim=2) if rep > 1 else v
    nq, nk = q.shape[1], k.shape[1]
    if mask is not None:
        if mask.dim() == 3:
            mask = mask.unsqueeze(1)
        mask = mask.expand(batch, heads, nq, nk)
    rows = torch.arange(nq) if rows is None else torch.as_tensor(rows)
    out = torch.empty((batch, len(rows), heads, d), dtype=torch.float64)
    for a in range(0, len(rows), chunk):
        idx = rows[a:a + chunk]
        scores = torch.einsum("bqhd,bkhd->bhqk", q[:, idx], kr) * scale
        if mask is not None:
            m = mask[:, :, idx]
            if m.dtype == torch.bool:
                scores = scores.masked_fill(~m, float("-inf"))
            else:
                scores = scores + m.double()
        probs = torch.softmax(scores, dim=-1)
        out[:, a:a + len(idx)] = torch.einsum("bhqk,bkhd->bqhd", probs, vr)
        del scores, probs
    if return_parts:
        return out, dict(q=q, k=k, v=v)
    return out


def sample_rows(tokens: int, count: int = 256, boundaries: Sequence[int] = (), seed: int = 0) -> torch.Tensor:
    """Query positions to check: both ends, around each boundary, and `count` random ones (sorted, unique)."""
    g = torch.Generator().manual_seed(seed)
    picks = [torch.arange(0, min(8, tokens)), torch.arange(max(0, tokens - 8), tokens),
             torch.randint(0, tokens, (count,), generator=g)]
    for b in boundaries:
        picks.append(torch.arange(max(0, b - 4), min(tokens, b + 4)))
    return torch.unique(torch.cat(picks))


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (in float64)."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
