"""The runtime's head groups against the float64 reference and its own rules: projections that are not
row-sliceable run unsplit (said once), the group count rule and the groups a call uses, bounded row chunks,
and `keep_keys` (the statistics pass keeping a share of the groups' keys). The helpers are
tests/test_runtime_numerics.py's."""
from __future__ import annotations

import logging

import pytest
import torch

import qkv_core as qc
from support.reference import SpanningNormRope, Unsliceable, make_qkv, max_rel_err, randn, reference, sample_rows

from test_runtime_numerics import (D, FEAT, H, ITEM_FLOOR, LEVELS, REAL_FLOOR, TOL_REF, TOL_SPLIT,  # noqa: F401
                                   Recorder, check_levels, item_floor, make_norm, make_prefix, norm_options)


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
    assert [notice.kind for notice in qc.drain_notices()] == [qc.notices.UNSPLIT]


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
    assert not [r for r in caplog.records if getattr(r, "notice", None) and r.notice.kind == qc.notices.UNSPLIT]


def test_unsliceable_long_context_in_cross_runs_unsplit(caplog):
    caplog.set_level(logging.INFO, logger="qkv_core")
    qp, kp, vp = make_qkv(FEAT, H, D, seed=125)
    x, ctx = randn(1, 64, FEAT, seed=126), randn(1, 8192, FEAT, seed=127)
    rec = Recorder()
    out = qc.cross_qkv_attention([x], [ctx], qp, kp, Unsliceable(vp), H, D, rec, head_split_level=3)
    assert rec.count() == 1
    assert max_rel_err(out, reference([(x, qp)], [(ctx, kp, vp)], H, D)) < TOL_REF
    assert [r for r in caplog.records if getattr(r, "notice", None) and r.notice.kind == qc.notices.UNSPLIT]


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
