"""Block pieces in fewer launches (real ComfyUI): a plain LayerNorm and its adaLN modulation in one
`F.layer_norm` (`block_parts.modulated_layer_norm`, used by the Wan and Qwen-Image blocks), and the GELU of a
product (`comfy_ops.CastLinear.gelu`: on CUDA in the product's epilogue, tested in tests/test_wan_gpu.py; here
the two steps it falls back to). Each against the two steps it replaces, each case where it must not apply, and
the bounded Wan block of one batch item (where the fused norms run) against ComfyUI's own; the bounded MLP's
chunk inputs freed before its hidden activations are made."""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env

pytestmark = pytest.mark.comfyui

WIDTH = 64


@pytest.fixture(scope="module")
def env():
    modules = comfy_env.pack_modules()
    modules.parts = importlib.import_module(modules.pack.__name__ + ".nodes.block_parts")
    return modules


def _layer_norm(eps=1e-6):
    import comfy.ops
    return comfy.ops.disable_weight_init.LayerNorm(WIDTH, eps=eps, elementwise_affine=False)


def _operands(torch, dtype, batch=1, tokens=300):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(batch, tokens, WIDTH, generator=g) * 3 + 1).to(dtype)
    shift = (0.5 * torch.randn(1, 1, WIDTH, generator=g)).to(dtype)
    scale = (1 + 0.3 * torch.randn(1, 1, WIDTH, generator=g)).to(dtype)
    return x, shift, scale


