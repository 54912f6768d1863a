"""Triton kernels against their PyTorch paths, on CPU through Triton's interpreter (TRITON_INTERPRET=1, set
in a child process: Triton reads it when the kernels are defined). Skipped when Triton is not installed."""
from __future__ import annotations

import textwrap

import pytest
import torch

from qkv_core import kernels
from support.interpreter import run_in_interpreter

CHECK = textwrap.dedent("""
    import torch
    from qkv_core import kernels
    assert kernels.INTERPRET and kernels.triton is not None
    g = torch.Generator().manual_seed(0)
    cases = 0
    for dtype in (torch.float32, torch.bfloat16):
        for batch, freqs_batch in ((1, 1), (2, 1), (2, 2)):
            tokens, heads, dim = 37, 3, 32                      # tokens not a multiple of the block
            storage = torch.randn(batch, tokens, 5, dim, generator=g).to(dtype)
            inv = torch.rand(batch, tokens, 1, 1, generator=g) + 0.5
            weight = (torch.randn(heads, dim, generator=g) * 0.2 + 1).to(dtype)
            freqs = torch.randn(freqs_batch, tokens, 1, dim // 2, 2, 2, generator=g)
            for args in ((inv, weight, freqs), (None, None, freqs), (inv, weight, None), (inv, None, freqs)):
                view = storage.clone()[:, :, 1:4]                # a strided view, as a head group in place
                before = storage.clone()
                want = kernels.norm_rope_reference(view, *args)
                assert kernels.norm_rope_(view, *args)
                # bf16: the interpreter rounds its casts its own way; a step or two of bf16 either side
                tolerance = 0 if dtype == torch.float32 else 2 ** -6 * float(want.float().abs().max())
                assert float((view.float() - want.float()).abs().max()) <= tolerance, (dtype, batch)
                cases += 1
    # an RMSNorm over each head's channels (Flux's QKNorm): a weight shared by the heads, or none
    for dtype in (torch.float32, torch.bfloat16):
        view = torch.randn(2, 37, 5, 32, generator=g).to(dtype)[:, :, 1:4]
        shared = (torch.randn(32, generator=g) * 0.2 + 1).to(dtype)
        freqs = torch.randn(1, 37, 1, 16, 2, 2, generator=g)
        for weight, table in ((shared, freqs), (None, freqs), (shared, freqs.to(dtype))):   # a 16-bit table too
            target = view.clone()
            want = kernels.norm_rope_reference(target, None, weight, table.float(), head_norm_eps=1e-6)
            assert kernels.norm_rope_(target, None, weight, table, head_norm_eps=1e-6)
            tolerance = 1e-5 * float(want.float().abs().max()) if dtype == torch.float32 else \
                2 ** -6 * float(want.float().abs().max())
            assert float((target.float() - want.float()).abs().max()) <= tolerance, (dtype, weight is None)
            cases += 1
    # what it refuses: an odd or non-power-of-two half head dim, a non-contiguous last dim
    assert not kernels.norm_rope_(torch.randn(1, 4, 2, 24))
    assert not kernels.norm_rope_(torch.randn(1, 4, 32, 2).transpose(2, 3))
    print("cases", cases)
""")


def test_norm_rope_kernel_matches_pytorch_in_the_interpreter():
    assert "cases 30" in run_in_interpreter(CHECK)


def test_without_a_gpu_or_the_interpreter_the_kernel_declines():
    if kernels.INTERPRET:
        pytest.skip("this process runs Triton's interpreter")
    t = torch.randn(1, 8, 2, 32)
    assert kernels.norm_rope_(t, freqs=torch.randn(1, 8, 1, 16, 2, 2)) is False   # the caller's PyTorch path runs


