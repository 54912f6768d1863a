"""Row projections beyond `rows()` (docs/design.md §2.1-2.3): rows of a token range written straight into a buffer
(`rows_into`, used for q of every head into the output buffer and for the full-width key statistics), checked
against `F.linear` of the same rows in float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv_core as qc
from qkv_core.projections import WholeThenSlice
from support.reference import make_linear, randn


def _prepared(linear, x):
    return qc.projections.as_row_projection(linear).prepare(x)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
def test_rows_into_a_strided_token_range(bias, batch):
    linear = make_linear(48, 96, seed=1, dtype=torch.float64)
    if not bias:
        linear.bias = None
    x = randn(batch, 40, 48, seed=2).double()
    prepared = _prepared(linear, x)
    assert prepared.by_tokens
    buffer = torch.full((batch, 40, 200), float("nan"), dtype=torch.float64)
    view = buffer[:, 10:25, 50:82]            # rows 16..48 of tokens 10..25, a view with row stride 200
    prepared.rows_into(view, 16, 48, token_start=10)
    expected = F.linear(x, linear.weight, linear.bias)[:, 10:25, 16:48]
    torch.testing.assert_close(view, expected, rtol=1e-12, atol=1e-12)
    assert torch.isnan(buffer[:, :10]).all() and torch.isnan(buffer[:, 25:]).all()   # nothing else written
    assert torch.isnan(buffer[:, 10:25, :50]).all() and torch.isnan(buffer[:, 10:25, 82:]).all()


@pytest.mark.parametrize("whole", [False, True])
def test_rows_into_a_two_dimensional_output_of_one_batch_item(whole):
    """One batch item's rows may come as `(tokens, features)` (the runtime's joined k and v of a group: a view
    less a product): the same numbers, nothing else written, for a Linear and for a projection run whole."""
    linear = make_linear(48, 96, seed=5, dtype=torch.float64)
    x = randn(1, 40, 48, seed=6).double()
    prepared = _prepared(linear, x)
    if whole:
        prepared = WholeThenSlice(prepared)
    buffer = torch.full((40, 200), float("nan"), dtype=torch.float64)
    view = buffer[10:25, 50:82]
    prepared.rows_into(view, 16, 48, token_start=10)
    torch.testing.assert_close(view, F.linear(x, linear.weight, linear.bias)[0, 10:25, 16:48], rtol=1e-12,
                               atol=1e-12)
    assert torch.isnan(buffer[:10]).all() and torch.isnan(buffer[25:]).all()
    assert torch.isnan(buffer[10:25, :50]).all() and torch.isnan(buffer[10:25, 82:]).all()


def test_rows_into_whole_then_slice_and_default():
    """A projection that runs whole (any callable) computes once and hands out token/row slices; a custom
    `PreparedProjection` with only `rows()` still gets a correct (if not cheap) `rows_into`."""
    linear = make_linear(32, 64, seed=3, dtype=torch.float64)
    x = randn(2, 30, 32, seed=4).double()
    calls = []

    def whole(t):
        calls.append(1)
        return F.linear(t, linear.weight, linear.bias)

    expected = F.linear(x, linear.weight, linear.bias)
    sliced = WholeThenSlice(qc.WholeProjection(whole).prepare(x))
    assert sliced.by_tokens
    for a in (0, 12, 24):
        out = torch.empty(2, 6, 20, dtype=torch.float64)
        sliced.rows_into(out, 8, 28, token_start=a)
        torch.testing.assert_close(out, expected[:, a:a + 6, 8:28])
    assert len(calls) == 1

    class RowsOnly(qc.PreparedProjection):
        def rows(self, start, stop):
            return F.linear(x, linear.weight[start:stop], linear.bias[start:stop])

    plain = RowsOnly()
    assert not plain.by_tokens
    out = torch.empty(2, 5, 10, dtype=torch.float64)
    plain.rows_into(out, 3, 13, token_start=20)
    torch.testing.assert_close(out, expected[:, 20:25, 3:13])


def test_rows_on_demand_casts_only_the_rows_asked_for():
    """`RowsOnDemand` (weights stored in another dtype, cast per call): each range is cast once when asked,
    one range is held at a time, and every result equals the whole cast weight's rows."""
    linear = make_linear(48, 96, seed=4, dtype=torch.float64)
    stored = linear.weight.to(torch.float16)           # the stored format, cast to x's dtype per row range
    x = randn(2, 30, 48, seed=5).double()
    asked = []

    def weight_rows(start, stop):
        asked.append((start, stop))
        return stored[start:stop].double(), linear.bias[start:stop]

    prepared = qc.RowsOnDemand(x, 96, weight_rows)
    whole = F.linear(x, stored.double(), linear.bias)
    buffer = torch.empty(2, 10, 96, dtype=torch.float64)
    for token_start in (0, 10, 20):                    # a pass over token chunks of the same rows: cast once
        prepared.rows_into(buffer, 0, 96, token_start)
        torch.testing.assert_close(buffer, whole[:, token_start:token_start + 10], rtol=0, atol=1e-12)
    torch.testing.assert_close(prepared.rows(32, 64), whole[..., 32:64], rtol=0, atol=1e-12)
    torch.testing.assert_close(prepared.full(), whole, rtol=0, atol=1e-12)
    assert asked == [(0, 96), (32, 64), (0, 96)]
    prepared.release()
    assert prepared.x is None
