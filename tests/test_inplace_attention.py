"""The attention written over its own queries (`qkv_core.inplace_attention`) and the split calls that use it:
the kernel against a float64 reference in Triton's interpreter (a child process with TRITON_INTERPRET=1), the
runtime's joint call through it against its SDPA path, and the plan and refusals without Triton. The kernel on
a GPU is in tests/test_gpu.py."""
from __future__ import annotations

import textwrap

import pytest
import torch

import qkv_core as qc
from qkv_core import head_split, inplace_attention, kernels, runtime
from support.interpreter import run_in_interpreter

KERNEL_CHECK = textwrap.dedent("""
    import math, torch
    from qkv_core import inplace_attention as ia
    g = torch.Generator().manual_seed(0)
    cases = 0

    def reference(q, k, v, scale):
        group = q.shape[2] // k.shape[2]
        k, v = (t.double().repeat_interleave(group, 2).transpose(1, 2) for t in (k, v))
        s = q.double().transpose(1, 2) @ k.transpose(-1, -2) * scale
        return (s.softmax(-1) @ v).transpose(1, 2)

    # (batch, q tokens, kv tokens, heads, kv heads, head dim, scale): ragged ends of both blocks, grouped-query,
    # a kv sequence of its own length (a prefix), a given scale
    for batch, nq, nk, h, hk, d, scale in ((1, 37, 37, 2, 2, 128, None), (2, 20, 45, 4, 2, 128, None),
                                           (1, 16, 16, 1, 1, 128, 0.05), (2, 33, 17, 3, 1, 128, None)):
        for dtype in (torch.float16, torch.bfloat16):
            storage = torch.randn(batch, nq, 3 * h, d, generator=g).to(dtype)
            q = storage[:, :, h:2 * h]                          # a group's heads of an output buffer
            k = torch.randn(batch, nk, hk, d, generator=g).to(dtype)
            v = torch.randn(batch, nk, hk, d, generator=g).to(dtype)
            want = reference(q, k, v, 1 / math.sqrt(d) if scale is None else scale)
            before = storage.clone()
            assert ia.attend_over_queries_(q, k, v, scale)
            error = float((q.double() - want).abs().max())
            assert error <= 2 ** -7 * 2 * float(want.abs().max()), (batch, nq, nk, h, hk, d, dtype, error)
            assert torch.equal(storage[:, :, :h], before[:, :, :h]) and torch.equal(storage[:, :, 2 * h:],
                                                                                    before[:, :, 2 * h:])
            cases += 1
    # what it refuses: float32, a head dim other than 128 (64 is not tuned), channels not contiguous, k and v of
    # different lengths
    x = torch.randn(1, 8, 2, 128)
    assert ia.cannot_attend_over_queries(x, x, x) is not None
    for dim in (32, 64):
        y = torch.randn(1, 8, 2, dim, dtype=torch.bfloat16)
        assert not ia.attend_over_queries_(y, y, y)
    z = torch.randn(1, 8, 128, 2, dtype=torch.bfloat16).transpose(2, 3)
    assert not ia.attend_over_queries_(z, z, z)
    w = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)
    assert not ia.attend_over_queries_(w, w, w[:, :4])
    # a pass is worked out once for a layout, scale and alignment and kept for the next call's (it holds no
    # tensor); another scale, layout or alignment is another pass, and forgetting the kept launches drops it
    from qkv_core import launch
    a, b = (torch.randn(1, 40, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    kept = ia.over_queries_pass(a, a, a)
    assert ia.over_queries_pass(b, b, b) is kept and ia.over_queries_pass(b, b, b, 0.1) is not kept
    assert ia.over_queries_pass(b[:, :39], b[:, :39], b[:, :39]) is not kept
    odd = torch.randn(1 * 40 * 2 * 128 + 4, dtype=torch.bfloat16)[4:].view(1, 40, 2, 128)   # 8 bytes off
    assert ia.over_queries_pass(odd, b, b) is not kept
    launch.forget_shared_launches()
    assert ia.over_queries_pass(b, b, b) is not kept
    print("cases", cases)
""")