TWO_STREAMS = textwrap.dedent("""
    import torch
    from qkv_core import kernels
    assert kernels.INTERPRET and kernels.triton is not None
    g = torch.Generator().manual_seed(1)
    cases = 0
    for dtype in (torch.float32, torch.bfloat16):
        for split in (5, 16, 30):                                 # inside a block of tokens and on its edge
            storage = torch.randn(2, 37, 5, 32, generator=g).to(dtype)
            weights = [(torch.randn(32, generator=g) * 0.2 + 1).to(dtype) for _ in range(2)]
            freqs = torch.randn(1, 37, 1, 16, 2, 2, generator=g)
            joined, apart = storage.clone()[:, :, 1:4], storage.clone()[:, :, 1:4]
            launch = kernels.norm_rope_launch(joined, None, weights[0], freqs, 1e-6, weight2=weights[1], split=split)
            assert launch is not None
            launch()
            assert kernels.norm_rope_(apart[:, :split], None, weights[0], freqs[:, :split], 1e-6)
            assert kernels.norm_rope_(apart[:, split:], None, weights[1], freqs[:, split:], 1e-6)
            assert torch.equal(joined, apart), (dtype, split)    # one pass, the same numbers as two
            want = kernels.norm_rope_reference(storage[:, :, 1:4], None, weights[0], freqs, 1e-6,
                                               weight2=weights[1], split=split)
            tolerance = 1e-5 if dtype == torch.float32 else 2 ** -6
            assert float((joined.float() - want.float()).abs().max()) <= tolerance * float(want.float().abs().max())
            cases += 1
    t = torch.randn(1, 8, 2, 32)
    assert kernels.norm_rope_launch(t, None, None, None, 1e-6, weight2=torch.ones(32), split=4) is None
    assert kernels.norm_rope_launch(t, None, torch.ones(32), None, 1e-6, weight2=torch.ones(16), split=4) is None
    print("cases", cases)
""")


def test_norm_rope_kernel_two_streams_in_one_pass_in_the_interpreter():
    """Two adjacent streams, each with its own norm weight, in one launch: the numbers of one launch each."""
    assert "cases 6" in run_in_interpreter(TWO_STREAMS)


PASS_REUSE = textwrap.dedent("""
    import gc, weakref
    import torch
    from qkv_core import kernels
    assert kernels.INTERPRET and kernels.triton is not None
    g = torch.Generator().manual_seed(2)
    weights = [(torch.randn(32, generator=g) * 0.2 + 1) for _ in range(2)]
    freqs = torch.randn(1, 37, 1, 16, 2, 2, generator=g)
    first = torch.randn(2, 37, 3, 32, generator=g)
    planned = kernels.norm_rope_pass(first, None, weights[0], freqs, 1e-6, weight2=weights[1], split=9)
    planned.run(first)
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None                                     # the pass keeps no tensor it ran on
    for _ in range(2):                                        # each head group's keys: new tensors, one layout
        keys = torch.randn(2, 37, 3, 32, generator=g)
        want = keys.clone()
        assert kernels.norm_rope_(want[:, :9], None, weights[0], freqs[:, :9], 1e-6)
        assert kernels.norm_rope_(want[:, 9:], None, weights[1], freqs[:, 9:], 1e-6)
        assert planned.fits(keys)
        planned.run(keys)
        assert torch.equal(keys, want)
    assert not planned.fits(torch.randn(2, 37, 4, 32))        # another layout: worked out again
    assert not planned.fits(torch.randn(2, 37, 5, 32)[:, :, :3])
    into = kernels.norm_rope_pass(keys, None, weights[0], freqs, 1e-6, into=torch.empty_like(keys))
    assert into is not None and not into.fits(keys)           # a pass writing elsewhere serves its own tensor
    print("reused")
""")


def test_norm_rope_pass_is_worked_out_once_for_tensors_of_one_layout_in_the_interpreter():
    """A `NormRopePass` runs on later tensors of its layout with the numbers of a launch of their own, and
    holds none of them."""
    assert "reused" in run_in_interpreter(PASS_REUSE)


