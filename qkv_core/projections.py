"""Projections by rows: compute output features `[start, stop)` of a projection without the others.

A projection is prepared once per layer call (`prepare(x)`: the weight is cast or patched once, the input
made ready once), then asked for the rows of one head group at a time. Adapters for other weight types
(ComfyUI's ops, quantized weights) subclass `RowProjection`; `torch.nn.Linear` is supported here, and any
other callable runs whole and is sliced (`WholeProjection`).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import fast_paths


def _as_items(t: torch.Tensor) -> torch.Tensor:
    """`(batch, tokens, features)`: `t` itself, or a `(tokens, features)` tensor as one batch item (a view)."""
    return t if t.dim() == 3 else t.unsqueeze(0)


class PreparedProjection:
    """A projection ready for one layer call (what `RowProjection.prepare` returns); subclass it for a weight
    format. It holds the input `x` ``(batch, tokens, in)`` or ``(tokens, in)`` (and any cast weight) until
    `release`, which the runtime calls once the call's last group has read it.

    Attributes
    ----------
    by_tokens : bool
        `rows_into` computes only the tokens asked for (else it computes every token and copies).

    Methods
    -------
    rows(start, stop)
        Output features ``[start, stop)`` for every token: a new tensor ``(*x.shape[:-1], stop - start)`` in
        the compute dtype, owned by the caller. Required.
    rows_into(out, start, stop, token_start=0)
        The same features of tokens ``[token_start, token_start + n)`` written into `out` ``(batch, n,
        stop - start)`` (any strides; one batch item may come as ``(n, stop - start)``): the full width a chunk
        of tokens at a time, or straight into a buffer the caller has. Default: `rows`, then a copy.
    writes_into(batch)
        Is `rows_into` of a whole output one launch, no more than `rows` and a copy? Default False.
    writer(out)
        ``write(start, stop)``: `rows_into` of every token into `out`, with what does not depend on the rows
        worked out once; None where the class has none. The writer holds the input until the caller drops it.
    full()
        Every output feature (`x` projected whole): a new tensor the caller owns. Required.
    release()
        Drops the input and cast weights; nothing may be asked after.
    """

    by_tokens = False

    def rows(self, start: int, stop: int) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def rows_into(self, out: torch.Tensor, start: int, stop: int, token_start: int = 0) -> None:
        rows = self.rows(start, stop)
        _as_items(out).copy_(_as_items(rows)[:, token_start:token_start + out.shape[-2]])

    def writes_into(self, batch: int) -> bool:
        """Is `rows_into` for a whole `(batch, tokens, ...)` output one launch, no more than `rows` and a copy
        (so a caller with a buffer should use it)?"""
        return False

    def writer(self, out: torch.Tensor) -> Optional[Callable[[int, int], None]]:
        """`write(start, stop)`: `rows_into(out, start, stop)` for every token, with what does not depend on
        the rows worked out once (a caller that writes each head group's rows into the same buffer); None where
        the class has none (the caller uses `rows_into`). The writer holds the input: the caller drops it
        when it releases the projection."""
        return None

    def full(self) -> torch.Tensor:
        raise NotImplementedError

    def release(self) -> None:
        """Drop the input and cast weights; `rows` must not be called after."""


class RowProjection:
    """A projection whose output features (rows of its weight) can be computed apart: what the runtime takes
    besides `torch.nn.Linear` and plain callables. Subclass it for a weight format (`nodes/comfy_ops.py`).

    Attributes
    ----------
    out_features : int, optional
        Output features, where known (`FusedRows` needs it to split a fused layer into equal parts).

    Methods
    -------
    prepare(x)
        A `PreparedProjection` of `x` ``(batch, tokens, in)`` or ``(tokens, in)`` for one call (the weight cast
        or patched once). The prepared projection holds `x` until its `release`. Required.
    not_row_sliceable()
        None when the prepared rows are exact slices of the whole projection, else a short reason (a weight
        format or LoRA type with no row slice): the runtime then projects that stream whole, and a stream long
        enough to be split runs in one group.
    """

    out_features: Optional[int] = None

    def not_row_sliceable(self) -> Optional[str]:
        return None

    def prepare(self, x: torch.Tensor) -> PreparedProjection:  # pragma: no cover - interface
        raise NotImplementedError


class WeightRows(PreparedProjection):
    """Rows of ``x @ weight.T + bias`` from an already cast weight: the `PreparedProjection` of a plain Linear.

    Parameters
    ----------
    x : torch.Tensor
        ``(batch, tokens, in)`` or ``(tokens, in)``; held until `release`.
    weight : torch.Tensor
        ``(out, in)`` in `x`'s dtype and device; held until `release`.
    bias : torch.Tensor, optional
        ``(out,)``.
    on_release : callable, optional
        Called once by `release` (e.g. to drop a cast weight the caller keeps elsewhere).
    """

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 on_release: Optional[Callable[[], None]] = None):
        self.x, self.weight, self.bias, self._on_release = x, weight, bias, on_release
        # made at the first `rows_into` (views, once a call: each is a host step per product otherwise):
        # x as (batch, tokens, in), x's only item as (tokens, in) (one batch item), the weight transposed
        self._items = self._item = self._weight_t = None

    by_tokens = True

    def rows(self, start: int, stop: int) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[start:stop]
        return F.linear(self.x, self.weight[start:stop], bias)

    def rows_into(self, out: torch.Tensor, start: int, stop: int, token_start: int = 0) -> None:
        """The product goes straight into `out`: no temporary of the output's size. `self.x` is
        `(batch, tokens, in)` or `(tokens, in)`; `out`'s rows of each batch item are contiguous (its items may be
        apart: the tokens of one stream in a joined buffer). The bias is added in the product, as F.linear adds
        it."""
        if self._weight_t is None or not fast_paths.on("weight_views"):
            self._items = _as_items(self.x)
            self._item = self._items[0] if self._items.shape[0] == 1 else None
            self._weight_t = self.weight.t()
        weight_t = self._weight_t[:, start:stop]
        bias = None if self.bias is None else self.bias[start:stop]
        tokens = out.shape[-2]
        if out.dim() == 2 or out.shape[0] == 1:   # one item: F.linear's own addmm
            x = self._item
            if token_start != 0 or tokens != x.shape[0]:   # some tokens (a head group's rows of all: x as it is)
                x = x[token_start:token_start + tokens]
            if out.dim() == 3:
                out = out[0]
            if bias is None:
                torch.mm(x, weight_t, out=out)
            else:
                torch.addmm(bias, x, weight_t, out=out)
            return
        x = self._items
        if token_start != 0 or tokens != x.shape[1]:
            x = x[:, token_start:token_start + tokens]
        # one batched product over the items, written through out's batch stride (cuBLAS takes it as it is)
        weight_t = weight_t.expand(out.shape[0], -1, -1)
        if bias is None:
            torch.bmm(x, weight_t, out=out)
        else:
            torch.baddbmm(bias.view(1, 1, -1), x, weight_t, out=out)

    def writes_into(self, batch: int) -> bool:
        return True

    def writer(self, out: torch.Tensor) -> Optional[Callable[[int, int], None]]:
        """One batch item's every token into a 2-D `out` `(tokens, rows)`: one product a call, no checks."""
        item = self.x if self.x.dim() == 2 else (self.x[0] if self.x.shape[0] == 1 else None)
        if item is None or out.dim() != 2 or out.shape[0] != item.shape[0]:
            return None
        weight_t, bias = self.weight.t(), self.bias
        if bias is None:
            return lambda start, stop: torch.mm(item, weight_t[:, start:stop], out=out)
        return lambda start, stop: torch.addmm(bias[start:stop], item, weight_t[:, start:stop], out=out)

    def full(self) -> torch.Tensor:
        return F.linear(self.x, self.weight, self.bias)

    def release(self) -> None:
        self.x = self.weight = self.bias = self._items = self._item = self._weight_t = None
        if self._on_release is not None:
            on_release, self._on_release = self._on_release, None
            on_release()


