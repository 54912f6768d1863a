"""A staged call that reuses its input (`reuse_input=True`, qkv_core/input_reuse.py), through a fake staged core
whose quantized q is assembled from chunks of tokens (as SageAttention 2's sm90 core's is).

The fake quantizers keep float tensors (copies, as a real core's quantized forms are), so the results must
equal a float64 reference; the projections log what they compute, so "k is projected once, at full width"
is observable.
"""
from __future__ import annotations

import pytest
import torch

import qkv_core as qc
from support.fake_backends import ROWS_NAME as NAME, TILE, row_tiled_backend
from support.reference import SpanningNormRope, make_qkv, max_rel_err, randn, reference

H, D, FEAT = 8, 32, 256
ITEM_FLOOR = 512   # the split floor these tests run with (the runtime's: 8,192 tokens an item)


@pytest.fixture(autouse=True)
def item_floor(monkeypatch):
    monkeypatch.setattr(qc.head_split, "SPLIT_FLOOR_TOKENS", ITEM_FLOOR)


@pytest.fixture
def core(request):
    backend = row_tiled_backend(qc)
    qc.backends.register_backend(backend)
    request.addfinalizer(lambda: qc.backends.unregister_backend(NAME))
    return backend.staged_core


class LoggedLinear(qc.RowProjection):
    """A Linear by rows that logs what each call computes: ('rows', name, width) or ('rows_into', name, width,
    tokens)."""

    def __init__(self, linear, name, log):
        self.linear, self.name, self.log = linear, name, log

    def prepare(self, x):
        inner = qc.WeightRows(x, self.linear.weight, self.linear.bias)
        log, name = self.log, self.name

        class Prepared(qc.PreparedProjection):
            by_tokens = True

            def rows(self, start, stop):
                log.append(("rows", name, stop - start))
                return inner.rows(start, stop)

            def rows_into(self, out, start, stop, token_start=0):
                log.append(("rows_into", name, stop - start, out.shape[1]))
                inner.rows_into(out, start, stop, token_start)

            def full(self):
                return inner.full()

            def release(self):
                inner.release()
        return Prepared()


def _call(x, projections, norm, reuse: bool, **options):
    return qc.qkv_attention([x], *projections, H, D, norm, norm_spans_heads=True, head_split_level="low",
                            force_attention=NAME, reuse_input=reuse, **options)


@pytest.mark.parametrize("batch,tokens", [(1, 1000), (2, 640)])
def test_reusing_the_input_equals_the_reference_and_returns_its_storage(core, batch, tokens):
    q, k, v = make_qkv(FEAT, H, D, seed=3)
    norm = SpanningNormRope(H, H, D)
    x = randn(batch, tokens, H * D, seed=4)
    want = reference([(x, q)], [(x, k, v)], H, D, norm=norm)
    given = x.clone()
    pointer = given.data_ptr()
    got = _call(given, (q, k, v), norm, reuse=True)
    assert got.data_ptr() == pointer, "the result is not in the input's storage"
    assert tuple(got.shape) == (batch, tokens, H, D)
    assert max_rel_err(got, want) < 1e-5
    usual = _call(x.clone(), (q, k, v), norm, reuse=False)
    assert max_rel_err(got, usual) < 1e-6
    # every token chunk of every head went through the norm, once for q and once for k, chunks of whole tiles
    chunks = [g.tokens for g in norm.groups if g.tokens is not None]
    assert chunks and len(chunks) % 2 == 0
    covered = sorted({(r.start, r.stop) for r in chunks})
    assert covered[0][0] == 0 and covered[-1][1] == tokens and \
        all(a[1] == b[0] for a, b in zip(covered, covered[1:])) and all(a % TILE == 0 for a, _ in covered)