PASS_LAYOUT_KEPT = textwrap.dedent("""
    import torch
    from qkv_core import kernels, launch
    assert kernels.INTERPRET and kernels.triton is not None
    g = torch.Generator().manual_seed(4)
    def tensors():
        weight = (torch.randn(3, 32, generator=g) * 0.2 + 1)             # (h, D): viewed flat by the pass
        weight2 = (torch.randn(3, 32, generator=g) * 0.2 + 1)
        freqs = torch.randn(1, 37, 1, 2, 16, 2, generator=g).transpose(3, 4)   # not contiguous: copied
        inverse = torch.rand(2, 37, 1, 1, generator=g) + 0.5
        return torch.randn(2, 37, 3, 32, generator=g), weight, weight2, freqs, inverse
    cases = [lambda t, w, w2, f, i: ((t, None, w, f, 1e-6), dict(weight2=w2, split=9)),
             lambda t, w, w2, f, i: ((t, i, w, f), {}),
             lambda t, w, w2, f, i: ((t, None, None, f), {}),
             lambda t, w, w2, f, i: ((t, None, w[0], None), dict(span_eps=1e-6))]
    for case in cases:
        launch.forget_shared_launches()
        first = tensors()
        args, kwargs = case(*first)
        made = kernels.norm_rope_pass(*args, **kwargs)            # worked out, its layout kept
        kept = [v for v in launch._shared.values() if isinstance(v, kernels._PassLayout)]
        assert len(kept) == 1 and not any(torch.is_tensor(a) for a in kept[0].tail)   # no tensor of this call
        second = tensors()
        args2, kwargs2 = case(*second)
        bound = kernels.norm_rope_pass(*args2, **kwargs2)         # bound to the kept layout
        launch.forget_shared_launches()
        fresh = kernels.norm_rope_pass(*args2, **kwargs2)         # worked out again for the same tensors
        assert bound._launch is made._launch and bound._slots == fresh._slots
        assert len(bound._args) == len(fresh._args)
        for a, b in zip(bound._args, fresh._args):
            assert (a is None) == (b is None)
            if torch.is_tensor(a):
                assert torch.equal(a, b) and a.shape == b.shape and a.stride() == b.stride()
            else:
                assert a == b and type(a) is type(b)
        keys = args2[0]
        want = keys.clone()
        fresh.run(want)
        bound.run(keys)
        assert torch.equal(keys, want)
    odd = torch.randn(1, 8, 2, 24)                                 # a head size the kernel declines, twice
    assert kernels.norm_rope_pass(odd) is None and kernels.norm_rope_pass(odd) is None
    print("kept", len(cases))
""")


def test_a_pass_layout_is_kept_and_bound_to_the_next_calls_tensors_in_the_interpreter():
    """`norm_rope_pass` keeps what it works out of an in-place pass's layouts (`_PassLayout`): a later call of
    the same layouts gets its own tensors in place (viewed and copied as the checks view them), the arguments
    and numbers a pass worked out for them gives, and the kept compiled launch."""
    assert "kept 4" in run_in_interpreter(PASS_LAYOUT_KEPT)


def test_without_a_gpu_or_the_interpreter_no_launch_is_made():
    if kernels.INTERPRET:
        pytest.skip("this process runs Triton's interpreter")
    assert kernels.norm_rope_launch(torch.randn(1, 8, 2, 32), freqs=torch.randn(1, 8, 1, 16, 2, 2)) is None
    assert kernels.norm_rope_pass(torch.randn(1, 8, 2, 32), freqs=torch.randn(1, 8, 1, 16, 2, 2)) is None


