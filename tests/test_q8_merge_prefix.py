"""The q8 key/value format, log-sum-exp merges and the prefix cache (docs/design.md §2.6, §2.7), PyTorch paths."""
from __future__ import annotations

import logging
import math

import pytest
import torch

import qkv_core as qc
from qkv_core import q8 as q8mod

SLACK = 1 + 2 ** -10  # the fp16 rounding of the scale


@pytest.fixture(autouse=True)
def _notices():
    qc.reset_notices()
    yield
    qc.reset_notices()


def spread(*shape, seed=0, dtype=torch.float32):
    """Values in normal fp16 range with magnitudes varying per token and per 32-channel group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    mag = 10.0 ** (torch.rand(*shape[:-1], shape[-1] // 32, 1, generator=g) * 4 - 1.5)  # 0.03 .. 300
    return (x.unflatten(-1, (-1, 32)) * mag).flatten(-2).to(dtype)


def group_max(x):
    return x.double().unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)


def assert_q8_close(deq, x):
    err = (deq.double() - x.double()).unflatten(-1, (-1, 32)).abs()
    bound = group_max(x) / 254 * SLACK
    assert bool((err <= bound).all()), f"worst {(err / bound).max().item():.4f} of the bound"


# --- q8 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_q8_round_trip_shapes_and_dtypes(dtype):
    x = spread(2, 300, 3, 64, seed=1, dtype=dtype)
    before = x.clone()
    values, scales = q8mod.quantize_q8(x)
    assert torch.equal(x, before)  # the input is not changed
    assert values.shape == x.shape and values.dtype == torch.int8
    assert scales.shape == (2, 300, 3, 2) and scales.dtype == torch.float16
    assert int(values.abs().max()) <= 127
    # each group's scale is max|x| / 127 in fp16
    want = (group_max(x).squeeze(-1) / 127).to(torch.float16)
    assert torch.allclose(scales.double(), want.double(), rtol=2 ** -10, atol=0)
    for out_dtype in (torch.float32, torch.bfloat16):
        deq = q8mod.dequantize_q8(values, scales, out_dtype)
        assert deq.dtype == out_dtype and deq.shape == x.shape
        if out_dtype == torch.float32:
            assert_q8_close(deq, x)
    assert q8mod.dequantize_q8(values, scales).dtype == torch.bfloat16


def test_q8_zero_group():
    x = torch.zeros(1, 5, 1, 64)
    x[..., 32:] = 1.0
    values, scales = q8mod.quantize_q8(x)
    deq = q8mod.dequantize_q8(values, scales, torch.float32)
    assert torch.isfinite(deq).all()
    assert torch.equal(deq[..., :32], torch.zeros(1, 5, 1, 32))
    assert_q8_close(deq, x)


def test_q8_chunks_across_4096_token_boundaries():
    assert q8mod.CHUNK_TOKENS == 4096
    x = spread(1, 9000, 2, 64, seed=2)
    values, scales = q8mod.quantize_q8(x)
    # the same as one unchunked pass of the rule
    part = x.unflatten(-1, (-1, 32))
    scale16 = (part.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-8).to(torch.float16)
    want = (part / scale16.float().clamp_min(1e-8)).round().clamp(-127, 127).flatten(-2).to(torch.int8)
    assert torch.equal(values, want)
    assert torch.equal(scales, scale16.squeeze(-1))
    deq = q8mod.dequantize_q8(values, scales, torch.float32)
    assert_q8_close(deq, x)
    for edge in (4095, 4096, 8191, 8192, 8999):
        assert_q8_close(deq[:, edge:edge + 1], x[:, edge:edge + 1])


def test_dequantize_into_view_with_batch_broadcast():
    x = spread(1, 4200, 2, 32, seed=3)
    values, scales = q8mod.quantize_q8(x)
    joined = torch.full((3, 10 + 4200 + 7, 2, 32), 5.0)
    view = joined[:, 10:10 + 4200]
    assert q8mod.dequantize_q8_into(view, values, scales) is view
    for b in range(3):
        assert_q8_close(joined[b:b + 1, 10:4210], x)
    assert bool((joined[:, :10] == 5).all()) and bool((joined[:, 4210:] == 5).all())
    # a strided view over heads too (e.g. one head of a buffer)
    buf = torch.zeros(2, 4200, 4, 32, dtype=torch.bfloat16)
    q8mod.dequantize_q8_into(buf[:, :, 1:3], values, scales)
    assert torch.equal(buf[:, :, 1:3].float(), q8mod.dequantize_q8(values, scales, torch.bfloat16).expand(2, -1, -1, -1)
                       .float())
    assert bool((buf[:, :, 0] == 0).all()) and bool((buf[:, :, 3] == 0).all())


# --- merge_lse_ ----------------------------------------------------------------------------------------
def partial64(q, k, v):
    """float64 attention of q over k/v and its base-2 log-sum-exp `(batch, heads, tokens)`."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v.double())
    return out, lse / math.log(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_lse_equals_joined_keys(dtype):
    g = torch.Generator().manual_seed(4)
    b, n, h, d = 2, 4100, 2, 16  # crosses the 4096-token chunk
    q = torch.randn(b, n, h, d, generator=g)
    k1, v1 = torch.randn(b, 40, h, d, generator=g) * 2, torch.randn(b, 40, h, d, generator=g)
    k2, v2 = torch.randn(b, 24, h, d, generator=g), torch.randn(b, 24, h, d, generator=g)
    o1, l1 = partial64(q, k1, v1)
    o2, l2 = partial64(q, k2, v2)
    want, want_lse = partial64(q, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1))
    out, lse = o1.to(dtype), l1.float()
    other, other_lse = o2.to(dtype), l2.float()
    other_before, other_lse_before = other.clone(), other_lse.clone()
    assert q8mod.merge_lse_(out, lse, other, other_lse) is None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < tol
    assert ((lse.double() - want_lse).abs().max()).item() < 1e-4
    assert lse.dtype == torch.float32 and out.dtype == dtype
    assert torch.equal(other, other_before) and torch.equal(other_lse, other_lse_before)  # only read


