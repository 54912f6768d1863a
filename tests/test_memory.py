"""Peak working set of a self-attention call on CPU (docs/design.md §2.3, §4), measured by MemTracker in bf16.

Wan-like width: 8 heads x 128, 16384 tokens, batch 1, a spanning RMSNorm (all heads) + RoPE applied through
`rows_`. The working set is the most memory the call holds at once above what is live before it (the input
x, which the caller keeps here, the weights, the norm weights and the RoPE table), its result included.
Measured with `benchmarks.memory.PeakMemory` (MemTracker counts the storages op results create; see there).

Expected at High (8 groups of one head): the result (1 activation), q/k/v of one group (3/8) and the norm's
float32 scratch for one group's tensor while at most two of q/k/v exist: about 1.63 activations.
"""
from __future__ import annotations

import gc

import pytest
import torch

import qkv_core as qc
from benchmarks.memory import PeakMemory, check_cpu_tracker
from support.reference import RopeTable, WanNorm, make_qkv, randn

H, D, N = 8, 128, 16384
WIDTH = H * D
ACT = N * WIDTH * 2  # one bf16 activation (tokens x heads*head_dim)


@pytest.fixture(scope="module")
def setup():
    dt = torch.bfloat16
    layers = make_qkv(WIDTH, H, D, seed=1, dtype=dt)
    table = RopeTable(N, D)
    norm = WanNorm(H, H, D, table=table)
    return layers, table, norm


def measure(setup, level):
    layers, table, norm = setup
    x = randn(1, N, WIDTH, seed=2, dtype=torch.bfloat16)
    x_list = [x]  # the caller keeps x too: the working set is above the live input
    live = [*layers, norm.q_weight, norm.k_weight, table.cos, table.sin, x_list]
    with torch.no_grad(), PeakMemory("cpu", live=live) as pm:
        out = qc.qkv_attention(x_list, *layers, H, D, norm, norm_spans_heads=True, head_split_level=level)
    assert out.shape == (1, N, H, D) and out.dtype == torch.bfloat16
    assert pm.untracked_alias_bytes == 0  # everything live before the call was registered
    result = pm.peak_bytes / ACT, {k: round(v / ACT, 3) for k, v in pm.breakdown.items()}
    del out, x, x_list
    gc.collect()
    return result


def test_tracker_is_sound():
    assert check_cpu_tracker(4) is None


def test_high_working_set(setup):
    high, high_parts = measure(setup, 3)
    off, off_parts = measure(setup, 0)
    print(f"\nworking set / activation: High {high:.3f} {high_parts}; Off {off:.3f} {off_parts}")
    assert high >= 1.0  # at least the result itself: the measurement sees the call
    assert high <= 1.75, f"High: {high:.3f} x activation at the peak, breakdown {high_parts}"
    assert high <= 0.5 * off, f"High {high:.3f} vs Off {off:.3f}"
    # Off: q, k, v and the result, plus bounded norm scratch (a layout that sent the attention kernel to a
    # path materializing the scores would show here first)
    assert off <= 4.1, f"Off: {off:.3f} x activation at the peak, breakdown {off_parts}"
