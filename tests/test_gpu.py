"""qkv_core on CUDA (skipped without it): a Wan 14B-wide self-attention at 480p x 81 frames in bf16, CUDA
allocator peaks. The split equals the unsplit path to bf16 round-off, and bounds the working set."""
from __future__ import annotations

import pytest
import torch

import qkv_core as qc
from benchmarks.memory import measure_peak
from support.reference import RopeTable, WanNorm, make_qkv, randn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU machine)")]

H, D, N = 40, 128, 32760
WIDTH = H * D
ACT = N * WIDTH * 2


@pytest.fixture(scope="module")
def layer():
    device, dtype = torch.device("cuda"), torch.bfloat16
    layers = [m.to(device) for m in make_qkv(WIDTH, H, D, seed=1, dtype=dtype)]
    table = RopeTable(N, D)
    table.cos, table.sin = table.cos.to(device), table.sin.to(device)
    norm = WanNorm(H, H, D, table=table)
    norm.q_weight, norm.k_weight = norm.q_weight.to(device), norm.k_weight.to(device)
    return layers, norm


def run(layer, level):
    layers, norm = layer
    x_list = [randn(1, N, WIDTH, seed=2, dtype=torch.bfloat16).cuda()]
    with torch.no_grad():
        result = measure_peak(qc.qkv_attention, x_list, *layers, H, D, norm, norm_spans_heads=True,
                              head_split_level=level, force_attention="sdpa", device="cuda")
    return result.result, result.peak_bytes / ACT


def test_split_equals_unsplit_and_bounds_memory(layer):
    off, off_peak = run(layer, 0)
    high, high_peak = run(layer, 3)
    assert float((high.float() - off.float()).abs().max()) <= 2e-2 * float(off.float().abs().max())
    print(f"\nCUDA {N} tokens x {WIDTH}: Off {off_peak:.2f}x|x|, High {high_peak:.2f}x|x|")
    assert high_peak <= 1.75
    assert high_peak <= 0.5 * off_peak


def test_missing_kernels_fall_back_to_sdpa(layer):
    q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    out = qc.pay_attention(q, q, q, force_attention="flash")
    ref = qc.pay_attention(q, q, q, force_attention="sdpa")
    assert out.shape == ref.shape
    assert float((out.float() - ref.float()).abs().max()) <= 2e-2