class RowsOnDemand(PreparedProjection):
    """Rows of ``x @ W.T + b`` where only the weight rows asked for are made ready (cast or dequantized).

    One range is held at a time, so a layer call holds a head group's rows of its weight, not the whole cast
    weight beside the input; the last range is reused (token chunks of the same rows cast once).

    Parameters
    ----------
    x : torch.Tensor
        ``(batch, tokens, in)`` or ``(tokens, in)``; held until `release`.
    out_features : int
        Rows of the whole weight.
    weight_rows : callable
        ``weight_rows(start, stop)`` -> ``(weight rows (stop - start, in), bias rows (stop - start,) or None)``
        in `x`'s dtype, cast as the whole weight would be (an elementwise cast or a dequantization by rows
        gives the same values). The rows are new tensors; this object drops them when it moves to another range.
    """

    by_tokens = True

    def __init__(self, x: torch.Tensor, out_features: int,
                 weight_rows: Callable[[int, int], tuple[torch.Tensor, Optional[torch.Tensor]]]):
        self.x, self.out_features, self._weight_rows = x, out_features, weight_rows
        self._range: Optional[tuple[int, int]] = None
        self._rows: Optional[WeightRows] = None

    def _ready(self, start: int, stop: int) -> WeightRows:
        if self._range != (start, stop):
            self._rows = self._range = None   # drop the previous range first: never two at once
            weight, bias = self._weight_rows(start, stop)
            self._rows, self._range = WeightRows(self.x, weight, bias), (start, stop)
        return self._rows

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self._ready(start, stop).rows(0, stop - start)

    def rows_into(self, out: torch.Tensor, start: int, stop: int, token_start: int = 0) -> None:
        self._ready(start, stop).rows_into(out, 0, stop - start, token_start)

    def writes_into(self, batch: int) -> bool:
        return True

    def full(self) -> torch.Tensor:
        return self._ready(0, self.out_features).full()

    def release(self) -> None:
        self.x = self._rows = self._range = self._weight_rows = None


