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
from support.reference import (PerHeadNormRope, SpanningNormRope, Unsliceable, ValueNorm, make_linear, make_qkv,
                               max_rel_err, project64, randn, reference, sample_rows)

H, D, FEAT = 8, 32, 64
LEVELS = tuple(range(len(qc.LEVEL_NAMES)))   # 0-3: the runtime's levels (Off, Low, Medium, High)
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