Q8_AND_MERGE = textwrap.dedent('''
import torch
from qkv_core import kernels, q8, q8_kernels
assert kernels.INTERPRET and kernels.triton is not None
g = torch.Generator().manual_seed(0)
cases = 0
def pytorch_path(fn, *args):
    saved = (q8_kernels.dequantize_q8_, q8_kernels.merge_lse_)
    q8_kernels.dequantize_q8_ = lambda *a: False
    q8_kernels.merge_lse_ = lambda *a: False
    try:
        return fn(*args)
    finally:
        q8_kernels.dequantize_q8_, q8_kernels.merge_lse_ = saved
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for batch, vbatch in ((1, 1), (2, 1), (2, 2)):
        tokens, heads, dim = 37, 3, 64
        values, scales = q8.quantize_q8(torch.randn(vbatch, tokens, heads, dim, generator=g) * 3)
        storage = torch.zeros(batch, tokens + 5, heads + 2, dim, dtype=dtype)
        view = storage[:, 5:, 1:4]                      # a strided view: the prefix part of joined keys
        want = pytorch_path(q8.dequantize_q8_into, torch.empty(batch, tokens, heads, dim, dtype=dtype), values, scales)
        assert q8_kernels.dequantize_q8_(view, values, scales, q8.GROUP)
        tol = 0 if dtype == torch.float32 else 2 ** -7 * float(want.float().abs().max())
        assert float((view.float() - want.float()).abs().max()) <= tol, (dtype, batch, vbatch)
        assert float(storage[:, :5].abs().max()) == 0 and float(storage[:, :, 0].abs().max()) == 0
        cases += 1
    for batch in (1, 2):
        tokens, heads, dim = 37, 3, 32
        out = torch.randn(batch, tokens, heads, dim, generator=g).to(dtype)
        other = torch.randn(batch, tokens, heads, dim, generator=g).to(dtype)
        lse = torch.randn(batch, heads, tokens, generator=g) * 4
        olse = torch.randn(batch, heads, tokens, generator=g) * 4
        lse[:, 0, :3] = -float("inf")                    # queries that saw no key in one part
        olse[:, 0, 2:5] = -float("inf")
        want_out, want_lse = out.clone(), lse.clone()
        pytorch_path(q8.merge_lse_, want_out, want_lse, other, olse)
        got_out, got_lse = out.clone(), lse.clone()
        assert q8_kernels.merge_lse_(got_out, got_lse, other, olse)
        tol = 1e-6 * float(want_out.float().abs().max()) if dtype == torch.float32 else \
            2 ** -7 * float(want_out.float().abs().max())
        assert float((got_out.float() - want_out.float()).abs().max()) <= tol, (dtype, batch)
        finite = torch.isfinite(want_lse)
        assert torch.equal(finite, torch.isfinite(got_lse))
        assert float((got_lse[finite] - want_lse[finite]).abs().max()) <= 1e-5
        cases += 1
# what they refuse: a non-power-of-two head dim, a non-contiguous last dim, 16-bit LSEs
assert not q8_kernels.dequantize_q8_(torch.empty(1, 4, 2, 96), *q8.quantize_q8(torch.randn(1, 4, 2, 96)), q8.GROUP)
assert not q8_kernels.merge_lse_(torch.randn(1, 4, 32, 2).transpose(2, 3), torch.zeros(1, 2, 4),
                              torch.randn(1, 4, 2, 32), torch.zeros(1, 2, 4))
assert not q8_kernels.merge_lse_(torch.randn(1, 4, 2, 32), torch.zeros(1, 2, 4, dtype=torch.float16),
                              torch.randn(1, 4, 2, 32), torch.zeros(1, 2, 4))
print("cases", cases)
''')


def test_q8_and_merge_kernels_match_pytorch_in_the_interpreter():
    """`q8_kernels.dequantize_q8_` (strided outputs, a batch-1 prefix for two items) and `q8_kernels.merge_lse_` (queries
    that saw no key in one part) against `q8`'s PyTorch paths, float32 / fp16 / bf16."""
    assert "cases 15" in run_in_interpreter(Q8_AND_MERGE)


def test_without_a_gpu_the_q8_kernels_decline():
    if kernels.INTERPRET:
        pytest.skip("this process runs Triton's interpreter")
    from qkv_core import q8, q8_kernels
    values, scales = q8.quantize_q8(torch.randn(1, 8, 2, 64))
    assert q8_kernels.dequantize_q8_(torch.empty(1, 8, 2, 64), values, scales, q8.GROUP) is False
    out = torch.randn(1, 8, 2, 64)
    assert q8_kernels.merge_lse_(out, torch.zeros(1, 2, 8), out.clone(), torch.zeros(1, 2, 8)) is False


