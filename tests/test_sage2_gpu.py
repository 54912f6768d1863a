"""SageAttention 2's staged core (`qkv_core/sage2.py`) on the GPU, against SageAttention 2's own unstaged calls
(skipped without CUDA or without a SageAttention 2 build: it is not on PyPI).

- bitwise equal to `sageattn_qk_int8_pv_fp8_cuda_sm90` (sm90) and to `sageattn_qk_int8_pv_fp16_triton` with a mask;
- the natural-log LSE within 0.01 of a float32 reference with biased keys;
- a native prefix (keys smoothed by its own mean, values fp8, its own pass merged by LSE) as close to exact
  attention as one SageAttention call over the joined keys, for every batch item from a batch-1 prefix;
- the runtime routes masked calls to the Triton kernel and native prefixes to the core, split by head groups.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv_core as qc
from support.reference import make_qkv, randn
from support.sage2 import sage2_reason


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(sage2_reason() is not None, reason=str(sage2_reason()))]


def sm90():
    return torch.cuda.get_device_capability() == (9, 0)


def qkv(batch, tokens, heads, dim, seed=0, kv_heads=None, bias=2.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv_heads = kv_heads or heads
    q = torch.randn(batch, tokens, heads, dim, device="cuda", generator=g).bfloat16()
    k = (torch.randn(batch, tokens, kv_heads, dim, device="cuda", generator=g)
         + bias * torch.randn(1, 1, kv_heads, dim, device="cuda", generator=g)).bfloat16()
    v = torch.randn(batch, tokens, kv_heads, dim, device="cuda", generator=g).bfloat16()
    return q, k, v


def exact(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                          v.transpose(1, 2).float(), attn_mask=mask,
                                          enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("tokens,dim,kv_heads", [(4000, 128, 8), (4090, 64, 8), (4096, 128, 2)])
def test_staged_equals_sageattn(tokens, dim, kv_heads):
    """kv_first_attention through the staged core: SageAttention 2's own result, bitwise (4000 tokens: v needs
    zero rows to a multiple of 128; 4090: the transposing kernel's padding suffices; 2 kv heads: GQA)."""
    from qkv_core.sage2 import sage2_reference
    q, k, v = qkv(1, tokens, 8, dim, kv_heads=kv_heads)
    want = sage2_reference(q, k, v)
    got = qc.kv_first_attention([q.clone(), k.clone(), v.clone()], force_attention="sage")
    assert torch.equal(got, want)
    assert rel(got, exact(q, k, v)) < 0.05


def test_head_split_call_matches_unsplit_and_exact():
    """The runtime's split call (projections by groups, the staged core per group) against the unsplit call:
    per-head quantization makes them equal up to the projections' round-off."""
    layers = [m.cuda() for m in make_qkv(1024, 8, 128, seed=1, dtype=torch.bfloat16)]
    x = randn(1, 8192, 1024, seed=2, dtype=torch.bfloat16).cuda()
    split = qc.qkv_attention([x.clone()], *layers, 8, 128, head_split_level=3, force_attention="sage")
    whole = qc.qkv_attention([x.clone()], *layers, 8, 128, head_split_level=0, force_attention="sage")
    exact_ = qc.qkv_attention([x.clone()], *layers, 8, 128, head_split_level=0, force_attention="sdpa")
    assert rel(split, whole) < 0.01 and rel(split, exact_) < 0.08   # random data: SageAttention ~0.05


