"""SageAttention 1's staged core (`qkv_core/sage.py`) against SageAttention's own unstaged call, on CPU through
Triton's interpreter (TRITON_INTERPRET=1, in a child process) with the PyPI package's kernels: the core's steps,
and the runtime's head-split calls through it (self-attention with a norm, grouped-query heads, a q8 prefix
dequantized into the joined keys). Skipped without Triton or `sageattention` (scripts/test installs 1.0.6). The
same on CUDA: tests/test_gpu.py."""
from __future__ import annotations

import textwrap

import pytest

from support.interpreter import run_in_interpreter

CHECK = textwrap.dedent("""
    import sys
    import torch
    import qkv_core as qc
    from qkv_core import backends, kernels
    from qkv_core.sage import Sage1Core, sage1_reference
    assert kernels.INTERPRET
    g = torch.Generator().manual_seed(0)
    core = Sage1Core()
    cases = 0
    try:   # SageAttention's kernels loop to a runtime bound, which some interpreters cannot run
        probe = torch.randn(1, 64, 1, 64).half()
        sage1_reference(probe, probe, probe)
    except Exception as error:
        if "0-dimensional" in repr(error):
            print("SKIP: this Triton interpreter takes no runtime loop bound (Triton 3.6 with numpy 2.5): "
                  "SageAttention's kernels cannot run in it")
            sys.exit(0)
        raise
    # the core's steps, into a strided view of a larger output, against sageattn's own sequence
    for dtype in (torch.float16, torch.bfloat16):
        for batch, tokens, heads, kv_heads, dim in ((1, 256, 2, 2, 64), (2, 192, 4, 2, 64), (1, 200, 2, 1, 128)):
            q = torch.randn(batch, tokens, heads, dim, generator=g).to(dtype)
            k = (torch.randn(batch, tokens, kv_heads, dim, generator=g) + 0.5).to(dtype)   # biased keys
            v = torch.randn(batch, tokens, kv_heads, dim, generator=g).to(dtype)
            want = sage1_reference(q, k, v)
            settings = core.settings(q.shape, k.shape, dtype, q.device)
            quantized_v = core.staged_quantize_v([v.clone()], settings)
            quantized_k = core.staged_quantize_k([k.clone()], settings)
            quantized_q = core.staged_quantize_q([q.clone()], settings)
            out = torch.zeros(batch, tokens, heads + 2, dim, dtype=dtype)
            core.staged_attention(out[:, :, 1:heads + 1], (quantized_q, quantized_k, quantized_v), settings)
            assert torch.equal(out[:, :, 1:heads + 1], want), (dtype, batch, heads, kv_heads, dim)
            assert float(out[:, :, 0].abs().max()) == 0 and float(out[:, :, -1].abs().max()) == 0
            exact = torch.nn.functional.scaled_dot_product_attention(
                q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
                enable_gqa=heads != kv_heads).transpose(1, 2)
            if tokens % 64 == 0:   # SageAttention 1 lets a last, partial block's padding keys into the softmax
                assert float((want.float() - exact).abs().max()) <= 0.05 * float(exact.abs().max())   # int8 q, k
            cases += 1

    # the runtime through it: a test backend that takes CPU tensors (the interpreter), with the staged core
    class InterpretedSage(backends.SageBackend):
        name = "sage-interpreted"

        def cannot_take(self, q, k, v, mask, softmax_scale):
            return "no mask here" if mask is not None else None
    qc.backends.register_backend(InterpretedSage())
    assert qc.backends._REGISTRY["sage-interpreted"].staged_core is not None
    width, heads, tokens = 128, 4, 192
    x = torch.randn(1, tokens, width, generator=g).to(torch.float16)
    layers = [torch.nn.Linear(width, width).to(torch.float16) for _ in range(3)]
    with torch.no_grad():
        q, k, v = (layer(x).unflatten(-1, (heads, width // heads)) for layer in layers)
        want = sage1_reference(q, k, v)
        for level in (0, 3):
            got = qc.qkv_attention([x.clone()], *layers, heads, width // heads, force_attention="sage-interpreted",
                                   head_split_level=level, split_floor_tokens=0)
            assert torch.equal(got, want), level
            cases += 1
    print("cases", cases)
""")


def test_sage1_staged_core_equals_sageattn_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    pytest.importorskip("sageattention", reason="SageAttention is not installed (pip install sageattention==1.0.6)")
    stdout = run_in_interpreter(CHECK, timeout=900)
    if stdout.startswith("SKIP: "):
        pytest.skip(stdout[len("SKIP: "):].strip())
    assert "cases 8" in stdout
