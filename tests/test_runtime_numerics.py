"""Numerics of the runtime against the float64 reference (docs/design.md §2.1-2.3, §2.6, §2.8).

Every configuration is run at each head-split level 0-3 and compared with one float64 reference (tight
float32 tolerance), and the split levels are compared with level 0 (the unsplit SDPA path) to float round-off.
The runtime splits calls of 8,192+ tokens an item; these tests lower that floor to ITEM_FLOOR (1,024) so that
batches of short sequences split too and stay small (the floor's own rule is tested at its real value below).
Long sequences are checked on a sample of query rows against the reference (every row between levels).
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import qkv_core as qc
from reference import (PerHeadNormRope, SpanningNormRope, Unsliceable, ValueNorm, make_linear, make_qkv,
                       max_rel_err, project64, randn, reference, sample_rows)

H, D, FEAT = 8, 32, 64
LEVELS = (0, 1, 2, 3)
TOL_REF = 1e-5      # float32 vs float64, relative to max|ref|
TOL_SPLIT = 2e-6    # float32 split vs unsplit: ~1e-6 (mean squares summed by groups of heads round differently)
TOL_SPLIT_BF16 = 1e-2  # observed ~3e-3
TOL_REF_BF16 = 2e-2    # observed ~6e-3
ITEM_FLOOR = 1024      # the split floor these tests run with (the runtime's: 8,192 tokens of one item)
REAL_FLOOR = 8192


@pytest.fixture(autouse=True)
def item_floor(monkeypatch):
    monkeypatch.setattr(qc.head_split, "SPLIT_FLOOR_TOKENS", ITEM_FLOOR)



class Recorder:
    """A norm_rope that records each call's group and then runs `inner` (or nothing)."""

    def __init__(self, inner=None):
        self.inner, self.groups = inner, []

    def __call__(self, query, key, group):
        self.groups.append(group)
        if self.inner is not None:
            self.inner(query, key, group)

    def count(self):
        return len({(g.q.start, g.q.stop) for g in self.groups})


def make_norm(kind, kv_heads):
    if kind in ("span", "span_stats"):
        return SpanningNormRope(H, kv_heads, D)
    if kind == "per_head":
        return PerHeadNormRope(D)
    return None


def norm_options(kind, norm):
    if kind == "span":
        return dict(norm_spans_heads=True)
    if kind == "span_stats":
        return dict(norm_spans_heads=True, norm_stats=norm.norm_stats)
    return {}