def test_mask_runs_the_triton_kernel_staged():
    """A tensor mask: the core's Triton mode equals `sageattn_qk_int8_pv_fp16_triton(attn_mask=...)` bitwise."""
    from qkv_core.sage2 import Sage2Core, sage2_reference
    q, k, v = qkv(1, 2048, 8, 128, seed=3)
    mask = torch.rand(1, 1, 2048, 2048, device="cuda") > 0.3
    want = sage2_reference(q, k, v, mask=mask)
    core = Sage2Core()
    settings = core.settings(q.shape, k.shape, q.dtype, q.device, masked=True)
    assert settings.kernel == "triton"
    quantized_v = core.staged_quantize_v([v.clone()], settings)
    quantized_k = core.staged_quantize_k([k.clone()], settings)
    quantized_q = core.staged_quantize_q([q.clone()], settings)
    out = torch.empty_like(q)
    core.staged_attention(out, (quantized_q, quantized_k, quantized_v), settings, mask=mask)
    assert torch.equal(out, want)
    assert rel(out, exact(q, k, v, mask.expand(1, 8, -1, -1))) < 0.05
    # through the runtime: the masked call stays on SageAttention (no SDPA fallback)
    layers = [m.cuda() for m in make_qkv(1024, 8, 128, seed=4, dtype=torch.bfloat16)]
    x = randn(1, 2048, 1024, seed=5, dtype=torch.bfloat16).cuda()
    got = qc.qkv_attention([x.clone()], *layers, 8, 128, attention_mask=mask, force_attention="sage",
                           head_split_level=3, split_floor_tokens=1024)
    ref = qc.qkv_attention([x.clone()], *layers, 8, 128, attention_mask=mask, force_attention="sdpa")
    assert rel(got, ref) < 0.05


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the sm90 kernel")
def test_lse_is_natural_log_within_001():
    from qkv_core.sage2 import Sage2Core
    q, k, v = qkv(1, 2048, 4, 128, seed=6, bias=8.0)
    core = Sage2Core()
    settings = core.settings(q.shape, k.shape, q.dtype, q.device, return_lse=True)
    quantized = (None, core.staged_quantize_k([k.clone()], settings), core.staged_quantize_v([v.clone()], settings))
    quantized = (core.staged_quantize_q([q.clone()], settings), quantized[1], quantized[2])
    out = torch.empty_like(q)
    lse = core.staged_attention(out, quantized, settings)
    scores = torch.einsum("bnhd,bmhd->bhnm", q.float(), k.float()) * 128 ** -0.5
    assert float((lse - torch.logsumexp(scores, -1)).abs().max()) < 0.01


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="native prefixes are the sm90 kernel's")
@pytest.mark.parametrize("batch", [1, 2])
def test_native_prefix_as_close_as_one_call(batch):
    """A 1,000-token native prefix (batch 1, serving every item) attended with 4,096 projected tokens: the
    merged result is as close to exact attention over [prefix, keys] as one SageAttention call over the joined
    keys is (within 25%), and it holds about half the 16-bit prefix's bytes."""
    from qkv_core.sage2 import sage2_reference
    heads, dim = 8, 128
    pk, pv = (t[:1] for t in qkv(1, 1000, heads, dim, seed=7)[1:])
    native = qc.cache_prefix([pk.clone(), pv.clone()], native=True, kit=qc.native_prefix_kit())
    assert native.is_native
    assert sum(t.numel() * t.element_size() for t in native if t is not None) < 0.6 * 2 * pk.numel() * 2
    layers = [m.cuda() for m in make_qkv(heads * dim, heads, dim, seed=8, dtype=torch.bfloat16)]
    x = randn(batch, 4096, heads * dim, seed=9, dtype=torch.bfloat16).cuda()
    got = qc.qkv_attention([x.clone()], *layers, heads, dim, kv_prefix=native, force_attention="sage",
                           head_split_level=3, split_floor_tokens=1024)
    # the same call's q, k, v, to compare with exact attention and with one SageAttention call
    with torch.no_grad():
        q, k, v = (layer(x).view(batch, 4096, heads, dim) for layer in layers)
    k_all = torch.cat([pk.expand(batch, -1, -1, -1), k], 1)
    v_all = torch.cat([pv.expand(batch, -1, -1, -1), v], 1)
    truth = exact(q, k_all, v_all)
    one_call = sage2_reference(q, k_all, v_all)
    assert rel(got, truth) <= 1.25 * rel(one_call, truth) + 1e-3


def test_native_prefix_kit_and_refusals():
    kit = qc.native_prefix_kit()
    assert kit is not None and kit.name == "sage2"
    pk, pv = qkv(1, 64, 2, 96, seed=10)[1:]
    with pytest.raises(ValueError, match="head dim 64 or 128: cache it with native=False"):
        kit.cache_native_prefix([pk, pv])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the sm90 kernel's q layout")
