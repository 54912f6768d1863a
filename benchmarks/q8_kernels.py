"""Bandwidth of the q8 prefix kernels (issue 11): `dequantize_q8_into` and `merge_lse_`, Triton pass against the
PyTorch path, on a Wan-720p-sized tensor (75,600 tokens x 40 heads x 128, bf16 out). Needs CUDA.

    python -m benchmarks.q8_kernels [--tokens 75600] [--heads 40] [--repeats 20]

Bytes are those read and written once (int8 values + fp16 scales + 16-bit out; out read and written + other
read + both LSEs for the merge), over the median time of `--repeats` runs (CUDA events). About ten seconds.
"""
from __future__ import annotations

import argparse
import sys

import torch

from qkv_core import kernels, q8


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[2:])[repeats // 2]


def _pytorch_path(fn):
    """`fn` with the Triton passes declined (the PyTorch paths run)."""
    def run():
        saved = kernels.dequantize_q8_, kernels.merge_lse_
        kernels.dequantize_q8_ = kernels.merge_lse_ = lambda *args: False
        try:
            fn()
        finally:
            kernels.dequantize_q8_, kernels.merge_lse_ = saved
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.q8_kernels")
    parser.add_argument("--tokens", type=int, default=75600)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    shape = (1, args.tokens, args.heads, args.dim)
    g = torch.Generator(device="cuda").manual_seed(0)
    values, scales = q8.quantize_q8(torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16))
    out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    other = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
    lse = torch.randn(1, args.heads, args.tokens, device="cuda", generator=g)
    other_lse = torch.randn(1, args.heads, args.tokens, device="cuda", generator=g)
    elements = out.numel()
    dequant_bytes = elements * (1 + 2) + scales.numel() * 2
    merge_bytes = elements * 2 * 3 + lse.numel() * 4 * 3

    def dequantize():
        q8.dequantize_q8_into(out, values, scales)

    def merge():
        q8.merge_lse_(out, lse, other, other_lse)
    print(f"{torch.cuda.get_device_name()}, {shape} bf16, Triton {'yes' if kernels.triton else 'no'}")
    print(f"{'pass':24} {'ms':>8} {'TB/s':>6}")
    for name, fn, nbytes in (("dequantize_q8_into", dequantize, dequant_bytes), ("merge_lse_", merge, merge_bytes)):
        for path, run in (("triton", fn), ("pytorch", _pytorch_path(fn))):
            ms = _median_ms(run, args.repeats)
            print(f"{name + ' ' + path:24} {ms:8.3f} {nbytes / ms / 1e9:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