def make_mask(kind, batch, nq, nk, dtype, seed=7, dense=True):
    """Masks of the given kind; `dense=False` builds them as stride-0 expansions over the query dim (long
    self-attention), which still differ per head and per key."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    rows = nq if dense else 1
    if kind == "bool":
        m = torch.rand(batch, 1, rows, nk, generator=g) < 0.7
        m[..., 0] = True
    elif kind == "additive":
        m = torch.rand(batch, 1, rows, nk, generator=g) * -3.0
        m[torch.rand(m.shape, generator=g) < 0.1] = float("-inf")
        m[..., 0] = 0.0
        m = m.to(dtype)
    elif kind == "per_head":
        m = torch.rand(batch, H, rows, nk, generator=g) * -4.0
        m[torch.rand(m.shape, generator=g) < 0.2] = float("-inf")
        m[..., 0] = 0.0
        m = m.to(dtype)
    elif kind == "per_head_bool":
        m = torch.rand(batch, H, rows, nk, generator=g) < 0.6
        m[..., 0] = True
    elif kind == "3d":
        m = (torch.rand(batch, rows, nk, generator=g) * -3.0).to(dtype)
    else:
        raise AssertionError(kind)
    if not dense:
        m = m.expand(*m.shape[:-2], nq, nk)
    return m


def make_prefix(kind, batch, kv_heads, tokens=64, seed=11, dtype=torch.float32):
    """(what to pass as kv_prefix, the (key, value) the reference gets)."""
    if kind is None:
        return None, None
    pb = 1 if kind == "q8_b1" else batch
    k = randn(pb, tokens, kv_heads, D, seed=seed, dtype=dtype)
    v = randn(pb, tokens, kv_heads, D, seed=seed + 1, dtype=dtype)
    if kind in ("16bit", "16bit_b1"):
        if kind == "16bit_b1":
            k, v = k[:1], v[:1]
        return (k, v), (k, v)
    if kind in ("q8", "q8_b1"):
        prefix = qc.cache_prefix([k.clone(), v.clone()], native=False)
        assert prefix.k.dtype == torch.int8 and not prefix.is_native
        return prefix, qc.dequantize_prefix(prefix, torch.float32)
    if kind == "q8_wrap":  # an archive's q8 tensors, 3-D (no batch)
        kq, ks = qc.q8.quantize_q8(k[:1])
        vq, vs = qc.q8.quantize_q8(v[:1])
        prefix = qc.q8_prefix(kq[0], ks[0], vq[0], vs[0])
        return prefix, qc.dequantize_prefix(prefix, torch.float32)
    if kind == "layer":
        cache = qc.PrefixCache(2, quantize=True, native=False)
        cache[1].store(k, v)
        return cache[1], cache[1].get(torch.float32)
    raise AssertionError(kind)


def check_levels(run, ref, rows=None, levels=LEVELS, expect=None, tol_ref=TOL_REF, tol_split=TOL_SPLIT):
    """run(level) -> (out, groups used). Each level against the reference, each split level against 0."""
    outs, counts = {}, {}
    for level in levels:
        out, count = run(level)
        got = out if rows is None else out[:, rows]
        assert got.shape == ref.shape
        err = max_rel_err(got, ref)
        assert err < tol_ref, f"level {level}: {err:.3g} from the float64 reference"
        outs[level], counts[level] = out, count
    if expect is not None:
        assert counts == {lvl: expect(lvl) for lvl in levels}
    for level in levels:
        if level != levels[0]:
            err = max_rel_err(outs[level], outs[levels[0]])
            assert err < tol_split, f"level {level} vs level {levels[0]}: {err:.3g}"
    return outs, counts


# --- self-attention ------------------------------------------------------------------------------------
SELF_CASES = [
    # id, norm, kv_heads, batch, tokens (None: 2-D input), mask, prefix
    ("span-b1", "span", 8, 1, 8192, None, None),
    ("span_stats-b2", "span_stats", 8, 2, 4096, None, None),
    ("span-gqa2-b8", "span", 2, 8, 1024, None, None),
    ("span_stats-gqa4-q8b1", "span_stats", 4, 2, 4096, None, "q8_b1"),
    ("per_head-2d-short", "per_head", 8, None, 300, None, None),
    ("none-additive-b8", None, 8, 8, 1024, "additive", None),
    ("per_head-bool-16bit", "per_head", 8, 2, 4096, "bool", "16bit"),
    ("span-per_head_mask-gqa4-q8", "span", 4, 8, 1024, "per_head", "q8"),
    ("span_stats-3d-layer", "span_stats", 8, 8, 1024, "3d", "layer"),
    ("per_head-per_head_bool-q8wrap", "per_head", 2, 8, 1024, "per_head_bool", "q8_wrap"),
    ("short-per_head_mask-16bit_b1", "span", 4, 2, 300, "per_head", "16bit_b1"),
]


@pytest.mark.parametrize("case", SELF_CASES, ids=[c[0] for c in SELF_CASES])
def test_self_attention(case):
    _, norm_kind, kvh, batch, tokens, mask_kind, prefix_kind = case
    qp, kp, vp = make_qkv(FEAT, H, D, kvh, seed=1)
    two_d = batch is None
    b = 1 if two_d else batch
    x = randn(tokens, FEAT, seed=5) if two_d else randn(b, tokens, FEAT, seed=5)
    norm = make_norm(norm_kind, kvh)
    prefix, ref_prefix = make_prefix(prefix_kind, b, kvh)
    ptoks = 0 if ref_prefix is None else ref_prefix[0].shape[1]
    long = tokens >= ITEM_FLOOR
    mask = make_mask(mask_kind, b, tokens, ptoks + tokens, torch.float32, dense=not long)
    rows = sample_rows(tokens) if long else None
    ref = reference([(x, qp)], [(x, kp, vp)], H, D, kvh, norm=norm, kv_prefix=ref_prefix, mask=mask, rows=rows)

    def run(level):
        rec = Recorder(norm)
        out = qc.qkv_attention([x], qp, kp, vp, H, D, rec, kv_heads=kvh, head_split_level=level,
                               kv_prefix=prefix, attention_mask=mask, **norm_options(norm_kind, norm))
        assert out.shape == (b, tokens, H, D) and out.dtype == torch.float32
        return out, rec.count()

    check_levels(run, ref, rows, expect=lambda lvl: qc.group_count(kvh, tokens, lvl))
    if long:
        assert qc.group_count(kvh, tokens, 3) > 1


def test_self_attention_full_rows_check():
    """One long case checked on every row (the others sample rows)."""
    qp, kp, vp = make_qkv(FEAT, H, D, 4, seed=21)
    norm = SpanningNormRope(H, 4, D, seed=5)
    x = randn(8, 1024, FEAT, seed=22)
    ref = reference([(x, qp)], [(x, kp, vp)], H, D, 4, norm=norm)

    def run(level):
        rec = Recorder(norm)
        return qc.qkv_attention([x], qp, kp, vp, H, D, rec, kv_heads=4, norm_spans_heads=True,
                                head_split_level=level), rec.count()

    check_levels(run, ref, levels=(0, 3), expect={0: 1, 3: 4}.get)


def test_level_names_and_default():
    """A call's level by name (any case) or number; a call that names none splits at High: no process-wide level."""
    qp, kp, vp = make_qkv(FEAT, H, D, seed=3)
    x = randn(1, 8192, FEAT, seed=4)
    counts = {}

    def zeros(qkv, group):  # no attention: only the plan matters here
        return torch.zeros(qkv[0].shape)

    for level in ("off", "Low", "MEDIUM", "high", None):
        rec = Recorder()
        options = {} if level is None else {"head_split_level": level}
        qc.qkv_attention([x.clone()], qp, kp, vp, H, D, rec, split_heads=None, attention_fn=zeros, **options)
        counts[level] = rec.count()
    assert counts == {"off": 1, "Low": 4, "MEDIUM": 8, "high": 8, None: 8}
    rec = Recorder()
    qc.qkv_attention([x], qp, kp, vp, H, D, rec, split_heads=False, attention_fn=zeros)
    assert rec.count() == 1
    assert not hasattr(qc, "set_head_split_level") and not hasattr(qc, "get_head_split_level")


