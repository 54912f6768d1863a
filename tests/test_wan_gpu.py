"""The bounded Wan block on CUDA (skipped without CUDA or ComfyUI): ComfyUI's own `WanAttentionBlock`, random
weights, 16 heads of 32 (512 wide), 16,384 tokens. On CUDA the adapter takes paths the CPU tests cannot reach
(the fused norm + RoPE Triton kernel for whole and split tensors, products straight into the output buffer,
CUDA allocator peaks), so they are checked here against the block's own forward and for their peak."""
from __future__ import annotations

import sys

import pytest
import torch

from support import comfy_env

pytestmark = [pytest.mark.gpu, pytest.mark.comfyui,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU machine)")]

WIDTH, HEADS, FFN, TOKENS, GRID = 512, 16, 1536, 16384, (4, 64, 64)


@pytest.fixture(scope="module")
def env():
    """The adapter loaded the way the benchmark loads it (`benchmarks.bench.load_comfyui_workload`): no
    `comfy.sample` (torchsde) and no `comfy_api` (pydantic, av) needed, so a bare GPU machine runs it."""
    comfy_env.load_on_cuda()
    from benchmarks import bench
    import comfy.ldm.wan.model as wan_model
    import comfy.ops
    modules = {name: sys.modules[f"{bench.PACK_PACKAGE}.{name}"]
               for name in ("benchmarks.wan_block", "nodes.families.wan", "nodes.dispatch", "benchmarks.memory")}
    wan_block, wan = modules["benchmarks.wan_block"], modules["nodes.families.wan"]
    memory = modules["benchmarks.memory"]
    config = modules["nodes.dispatch"].QKVConfig

    def build(dtype, heads=HEADS):
        settings = {"operations": comfy.ops.disable_weight_init, "device": torch.device("cuda"), "dtype": dtype}
        block = wan_model.WanAttentionBlock("t2v_cross_attn", WIDTH, FFN, heads, qk_norm=True,
                                            cross_attn_norm=True, eps=1e-6, operation_settings=settings)
        wan_block.fill_random_(block, 0)
        block = block.eval().requires_grad_(False)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(1, TOKENS, WIDTH, generator=generator).to("cuda", dtype)
        e = (torch.randn(1, 1, 6, WIDTH, generator=generator) * 0.1).to("cuda", dtype)
        context = torch.randn(1, 64, WIDTH, generator=generator).to("cuda", dtype)
        freqs = wan_block.rope_freqs(GRID, TOKENS, torch.device("cuda"), dtype, WIDTH // heads)
        return block, x, dict(e=e, freqs=freqs, context=context)

    return build, wan, config, memory


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_cast_linear_gelu_runs_in_the_product_epilogue(env):
    """`CastLinear.gelu` on CUDA: one `torch._addmm_activation` (cuBLASLt's GELU epilogue, the tanh
    approximation) whose result is the product then the GELU, but for the rounding of the product before the
    GELU: within a bf16 step of it. The exact GELU takes the two steps."""
    import comfy.ops
    from benchmarks import bench
    comfy_ops = sys.modules[f"{bench.PACK_PACKAGE}.nodes.comfy_ops"]
    linear = comfy.ops.disable_weight_init.Linear(WIDTH, FFN, device="cuda", dtype=torch.bfloat16)
    generator = torch.Generator(device="cuda").manual_seed(3)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator, device="cuda") / WIDTH ** 0.5)
        linear.bias.copy_(0.1 * torch.randn(linear.bias.shape, generator=generator, device="cuda"))
        x = torch.randn(1, 4096, WIDTH, generator=generator, device="cuda").to(torch.bfloat16)
        cast = comfy_ops.CastLinear(linear, x)
        with comfy_env.TorchCalls(torch, torch._addmm_activation) as epilogue:
            fused = cast.gelu(x, "tanh")
            exact = cast.gelu(x, "none")
        product = linear(x)
        two_steps = torch.nn.functional.gelu(product, approximate="tanh")
    assert len(epilogue.calls) == 1
    assert fused.shape == two_steps.shape and fused.dtype == torch.bfloat16
    # the product's rounding moves the GELU's input by half a bf16 step (its slope is at most ~1.13)
    bound = 2.0 ** -7 * (1.2 * product.float().abs() + two_steps.float().abs()) + 1e-6
    assert bool(((fused.float() - two_steps.float()).abs() <= bound).all())
    assert torch.equal(exact, torch.nn.functional.gelu(product))


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_bounded_block_equals_stock_float32(env, no_tf32, level):
    build, wan, config, _ = env
    block, x, inputs = build(torch.float32)
    with torch.no_grad():
        stock = block(x, **inputs)
        ours = wan.bounded_block_forward(block, config(level, "sdpa", True))(x, **inputs)
    assert rel_err(ours, stock) <= 1e-4, level


