"""Test helper: the planner's working-set estimate (an adapter's `SPEC.measured.working_sets`, nodes/families/measured.py) against the
peaks a memory test measured with MemTracker, and the pack's module that measures them (`measurement_module`).
Imported by the adapters' memory tests as
``from support import working_set_check`` (tests/ is on sys.path)."""
from __future__ import annotations

import importlib

import pytest

TOLERANCE = 0.15   # issue 13: estimates within 15% of the CPU MemTracker runs


def assert_estimates(pack, adapter, kind: str, kv_heads: int, tokens: int, ratio_stock: float,
                     ratio_bounded: float, level: int = 3) -> None:
    """`adapter`'s estimate for its `kind` block (stock's on the ComfyUI under test, and bounded at `level` for a
    call of `tokens` tokens over `kv_heads` key/value heads, in the family's head groups) is within TOLERANCE of
    the measured `ratio_stock` / `ratio_bounded` (peaks in multiples of |x|)."""
    planner = importlib.import_module(f"{pack.__name__}.nodes.planner")
    groups = pack.qkv_core.SplitPolicy(level, group_scale=adapter.SPEC.measured.group_scale).plan(kv_heads, tokens).groups
    working_set = adapter.SPEC.measured.working_sets[kind]
    for what, estimate, measured in (("stock", working_set.stock_on(planner.comfy_release()), ratio_stock),
                                     (f"bounded, {groups} groups", working_set.bounded(groups), ratio_bounded)):
        assert abs(estimate - measured) <= TOLERANCE * measured, (
            f"{adapter.FAMILY} {kind} block ({what}): the planner estimates {estimate:.2f} x |x|, "
            f"MemTracker measured {measured:.2f}")


def measurement_module(pack):
    """`benchmarks.memory` (qkv_core/memory.py before the benchmarks moved out of the runtime)."""
    for name in ("benchmarks.memory", "qkv_core.memory"):
        try:
            return importlib.import_module(f"{pack.__name__}.{name}")
        except ImportError:
            continue
    pytest.skip("no memory-measurement module (benchmarks/memory.py)")


def check_first_call(pack, forward, *args, **kwargs) -> None:
    """Run the guards and the self-check of `forward`'s first call on these inputs (`compat.decide_call`), not
    the forward itself: the measurement that follows starts with the verdict cached. Fails where the call would
    run ComfyUI's own forward."""
    compat = importlib.import_module(f"{pack.__name__}.nodes.compat")
    assert compat.decide_call(forward, *args, **kwargs) is None, "the call would run ComfyUI's own forward"


def measure_block_peaks(pack, block, bounded_forward, inputs: dict, x: str, in_place: bool = False) -> tuple:
    """MemTracker's peaks of ComfyUI's `block` and the pack's `bounded_forward` on the keyword `inputs`, the
    verdict of the self-check cached first (`check_first_call`, outside the measurement) and no fallback or short
    call: (stock, bounded, ratio_stock, ratio_bounded), the ratios in multiples of |inputs[x]|. `in_place`: the
    forwards add into `inputs[x]`, so each measured run gets its own copy, made (and kept live) before it."""
    import torch
    from support.comfy_env import lines_of_kind
    memory, core = measurement_module(pack), pack.qkv_core
    x_bytes = inputs[x].numel() * inputs[x].element_size()
    copies = [inputs[x].clone(), inputs[x].clone()] if in_place else [inputs[x], inputs[x]]
    live = [block, list(inputs.values()), *copies]
    with torch.no_grad():
        core.reset_notices()
        check_first_call(pack, bounded_forward, **inputs)   # outside the measurement
        assert not lines_of_kind(core.drain_notices(), core.notices.FALLBACK, core.notices.SHORT_CALL)
        stock = memory.measure_peak(block, **{**inputs, x: copies[0]}, live=live)
        bounded = memory.measure_peak(bounded_forward, **{**inputs, x: copies[1]}, live=live)
    return stock, bounded, stock.peak_bytes / x_bytes, bounded.peak_bytes / x_bytes