# --- joint streams -------------------------------------------------------------------------------------
JOINT_CASES = [
    # id, norm, kv_heads, batch, (tokens of the two streams), mask, prefix
    ("span", "span", 8, 1, (120, 8080), None, None),
    ("span_stats-gqa2-b2", "span_stats", 2, 2, (4040, 60), None, None),
    ("per_head-b4-q8", "per_head", 8, 4, (64, 2000), None, "q8"),
    ("span-per_head_mask-gqa4-b4", "span", 4, 4, (100, 2000), "per_head", None),
    ("span_stats-bool-16bit-b2", "span_stats", 8, 2, (200, 4000), "bool", "16bit"),
    ("short", "span", 8, 1, (50, 300), "additive", None),
]


@pytest.mark.parametrize("case", JOINT_CASES, ids=[c[0] for c in JOINT_CASES])
def test_joint_streams(case):
    _, norm_kind, kvh, b, (n1, n2), mask_kind, prefix_kind = case
    s1 = make_qkv(FEAT, H, D, kvh, seed=30)
    s2 = make_qkv(FEAT, H, D, kvh, seed=40)
    x1, x2 = randn(b, n1, FEAT, seed=31), randn(b, n2, FEAT, seed=41)
    n = n1 + n2
    norm = make_norm(norm_kind, kvh)
    prefix, ref_prefix = make_prefix(prefix_kind, b, kvh)
    ptoks = 0 if ref_prefix is None else ref_prefix[0].shape[1]
    long = n >= ITEM_FLOOR
    mask = make_mask(mask_kind, b, n, ptoks + n, torch.float32, dense=not long)
    rows = sample_rows(n, boundaries=(n1,)) if long else None
    ref = reference([(x1, s1[0]), (x2, s2[0])], [(x1, s1[1], s1[2]), (x2, s2[1], s2[2])], H, D, kvh,
                    norm=norm, kv_prefix=ref_prefix, mask=mask, rows=rows)

    def run(level):
        rec = Recorder(norm)
        out = qc.joint_qkv_attention([([x1], s1), ([x2], s2)], H, D, rec, kv_heads=kvh, head_split_level=level,
                                     kv_prefix=prefix, attention_mask=mask, **norm_options(norm_kind, norm))
        assert out.shape == (b, n, H, D)
        return out, rec.count()

    check_levels(run, ref, rows, expect=lambda lvl: qc.group_count(kvh, n, lvl))


# --- cross attention -----------------------------------------------------------------------------------
CROSS_CASES = [
    # id, norm, kv_heads, batch, x tokens, context tokens, context batch, mask, prefix
    ("long_x-per_head-per_head_mask", "per_head", 8, 1, 8200, 77, 1, "per_head", None),
    ("long_x_2d-span", "span", 8, None, 8200, 77, None, "additive", "16bit"),
    ("long_x-span_stats-gqa2-additive", "span_stats", 2, 2, 4100, 77, 2, "additive", None),
    ("long_x-ctx_b1-bool-q8", "span", 4, 2, 4100, 60, 1, "bool", "q8"),
    ("short_x-long_ctx-span", "span", 8, 1, 96, 8200, 1, None, None),
    ("short_x-long_ctx-3d-gqa4", "span_stats", 4, 2, 80, 4100, 2, "3d", "q8_b1"),
    ("short_x-long_ctx-per_head_bool-16bit", None, 8, 1, 64, 8300, 1, "per_head_bool", "16bit"),
    ("both_short", "span", 8, 2, 100, 77, 2, "per_head", None),
]


@pytest.mark.parametrize("case", CROSS_CASES, ids=[c[0] for c in CROSS_CASES])
def test_cross_attention(case):
    _, norm_kind, kvh, b, nq, nk, cb, mask_kind, prefix_kind = case
    qp, kp, vp = make_qkv(FEAT, H, D, kvh, seed=50)
    if b is None:  # 2-D inputs: (tokens, features), batch 1
        x, ctx, b = randn(nq, FEAT, seed=51), randn(nk, FEAT, seed=52), 1
    else:
        x, ctx = randn(b, nq, FEAT, seed=51), randn(cb, nk, FEAT, seed=52)
    norm = make_norm(norm_kind, kvh)
    prefix, ref_prefix = make_prefix(prefix_kind, b, kvh)
    ptoks = 0 if ref_prefix is None else ref_prefix[0].shape[1]
    mask = make_mask(mask_kind, b, nq, ptoks + nk, torch.float32, dense=True)
    rows = sample_rows(nq) if nq > 1000 else None
    ref = reference([(x, qp)], [(ctx, kp, vp)], H, D, kvh, norm=norm, kv_prefix=ref_prefix, mask=mask,
                    rows=rows)

    def run(level):
        rec = Recorder(norm)
        out = qc.cross_qkv_attention([x], [ctx], qp, kp, vp, H, D, rec, kv_heads=kvh, head_split_level=level,
                                     kv_prefix=prefix, attention_mask=mask, **norm_options(norm_kind, norm))
        assert out.shape == (b, nq, H, D)
        return out, rec.count()

    # the longer of the two sequences decides the split
    _, counts = check_levels(run, ref, rows, expect=lambda lvl: qc.group_count(kvh, max(nq, nk), lvl))
    if max(nq, nk) >= ITEM_FLOOR:
        assert counts[3] > 1