def test_bounded_block_bf16_close_and_bounded(env):
    """bf16 at High: within a few bf16 steps of stock, and the CUDA allocator's peak (above the inputs and
    weights, the output included) at most 2.5 x |x| and at most 0.4 x stock's."""
    build, wan, config, memory = env
    block, x, inputs = build(torch.bfloat16)
    unit = x.numel() * x.element_size()
    forward = wan.bounded_block_forward(block, config(3, "sdpa", True))
    with torch.no_grad():
        stock = memory.measure_peak(block, x, device=x.device, **inputs)
        ours = memory.measure_peak(forward, x, device=x.device, **inputs)
    assert rel_err(ours.result, stock.result) <= 2e-2
    assert ours.peak_bytes <= 2.5 * unit, ours.peak_bytes / unit
    assert ours.peak_bytes <= 0.4 * stock.peak_bytes, (ours.peak_bytes / unit, stock.peak_bytes / unit)
    # the planner's estimate (measured on the CPU) holds for the CUDA allocator's peak too
    estimate = wan.SPEC.measured.working_sets["block"].bounded(16)
    print(f"\nWan block CUDA bf16: stock {stock.peak_bytes / unit:.2f} x |x|, High {ours.peak_bytes / unit:.2f}; "
          f"planner {wan.SPEC.measured.working_sets['block'].stock:.2f} / {estimate:.2f}")
    assert abs(estimate - ours.peak_bytes / unit) <= 0.15 * ours.peak_bytes / unit


def _sage2_sm90_reason():
    from support.sage2 import sage2_reason
    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        return "needs an sm90 GPU (SageAttention 2's staged sm90 core)"
    return sage2_reason()


@pytest.mark.skipif(_sage2_sm90_reason() is not None, reason=str(_sage2_sm90_reason()))
@pytest.mark.parametrize("level", [1, 3])
def test_bounded_block_on_sage2_reuses_its_modulated_input(env, monkeypatch, level):
    """On SageAttention 2's sm90 core the bounded block hands its modulated input over for good
    (`reuse_input`): the self-attention keeps its keys and writes its result in that storage and projects k
    once, the keys written there by the norm's pass. Against the usual staged split: the same output but for
    the keys' mean summed in another order, a peak no higher, and stock's output within SageAttention's
    error. 8 heads of 64 (SageAttention's head dims are 64 and 128)."""
    import qkv_core.runtime as runtime   # the adapter's runtime (the benchmark loader shares the module)
    build, wan, config, memory = env
    block, x, inputs = build(torch.bfloat16, heads=8)
    unit = x.numel() * x.element_size()
    forward = wan.bounded_block_forward(block, config(level, "sage", True))
    runs, written_into = [], []
    reuse = runtime.run_in_input
    key_into = wan.SpanningNormRope.key_into

    def counted(*args, **kwargs):
        runs.append(1)
        return reuse(*args, **kwargs)

    def recorded(self, *args):
        written_into.append(key_into(self, *args))
        return written_into[-1]
    monkeypatch.setattr(runtime, "run_in_input", counted)
    monkeypatch.setattr(wan.SpanningNormRope, "key_into", recorded)
    with torch.no_grad():
        stock = memory.measure_peak(block, x, device=x.device, **inputs)
        reused = memory.measure_peak(forward, x, device=x.device, **inputs)
        runs_reused = len(runs)
        assert runs_reused, "the block's self-attention did not run in its input"
        # its keys went into the input's rows by the norm's own pass (`norm_key_into`), bitwise what the norm
        # in place and a copy give
        assert written_into and all(written_into)
        monkeypatch.setattr(wan.SpanningNormRope, "key_into", lambda self, *args: False)
        copied = forward(x, **inputs)
        assert torch.equal(copied, reused.result)
        del copied
        runs_reused = len(runs)
        monkeypatch.setattr(runtime, "reuse_reason", lambda *args: "switched off by the test")
        usual = memory.measure_peak(forward, x, device=x.device, **inputs)
    assert len(runs) == runs_reused
    assert rel_err(reused.result, usual.result) <= 1e-2
    assert rel_err(reused.result, stock.result) <= 5e-2
    print(f"\nWan block, SageAttention 2, level {level}: stock {stock.peak_bytes / unit:.2f} x |x|, usual split "
          f"{usual.peak_bytes / unit:.2f}, input reused {reused.peak_bytes / unit:.2f}")
    assert reused.peak_bytes <= usual.peak_bytes + 0.02 * unit