PER_THREAD = textwrap.dedent('''
import torch
from qkv_core import kernels
assert kernels.INTERPRET and kernels.triton is not None
g = torch.Generator().manual_seed(0)

def per_thread(x):
    """SageAttention 2's per-thread q quantization (sm90 kernel: rows r and r + 8 of each 16 share a scale,
    tiles of 64 rows), in PyTorch: int8 (B, N, H, D) and float32 scales (B, H, tiles * 32)."""
    b, n, h, d = x.shape
    padded = -(-n // 64) * 64
    f = torch.zeros(b, padded, h, d)
    f[:, :n] = x.float()
    w = f.view(b, padded // 16, 2, 8, h, d)
    scale = w.abs().amax(dim=(2, 5)) / 127. + 0.0000001                  # (b, windows, 8, h)
    q = w / scale[:, :, None, :, :, None]
    q = q + 0.5 * torch.where(q >= 0, 1.0, -1.0)
    return q.to(torch.int8).view(b, padded, h, d)[:, :n], scale.permute(0, 3, 1, 2).reshape(b, h, padded // 2)

cases = 0
for dtype in (torch.float32, torch.bfloat16):
    for tokens in (37, 64, 130):                       # a partial tile, one tile, a partial third tile
        storage = torch.randn(2, tokens, 5, 64, generator=g).to(dtype)
        view = storage[:, :, 1:4]                      # a head group of the output buffer, strided
        before = storage.clone()
        inv = torch.rand(2, tokens, 1, generator=g) + 0.5
        weight = (torch.randn(3, 64, generator=g) * 0.2 + 1).to(dtype)
        freqs = torch.randn(1, tokens, 1, 32, 2, 2, generator=g)
        for args in ((inv, weight, freqs), (inv, weight, None), (None, None, freqs)):
            normed = view.clone()
            assert kernels.norm_rope_(normed, *args)
            want_values, want_scales = per_thread(normed)
            values, scales = kernels.norm_rope_quantize_per_thread(view, *args)
            assert torch.equal(storage, before)          # q itself is not written
            assert torch.equal(values, want_values), (dtype, tokens)
            assert torch.equal(scales, want_scales), (dtype, tokens)
            cases += 1
# what it refuses: a head dim over 128 (the sm90 kernel's), a per-head norm
assert kernels.norm_rope_quantize_per_thread(torch.randn(1, 16, 2, 256), torch.ones(1, 16, 1)) is None
print("cases", cases)
''')


def test_norm_rope_quantize_per_thread_matches_the_two_passes_in_the_interpreter():
    """Norm + RoPE + SageAttention 2's per-thread q quantization in one pass: bitwise the norm + RoPE pass
    followed by that quantization (its arithmetic written in PyTorch), for strided head groups and partial
    tiles."""
    assert "cases 18" in run_in_interpreter(PER_THREAD)


SPAN_STATS = textwrap.dedent('''
import torch
from qkv_core import kernels
assert kernels.INTERPRET and kernels.triton is not None
g = torch.Generator().manual_seed(5)
cases = 0
for dtype in (torch.float32, torch.bfloat16):
    for tokens in (37, 130):
        t = (torch.randn(2, tokens, 4, 64, generator=g) * 2).to(dtype)   # every head of a chunk of tokens
        weight = (torch.randn(4, 64, generator=g) * 0.2 + 1).to(dtype)
        freqs = torch.randn(1, tokens, 1, 32, 2, 2, generator=g)
        eps = 1e-6
        # the inverse RMS over every head, as the model's RMSNorm over the full width takes it
        inv = torch.rsqrt(t.float().square().mean(dim=(-2, -1)) + eps).unsqueeze(-1)
        for w, f in ((weight, freqs), (None, freqs), (weight, None)):
            given, taken = t.clone(), t.clone()
            assert kernels.norm_rope_(given, inv, w, f)
            assert kernels.norm_rope_(taken, None, w, f, span_eps=eps)
            # the same statistics summed in another order: a float32 rounding apart, a bf16 step at most
            tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
            assert float((taken.float() - given.float()).abs().max()) <= tolerance * float(given.float().abs().max())
            # `into`: the same result written into another tensor (here a strided view of a wider buffer, as the
            # runtime's reuse of its input writes k into x's rows), t itself not changed
            wider = torch.zeros(2, tokens + 3, 4, 64, dtype=dtype)
            source = t.clone()
            assert kernels.norm_rope_(source, None, w, f, span_eps=eps, into=wider[:, 1:tokens + 1])
            assert torch.equal(source, t) and torch.equal(wider[:, 1:tokens + 1], taken)
            assert not wider[:, 0].any() and not wider[:, tokens + 1:].any()
            if dtype == torch.bfloat16:
                want, want_scales = kernels.norm_rope_quantize_per_thread(t, inv, w, f)
                got, got_scales = kernels.norm_rope_quantize_per_thread(t, None, w, f, span_eps=eps)
                assert int((got.int() - want.int()).abs().max()) <= 1   # an int8 step where a rounding tips
                assert torch.allclose(got_scales, want_scales, rtol=2 ** -7)
            cases += 1
# not both: given statistics and statistics to take; `into` of another shape or dtype, or beside quantize_into
assert kernels.norm_rope_launch(t, inv, None, None, span_eps=1e-6) is None
assert kernels.norm_rope_launch(t, None, None, None, span_eps=1e-6, into=t[:, 1:].clone()) is None
assert kernels.norm_rope_launch(t, None, None, None, span_eps=1e-6, into=t.float()) is None
assert kernels.norm_rope_launch(t, None, None, None, span_eps=1e-6, into=t.clone(), quantize_into=(t, t)) is None
print("cases", cases)
''')