class LinearRows(RowProjection):
    """`torch.nn.Linear` by rows: rows of the weight are contiguous, so a slice is a free view."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear = linear
        self.out_features = linear.out_features

    def prepare(self, x: torch.Tensor) -> PreparedProjection:
        return WeightRows(x, self.linear.weight, self.linear.bias)


class WholeThenSlice(PreparedProjection):
    """Computes the whole projection once, on first use, and hands out column slices of it (copies, so
    the caller may change them in place)."""

    def __init__(self, prepared: PreparedProjection):
        self._prepared, self._whole = prepared, None

    by_tokens = True

    def _computed(self) -> torch.Tensor:
        if self._whole is None:
            self._whole = self._prepared.full()
            self._prepared.release()
        return self._whole

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self._computed()[..., start:stop].clone()

    def rows_into(self, out: torch.Tensor, start: int, stop: int, token_start: int = 0) -> None:
        whole = _as_items(self._computed())
        _as_items(out).copy_(whole[:, token_start:token_start + out.shape[-2], start:stop])

    def writes_into(self, batch: int) -> bool:
        return True   # a copy of a slice

    def full(self) -> torch.Tensor:
        if self._whole is not None:
            whole, self._whole = self._whole, None
            return whole
        return self._prepared.full()

    def release(self) -> None:
        self._whole = None
        self._prepared.release()


class _CallOnce(PreparedProjection):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor):
        self.fn, self.x = fn, x

    def full(self) -> torch.Tensor:
        return self.fn(self.x)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.fn(self.x)[..., start:stop].contiguous()

    def release(self) -> None:
        self.x = None


class WholeProjection(RowProjection):
    """A projection that cannot be computed by rows: it runs whole, once per call, and is sliced.

    Parameters
    ----------
    fn : callable
        ``fn(x)`` -> ``(*x.shape[:-1], features)``.
    reason : str
        What `not_row_sliceable` says (the runtime logs it where a split stream is kept in one group).
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], reason: str = "not a Linear"):
        self.fn, self.reason = fn, reason

    def not_row_sliceable(self) -> Optional[str]:
        return self.reason

    def prepare(self, x: torch.Tensor) -> PreparedProjection:
        return _CallOnce(self.fn, x)