def test_merge_lse_with_a_part_that_saw_no_keys():
    g = torch.Generator().manual_seed(5)
    b, n, h, d = 1, 64, 2, 16
    q = torch.randn(b, n, h, d, generator=g)
    k1, v1 = torch.randn(b, 10, h, d, generator=g), torch.randn(b, 10, h, d, generator=g)
    k2, v2 = torch.randn(b, 12, h, d, generator=g), torch.randn(b, 12, h, d, generator=g)
    o1, l1 = partial64(q, k1, v1)
    o2, l2 = partial64(q, k2, v2)
    joined, joined_lse = partial64(q, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1))
    out, lse, other, other_lse = o1.float(), l1.float(), o2.float(), l2.float()
    # queries 0-9 saw no key in the other part; queries 10-19 saw none in the first
    other_lse[:, :, :10] = float("-inf")
    other[:, :10] = 0.0
    lse[:, :, 10:20] = float("-inf")
    out[:, 10:20] = 0.0
    q8mod.merge_lse_(out, lse, other, other_lse)
    assert torch.allclose(out[:, :10].double(), o1[:, :10], rtol=0, atol=1e-6)
    assert torch.allclose(lse[:, :, :10].double(), l1[:, :, :10], rtol=0, atol=1e-5)
    assert torch.allclose(out[:, 10:20].double(), o2[:, 10:20], rtol=0, atol=1e-6)
    assert torch.allclose(out[:, 20:].double(), joined[:, 20:], rtol=0, atol=1e-5)
    assert torch.allclose(lse[:, :, 20:].double(), joined_lse[:, :, 20:], rtol=0, atol=1e-4)
    # neither part saw a key: stays -inf, output zero, nothing NaN
    out2, lse2 = torch.zeros(1, 3, 1, 4), torch.full((1, 1, 3), float("-inf"))
    q8mod.merge_lse_(out2, lse2, torch.zeros(1, 3, 1, 4), torch.full((1, 1, 3), float("-inf")))
    assert bool(torch.isneginf(lse2).all()) and torch.equal(out2, torch.zeros(1, 3, 1, 4))


# --- prefixes ------------------------------------------------------------------------------------------
def test_cache_prefix_q8_and_notice(caplog):
    caplog.set_level(logging.INFO, logger="qkv_core")
    k, v = spread(1, 50, 2, 64, seed=6), spread(1, 50, 2, 64, seed=7)
    kv = [k.clone(), v.clone()]
    prefix = qc.cache_prefix(kv, native=False)
    assert kv == [] and isinstance(prefix, qc.KVPrefix) and not prefix.is_native and prefix.tokens == 50
    assert prefix.k_mean is None and prefix.v_mean is None
    assert all(torch.is_tensor(t) for t in (prefix.k, prefix.k_scale, prefix.v, prefix.v_scale))
    assert not caplog.records
    dk, dv = qc.dequantize_prefix(prefix, torch.float32)
    assert_q8_close(dk, k)
    assert_q8_close(dv, v)
    # native=True on a machine without a staged core: q8, said once
    for _ in range(2):
        native = qc.cache_prefix([k.clone(), v.clone()])
        assert not native.is_native and torch.equal(native.k, prefix.k)
    assert len([r for r in caplog.records if "cached as q8" in r.getMessage()]) == 1


def test_q8_prefix_wraps_without_copy():
    kq, ks = q8mod.quantize_q8(spread(30, 2, 64, seed=8).unsqueeze(0))
    vq, vs = q8mod.quantize_q8(spread(30, 2, 64, seed=9).unsqueeze(0))
    prefix = qc.q8_prefix(kq[0], ks[0], vq[0], vs[0])  # 3-D: batch 1
    assert prefix.k.shape == (1, 30, 2, 64) and prefix.k.data_ptr() == kq.data_ptr()
    assert prefix.v_scale.data_ptr() == vs.data_ptr()
    prefix4 = qc.q8_prefix(kq, ks.float(), vq, vs)  # float32 scales are converted
    assert prefix4.k_scale.dtype == torch.float16 and prefix4.k.data_ptr() == kq.data_ptr()