JOINT_CHECK = textwrap.dedent("""
    import torch
    import qkv_core as qc
    from qkv_core import runtime, tally
    runtime.OVER_QUERIES_MAX_TOKENS = 100   # these tiny calls stand for the short calls it takes
    g = torch.Generator().manual_seed(0)
    heads, dim, width = 24, 128, 96
    streams = [(torch.randn(2, 9, width, generator=g).to(torch.bfloat16),
                [torch.nn.Linear(width, heads * dim, dtype=torch.bfloat16) for _ in range(3)]),
               (torch.randn(2, 40, width, generator=g).to(torch.bfloat16),
                [torch.nn.Linear(width, heads * dim, dtype=torch.bfloat16) for _ in range(3)])]

    def call(level, limit):
        runtime.OVER_QUERIES_MAX_TOKENS = limit
        tally.drain_tally()
        with torch.no_grad():
            out = qc.joint_qkv_attention([([x.clone()], tuple(p)) for x, p in streams], heads, dim,
                                         head_split_level=level, force_attention="sdpa", split_floor_tokens=0)
        return out.double(), tally.drain_tally()

    whole, _ = call("off", 100)
    for level, groups in (("medium", 6), ("high", 12)):
        over, counted = call(level, 100)
        assert counted.splits == {groups: 1}, counted
        assert counted.kernels == {"sdpa (Triton, over the queries)": groups}, counted
        assert float((over - whole).abs().max()) <= 2 ** -6 * float(whole.abs().max())
    # over the limit: SDPA and the level's own count
    sdpa, counted = call("medium", 48)
    assert counted.splits == {8: 1} and counted.kernels == {"sdpa": 8}, counted
    print("ok")
""")


def test_the_kernel_matches_a_float64_reference_in_the_interpreter():
    assert "cases 8" in run_in_interpreter(KERNEL_CHECK)


def test_short_split_sdpa_calls_attend_over_their_queries_in_two_thirds_of_the_groups():
    assert "ok" in run_in_interpreter(JOINT_CHECK)


def test_the_level_target_scales_to_the_nearest_divisor():
    # 24 heads: Medium's 8 x 2/3 -> 6, High's 16 x 2/3 -> 12, Low's 4 x 2/3 -> 3; 40 heads (Wan): 5 and 10
    assert [head_split.split_plan(24, 10_000, level, 0, target_scale=2 / 3).groups for level in (1, 2, 3)] == \
        [3, 6, 12]
    assert [head_split.split_plan(40, 10_000, level, 0, target_scale=2 / 3).groups for level in (2, 3)] == [5, 10]
    assert head_split.split_plan(24, 10_000, 2, 0).groups == 8


@pytest.mark.skipif(kernels.INTERPRET, reason="the interpreter runs the kernel on CPU")
def test_without_a_gpu_split_calls_keep_sdpa_and_the_levels_count():
    x = torch.randn(1, 64, 8 * 128, dtype=torch.bfloat16)
    q = torch.randn(1, 64, 8, 128, dtype=torch.bfloat16)
    assert inplace_attention.cannot_attend_over_queries(q, q, q) is not None
    assert not inplace_attention.attend_over_queries_(q, q, q)
    layers = [torch.nn.Linear(1024, 1024, dtype=torch.bfloat16) for _ in range(3)]
    qc.drain_tally()
    with torch.no_grad():
        qc.qkv_attention([x], *layers, 8, 128, head_split_level="medium", force_attention="sdpa",
                         split_floor_tokens=0)
    counted = qc.drain_tally()
    assert counted.splits == {8: 1} and counted.kernels == {"sdpa": 8}
    assert runtime.OVER_QUERIES_MAX_TOKENS == 12288 and runtime.OVER_QUERIES_GROUP_SCALE == 2 / 3
