"""The runtime's options against the float64 reference (docs/design.md §2.1-2.3): bf16 splits equal to the unsplit
call, an extra projection and the caller's `attention_fn`, `norm_v`, `softmax_scale`, one module shared by k and
v. The helpers are tests/test_runtime_numerics.py's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv_core as qc
from support.reference import (PerHeadNormRope, SpanningNormRope, Unsliceable, ValueNorm, make_linear, make_qkv,
                               max_rel_err, project64, randn, reference, sample_rows)

from test_runtime_numerics import (D, FEAT, H, ITEM_FLOOR, LEVELS, TOL_REF, TOL_SPLIT, Recorder,  # noqa: F401
                                   TOL_REF_BF16, TOL_SPLIT_BF16, check_levels, item_floor, make_mask, make_norm,
                                   make_prefix, norm_options)


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
