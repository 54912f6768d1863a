"""Triton kernels against their PyTorch paths, on CPU through Triton's interpreter (TRITON_INTERPRET=1, set
in a child process: Triton reads it when the kernels are defined). Skipped when Triton is not installed."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qkv_core import kernels

ROOT = Path(__file__).resolve().parent.parent

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
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cases 30" in done.stdout


def test_without_a_gpu_or_the_interpreter_the_kernel_declines():
    if kernels.INTERPRET:
        pytest.skip("this process runs Triton's interpreter")
    t = torch.randn(1, 8, 2, 32)
    assert kernels.norm_rope_(t, freqs=torch.randn(1, 8, 1, 16, 2, 2)) is False   # the caller's PyTorch path runs