class _OffsetRows(PreparedProjection):
    """Rows `[offset + start, offset + stop)` of a prepared projection, as rows `[start, stop)`."""

    def __init__(self, inner: PreparedProjection, offset: int, width: int):
        self.inner, self.offset, self.width = inner, offset, width
        self.by_tokens = inner.by_tokens

    def rows(self, start: int, stop: int) -> torch.Tensor:
        return self.inner.rows(self.offset + start, self.offset + stop)

    def rows_into(self, out: torch.Tensor, start: int, stop: int, token_start: int = 0) -> None:
        self.inner.rows_into(out, self.offset + start, self.offset + stop, token_start)

    def writes_into(self, batch: int) -> bool:
        return self.inner.writes_into(batch)

    def writer(self, out: torch.Tensor) -> Optional[Callable[[int, int], None]]:
        write, offset = self.inner.writer(out), self.offset
        return None if write is None else (lambda start, stop: write(offset + start, offset + stop))

    def full(self) -> torch.Tensor:
        return self.inner.rows(self.offset, self.offset + self.width)

    def release(self) -> None:
        self.inner.release()


class FusedRows(RowProjection):
    """One part of a fused projection whose output stacks several projections by rows (a ``qkv`` Linear: q,
    k, v; Flux's ``linear1``: q, k, v, mlp). Pass one per role: ``FusedRows(qkv, 0, 3), FusedRows(qkv, 1, 3),
    FusedRows(qkv, 2, 3)``; each prepares the fused layer for itself (a Linear's rows are views: nothing is
    copied).

    Parameters
    ----------
    projection : torch.nn.Linear, RowProjection or callable
        The fused layer (a callable runs whole and is sliced).
    index : int
        Which part, from 0.
    parts : int
        Equal parts (default 3), when `sizes` is not given.
    sizes : sequence of int, optional
        Output features of each part, e.g. ``(heads * d, kv_heads * d, kv_heads * d)`` for grouped-query
        attention.

    Raises
    ------
    ValueError
        The layer's output features do not split into `parts` equal parts, `sizes` does not add up to them,
        or `index` is not one of the parts.
    """

    def __init__(self, projection, index: int, parts: int = 3, sizes=None):
        self.inner = as_row_projection(projection)
        total = getattr(self.inner, "out_features", None)
        if sizes is None:
            if total is None or parts <= 0 or total % parts:
                raise ValueError(f"FusedRows: {total} output features do not split into {parts} equal parts; "
                                 f"pass sizes=(features of each part)")
            sizes = (total // parts,) * parts
        sizes = tuple(int(n) for n in sizes)
        if total is not None and sum(sizes) != total:
            raise ValueError(f"FusedRows: sizes {sizes} add up to {sum(sizes)}, the layer has {total} outputs")
        if not 0 <= index < len(sizes):
            raise ValueError(f"FusedRows: index {index} is not one of the {len(sizes)} parts")
        self.offset, self.out_features = sum(sizes[:index]), sizes[index]

    def not_row_sliceable(self) -> Optional[str]:
        return self.inner.not_row_sliceable()

    def prepare(self, x: torch.Tensor) -> PreparedProjection:
        return _OffsetRows(self.inner.prepare(x), self.offset, self.out_features)


def as_row_projection(projection) -> RowProjection:
    """A `RowProjection` for `projection`: itself, a `torch.nn.Linear`, or any callable (run whole)."""
    if isinstance(projection, RowProjection):
        return projection
    if isinstance(projection, torch.nn.Linear) and type(projection).forward is torch.nn.Linear.forward:
        return LinearRows(projection)
    if callable(projection):
        return WholeProjection(projection, f"{type(projection).__name__} has no row slice")
    raise ValueError(f"a projection must be a torch.nn.Linear, a RowProjection or a callable, "
                     f"not {type(projection).__name__}")