# --- bf16: split equals unsplit to round-off -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["self-span-gqa4", "joint-span_stats", "cross-per_head-mask"])
def test_bf16_split_equals_unsplit(kind):
    dt = torch.bfloat16
    if kind.startswith("self"):
        qp, kp, vp = make_qkv(FEAT, H, D, 4, seed=60, dtype=dt)
        x = randn(2, 4096, FEAT, seed=61, dtype=dt)
        norm = SpanningNormRope(H, 4, D)
        rows = sample_rows(4096)
        ref = reference([(x, qp)], [(x, kp, vp)], H, D, 4, norm=norm, rows=rows)

        def call(level):
            return qc.qkv_attention([x], qp, kp, vp, H, D, norm, kv_heads=4, norm_spans_heads=True,
                                    head_split_level=level)
    elif kind.startswith("joint"):
        s1, s2 = make_qkv(FEAT, H, D, seed=62, dtype=dt), make_qkv(FEAT, H, D, seed=63, dtype=dt)
        x1, x2 = randn(2, 150, FEAT, seed=64, dtype=dt), randn(2, 4000, FEAT, seed=65, dtype=dt)
        norm = SpanningNormRope(H, H, D)
        rows = sample_rows(4150, boundaries=(150,))
        ref = reference([(x1, s1[0]), (x2, s2[0])], [(x1, s1[1], s1[2]), (x2, s2[1], s2[2])], H, D,
                        norm=norm, rows=rows)

        def call(level):
            return qc.joint_qkv_attention([([x1], s1), ([x2], s2)], H, D, norm, norm_spans_heads=True,
                                          norm_stats=norm.norm_stats, head_split_level=level)
    else:
        qp, kp, vp = make_qkv(FEAT, H, D, 2, seed=66, dtype=dt)
        x, ctx = randn(2, 4100, FEAT, seed=67, dtype=dt), randn(2, 77, FEAT, seed=68, dtype=dt)
        norm = PerHeadNormRope(D)
        mask = make_mask("per_head", 2, 4100, 77, dt)
        rows = sample_rows(4100)
        ref = reference([(x, qp)], [(ctx, kp, vp)], H, D, 2, norm=norm, mask=mask, rows=rows)

        def call(level):
            return qc.cross_qkv_attention([x], [ctx], qp, kp, vp, H, D, norm, kv_heads=2, attention_mask=mask,
                                          head_split_level=level)

    def run(level):
        out = call(level)
        assert out.dtype == dt
        return out, None

    check_levels(run, ref, rows, tol_ref=TOL_REF_BF16, tol_split=TOL_SPLIT_BF16)


# --- extra projection and attention_fn -----------------------------------------------------------------
class SDPAFn:
    """An attention_fn: checks what it receives, records the groups, attends with float64-checked SDPA."""

    def __init__(self, extra_ref=None, qkv_ref=None, heads=H, kv_heads=H):
        self.extra_ref, self.qkv_ref, self.heads, self.kv_heads = extra_ref, qkv_ref, heads, kv_heads
        self.groups, self.lists = [], []

    def __call__(self, qkv, group):
        self.groups.append(group)
        self.lists.append(qkv)
        assert isinstance(qkv, list) and len(qkv) == (3 if self.extra_ref is None else 4)
        q, k, v = qkv[:3]
        assert q.shape[2] == len(group.q) and k.shape[2] == len(group.kv) and v.shape[2] == len(group.kv)
        if self.extra_ref is not None:
            extra = qkv[3]
            want = self.extra_ref[..., group.q.start * D:group.q.stop * D].unflatten(-1, (len(group.q), D))
            assert extra.shape == want.shape
            assert max_rel_err(extra, want) < 1e-5
        if self.qkv_ref is not None:  # the group's normalized q/k and v, equal to the reference's heads
            assert max_rel_err(q, self.qkv_ref["q"][:, :, group.q.start:group.q.stop]) < 1e-5
            assert max_rel_err(k, self.qkv_ref["k"][:, :, group.kv.start:group.kv.stop]) < 1e-5
            assert max_rel_err(v, self.qkv_ref["v"][:, :, group.kv.start:group.kv.stop]) < 1e-5
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             enable_gqa=len(group.q) != len(group.kv)).transpose(1, 2)
        qkv.clear()
        return out


@pytest.mark.parametrize("kvh", [8, 4])
def test_extra_proj_and_attention_fn(kvh):
    qp, kp, vp = make_qkv(FEAT, H, D, kvh, seed=70)
    ep = make_linear(FEAT, H * D, seed=73)
    x = randn(8, 1024, FEAT, seed=74)
    norm = SpanningNormRope(H, kvh, D)
    rows = sample_rows(1024)
    ref, parts = reference([(x, qp)], [(x, kp, vp)], H, D, kvh, norm=norm, return_parts=True, rows=rows)
    extra_ref = project64(ep, x)

    def run(level):
        fn = SDPAFn(extra_ref, parts, kv_heads=kvh)
        out = qc.qkv_attention([x], qp, kp, vp, H, D, norm, extra_proj=ep, kv_heads=kvh, norm_spans_heads=True,
                               attention_fn=fn, head_split_level=level)
        assert all(lst == [] for lst in fn.lists)
        return out, len(fn.groups)

    check_levels(run, ref, rows, expect=lambda lvl: qc.group_count(kvh, 8192, lvl))


