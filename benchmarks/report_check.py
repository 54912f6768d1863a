"""Benchmark: the run report's "stock would need about X GiB" against a real stock run (CUDA).

    python -m benchmarks.bench --comfyui PATH --report-check [--layers 8] [--sizes 832x480,1280x720] [--frames 81]

A Wan 2.x 14B cut to `--layers` blocks (random bf16 weights, `benchmarks/wan_weights.py`: its state dict and loader),
sampled 2 steps at cfg 5 through ComfyUI's model management: stock, then patched (High, block bounds, auto).
Prints each run's peak VRAM and seconds per step, and the patched run's report (as the node shows it). About
two minutes on an H200. Loaded by `benchmarks/bench.py` inside the package it makes for the pack. Not part of
the node pack.
"""
from __future__ import annotations

import argparse
import importlib

import torch

from ..nodes import patching

# `from . import wan_model` would find the process's own `benchmarks` package (bench.py shares it): the
# workload module is imported inside the package bench.py makes for the pack, as bench.py itself does.
wan_model = importlib.import_module(__name__.rsplit(".", 1)[0] + ".wan_model")
wan_weights = importlib.import_module(__name__.rsplit(".", 1)[0] + ".wan_weights")

GiB = 2 ** 30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench --comfyui PATH --report-check")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sizes", default="832x480,1280x720")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("--report-check needs CUDA (the report's peak is CUDA's)")
        return 0
    sent = []
    send = patching.send_to_ui
    patching.send_to_ui = lambda event, payload: sent.append(payload) or True
    try:
        config = dict(wan_weights.WAN_14B, num_layers=args.layers)
        base = wan_weights.load_model("bf16", wan_weights.wan_state_dict("bf16", config, torch.device("cuda")), False)
        for size in (tuple(int(v) for v in text.split("x")) for text in args.sizes.split(",")):
            stock = wan_model.sample_once(base, args.frames, size, 2, 5.0, False, config["text_dim"])
            patched, _ = patching.apply_patch(base, "High", "auto", True, node_id="report-check")
            wan_model.sample_once(patched, args.frames, size, 1, 5.0, True, config["text_dim"])  # verifies once
            ours = wan_model.sample_once(patched, args.frames, size, 2, 5.0, False, config["text_dim"])
            report = sent[-1]["report"]
            print(f"\n{size[0]}x{size[1]} x {args.frames}, {args.layers} blocks: stock run peak "
                  f"{stock['peak_vram_gib']:.2f} GiB ({stock.get('s_per_step', 0):.2f} s/step); patched run peak "
                  f"{ours['peak_vram_gib']:.2f} GiB ({ours.get('s_per_step', 0):.2f} s/step); the report: stock "
                  f"would need about {report['stock_estimate_bytes'] / GiB:.2f} GiB "
                  f"({report['stock_estimate_bytes'] / GiB / stock['peak_vram_gib'] - 1:+.0%} of the real one)",
                  flush=True)
            print("\n".join("  " + line for line in report["lines"]), flush=True)
            patched = None
            wan_model.free_everything()
    finally:
        patching.send_to_ui = send
    return 0
