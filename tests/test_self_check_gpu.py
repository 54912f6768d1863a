"""The self-check on CUDA, where fp8-scaled layers run real fp8 matmuls (their inputs quantized per call): a Wan
14B-wide block (ComfyUI's own `WanAttentionBlock`, 5120 wide, 40 heads, random weights at a trained model's
scale) with fp8-scaled weights in both file layouts, cond + uncond in one call, the uncond item's text zeroed
as ConditioningZeroOut gives it (the item the check takes). The bounded block keeps its check (no fallback) and
is as near the float32 reference as ComfyUI's own block. Skipped without CUDA or ComfyUI (nodes/compat.py)."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

from support import comfy_env

pytestmark = [pytest.mark.gpu, pytest.mark.comfyui,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU machine)")]

TOKENS, GRID = 2048, (2, 32, 32)   # an item's tokens (the check takes the first 256 of the first item)


@pytest.fixture(scope="module")
def env():
    comfy_env.load_on_cuda()
    from benchmarks import bench
    import comfy.ops
    if not hasattr(comfy.ops, "mixed_precision_ops") or not hasattr(comfy.ops, "CastBiasWeightContext"):
        pytest.skip("this ComfyUI has no mixed-precision (fp8-scaled) ops with row slices")
    return {name: sys.modules[f"{bench.PACK_PACKAGE}.{name}"]
            for name in ("benchmarks.wan_block", "nodes.families.wan", "nodes.compat", "nodes.dispatch", "qkv_core")}


def _block(env, layout: str):
    """The benchmark's fp8-scaled block (a per-layer `comfy_quant` entry), or the same weights stored as
    Comfy-Org's `*_fp8_scaled` files store them and converted by ComfyUI's `convert_old_quants`."""
    import comfy.ldm.wan.model as wan_model
    import comfy.ops
    wan_block = env["benchmarks.wan_block"]
    device = torch.device("cuda")
    block = wan_block.build_block(device, torch.bfloat16, 0, weight_dtype=wan_block.FP8_SCALED)
    if layout == "comfy_quant":
        return block
    state = comfy_env._as_scaled_fp8_file(dict(block.state_dict()), "float8_e4m3fn", False)
    settings = {"operations": comfy.ops.mixed_precision_ops({}, torch.bfloat16), "device": device,
                "dtype": torch.bfloat16}
    converted = wan_model.WanAttentionBlock("t2v_cross_attn", wan_block.WIDTH, wan_block.FFN, wan_block.HEADS,
                                            qk_norm=True, cross_attn_norm=True, eps=wan_block.EPS,
                                            operation_settings=settings)
    converted.load_state_dict(state, strict=False)
    return converted.eval().requires_grad_(False)


def _inputs(env, negative: str):
    wan_block = env["benchmarks.wan_block"]
    g = torch.Generator().manual_seed(1)
    width = wan_block.WIDTH
    x = torch.randn(2, TOKENS, width, generator=g)
    e = torch.randn(2, 1, 6, width, generator=g) * 0.1
    context = torch.randn(2, 512, width, generator=g) * 0.3
    if negative == "zeros":   # the text embedding of a zeroed prompt: one row (its biases) for every token
        context[0] = 0.02 * torch.randn(width, generator=g)
    freqs = wan_block.rope_freqs(GRID, TOKENS, torch.device("cuda"), torch.bfloat16)
    return dict(x=x.to("cuda", torch.bfloat16), e=e.to("cuda", torch.bfloat16), freqs=freqs,
                context=context.to("cuda", torch.bfloat16))


@pytest.mark.parametrize("negative", ["zeros", "random"])
@pytest.mark.parametrize("layout", ["comfy_quant", "scaled_fp8"])
def test_fp8_scaled_block_keeps_its_check_with_a_zeroed_negative(env, layout, negative, caplog):
    wan, compat = env["nodes.families.wan"], env["nodes.compat"]
    block = _block(env, layout)
    assert type(block.ffn[0].weight).__name__ == "QuantizedTensor"
    inputs = _inputs(env, negative)
    seen = {}
    compare = compat.compare

    def recording(stock, ours, base=None, quantized=False, routed=False, reference=None):
        reason = compare(stock, ours, base, quantized, routed, reference=reference)
        if base is not None and torch.is_tensor(reference):
            exact, update = reference.double(), reference.double() - base.double()
            seen.update(stock=float((stock.double() - exact).norm() / update.norm()),
                        ours=float((ours.double() - exact).norm() / update.norm()),
                        apart=float((ours.double() - stock.double()).norm() / update.norm()),
                        without_reference=compare(stock, ours, base, quantized, routed))
        return reason
    compat.forget_verdicts()
    env["qkv_core"].reset_notices()
    caplog.set_level(logging.INFO)
    config = env["nodes.dispatch"].QKVConfig(level=3, backend="sdpa", block=True)
    forward = wan.bounded_block_forward(block, config)
    compat.compare = recording
    try:
        with torch.no_grad():
            ours = forward(**{k: v.clone() for k, v in inputs.items()})
    finally:
        compat.compare = compare
    print(f"\n{layout}, negative {negative}: check tokens' distance to the float32 reference, x |update|: "
          f"ComfyUI {seen.get('stock', float('nan')):.4f}, pack {seen.get('ours', float('nan')):.4f}, apart "
          f"{seen.get('apart', float('nan')):.4f}; judged against ComfyUI's output alone: "
          f"{seen.get('without_reference') or 'passes'}")
    assert not comfy_env.logged_of_kind(caplog.records, env["qkv_core"].notices.FALLBACK), caplog.text
    assert seen and seen["ours"] <= 1.25 * seen["stock"] + 4e-3
    with torch.no_grad():
        stock = block(**{k: v.clone() for k, v in inputs.items()})
    assert float((ours.float() - stock.float()).norm() / stock.float().norm()) <= 5e-2