def test_k_is_projected_once_at_full_width_and_v_by_groups(core):
    q, k, v = make_qkv(FEAT, H, D, seed=5)
    log = []
    projections = tuple(LoggedLinear(p, name, log) for p, name in zip((q, k, v), "qkv"))
    x = randn(1, 1000, H * D, seed=6)
    _call(x.clone(), projections, SpanningNormRope(H, H, D), reuse=True)
    keys = [entry for entry in log if entry[1] == "k"]
    assert keys and all(entry[0] == "rows_into" and entry[2] == H * D for entry in keys)
    assert sum(entry[3] for entry in keys) == 1000           # every token once
    values = [entry for entry in log if entry[1] == "v"]
    assert [entry[2] for entry in values] == [H * D // 4] * 4  # level Low: 4 groups, each its own rows once
    # the usual staged split projects k twice: at full width for the statistics, then each group's rows
    log.clear()
    _call(x.clone(), projections, SpanningNormRope(H, H, D), reuse=False)
    usual_keys = [entry for entry in log if entry[1] == "k"]
    assert sum(entry[3] for entry in usual_keys if entry[0] == "rows_into") == 1000
    assert [entry[2] for entry in usual_keys if entry[0] == "rows"] == [H * D // 4] * 4
    assert core.log.count("attention") == 8


@pytest.mark.parametrize("accepts", [True, False])
def test_keys_go_into_the_input_by_the_norms_own_pass_where_it_offers_one(core, accepts):
    """`norm_key_into(key, dest, group)`: the runtime hands each chunk's keys and the input's rows they belong in
    to the caller's pass, which writes the normalized, rotated keys there (no copy follows); a pass that
    declines (False, nothing written) gets the norm in place and a copy. Both equal the reference."""
    q, k, v = make_qkv(FEAT, H, D, seed=11)
    norm = SpanningNormRope(H, H, D)
    x = randn(1, 1000, H * D, seed=12)
    want = reference([(x, q)], [(x, k, v)], H, D, norm=norm)
    given = x.clone()
    offered = []

    def key_into(key, dest, group):
        offered.append((group.tokens, tuple(dest.shape), dest.data_ptr()))
        if not accepts:
            return False
        done = key.clone()
        norm(None, done, group)
        dest.copy_(done)
        return True
    got = _call(given, (q, k, v), norm, reuse=True, norm_key_into=key_into)
    assert max_rel_err(got, want) < 1e-5
    # one offer per chunk of the full-width pass, each the input's own rows of that chunk, every token once
    assert offered and sum(shape[1] for _, shape, _ in offered) == 1000
    row_bytes = H * D * x.element_size()
    assert all(ptr == got.data_ptr() + tokens.start * row_bytes and shape == (1, len(tokens), H, D)
               for tokens, shape, ptr in offered)


@pytest.mark.parametrize("case", ["view", "gqa", "mask", "unstaged", "not given up", "one group"])
def test_where_it_does_not_apply_the_usual_path_runs_and_the_input_is_kept(core, case):
    kv_heads = 4 if case == "gqa" else H
    q, k, v = make_qkv(FEAT, H, D, kv_heads=kv_heads, seed=7)
    norm = SpanningNormRope(H, kv_heads, D)
    tokens = 768
    base = randn(1, tokens + 16, H * D, seed=8)
    x = base[:, :tokens] if case == "view" else base[:, :tokens].clone()
    before = base.clone()
    options = dict(force_attention=NAME, reuse_input=case != "not given up", norm_spans_heads=True,
                   head_split_level="off" if case == "one group" else "low")
    if case == "gqa":
        options["kv_heads"] = kv_heads
    if case == "mask":
        options["attention_mask"] = torch.ones(1, 1, tokens, tokens, dtype=torch.bool)
    if case == "unstaged":
        options["force_attention"] = "sdpa"
    want = reference([(x, q)], [(x, k, v)], H, D, kv_heads=kv_heads, norm=norm)
    pointer = x.data_ptr()
    got = qc.qkv_attention([x], q, k, v, H, D, norm, **options)
    assert got.data_ptr() != pointer
    assert max_rel_err(got, want) < 1e-5
    assert torch.equal(base, before)
    assert all(g.tokens is None for g in norm.groups)



def test_sage2_core_assembles_its_quantized_q_from_token_chunks():
    """SageAttention 2's sm90 layout (no kernel runs: plain tensor copies): chunks of every head placed at their
    tokens give each group the values and scales of its heads, those of the whole call; the kernel reads the
    values strided, the scales contiguous."""
    from types import SimpleNamespace
    from qkv_core.sage2 import Sage2Core
    core = Sage2Core()
    settings = SimpleNamespace(kernel="sm90", return_lse=False, prefix=None, device=torch.device("cpu"))
    assert core.q_row_tile(settings) == 64
    assert core.q_row_tile(SimpleNamespace(kernel="triton", return_lse=False, prefix=None)) is None
    assert core.q_row_tile(SimpleNamespace(kernel="sm90", return_lse=True, prefix=None)) is None
    batch, tokens, heads, dim = 2, 300, 6, 64
    g = torch.Generator().manual_seed(0)
    values = torch.randint(-127, 128, (batch, tokens, heads, dim), generator=g, dtype=torch.int8)
    scales = torch.rand(batch, heads, -(-tokens // 64) * 32, generator=g)
    full = core.empty_quantized_q((batch, tokens, heads, dim), settings)
    for a in range(0, tokens, 128):
        b = min(a + 128, tokens)
        part = (values[:, a:b].clone(), scales[:, :, a // 2:-(-b // 64) * 32].clone(), None)
        core.place_quantized_q_rows(full, part, a)
    for group in (range(0, 2), range(2, 4), range(4, 6)):
        group_values, group_scales, _ = core.quantized_q_heads(full, group)
        assert group_values.stride(-1) == 1 and group_scales.is_contiguous()
        assert torch.equal(group_values, values[:, :, group.start:group.stop])
        assert torch.equal(group_scales, scales[:, group.start:group.stop])