def test_joint_extra_proj_and_attention_fn():
    s1 = (*make_qkv(FEAT, H, D, seed=75), make_linear(FEAT, H * D, seed=78))
    s2 = (*make_qkv(FEAT, H, D, seed=79), make_linear(FEAT, H * D, seed=82))
    x1, x2 = randn(2, 100, FEAT, seed=83), randn(2, 4000, FEAT, seed=84)
    norm = PerHeadNormRope(D)
    rows = sample_rows(4100, boundaries=(100,))
    ref, parts = reference([(x1, s1[0]), (x2, s2[0])], [(x1, s1[1], s1[2]), (x2, s2[1], s2[2])], H, D,
                           norm=norm, return_parts=True, rows=rows)
    extra_ref = torch.cat([project64(s1[3], x1), project64(s2[3], x2)], dim=1)

    def run(level):
        fn = SDPAFn(extra_ref, parts)
        out = qc.joint_qkv_attention([([x1], s1), ([x2], s2)], H, D, norm, attention_fn=fn,
                                     head_split_level=level)
        return out, len(fn.groups)

    check_levels(run, ref, rows, expect=lambda lvl: qc.group_count(H, 8200, lvl))


# --- norm_v, softmax_scale, shared k/v ----------------------------------------------------------------
@pytest.mark.parametrize("prefix_kind", [None, "q8"])
def test_norm_v(prefix_kind):
    qp, kp, vp = make_qkv(FEAT, H, D, 4, seed=90)
    x = randn(8, 1024, FEAT, seed=91)
    norm, vnorm = PerHeadNormRope(D), ValueNorm(4)
    prefix, ref_prefix = make_prefix(prefix_kind, 8, 4)
    rows = sample_rows(1024)
    ref = reference([(x, qp)], [(x, kp, vp)], H, D, 4, norm=norm, norm_v=vnorm, kv_prefix=ref_prefix, rows=rows)

    def run(level):
        vnorm.groups.clear()
        out = qc.qkv_attention([x], qp, kp, vp, H, D, norm, kv_heads=4, norm_v=vnorm, kv_prefix=prefix,
                               head_split_level=level)
        return out, len(vnorm.groups)

    check_levels(run, ref, rows, expect=lambda lvl: qc.group_count(4, 8192, lvl))


@pytest.mark.parametrize("kind", ["self", "cross"])
def test_softmax_scale(kind):
    qp, kp, vp = make_qkv(FEAT, H, D, seed=95)
    scale = 0.37
    norm = PerHeadNormRope(D)
    if kind == "self":
        x = randn(2, 4096, FEAT, seed=96)
        rows = sample_rows(4096)
        ref = reference([(x, qp)], [(x, kp, vp)], H, D, norm=norm, softmax_scale=scale, rows=rows)

        def call(level, rec):
            return qc.qkv_attention([x], qp, kp, vp, H, D, rec, softmax_scale=scale, force_attention="sdpa",
                                    head_split_level=level)
    else:
        x, ctx = randn(1, 8192, FEAT, seed=97), randn(1, 40, FEAT, seed=98)
        rows = sample_rows(8192)
        ref = reference([(x, qp)], [(ctx, kp, vp)], H, D, norm=norm, softmax_scale=scale, rows=rows)

        def call(level, rec):
            return qc.cross_qkv_attention([x], [ctx], qp, kp, vp, H, D, rec, softmax_scale=scale,
                                          force_attention="sdpa", head_split_level=level)

    def run(level):
        rec = Recorder(norm)
        return call(level, rec), rec.count()

    check_levels(run, ref, rows, expect=lambda lvl: qc.group_count(H, 8192, lvl))


@pytest.mark.parametrize("kind", ["self", "joint", "joint-mixed", "cross"])
def test_shared_kv_module(kind):
    """k_proj is v_proj: projected once, the value an independent copy (the norm changes k in place)."""
    qp, kvp, _ = make_qkv(FEAT, H, D, 4, seed=100)
    norm = SpanningNormRope(H, 4, D)
    calls = []

    def counting(module):
        module.register_forward_hook(lambda *a: calls.append(1))
        return module

    if kind == "self":
        x = randn(8, 1024, FEAT, seed=101)
        rows = sample_rows(1024)
        ref = reference([(x, qp)], [(x, kvp, kvp)], H, D, 4, norm=norm, rows=rows)

        def call(level):
            return qc.qkv_attention([x], qp, kvp, kvp, H, D, norm, kv_heads=4, norm_spans_heads=True,
                                    head_split_level=level)
    elif kind.startswith("joint"):
        qp2, kvp2, vp2 = make_qkv(FEAT, H, D, 4, seed=102)
        x1, x2 = randn(2, 100, FEAT, seed=103), randn(2, 4000, FEAT, seed=104)
        v2 = kvp2 if kind == "joint" else vp2
        rows = sample_rows(4100, boundaries=(100,))
        ref = reference([(x1, qp), (x2, qp2)], [(x1, kvp, kvp), (x2, kvp2, v2)], H, D, 4, norm=norm, rows=rows)

        def call(level):
            return qc.joint_qkv_attention([([x1], (qp, kvp, kvp)), ([x2], (qp2, kvp2, v2))], H, D, norm,
                                          kv_heads=4, norm_spans_heads=True, head_split_level=level)
    else:
        unsliceable = Unsliceable(kvp)  # short context: projected whole once
        x, ctx = randn(1, 8192, FEAT, seed=105), randn(1, 77, FEAT, seed=106)
        rows = sample_rows(8192)
        ref = reference([(x, qp)], [(ctx, kvp, kvp)], H, D, 4, norm=norm, rows=rows)

        def call(level):
            unsliceable.calls = 0
            out = qc.cross_qkv_attention([x], [ctx], qp, unsliceable, unsliceable, H, D, norm, kv_heads=4,
                                         norm_spans_heads=True, head_split_level=level)
            assert unsliceable.calls == 1
            return out

    def run(level):
        norm.groups.clear()
        return call(level), len(norm.groups)

    check_levels(run, ref, rows)


