"""The self-check judges each weight format by its own noise (nodes/compat.py, `compare` and `exact_reference`).

ComfyUI's forward and the pack's are both measured against the same module in float32 with dequantized weights and
unquantized inputs; the pack passes when it is no farther from that than ComfyUI's own (within a margin). The
rule it replaces (within 2 % of ComfyUI's update plus a bf16 step of the output) was below fp8's own noise: two
forwards that each quantize their layers' inputs to fp8 differ from each other by ~3 % of the update, and a
zeroed negative prompt (ConditioningZeroOut) made the update a smaller share of the block's output, so the check
sent the block to ComfyUI's own and a 16 GB fp8 run out of memory. Skipped without ComfyUI.
"""
from __future__ import annotations

import importlib
import logging

import pytest

from support import comfy_env

pytestmark = pytest.mark.comfyui

MODEL = dict(dim=256, heads=8, layers=1)
SIZE = dict(frames=3, h=64, w=88, batch=2)   # 2 x 4,224 tokens: split (the floor is lowered below)


from support.wan_runs import _fresh_verdicts, env   # noqa: E402,F401 - the lowered floor, fresh verdicts


def _noisy(torch, exact, update, share, seed):
    """`exact` plus noise of `share` x |update| (another draw of a format's rounding)."""
    noise = torch.randn(exact.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return exact + noise * (share * update.norm() / noise.norm())


def test_two_draws_of_a_formats_noise_pass_and_a_change_of_math_does_not(env):
    """The case the old rule failed: ComfyUI's output and the pack's each ~4 % of the update from the exact
    output (fp8 input quantization), ~5.5 % from each other, in a block whose update outweighs its input.
    Judged against ComfyUI's output alone it fails; judged by the format's noise it passes. An output with
    another math (the update scaled by 1.1) fails either way, as does noise twice ComfyUI's."""
    torch = env.torch
    compare = env.compat.compare
    g = torch.Generator().manual_seed(0)
    base = 0.3 * torch.randn(1, 256, 64, generator=g, dtype=torch.float64)
    update = torch.randn(1, 256, 64, generator=g, dtype=torch.float64) - 0.5 * base
    exact = base + update
    stock = _noisy(torch, exact, update, 0.04, 1).to(torch.bfloat16)
    ours = _noisy(torch, exact, update, 0.04, 2).to(torch.bfloat16)
    reference = exact.float()
    bf16_base = base.to(torch.bfloat16)
    assert compare(stock, ours, bf16_base, quantized=True) is not None            # the old rule: a fallback
    assert compare(stock, ours, bf16_base, quantized=True, reference=reference) is None
    changed = _noisy(torch, base + 1.1 * update, update, 0.04, 2).to(torch.bfloat16)
    reason = compare(stock, changed, bf16_base, quantized=True, reference=reference)
    assert reason is not None and "from the float32 reference" in reason
    noisier = _noisy(torch, exact, update, 0.08, 3).to(torch.bfloat16)
    assert compare(stock, noisier, bf16_base, quantized=True, reference=reference) is not None
    # a reference that is not finite (or of another shape) is not used: ComfyUI's output is the reference
    assert compare(stock, ours, bf16_base, quantized=True, reference=reference * float("nan")) is not None


def _zeroed_negative_inputs(patcher, dtype):
    """Cond + uncond in one batch as ComfyUI batches them, the uncond item (the first: the one the check takes)
    with a zeroed text context, as ConditioningZeroOut gives it."""
    inputs = comfy_env.make_inputs(patcher.model, "t2v", dtype=dtype, **SIZE)
    inputs.pop("transformer_options")
    inputs["context"][0].zero_()
    return inputs


@pytest.mark.parametrize("layout", comfy_env.FP8_LAYOUTS)
@pytest.mark.parametrize("input_scale", [False, True], ids=["input-quantized-per-call", "input-scale"])
def test_fp8_scaled_with_a_zeroed_negative_keeps_the_bounded_block(env, layout, input_scale, caplog):
    """bf16 compute, fp8-scaled weights in both file layouts, the first batch item's text zeroed: the block's
    self-check passes, the split runs, and the output is as far from the float model's as stock's is."""
    torch = env.torch
    import comfy.ops
    if not hasattr(comfy.ops, "mixed_precision_ops") or not hasattr(comfy.ops, "CastBiasWeightContext"):
        pytest.skip("this ComfyUI has no mixed-precision (fp8-scaled) ops with row slices")
    base = comfy_env.make_fp8_scaled_wan("t2v", dtype=torch.bfloat16, input_scale=input_scale, layout=layout,
                                         **MODEL)
    assert type(base.model.diffusion_model.blocks[0].ffn[0].weight).__name__ == "QuantizedTensor"
    inputs = _zeroed_negative_inputs(base, torch.bfloat16)
    stock = comfy_env.model_forward(base, inputs)
    patched, report = env.node.apply_patch(base, "High", "sdpa", True)
    assert not report.skipped_reasons, report.lines()
    caplog.set_level(logging.INFO)
    with comfy_env.SdpaHeads(torch) as spy:
        ours = comfy_env.model_forward(base, inputs, applied=patched)
    assert not comfy_env.logged_of_kind(caplog.records, env.core.notices.FALLBACK), caplog.text
    assert set(spy.self_heads) == {1}   # High: 8 groups of one head
    # the float model of the same (fp8-rounded) weights: ComfyUI's output and ours are as far from it
    exact = _float_model_output(env, base, inputs)
    stock_distance = float((stock.double() - exact).norm() / exact.norm())
    ours_distance = float((ours.double() - exact).norm() / exact.norm())
    assert ours_distance <= 1.25 * stock_distance + 4e-3, (ours_distance, stock_distance)


def _float_model_output(env, patcher, inputs):
    """The diffusion model run as `exact_reference` runs a module: float32 inputs, every layer's weight cast to
    float32 (dequantized) at its call."""
    import torch
    model = patcher.model.diffusion_model
    with torch.no_grad():
        return env.compat.exact_reference(model, model.forward, inputs).double()


def test_a_change_of_math_on_quantized_weights_runs_stock(env, monkeypatch, caplog):
    """fp8-scaled weights, bf16: ComfyUI's self-attention edited to scale its queries (another math) is told
    apart from the format's noise: the pack's self-attention steps aside, the output is ComfyUI's."""
    torch = env.torch
    import comfy.ops
    import comfy.ldm.wan.model as wan_model
    if not hasattr(comfy.ops, "mixed_precision_ops") or not hasattr(comfy.ops, "CastBiasWeightContext"):
        pytest.skip("this ComfyUI has no mixed-precision (fp8-scaled) ops with row slices")
    compat_tests = importlib.import_module("test_wan_compat")
    monkeypatch.setattr(wan_model.WanSelfAttention, "forward",
                        compat_tests._rewritten_self_attention(torch, wan_model, scale_q=1.25))
    base = comfy_env.make_fp8_scaled_wan("t2v", dtype=torch.bfloat16, input_scale=False, **MODEL)
    inputs = _zeroed_negative_inputs(base, torch.bfloat16)
    stock = comfy_env.model_forward(base, inputs)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", False)
    caplog.set_level(logging.INFO)
    ours = comfy_env.model_forward(base, inputs, applied=patched)
    assert "Wan self-attention runs as ComfyUI's own: the outputs differ" in caplog.text
    assert "from the float32 reference" in caplog.text
    assert torch.equal(ours, stock)


def test_the_reference_leaves_every_layers_cast_flags_as_they_were(env):
    """`exact_reference` sets each ComfyUI layer's cast flags for its one forward and restores them, also when
    the forward raises: flags set by ComfyUI (a low-VRAM load) stay set, flags it never set stay unset. fp8-scaled
    layers where this ComfyUI has them (v0.8.0+), else fp8 weights cast per call (v0.3.x)."""
    torch = env.torch
    import comfy.ops
    if hasattr(comfy.ops, "mixed_precision_ops"):
        base = comfy_env.make_fp8_scaled_wan("t2v", dtype=torch.bfloat16, **MODEL)
    else:
        base = comfy_env.make_wan("t2v", **MODEL)
        comfy_env.fp8_cast_per_call_(base.model.diffusion_model)
    block = base.model.diffusion_model.blocks[0]
    block.ffn[2].comfy_cast_weights = True   # as a low-VRAM load leaves it
    before = {name: dict(layer.__dict__) for name, layer in block.named_modules()}

    def flags():
        return {name: {key: layer.__dict__.get(key) for key in ("comfy_cast_weights", "comfy_force_cast_weights")}
                for name, layer in block.named_modules()}
    expected = flags()
    seen = {}

    def forward(**kwargs):
        seen.update(flags())
        raise RuntimeError("a forward that fails")
    with pytest.raises(RuntimeError):
        env.compat.exact_reference(block, forward, {"x": torch.zeros(1, 4, 256, dtype=torch.bfloat16)})
    assert seen["ffn.0"] == {"comfy_cast_weights": True, "comfy_force_cast_weights": True}
    assert flags() == expected
    assert {name: set(layer.__dict__) for name, layer in block.named_modules()} == \
        {name: set(state) for name, state in before.items()}


def test_deciding_a_call_runs_its_check_not_its_forward(env, monkeypatch):
    """`compat.decide_call`: a call's guards and self-check without the forward (how a measurement starts with the
    verdict cached): None for a self-attention that passes, with no attention longer than the check's tokens run
    and the verdict kept; "stock" under gradients and for a planted change of ComfyUI's math."""
    torch = env.torch
    import comfy.ldm.wan.model as wan_model
    import comfy.ops
    from comfy.ldm.flux.layers import EmbedND
    settings = {"operations": comfy.ops.disable_weight_init, "device": torch.device("cpu"), "dtype": torch.float32}
    module = wan_model.WanSelfAttention(64, 4, qk_norm=True, operation_settings=settings)
    comfy_env.fill_random_(module, seed=0)
    ids = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(16), torch.arange(16), indexing="ij"),
                      dim=-1).reshape(1, -1, 3).float()
    freqs = EmbedND(dim=16, theta=10000.0, axes_dim=[8, 4, 4])(ids).movedim(1, 2)
    x = torch.randn(1, 512, 64, generator=torch.Generator().manual_seed(1))

    def forward():
        return env.wan.self_attention_forward(module, env.node.QKVConfig(3, "sdpa", False))

    patched = forward()
    with torch.no_grad(), comfy_env.SdpaHeads(torch) as spy:
        assert env.compat.decide_call(patched, x, freqs) is None
    assert spy.heads and spy.self_tokens == []   # the check's 256 tokens ran, the call's 512 did not
    with torch.no_grad(), comfy_env.SdpaHeads(torch) as spy:
        patched(x, freqs)
    assert spy.self_tokens and len(spy.heads) == len(spy.self_tokens)   # the call's attention only: checked before
    with torch.enable_grad():
        assert env.compat.decide_call(forward(), x, freqs) == "stock"
    compat_tests = importlib.import_module("test_wan_compat")
    monkeypatch.setattr(wan_model.WanSelfAttention, "forward",
                        compat_tests._rewritten_self_attention(torch, wan_model, scale_q=1.25))
    with torch.no_grad():
        assert env.compat.decide_call(forward(), x, freqs) == "stock"