def test_plain_layer_norm_is_told_by_its_class_and_parameters(env):
    import comfy.ops
    torch, eps = env.torch, env.ops.plain_layer_norm_eps
    assert eps(torch.nn.LayerNorm(WIDTH, eps=1e-6, elementwise_affine=False)) == 1e-6
    for ops in (comfy.ops.disable_weight_init, comfy.ops.manual_cast):
        assert eps(ops.LayerNorm(WIDTH, eps=1e-5, elementwise_affine=False)) == 1e-5

    class OwnMath(torch.nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    patched = _layer_norm()
    patched.forward = lambda x: x   # another node's forward on the instance
    for norm in (torch.nn.LayerNorm(WIDTH), comfy.ops.manual_cast.LayerNorm(WIDTH), torch.nn.RMSNorm(WIDTH),
                 OwnMath(WIDTH, elementwise_affine=False), patched,
                 torch.nn.LayerNorm((4, WIDTH), elementwise_affine=False), torch.nn.Identity()):
        assert eps(norm) is None, norm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_modulated_layer_norm_equals_the_norm_then_the_modulation(env, dtype):
    torch = env.torch
    dtype = getattr(torch, dtype)
    x, shift, scale = _operands(torch, dtype)
    norm = _layer_norm()
    fused = env.parts.modulated_layer_norm(norm, x, shift, scale)
    normed = norm(x)
    two_steps = torch.addcmul(shift, normed, scale)
    assert fused.dtype == dtype and fused.shape == x.shape
    diff = (fused.float() - two_steps.float()).abs()
    if dtype == torch.float32:
        assert float(diff.max() / two_steps.abs().max()) <= 1e-6
    else:   # one rounding against two: within a bf16 step of the norm's output (times the scale) and of the sum
        bound = 2.0 ** -7 * (normed.float().abs() * scale.float().abs() + two_steps.float().abs()) + 1e-6
        assert bool((diff <= bound).all()), float((diff / bound).max())


def test_modulated_layer_norm_leaves_other_cases_to_the_caller(env):
    torch = env.torch
    x, shift, scale = _operands(torch, torch.float32)
    fn, norm = env.parts.modulated_layer_norm, _layer_norm()
    per_token = shift.expand(1, x.shape[1], WIDTH).contiguous()
    two_items = torch.cat((x, x))
    cases = {
        "an affine LayerNorm": (torch.nn.LayerNorm(WIDTH), x, shift, scale),
        "an RMSNorm": (torch.nn.RMSNorm(WIDTH), x, shift, scale),
        "a modulation per token": (norm, x, per_token, scale),
        "a modulation per batch item": (norm, two_items, torch.cat((shift, shift)), torch.cat((scale, scale))),
        "a modulation of another dtype": (norm, x.bfloat16(), shift, scale),
        "no modulation": (norm, x, None, scale),
    }
    for what, args in cases.items():
        assert fn(*args) is None, what


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_cast_linear_gelu_off_cuda_is_the_product_then_the_gelu(env, approximate):
    import comfy.ops
    torch = env.torch
    linear = comfy.ops.disable_weight_init.Linear(WIDTH, 3 * WIDTH)
    comfy_env.fill_random_(linear)
    x = torch.randn(1, 70, WIDTH, generator=torch.Generator().manual_seed(2))
    cast = env.ops.CastLinear(linear, x)
    with torch.no_grad():
        out = cast.gelu(x, approximate)
        expected = torch.nn.functional.gelu(linear(x), approximate=approximate)
    assert torch.equal(out, expected)


def test_mlp_frees_each_chunks_input_before_its_hidden_activation(env):
    """`mlp_residual_` hands each chunk's input to the MLP in a list it clears: once the first layers have read
    it, nothing holds it (passed as an argument, the caller's frame kept it beside the hidden activation, 1 x
    the chunk more at the block's peak). Checked where the gated MLP combines its two hidden activations, and the
    residual update still equals the MLP's."""
    import comfy.ops
    import weakref
    torch, parts = env.torch, env.parts
    ops = comfy.ops.disable_weight_init
    mlp = torch.nn.Module()
    mlp.w1, mlp.w3, mlp.w2 = ops.Linear(WIDTH, 2 * WIDTH), ops.Linear(WIDTH, 2 * WIDTH), ops.Linear(2 * WIDTH, WIDTH)
    for layer in (mlp.w1, mlp.w3, mlp.w2):
        comfy_env.fill_random_(layer)
    residual = torch.randn(1, 600, WIDTH, generator=torch.Generator().manual_seed(3))
    expected = residual.clone()
    inputs, alive_at_combine = [], []

    def chunk_input(a, b):
        t = residual[:, a:b] * 0.5   # a fresh tensor, the chunk's own
        inputs.append(weakref.ref(t))
        return t

    def combine_(gate_out, up_out):
        alive_at_combine.append(inputs[-1]() is not None)
        return parts.silu_gate_(gate_out, up_out)

    def add_(part, out, a, b):
        part.add_(out)

    gated = parts.GatedMLP(gate="w1", up="w3", down="w2", combine_=combine_)
    with torch.no_grad():
        parts.mlp_residual_(residual, mlp, chunk_input, add_, fraction=8, gated=gated)
        half = expected * 0.5
        expected += mlp.w2(torch.nn.functional.silu(mlp.w1(half)) * mlp.w3(half))
    assert len(alive_at_combine) > 1 and not any(alive_at_combine)
    assert torch.allclose(residual, expected, rtol=1e-5, atol=1e-5)


def _fused_layer_norm(width):
    """`TorchCalls`' filter for the fused modulated norms: `F.layer_norm` calls with a weight of `width`."""
    def keep(args, kwargs):
        weight = args[2] if len(args) > 2 else kwargs.get("weight")
        return weight is not None and tuple(weight.shape) == (width,)
    return keep


def _wan_model(env, fmt):
    """A tiny one-layer Wan in the weight format `fmt`, as tests/support/wan_runs.py builds them (I2V: float32)."""
    if fmt == "i2v":
        return comfy_env.make_wan("i2v", dim=256, heads=8, layers=1)
    from support.wan_runs import wan_in_format
    return wan_in_format(env, fmt)


# weight format -> tolerance against stock (bf16: its own rounding; fp8-scaled: its layers quantize their inputs)
FORMATS = {"float32": 1e-5, "i2v": 1e-5, "bf16": 2e-2, "fp8": 1e-5, "fp8-scaled": 1e-2, "gguf": 1e-5}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("level", ["Off", "High"])
def test_wan_block_of_one_item_fuses_its_norms_and_equals_stock(env, split_everything, fmt, level):
    """One batch item (a sampler's cond or uncond alone): the bounded block's norm1 and norm2 take the fused
    launch, and the whole model's output is ComfyUI's own, in every weight format (float32 T2V and I2V, bf16,
    fp8 cast per call, fp8-scaled, GGUF Q8_0, whose LayerNorm is ComfyUI-GGUF's with nothing quantized)."""
    torch = env.torch
    base = _wan_model(env, fmt)
    kind = "i2v" if fmt == "i2v" else "t2v"
    norm = base.model.diffusion_model.blocks[0].norm1
    assert env.ops.plain_layer_norm_eps(norm) == norm.eps, type(norm).__mro__
    size = dict(frames=2, h=32, w=32, batch=1)
    dtype = torch.float32 if fmt == "fp8" else None   # stored in fp8, computed in float32

    def run(patcher=None):
        if patcher is not None:
            patcher.patch_model(load_weights=False)
        try:
            with torch.no_grad():
                return base.model.diffusion_model(**comfy_env.make_inputs(base.model, kind, **size, dtype=dtype))
        finally:
            if patcher is not None:
                patcher.unpatch_model(unpatch_weights=False)

    reference = run()
    patched, report = env.node.apply_patch(base, level, "sdpa", True)
    assert report.any_patched and not report.skipped_reasons, report.lines()
    run(patched)   # the self-check, once
    width = base.model.diffusion_model.blocks[0].norm1.normalized_shape[0]
    with comfy_env.TorchCalls(torch, torch.nn.functional.layer_norm, _fused_layer_norm(width)) as fused:
        out = run(patched)
    assert len(fused.calls) >= 2, len(fused.calls)   # norm1 whole, norm2 by FFN chunks
    assert float((out.float() - reference.float()).abs().max() / reference.float().abs().max()) <= FORMATS[fmt]