# --- projections that are not row-sliceable --------------------------------------------------------------
def test_unsliceable_long_stream_runs_unsplit(caplog):
    qc.reset_notices()
    caplog.set_level(logging.INFO, logger="qkv_core")
    qp, kp, vp = make_qkv(FEAT, H, D, seed=110)
    wrapped = Unsliceable(kp)
    x = randn(8, 1024, FEAT, seed=111)
    norm = SpanningNormRope(H, H, D)
    rows = sample_rows(1024)
    ref = reference([(x, qp)], [(x, kp, vp)], H, D, norm=norm, rows=rows)
    for _ in range(2):
        rec = Recorder(norm)
        wrapped.calls = 0
        out = qc.qkv_attention([x], qp, wrapped, vp, H, D, rec, norm_spans_heads=True, head_split_level=3)
        assert rec.count() == 1 and wrapped.calls == 1
        assert rec.groups[0].mean_squares is None
        assert max_rel_err(out[:, rows], ref) < TOL_REF
    lines = [r.getMessage() for r in caplog.records if "Head Split is not applied" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("[Attention] Head Split is not applied")
    assert any("Head Split is not applied" in line for line in qc.drain_notices())


@pytest.mark.parametrize("norm_kind", ["span", "span_stats"])
def test_cross_short_unsliceable_context_is_sliced(caplog, norm_kind):
    caplog.set_level(logging.INFO, logger="qkv_core")
    qp, kp, vp = make_qkv(FEAT, H, D, 4, seed=120)
    wk, wv = Unsliceable(kp), Unsliceable(vp)
    x, ctx = randn(1, 8192, FEAT, seed=121), randn(1, 77, FEAT, seed=122)
    norm = SpanningNormRope(H, 4, D)
    rows = sample_rows(8192)
    ref = reference([(x, qp)], [(ctx, kp, vp)], H, D, 4, norm=norm, rows=rows)

    def run(level):
        rec = Recorder(norm)
        wk.calls = wv.calls = 0
        out = qc.cross_qkv_attention([x], [ctx], qp, wk, wv, H, D, rec, kv_heads=4, head_split_level=level,
                                     **norm_options(norm_kind, norm))
        assert wk.calls == 1 and wv.calls == 1  # projected whole once, then sliced
        return out, rec.count()

    _, counts = check_levels(run, ref, rows, expect=lambda lvl: qc.group_count(4, 8192, lvl))
    assert counts[3] == 4
    assert not [r for r in caplog.records if "Head Split is not applied" in r.getMessage()]


def test_unsliceable_long_context_in_cross_runs_unsplit(caplog):
    caplog.set_level(logging.INFO, logger="qkv_core")
    qp, kp, vp = make_qkv(FEAT, H, D, seed=125)
    x, ctx = randn(1, 64, FEAT, seed=126), randn(1, 8192, FEAT, seed=127)
    rec = Recorder()
    out = qc.cross_qkv_attention([x], [ctx], qp, kp, Unsliceable(vp), H, D, rec, head_split_level=3)
    assert rec.count() == 1
    assert max_rel_err(out, reference([(x, qp)], [(ctx, kp, vp)], H, D)) < TOL_REF
    assert [r for r in caplog.records if "Head Split is not applied" in r.getMessage()]


# --- group counts --------------------------------------------------------------------------------------
def test_group_count_rule(monkeypatch):
    monkeypatch.setattr(qc.head_split, "SPLIT_FLOOR_TOKENS", REAL_FLOOR)
    # divisor of kv_heads closest to the target 1/4/8/16, ties to the smaller
    assert [qc.group_count(40, 8192, lvl) for lvl in range(4)] == [1, 4, 8, 20]
    assert [qc.group_count(24, 8192, lvl) for lvl in range(4)] == [1, 4, 8, 12]  # 12 vs 24 from 16
    assert [qc.group_count(12, 8192, lvl) for lvl in range(4)] == [1, 4, 6, 12]
    assert qc.group_count(6, 8192, 2) == 6                # 6 is closest to 8
    assert qc.group_count(10, 8192, 1) == 5               # 5 (1 away) beats 2 (2 away)
    assert qc.group_count(20, 8192, 2) == 10              # 10 (2 away) beats 5 (3 away)
    assert qc.group_count(30, 8192, 2) == 6               # tie: 6 and 10 are both 2 from 8 -> the smaller
    assert qc.group_count(18, 8192, 1) == 3               # 3 (1 away) beats 6 (2 away)
    assert qc.group_count(1, 10 ** 6, 3) == 1
    assert qc.group_count(40, 8191, 3) == 1               # the 8192-token floor
    assert qc.group_count(40, 8192, "high") == 20
    assert qc.group_count(40, 10 ** 5) == 20              # no level named: High
    with pytest.raises(ValueError, match="head_split_level must be 0-3"):
        qc.group_count(8, 8192, 4)


def test_head_groups():
    groups = qc.head_split.head_groups(8, 2, 2)
    assert [(g.q, g.kv, g.mean_squares) for g in groups] == [(range(0, 4), range(0, 1), None),
                                                              (range(4, 8), range(1, 2), None)]
    assert [g.q for g in qc.head_split.head_groups(6)] == [range(0, 6)]
    groups = qc.head_split.head_groups(40, 40, 20)
    assert len(groups) == 20 and groups[-1].q == range(38, 40) and groups[-1].kv == range(38, 40)
    # query head i uses key/value head i // (heads // kv_heads): every group holds whole kv heads
    for g in qc.head_split.head_groups(16, 4, 4):
        assert {i // 4 for i in g.q} == set(g.kv)
    with pytest.raises(ValueError, match="must be a multiple of kv_heads"):
        qc.head_split.head_groups(8, 3)
    with pytest.raises(ValueError, match="must divide kv_heads"):
        qc.head_split.head_groups(8, 4, 3)
    assert qc.HeadGroup(range(1), range(1)).mean_squares is None


@pytest.mark.parametrize("batch,tokens,level,expected", [
    (1, 8192, 1, 4), (1, 8192, 2, 8), (1, 8192, 3, 20), (1, 8192, 0, 1),
    (2, 4096, 3, 1),    # the floor counts the tokens of one batch item (cond + uncond do not add up)
    (2, 8192, 3, 20), (1, 8191, 3, 1),
])
def test_group_count_used_by_a_call(batch, tokens, level, expected, monkeypatch):
    """40 kv heads: an attention_fn records the group ranges the call really used."""
    monkeypatch.setattr(qc.head_split, "SPLIT_FLOOR_TOKENS", REAL_FLOOR)
    heads, d = 40, 4
    qp, kp, vp = make_qkv(16, heads, d, seed=130)
    x = randn(batch, tokens, 16, seed=131)
    groups = []

    def fn(qkv, group):
        groups.append(group)
        return torch.zeros(qkv[0].shape)

    out = qc.qkv_attention([x], qp, kp, vp, heads, d, attention_fn=fn, head_split_level=level)
    assert out.shape == (batch, tokens, heads, d)
    assert len(groups) == expected
    per = heads // expected
    assert [(g.q, g.kv) for g in groups] == [(range(i * per, (i + 1) * per),) * 2 for i in range(expected)]


def test_cross_group_count_uses_longer_sequence(monkeypatch):
    monkeypatch.setattr(qc.head_split, "SPLIT_FLOOR_TOKENS", REAL_FLOOR)
    heads, d = 40, 4
    qp, kp, vp = make_qkv(16, heads, d, seed=132)
    groups = []

    def fn(qkv, group):
        groups.append(group)
        return torch.zeros(qkv[0].shape)

    qc.cross_qkv_attention([randn(1, 32, 16, seed=1)], [randn(1, 8192, 16, seed=2)], qp, kp, vp, heads, d,
                           attention_fn=fn, head_split_level=2)
    assert len(groups) == 8
    groups.clear()
    qc.cross_qkv_attention([randn(2, 32, 16, seed=1)], [randn(1, 8192, 16, seed=2)], qp, kp, vp, heads, d,
                           attention_fn=fn, head_split_level=2)  # context of batch 1 serves batch 2
    assert len(groups) == 8


def test_rows_chunks_and_bounds():
    t = torch.arange(2 * 10 * 3, dtype=torch.float32).view(2, 10, 3)
    seen = []

    def fn(part, a, b):
        seen.append((a, b))
        assert part.shape == (2, b - a, 3)
        return part * 2

    qc.rows_(t, fn, 2, 7)
    assert seen == [(2, 7)]
    want = torch.arange(60, dtype=torch.float32).view(2, 10, 3)
    want[:, 2:7] *= 2
    assert torch.equal(t, want)
    # at most 2^23 elements a chunk -> chunks of 2^21 tokens of 4 elements
    big = torch.zeros(1, 5 * (1 << 21), 4)
    spans = []
    qc.rows_(big, lambda p, a, b: spans.append((a, b)) or p.add_(1))
    assert spans == [(i << 21, (i + 1) << 21) for i in range(5)]
    assert bool((big == 1).all())
    # and at most a quarter of the range (scratch stays small next to the tensor)
    mid = torch.zeros(1, 1 << 20, 4)
    spans.clear()
    qc.rows_(mid, lambda p, a, b: spans.append((a, b)) or p)
    assert spans == [(i << 18, (i + 1) << 18) for i in range(4)]
    # but not below 2^16 elements
    small = torch.zeros(1, 1 << 15, 4)
    spans.clear()
    qc.rows_(small, lambda p, a, b: spans.append((a, b)) or p)
    assert spans == [(0, 1 << 14), (1 << 14, 1 << 15)]


def test_entry_points_are_compiler_disabled():
    for fn in (qc.qkv_attention, qc.joint_qkv_attention, qc.cross_qkv_attention, qc.kv_first_attention):
        assert getattr(fn, "_torchdynamo_disable", False) is True


# --- keep_keys: the statistics pass keeps the k of the first groups -----------------------------------------
class CountingRows(qc.RowProjection):
    """A Linear by rows that counts the output elements it computes (`computed`). `by_tokens=False`: the
    runtime takes its statistics group by group (the default `rows_into` would compute every token)."""

    def __init__(self, linear: torch.nn.Linear, by_tokens: bool = True):
        self.linear, self.out_features, self.by_tokens, self.computed = linear, linear.out_features, by_tokens, 0

    def prepare(self, x):
        counter, weight, bias = self, self.linear.weight, self.linear.bias

        class Prepared(qc.WeightRows):
            by_tokens = self.by_tokens

            def rows(self, start, stop):
                counter.computed += self.x[..., :1].numel() * (stop - start)
                return super().rows(start, stop)

            def rows_into(self, out, start, stop, token_start=0):
                if not counter.by_tokens:
                    return qc.PreparedProjection.rows_into(self, out, start, stop, token_start)
                counter.computed += out[..., :1].numel() * (stop - start)
                return super().rows_into(out, start, stop, token_start)
        return Prepared(x, weight, bias)


@pytest.mark.parametrize("by_tokens", [True, False], ids=["by_tokens", "by_groups"])
@pytest.mark.parametrize("kvh", [8, 4])
def test_keep_keys(by_tokens, kvh):
    """A kept key is the group's own product: the output equals the second-projection path (float32 round-off
    of the statistics, summed in another order), and k is computed (1 + unkept share) times, not twice."""
    qp, kp, vp = make_qkv(FEAT, H, D, kvh, seed=31)
    norm = SpanningNormRope(H, kvh, D, seed=9)
    x = randn(1, 8192, FEAT, seed=32)
    groups = qc.group_count(kvh, 8192, 3)
    ref = reference([(x, qp)], [(x, kp, vp)], H, D, kvh, norm=norm, rows=sample_rows(8192))
    outs, computed = {}, {}
    for keep in (None, 0.5, 1.0):
        counting = CountingRows(kp, by_tokens)
        outs[keep] = qc.qkv_attention([x], qp, counting, vp, H, D, norm, kv_heads=kvh, norm_spans_heads=True,
                                      head_split_level=3, keep_keys=keep)
        computed[keep] = counting.computed / (8192 * kvh * D)
        assert max_rel_err(outs[keep][:, sample_rows(8192)], ref) < TOL_REF
        assert max_rel_err(outs[keep], outs[None]) < TOL_SPLIT
    kept_half = int(0.5 * groups) / groups
    if by_tokens:
        assert computed == {None: 2.0, 0.5: pytest.approx(2.0 - kept_half), 1.0: 1.0}
    else:  # group by group, each group's rows computed for every token
        assert computed[None] == 2.0 and computed[0.5] == pytest.approx(2.0 - kept_half) and computed[1.0] == 1.0


def test_keep_keys_with_prefix_and_shared_module():
    """Kept keys are normalized and joined with a prefix like projected ones; one module for k and v keeps
    nothing (k comes from the shared product)."""
    qp, kp, vp = make_qkv(FEAT, H, D, 4, seed=33)
    norm = SpanningNormRope(H, 4, D, seed=10)
    x = randn(1, 8192, FEAT, seed=34)
    prefix, ref_prefix = make_prefix("16bit", 1, 4)
    rows = sample_rows(8192)
    ref = reference([(x, qp)], [(x, kp, vp)], H, D, 4, norm=norm, kv_prefix=ref_prefix, rows=rows)
    out = qc.qkv_attention([x], qp, kp, vp, H, D, norm, kv_heads=4, norm_spans_heads=True, head_split_level=3,
                           kv_prefix=prefix, keep_keys=0.5)
    assert max_rel_err(out[:, rows], ref) < TOL_REF
    ref_shared = reference([(x, qp)], [(x, kp, kp)], H, D, 4, norm=norm, rows=rows)
    out = qc.qkv_attention([x], qp, kp, kp, H, D, norm, kv_heads=4, norm_spans_heads=True, head_split_level=3,
                           keep_keys=1.0)
    assert max_rel_err(out[:, rows], ref_shared) < TOL_REF


def test_keep_keys_joint_and_cross():
    """Kept keys of joined streams (each stream's tokens at its offset) and of a long cross-attention context
    equal the second-projection path."""
    s1, s2 = make_qkv(FEAT, H, D, 4, seed=35), make_qkv(FEAT, H, D, 4, seed=36)
    norm = SpanningNormRope(H, 4, D, seed=11)
    x1, x2 = randn(2, 4040, FEAT, seed=37), randn(2, 60, FEAT, seed=38)
    outs = [qc.joint_qkv_attention([([x1], s1), ([x2], s2)], H, D, norm, kv_heads=4, norm_spans_heads=True,
                                   head_split_level=3, keep_keys=keep) for keep in (None, 0.5)]
    assert max_rel_err(outs[1], outs[0]) < TOL_SPLIT
    qp, kp, vp = make_qkv(FEAT, H, D, 8, seed=39)
    norm = SpanningNormRope(H, 8, D, seed=12)
    x, context = randn(1, 8200, FEAT, seed=40), randn(1, 8300, FEAT, seed=41)
    outs = [qc.cross_qkv_attention([x], [context], qp, kp, vp, H, D, norm, norm_spans_heads=True,
                                   head_split_level=3, keep_keys=keep) for keep in (None, 0.25)]
    assert max_rel_err(outs[1], outs[0]) < TOL_SPLIT
