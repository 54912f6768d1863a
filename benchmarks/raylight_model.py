"""Benchmark: a whole Wan 2.x 14B sampled through raylight's sequence-parallel path (Ulysses), one process a GPU
as raylight's Ray workers run it, raylight alone against raylight with the pack, each GPU planned for a card.

    torchrun --nproc-per-node 2 -m benchmarks.bench --comfyui PATH --raylight-model --raylight-root RAYLIGHT [options]
    torchrun --nproc-per-node 2 -m benchmarks.bench --comfyui PATH --raylight-model --raylight-root RAYLIGHT \\
        --device cpu --tiny            # a smoke run on the CPU (gloo): a tiny Wan, 1 step

Each process does what one of raylight's workers does for a USP run, with raylight's own code (a checkout of
komikndr/raylight at RAYLIGHT, and xFuser installed): its xFuser bootstrap, `initialize_model_parallel` with a
Ulysses degree of the world size, its attention type (`--xfuser-attention`, raylight's default TORCH_FLASH), its
`USPInjectRegistry.inject` as the model's ON_LOAD callback, and `comfy.sample.sample` on every rank with the
same seed. "raylight + pack": the worker's model patched first by `apply_patch` (`--level`, block bounds), as the
QKV Attention (raylight) node does. The state dict, the card plan and the sampling run are the whole-model
benchmark's (`benchmarks/wan_model.py`: a random Wan 14B in `--format`, ComfyUI's loader, `--card` GiB a GPU
with ComfyUI's default reserve on top, enforced; a zeroed negative, cfg 5).

Reported by rank 0, for each method: seconds per step, peak VRAM and the weights kept on the GPU (the largest
over the ranks), the first block's activation peak on each GPU as a multiple of its local |x| (its input: the
rank's tokens), and the largest difference between the two methods' samples. `--search-frames`: the most
frames each method fits (a probe fits when it fits on every rank; ranks run out of memory at the same call, as
their shapes are the same). docs/benchmarks.md#ulysses has the 2-GPU command and its figures.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import comfy.patcher_extension

from ..nodes.patching import apply_patch
from .wan_model import GiB, free_everything, plan_for_card, sample_once, search_frames
from .wan_weights import WAN_14B, load_model, wan_state_dict

METHODS = ("raylight", "raylight + pack")
TINY = dict(WAN_14B, dim=256, ffn_dim=512, num_heads=8, num_layers=2)


def start_raylight(path: str, device: torch.device, attention: str) -> tuple:
    """raylight's worker set-up in this process: its xFuser bootstrap, the process group (NCCL on CUDA, gloo on
    the CPU), xFuser's model-parallel groups with a Ulysses degree of the world size, its attention type. Returns
    (rank, world, raylight's USP inject)."""
    sys.path.insert(0, os.path.join(path, "src"))
    available = torch.cuda.is_available
    if device.type == "cpu":   # xFuser's attention layer takes yunchang's only where it sees CUDA
        torch.cuda.is_available = lambda: True
    try:
        import raylight.xfuser_compat as compat
        compat.install_minimal_xfuser()
        import xfuser.core.long_ctx_attention  # noqa: F401
    finally:
        torch.cuda.is_available = available
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    import raylight.distributed_modules.attention as xfuser_attention
    xfuser_attention.set_attn_type(attention)
    xfuser_attention.set_sync_ulysses(False)
    from xfuser.core.distributed import init_distributed_environment, initialize_model_parallel
    init_distributed_environment(rank=rank, world_size=world)
    initialize_model_parallel(sequence_parallel_degree=world, ulysses_degree=world)
    from raylight.distributed_modules.usp import USPInjectRegistry
    return rank, world, USPInjectRegistry.inject


class BlockPeak:
    """The first block's activation peak in a run (CUDA): the allocator's peak during its first call above what was
    allocated when it started, as a multiple of its input (the rank's tokens); the run's own peak is kept."""

    def __init__(self, block):
        self.ratio, self._start, self._before = None, None, 0
        self._handles = [block.register_forward_pre_hook(self._pre, with_kwargs=True),
                         block.register_forward_hook(self._post, with_kwargs=True)]

    def _pre(self, module, args, kwargs):
        if self.ratio is None and torch.cuda.is_available():
            x = args[0] if args else kwargs["x"]
            torch.cuda.synchronize()
            self._before = torch.cuda.max_memory_allocated()
            self._start, self._x_bytes = torch.cuda.memory_allocated(), x.numel() * x.element_size()
            torch.cuda.reset_peak_memory_stats()

    def _post(self, module, args, kwargs, out):
        if self.ratio is None and self._start is not None:
            torch.cuda.synchronize()
            self.ratio = (torch.cuda.max_memory_allocated() - self._start) / self._x_bytes

    def run_peak(self) -> int:
        return max(self._before, torch.cuda.max_memory_allocated())

    def remove(self):
        for handle in self._handles:
            handle.remove()


def run_method(base, method: str, inject, args, config: dict, frames: int, probe: bool) -> dict:
    """One sampling run of `method` on this rank (`wan_model.sample_once`), with the first block's peak."""
    model = base.clone() if method == "raylight" else apply_patch(base, args.level, args.backend, True)[0]
    model.add_callback(comfy.patcher_extension.CallbacksMP.ON_LOAD, inject)
    peak = BlockPeak(model.model.diffusion_model.blocks[0])
    result = {}
    try:
        record = sample_once(model, frames, _size(args), args.steps, args.cfg, probe, config["text_dim"],
                             negative_kind=args.negative, keep=result)
    finally:
        peak.remove()
    record["method"], record["block_peak_x"] = method, peak.ratio
    if torch.cuda.is_available():
        record["peak_vram_gib"] = peak.run_peak() / GiB
    record["samples"] = result.get("samples")
    return record


def _size(args) -> tuple:
    width, height = (int(v) for v in args.size.lower().split("x"))
    return width, height


def _gathered(value):
    """`value` of every rank (rank order)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m benchmarks.bench --comfyui PATH "
                                          "--raylight-model", description=__doc__.split("\n")[0])
    parser.add_argument("--raylight-root", default=os.environ.get("RAYLIGHT_PATH", os.path.expanduser("~/raylight")),
                        help="a checkout of komikndr/raylight (default $RAYLIGHT_PATH, else ~/raylight)")
    parser.add_argument("--format", default="fp8_scaled", help="the weights' format (wan_model.py's FORMATS)")
    parser.add_argument("--card", type=float, default=16, help="the simulated card of each GPU, GiB (default 16)")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--size", default="1280x720", help="width x height (default 1280x720)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cfg", type=float, default=5.0)
    parser.add_argument("--negative", default="zeros", help="zeros (ConditioningZeroOut) or random")
    parser.add_argument("--level", default="High")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--xfuser-attention", default=None,
                        help="raylight's xFuser attention type (default TORCH_FLASH on CUDA, TORCH_MATH on the CPU)")
    parser.add_argument("--search-frames", action="store_true", help="also the most frames each method fits")
    parser.add_argument("--frame-step", type=int, default=40)
    parser.add_argument("--max-frames", type=int, default=401)
    parser.add_argument("--tiny", action="store_true", help="a tiny Wan (a smoke run), no card plan")
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None, help="rank 0 writes the records there")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    attention = args.xfuser_attention or ("TORCH_FLASH" if device.type == "cuda" else "TORCH_MATH")
    rank, world, inject = start_raylight(args.raylight_root, device, attention)
    config = TINY if args.tiny else WAN_14B
    if config["num_heads"] % world:
        raise SystemExit(f"{config['num_heads']} heads do not split over {world} GPUs")
    base = load_model(args.format, wan_state_dict(args.format, config, device), dynamic=False)
    if device.type == "cuda" and not args.tiny:
        import comfy.model_management
        plan_for_card(args.card, comfy.model_management.EXTRA_RESERVED_VRAM)
    records = []
    for method in METHODS:
        record = run_method(base, method, inject, args, config, args.frames, probe=False)
        records.append(record)
    difference = None
    if all(r.get("samples") is not None for r in records):
        a, b = (r["samples"].float() for r in records)
        difference = float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
    for record in records:
        record.pop("samples", None)
    searched = {}
    if args.search_frames:
        for method in METHODS:
            def fits(frames, method=method):
                record = run_method(base, method, inject, args, config, frames, probe=True)
                record.pop("samples", None)
                return all(_gathered(bool(record["fits"])))
            searched[method] = search_frames(fits, args.frames, args.frame_step, args.max_frames)
    every = _gathered(records)
    if rank == 0:
        _report(args, world, every, difference, searched)
    free_everything()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _report(args, world: int, every: list, difference, searched: dict) -> None:
    print(f"\nraylight Ulysses over {world} ranks, Wan {'tiny' if args.tiny else '14B'} {args.format}, "
          f"{args.frames} frames {args.size}, {args.card:g} GiB a GPU, cfg {args.cfg}, negative {args.negative}")
    print("| method | s / step | peak VRAM GiB (largest rank) | weights on GPU GiB | first block x its |x| (each "
          "rank) | fits |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    rows = []
    for index, method in enumerate(METHODS):
        ranks = [records[index] for records in every]
        row = {"method": method, "fits": all(r.get("fits") for r in ranks),
               "s_per_step": max((r.get("s_per_step") or 0) for r in ranks),
               "peak_vram_gib": max((r.get("peak_vram_gib") or 0) for r in ranks),
               "weights_on_gpu_gib": max((r.get("weights_on_gpu_gib") or 0) for r in ranks),
               "block_peak_x": [r.get("block_peak_x") for r in ranks], "errors": [r.get("error") for r in ranks]}
        rows.append(row)
        peaks = ", ".join("-" if p is None else f"{p:.2f}" for p in row["block_peak_x"])
        print(f"| {method} | {row['s_per_step']:.2f} | {row['peak_vram_gib']:.2f} | {row['weights_on_gpu_gib']:.2f} "
              f"| {peaks} | {'yes' if row['fits'] else 'out of memory'} |")
    if difference is not None:
        print(f"largest difference between the two methods' samples (rank 0): {difference:.2e}")
    for method, frames in searched.items():
        print(f"frames search ({args.size}, {args.card:g} GiB a GPU): {method}: {frames}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "args": vars(args), "rows": rows, "difference": difference,
                       "frames": searched}, f, indent=1)