def test_norm_rope_kernel_on_cuda():
    from qkv_core import kernels
    if kernels.triton is None:
        pytest.skip("Triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    storage = torch.randn(2, 1000, 6, 128, device="cuda", generator=g).to(torch.bfloat16)
    view = storage[:, :, 2:4]
    inv = torch.rand(2, 1000, 1, 1, device="cuda", generator=g) + 0.5
    weight = (torch.randn(2, 128, device="cuda", generator=g) * 0.2 + 1).to(torch.bfloat16)
    freqs = torch.randn(1, 1000, 1, 64, 2, 2, device="cuda", generator=g)
    want = kernels.norm_rope_reference(view, inv, weight, freqs)
    assert kernels.norm_rope_(view, inv, weight, freqs)
    diff = (view.float() - want.float()).abs()
    assert float(diff.max()) <= 2 ** -7 * float(want.float().abs().max())   # bf16 round-off (FMA order)
    assert float((diff > 0).float().mean()) < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_q8_and_merge_kernels_on_cuda(dtype):
    """The Triton passes of `dequantize_q8_into` and `merge_lse_` against their PyTorch paths on the GPU."""
    from qkv_core import q8, q8_kernels as kernels
    if kernels.triton is None:
        pytest.skip("Triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    values, scales = q8.quantize_q8(torch.randn(1, 3000, 8, 128, device="cuda", generator=g))
    storage = torch.zeros(2, 3100, 8, 128, device="cuda", dtype=dtype)
    assert kernels.dequantize_q8_(storage[:, 100:], values, scales, q8.GROUP)
    want = (values.float().unflatten(-1, (-1, 32)) * scales.float().unsqueeze(-1)).flatten(-2).to(dtype)
    assert torch.equal(storage[:, 100:], want.expand(2, -1, -1, -1))
    assert float(storage[:, :100].abs().max()) == 0
    out = torch.randn(2, 3000, 8, 128, device="cuda", generator=g).to(dtype)
    other = torch.randn(2, 3000, 8, 128, device="cuda", generator=g).to(dtype)
    lse = torch.randn(2, 8, 3000, device="cuda", generator=g) * 4
    other_lse = torch.randn(2, 8, 3000, device="cuda", generator=g) * 4
    top = torch.maximum(lse, other_lse)
    w1, w2 = torch.exp2(lse - top), torch.exp2(other_lse - top)
    total = w1 + w2
    want_out = (out.float() * (w1 / total).transpose(1, 2).unsqueeze(-1)
                + other.float() * (w2 / total).transpose(1, 2).unsqueeze(-1)).to(dtype)
    want_lse = top + torch.log2(total)
    assert kernels.merge_lse_(out, lse, other, other_lse)
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert float((out.float() - want_out.float()).abs().max()) <= tolerance * float(want_out.float().abs().max())
    assert float((lse - want_lse).abs().max()) <= 1e-4


def test_sage1_staged_core_equals_sageattn_on_cuda():
    """SageAttention 1's staged core (`qkv_core/sage.py`) against its own `sageattn` on the GPU, bitwise, through
    `kv_first_attention` and through a head-split call."""
    pytest.importorskip("sageattention", reason="SageAttention is not installed")
    from sageattention import sageattn
    from qkv_core.sage import Sage1Core  # noqa: F401 - the staged core the backend hands out
    if qc.backends._REGISTRY["sage"].major_version() != 1:
        pytest.skip("the installed SageAttention is not 1.x")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 3000, 8, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    k += 0.5   # biased keys: the smoothing matters
    want = sageattn(q.clone(), k.clone(), v.clone(), tensor_layout="NHD")
    got = qc.kv_first_attention([q.clone(), k.clone(), v.clone()], force_attention="sage")
    assert torch.equal(got, want)


def test_attention_over_queries_on_cuda():
    """The kernel against SDPA (cuDNN or FlashAttention) at a Qwen-Image 1328^2 head group (7,145 tokens, 4 of 24
    heads in the output buffer; also over one key/value head), and a short split call through it: 6 groups at
    Medium, a lower peak than SDPA's 8 groups with their result copies. Head dim 64 is declined."""
    from qkv_core import inplace_attention, runtime
    if inplace_attention.triton is None:
        pytest.skip("Triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    for dim, kv_heads in ((128, 4), (128, 1)):   # one key/value head: grouped-query
        buffer = torch.randn(1, 7145, 24, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        q = buffer[:, :, 4:8]
        k = torch.randn(1, 7145, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        want = qc.pay_attention(q.clone(), k, v, force_attention="sdpa").float()
        rest = buffer[:, :, 8:].clone()
        assert inplace_attention.attend_over_queries_(q, k, v)
        assert float((q.float() - want).abs().max()) <= 2e-2 * float(want.abs().max())
        assert torch.equal(buffer[:, :, 8:], rest)
    small = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16)
    assert not inplace_attention.attend_over_queries_(small, small, small)
    heads, dim, width = 24, 128, 3072
    layers = [torch.nn.Linear(width, heads * dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    x = torch.randn(1, 7145, width, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    results = {}
    for limit in (runtime.OVER_QUERIES_MAX_TOKENS, 0):   # the kernel, then SDPA alone
        saved, runtime.OVER_QUERIES_MAX_TOKENS = runtime.OVER_QUERIES_MAX_TOKENS, limit
        try:
            with torch.no_grad():   # once unmeasured: cuBLAS's workspace is allocated at a process's first product
                qc.qkv_attention([x.clone()], *layers, heads, dim, head_split_level="medium", force_attention="sdpa",
                                 split_floor_tokens=0)
            qc.drain_tally()
            with torch.no_grad():
                measured = measure_peak(qc.qkv_attention, [x.clone()], *layers, heads, dim, head_split_level="medium",
                                        force_attention="sdpa", split_floor_tokens=0, device="cuda")
            results[limit] = (measured.result.float(), measured.peak_bytes, qc.drain_tally())
        finally:
            runtime.OVER_QUERIES_MAX_TOKENS = saved
    (over, over_peak, over_tally), (sdpa, sdpa_peak, sdpa_tally) = results.values()
    assert over_tally.splits == {6: 1} and over_tally.kernels == {"sdpa (Triton, over the queries)": 6}
    assert sdpa_tally.splits == {8: 1}
    assert float((over - sdpa).abs().max()) <= 2e-2 * float(sdpa.abs().max())
    assert over_peak < sdpa_peak, (over_peak / x.nbytes, sdpa_peak / x.nbytes)


def test_repeated_launches_go_straight_to_the_compiled_launcher():
    """`launch.CompiledLaunch` (the norm pass and the attention over queries of every head group after the
    first): the later launches call the compiled kernel's launcher (the Triton versions CI and users run lay its
    arguments out as the kernel's parameters) and give Triton's own launch's numbers bitwise, on views at other
    offsets of one buffer; a tensor aligned otherwise goes back through Triton; a later call's pass of the same
    layout (`launch.shared_launch`) launches straight away."""
    from qkv_core import inplace_attention, kernels, launch
    if kernels.triton is None:
        pytest.skip("Triton is not installed")
    assert launch.triton_problem() is None, launch.triton_problem()   # the installed Triton is called directly
    g = torch.Generator(device="cuda").manual_seed(3)
    buffer = torch.randn(1, 1000, 24, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, 1000, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    by_triton = buffer.clone()
    for start in range(0, 24, 4):   # each group through Triton's own launch (no launch kept from before)
        launch.forget_shared_launches()
        assert inplace_attention.attend_over_queries_(by_triton[:, :, start:start + 4], k, v)
    launch.forget_shared_launches()
    planned = inplace_attention.over_queries_pass(buffer[:, :, 0:4], k, v)
    for start in range(0, 24, 4):
        planned.run(buffer[:, :, start:start + 4], k, v)
    assert planned._launch.direct == 5
    assert torch.equal(buffer, by_triton)
    weight = torch.randn(128, device="cuda", dtype=torch.bfloat16, generator=g)
    freqs = torch.randn(1, 1000, 1, 64, 2, 2, device="cuda", generator=g)
    keys = torch.randn(1, 1000, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    want = keys.clone()
    launch.forget_shared_launches()
    assert kernels.norm_rope_(want, None, weight, freqs, head_norm_eps=1e-6)
    launch.forget_shared_launches()
    norm = kernels.norm_rope_pass(keys, None, weight, freqs, head_norm_eps=1e-6)
    first, second = keys.clone(), keys.clone()
    norm.run(first)
    norm.run(second)
    assert norm._launch.direct == 1 and torch.equal(first, want) and torch.equal(second, want)
    odd = torch.empty(keys.numel() + 1, device="cuda", dtype=keys.dtype)[1:].view(keys.shape)   # 2 bytes off
    odd.copy_(keys)
    assert norm.fits(odd)
    norm.run(odd)
    assert norm._launch.direct == 1   # through Triton (its own specialization: not bitwise the aligned one's)
    assert float((odd.float() - want.float()).abs().max()) <= 2e-2 * float(want.float().abs().max())
    # the next call's pass of the same layout: its first launch goes straight to the launcher, same numbers
    again = kernels.norm_rope_pass(keys, None, weight, freqs, head_norm_eps=1e-6)
    third = keys.clone()
    again.run(third)
    assert again._launch is norm._launch and norm._launch.direct == 2 and torch.equal(third, want)
