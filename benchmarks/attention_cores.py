"""One attention call and a native prefix on CUDA: PyTorch's SDPA, SageAttention's own `sageattn` (the installed
version) and the pack's staged core, time and peak memory (docs/benchmarks.md#sage2).

    python -m benchmarks.attention_cores [--tokens 75600] [--heads 40] [--dim 128] [--prefix 3600]

- "one call": `(1, tokens, heads, dim)` bf16 q, k, v already made; the peak is what the call adds above them, in
  units of its output. The staged core is run through `kv_first_attention` (which hands q, k, v off).
- "prefix": the runtime's self-attention (5120-wide Linear projections, Head Split High) with a `prefix`-token
  prefix, 16-bit (joined into the keys) against native (SageAttention 2: its own pass merged by LSE). About
  one minute on an H200.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import qkv_core as qc


def _median_ms(fn, make, repeats):
    times, peak, result = [], 0, None
    for i in range(repeats + 1):
        args = make()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        result = fn(args)
        torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
        peak = torch.cuda.max_memory_allocated() - base
        del args
    times.sort()
    return times[len(times) // 2], peak, result


def one_call(tokens, heads, dim, repeats):
    shape = (1, tokens, heads, dim)
    out_bytes = tokens * heads * dim * 2

    def make():
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(shape, device="cuda", generator=g).bfloat16() for _ in range(3))
        k += 0.3
        return [q, k, v]

    def sdpa(l):
        q, k, v = (t.transpose(1, 2) for t in l)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)

    def upstream(l):
        from sageattention import sageattn
        return sageattn(l[0], l[1], l[2], tensor_layout="NHD")

    rows = []
    results = {}
    for name, fn in (("PyTorch SDPA", sdpa), ("sageattn (upstream)", upstream),
                     ("staged core (kv_first_attention)", lambda l: qc.kv_first_attention(l, force_attention="sage"))):
        ms, peak, results[name] = _median_ms(fn, make, repeats)
        rows.append((name, ms, peak / out_bytes))
    same = torch.equal(results["sageattn (upstream)"], results["staged core (kv_first_attention)"])
    return rows, same


def prefix_call(tokens, prefix_tokens, heads, dim, repeats):
    width = heads * dim
    g = torch.Generator(device="cuda").manual_seed(1)
    layers = []
    for _ in range(3):
        layer = torch.nn.Linear(width, width, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.normal_(0, width ** -0.5, generator=g)
        layers.append(layer)
    pk = torch.randn(1, prefix_tokens, heads, dim, device="cuda", generator=g).bfloat16()
    pv = torch.randn(1, prefix_tokens, heads, dim, device="cuda", generator=g).bfloat16()
    native = qc.cache_prefix([pk.clone(), pv.clone()], native=True, kit=qc.native_prefix_kit())
    rows = []
    for name, prefix in (("16-bit prefix, joined", (pk, pv)), ("native prefix, merged by LSE", native)):
        def make():
            return [torch.randn(1, tokens, width, device="cuda", generator=g).bfloat16()]

        def run(x_list):
            with torch.no_grad():
                return qc.qkv_attention(x_list, *layers, heads, dim, kv_prefix=prefix, force_attention="sage",
                                        head_split_level=3)
        ms, peak, _ = _median_ms(run, make, repeats)
        prefix_bytes = sum(t.numel() * t.element_size() for t in prefix if t is not None)
        rows.append((name, ms, peak / (tokens * width * 2), prefix_bytes / 2 ** 20))
    return rows, native.is_native


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=75600)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--prefix", type=int, default=3600, help="prefix tokens (one 720p latent frame: 3600)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.attention_cores needs CUDA and SageAttention")
    import sageattention
    version = f"{qc.backends.sage_major_version(sageattention)}.x"   # as the pack reads it (a source build too)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, sageattention {version}; "
          f"(1, {args.tokens}, {args.heads}, {args.dim}) bf16, median of {args.repeats}")
    rows, same = one_call(args.tokens, args.heads, args.dim, args.repeats)
    print("| one call | ms | peak above q, k, v (x output) |\n| --- | --- | --- |")
    for name, ms, peak in rows:
        print(f"| {name} | {ms:.1f} | {peak:.2f} |")
    print(f"staged core == sageattn, bitwise: {same}")
    rows, is_native = prefix_call(args.tokens, args.prefix, args.heads, args.dim, args.repeats)
    print(f"| self-attention with a {args.prefix}-token prefix (High) | ms | peak (x input) | prefix MiB |\n"
          "| --- | --- | --- | --- |")
    for name, ms, peak, mib in rows:
        print(f"| {name} | {ms:.1f} | {peak:.2f} | {mib:.0f} |")
    print(f"native prefix kept natively: {is_native}; native / joined time: {rows[1][1] / rows[0][1]:.3f}")
    print([str(notice) for notice in qc.drain_notices()])


if __name__ == "__main__":
    main()