def test_fused_norm_rope_quantize_equals_sageattention_quantizer():
    """One pass of norm + RoPE + per-thread int8 for a strided head group of q against the norm + RoPE pass
    followed by SageAttention 2's own q quantizer: the same scales, and the same int8 values but where the
    compiler contracts the rotation into an FMA differently in the two kernels (2 of 4.1 million values one
    step apart on an H200)."""
    from qkv_core import kernels
    from qkv_core.sage2 import quantize_per_thread
    g = torch.Generator(device="cuda").manual_seed(11)
    storage = torch.randn(1, 4000, 10, 128, device="cuda", generator=g).bfloat16()
    view = storage[:, :, 1:9]
    inv = torch.rand(1, 4000, 1, device="cuda", generator=g) + 0.5
    weight = (torch.randn(8, 128, device="cuda", generator=g) * 0.2 + 1).bfloat16()
    freqs = torch.randn(1, 4000, 1, 64, 2, 2, device="cuda", generator=g)
    normed = view.clone()
    assert kernels.norm_rope_(normed, inv, weight, freqs)
    want_values, want_scales = quantize_per_thread(normed, "q")
    values, scales = kernels.norm_rope_quantize_per_thread(view, inv, weight, freqs)
    assert torch.equal(scales, want_scales)
    steps = (values.int() - want_values.int()).abs()
    assert int(steps.max()) <= 1 and int((steps > 0).sum()) <= 1e-5 * steps.numel()
    # without the rotation there is nothing to contract: bitwise
    normed = view.clone()
    assert kernels.norm_rope_(normed, inv, weight, None)
    want_values, want_scales = quantize_per_thread(normed, "q")
    values, scales = kernels.norm_rope_quantize_per_thread(view, inv, weight, None)
    assert torch.equal(values, want_values) and torch.equal(scales, want_scales)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the sm90 kernel's k layout")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_smooth_quantize_k_equals_sageattention_steps(dtype):
    """The key smoothing and the per-thread k quantizer in one pass (`kernels.smooth_quantize_k_per_thread`):
    bitwise `k -= mean` then SageAttention 2's own quantizer, on a strided head group with a partial tile."""
    from qkv_core import kernels
    from qkv_core.sage2 import quantize_per_thread
    storage = qkv(1, 4001, 6, 128, seed=5)[1].to(dtype)
    k = storage[:, :, 1:4]
    mean = k.mean(dim=1, keepdim=True)
    values, scales = kernels.smooth_quantize_k_per_thread(k, mean)
    want_values, want_scales = quantize_per_thread(k - mean, "k")
    assert torch.equal(values, want_values) and torch.equal(scales, want_scales)


# the kernel `sageattn` runs on an A100 (sm80), staged: on an H200 it runs from a SageAttention build that carries
# it as PTX (TORCH_CUDA_ARCH_LIST="8.0+PTX"), compiled for the H200 by the driver; skipped without one. (The sm89
# kernel, built the same way, crashes inside SageAttention's own call on the H200: sm89 and sm120 stay unstaged.)
@pytest.mark.parametrize("tokens,dim,kv_heads", [(4000, 128, 8), (4090, 64, 2)])
def test_sm80_staged_equals_sageattn(monkeypatch, tokens, dim, kv_heads):
    """The staged sm80 mode (its kernel and quantizers, as `sageattn` picks them on an A100) equals
    SageAttention's own unstaged call of that kernel bitwise, also written into a strided head group of a
    larger output, with GQA and a partial tile."""
    from qkv_core import sage2
    import sageattention
    if not sage2._has_module("sm80_compile"):
        pytest.skip("this SageAttention build has no sm80 kernel")
    monkeypatch.setattr(sage2, "kernel_mode", lambda device, masked: "triton" if masked else "sm80")
    q, k, v = qkv(1, tokens, 8, dim, kv_heads=kv_heads, seed=7)
    want = sageattention.sageattn_qk_int8_pv_fp16_cuda(q, k, v, tensor_layout="NHD", pv_accum_dtype="fp32")
    got = qc.kv_first_attention([q.clone(), k.clone(), v.clone()], force_attention="sage")
    assert torch.equal(got, want)
    assert rel(got, exact(q, k, v)) < 0.05
    core = sage2.Sage2Core()
    settings = core.settings(q.shape, k.shape, q.dtype, q.device)
    assert settings.kernel == "sm80"
    wide = torch.zeros(1, tokens, 12, dim, dtype=q.dtype, device="cuda")
    quantized = (core.staged_quantize_q([q.clone()], settings), core.staged_quantize_k([k.clone()], settings),
                 core.staged_quantize_v([v.clone()], settings))
    core.staged_attention(wide[:, :, 2:10], quantized, settings)
    assert torch.equal(wide[:, :, 2:10], want) and not wide[:, :, :2].any() and not wide[:, :, 10:].any()