def test_norm_rope_takes_the_statistics_over_every_head_in_its_pass_in_the_interpreter():
    """`span_eps`: the norm over every head (Wan's) takes each token's inverse RMS in the pass itself, where the
    caller would reduce the chunk first: the numbers of the given statistics, for the in-place pass, the one
    written into another tensor (`into`) and the quantizing one."""
    assert "cases 12" in run_in_interpreter(SPAN_STATS)


SMOOTH_K = textwrap.dedent('''
import torch
from qkv_core import kernels
assert kernels.INTERPRET and kernels.triton is not None
g = torch.Generator().manual_seed(0)

def per_thread_k(x, tile):
    """SageAttention 2's per-thread k quantization (tiles of `tile` keys: 128 for sm90, 64 for sm80; rows
    8 i + 2 j and 8 i + 2 j + 1 share scale j of the tile), in PyTorch: int8 (B, N, H, D), float32 scales
    (B, H, tiles * 4)."""
    b, n, h, d = x.shape
    padded = -(-n // tile) * tile
    f = torch.zeros(b, padded, h, d)
    f[:, :n] = x.float()
    w = f.view(b, padded // tile, tile // 8, 4, 2, h, d)                 # tile, i, j, pair, head, channel
    scale = w.abs().amax(dim=(2, 4, 6)) / 127. + 0.0000001                # (b, tiles, 4, h)
    q = w / scale[:, :, None, :, None, :, None]
    q = q + 0.5 * torch.where(q >= 0, 1.0, -1.0)
    return q.to(torch.int8).view(b, padded, h, d)[:, :n], scale.permute(0, 3, 1, 2).reshape(b, h, padded // tile * 4)

cases = 0
for dtype, tile in ((torch.float16, 128), (torch.bfloat16, 128), (torch.bfloat16, 64)):
    for tokens in (37, 128, 300):                      # a partial tile, one tile, a partial third tile
        for mean_batch in (1, 2):
            storage = (torch.randn(2, tokens, 5, 64, generator=g) + 3).to(dtype)
            k = storage[:, :, 1:4]                     # a head group, strided
            before = storage.clone()
            mean = k.mean(dim=1, keepdim=True)[:mean_batch]
            smoothed = k.float() - mean.float()        # `k -= mean`: float32, rounded to k's dtype
            if dtype == torch.bfloat16:                # as the interpreter rounds bf16: truncated (a GPU: to
                smoothed = (smoothed.view(torch.int32) & -65536).view(torch.float32)   # nearest, as PyTorch)
            want_values, want_scales = per_thread_k(smoothed.to(dtype), tile)
            values, scales = kernels.smooth_quantize_k_per_thread(k, mean, tile)
            assert torch.equal(storage, before)          # k itself is not written
            assert torch.equal(values, want_values), (dtype, tile, tokens, mean_batch)
            assert torch.equal(scales, want_scales), (dtype, tile, tokens, mean_batch)
            cases += 1
# what it declines: float32, a head dim that is not a power of two, a mean of another shape
assert kernels.smooth_quantize_k_per_thread(torch.randn(1, 16, 2, 64), torch.zeros(1, 1, 2, 64)) is None
assert kernels.smooth_quantize_k_per_thread(torch.randn(1, 16, 2, 48).half(), torch.zeros(1, 1, 2, 48).half()) is None
assert kernels.smooth_quantize_k_per_thread(torch.randn(1, 16, 2, 64).half(), torch.zeros(1, 1, 3, 64).half()) is None
print("cases", cases)
''')


def test_smooth_quantize_k_matches_the_two_passes_in_the_interpreter():
    """SageAttention 2's key smoothing and per-thread k quantization in one pass: bitwise `k -= mean` followed
    by that quantization (its arithmetic written in PyTorch), for the sm90 and sm80 tiles, strided head
    groups, partial tiles and a batch-1 mean (a native prefix's) over two batch items. (On a GPU, against SageAttention's own quantizer:
    tests/test_sage2_gpu.py.)"""
    assert "cases 18" in run_in_interpreter(SMOOTH_K)