def store_tensors(blocks, seed, dtype=torch.float32, tokens=40):
    out = []
    for i in range(blocks):
        out.append((spread(1, tokens + i, 2, 32, seed=seed + 2 * i, dtype=dtype),
                    spread(1, tokens + i, 2, 32, seed=seed + 2 * i + 1, dtype=dtype)))
    return out


def assert_layer_equal(layer, k, v, quantize):
    got = layer.kv_prefix()
    if quantize:
        assert isinstance(got, qc.KVPrefix)
        dk, dv = qc.dequantize_prefix(got, torch.float32)
        assert_q8_close(dk, k)
        assert_q8_close(dv, v)
        gk, gv = layer.get(torch.float32)
        assert torch.equal(gk, dk) and torch.equal(gv, dv)
        assert layer.get()[0].dtype == torch.bfloat16  # the cache's dtype
    else:
        gk, gv = got
        assert torch.equal(gk, k) and torch.equal(gv, v)
        gk, gv = layer.get()
        assert torch.equal(gk, k) and torch.equal(gv, v)
        assert layer.get(torch.bfloat16)[0].dtype == torch.bfloat16


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("ram", [False, True])
def test_prefix_cache_store_and_read(quantize, ram):
    cache = qc.PrefixCache(3, quantize=quantize, native=False, ram=ram)
    assert len(cache) == 3 and cache[2].index == 2
    data = store_tensors(3, seed=10)
    for i, (k, v) in enumerate(data):
        handed_k, handed_v = k.clone(), v.clone()
        cache[i].store(handed_k, handed_v)
        handed_k.add_(1.0)  # the caller changing its tensors later does not change the cache
        handed_v.mul_(-1.0)
        assert cache[i].populated
    for _ in range(2):
        for i, (k, v) in enumerate(data):
            assert_layer_equal(cache[i], k, v, quantize)
    if quantize:
        full = sum(k.numel() * 2 + v.numel() * 2 for k, v in data)  # 16-bit bytes
        assert cache.nbytes() < 0.6 * full
    else:
        assert cache.nbytes() == sum(k.numel() * 4 + v.numel() * 4 for k, v in data)
    if not ram:
        assert cache.ring_nbytes() == 0


@pytest.mark.parametrize("quantize", [False, True])
def test_prefix_cache_ram_ring_streaming(quantize):
    blocks = 4
    cache = qc.PrefixCache(blocks, quantize=quantize, native=False, ram=True)
    data = store_tensors(blocks, seed=20, tokens=64)
    for i, (k, v) in enumerate(data):
        cache[i].store(k.clone(), v.clone())
    layer_bytes = [cache[i].nbytes() for i in range(blocks)]
    copies = []
    copy = cache._copy_into_slot

    def recording(layer, slot):
        copies.append(layer.index)
        copy(layer, slot)
    cache._copy_into_slot = recording
    # blocks in order, then the wrap to block 0 of the next step
    for step, i in enumerate(list(range(blocks)) + [0, 1]):
        assert_layer_equal(cache[i], *data[i], quantize)
        assert cache.ring_nbytes() <= 2 * max(layer_bytes)
    # each block was streamed once ahead of its use (the first on demand), the next step's block 0 too
    assert copies == [0, 1, 2, 3, 0, 1, 2]


def test_prefix_cache_clear_and_keep_ring():
    cache = qc.PrefixCache(2, quantize=True, native=False, ram=True)
    data = store_tensors(2, seed=30)
    for i, (k, v) in enumerate(data):
        cache[i].store(k.clone(), v.clone())
    first = cache[0].kv_prefix()
    ring_bytes = cache.ring_nbytes()
    assert ring_bytes > 0
    cache.clear(keep_ring=True)
    assert cache.ring_nbytes() == ring_bytes and cache.nbytes() == 0
    with pytest.raises(RuntimeError, match="KV cache has not been populated yet."):
        cache[0].kv_prefix()
    new = store_tensors(2, seed=40)  # e.g. a step-dependent LoRA changed the prefix
    for i, (k, v) in enumerate(new):
        cache[i].store(k.clone(), v.clone())
    again = cache[0].kv_prefix()
    assert again.k.data_ptr() == first.k.data_ptr()  # the ring's buffers are reused
    assert_layer_equal(cache[0], *new[0], True)
    assert_layer_equal(cache[1], *new[1], True)
    cache.clear()
    assert cache.ring_nbytes() == 0 and cache.nbytes() == 0
    assert not cache[0].populated and not cache[1].populated


def test_prefix_cache_empty_layer_raises():
    for cache in (qc.PrefixCache(2), qc.PrefixCache(2, quantize=True, ram=True)):
        with pytest.raises(RuntimeError, match=r"^KV cache has not been populated yet\.$"):
            cache[1].kv_prefix()
        with pytest.raises(RuntimeError, match=r"^KV cache has not been populated yet\.$"):
            cache[0].get()
    cache = qc.PrefixCache(1)
    cache[0].store(*store_tensors(1, seed=50)[0])
    cache[0].clear()
    with pytest.raises(RuntimeError, match="KV cache has not been populated yet."):
        cache[0].kv_prefix()
