"""Benchmark: a Wan 2.x 14B self-attention layer, the way ComfyUI runs it ("stock") against `qkv_core`.

    python -m benchmarks.bench                     # CUDA if present, else a scaled CPU run
    python -m benchmarks.bench --json              # machine-readable results
    python -m benchmarks.bench --plot bench-wan.png
    python -m benchmarks.bench --comfyui [PATH]    # ComfyUI's real Wan 14B block (benchmarks/wan_block.py)
    python -m benchmarks.bench --comfyui [PATH] --whole-model [options]   # benchmarks/wan_model.py
    python -m benchmarks.bench --comfyui [PATH] --families [options]      # benchmarks/family_blocks.py
    python -m benchmarks.bench --comfyui [PATH] --family-models [options] # benchmarks/family_models.py
    python -m benchmarks.bench --comfyui [PATH] --minimax-model [options] # benchmarks/minimax_model.py
    python -m benchmarks.bench --comfyui [PATH] --report-check [options]  # benchmarks/report_check.py (CUDA)
    torchrun --nproc-per-node 2 -m benchmarks.bench --comfyui [PATH] --raylight-model [options]
                                                   # benchmarks/raylight_model.py (raylight's Ulysses, 2 GPUs)

Run from the repository root (`scripts/bench` does); the benchmarks are not part of the node pack's runtime.

The layer: width 5120, 40 heads of 128, q/k/v/o Linear with bias, RMSNorm over all 5120 channels of q and of
k (eps 1e-6, with a weight), RoPE with Wan's 3-axis frequencies (interleaved pairs, axes [44, 42, 42] over
(t, h, w), applied in float32 and cast back), random weights. Both ways include the output projection o:
layer = projections + norm + RoPE + attention + o, input `(1, tokens, 5120)`, output `(1, tokens, 5120)`.

- "stock": ComfyUI v0.8.0's WanSelfAttention.forward, reproduced op for op (comfy/ldm/wan/model.py,
  apply_rope1 of comfy/ldm/flux/math.py or comfy_kitchen when importable, comfy/rmsnorm.py, and
  attention_pytorch's SDPA call in comfy/ldm/modules/attention.py); not imported from ComfyUI.
- "qkv_core <level>": `qkv_core.qkv_attention` with `norm_spans_heads=True`, `force_attention="sdpa"` and
  the Head Split level, then o.

Peak = working set above the live input and weights (the result included), also as a multiple of
|x| = tokens x 5120 x 2 bytes (one bf16 activation). On CUDA: the allocator's peak and CUDA-event times at
the real token counts. On CPU: `benchmarks.memory` (MemTracker), with the token counts scaled down (see
`--cpu-scale`). The workloads are pluggable: see `Workload` and `WORKLOADS`.

`--comfyui [PATH]`: ComfyUI's own `WanAttentionBlock` (Wan 2.x 14B: self-attention, cross-attention, FFN),
stock against the pack's Wan adapter (attention forwards only, and the bounded block). ComfyUI is taken from
PATH, else $COMFYUI_PATH, else the ComfyUI above this repository (custom_nodes/<pack>), else ~/ComfyUI. The
workload (`benchmarks/wan_block.py`) imports the pack's adapter relatively, so it is imported inside a
package made for the whole pack, `<PACK_PACKAGE>.benchmarks.wan_block`, without running the pack's
`__init__.py` files (they import comfy_api); see `load_pack_module`. `qkv_core` itself never imports ComfyUI.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from benchmarks import dynamic_vram

if "--dynamic-vram" in sys.argv[1:]:   # comfy-aimdo loads before torch does, as ComfyUI's main.py has it
    dynamic_vram.start()

import torch  # noqa: E402 - after comfy-aimdo's start (above)

import qkv_core
from qkv_core import head_split as _head_split
from qkv_core import runtime as _runtime
from benchmarks.memory import GiB, measure_peak, time_call, check_cpu_tracker

# the model, Wan 2.x 14B self-attention, stock and through qkv_core: benchmarks/wan_layer.py
from benchmarks.wan_layer import (DEFAULT_CPU_SCALE, RESOLUTIONS, WAN_14B, WanSelfAttentionLayer,  # noqa: E402
                                  make_norm_rope, qkv_forward, stock_forward, stock_rope_fn, wan_rope_freqs)


@dataclass
class Case:
    """One size to run: a name, the tokens actually run and the tokens it stands for."""
    name: str
    tokens: int
    full_tokens: int
    grid: tuple


@dataclass
class Method:
    name: str
    run: Callable[[list], torch.Tensor]   # takes the input list (it may clear it), returns the output
    groups: Optional[int] = None          # head groups it attends in, when known


@dataclass
class Prepared:
    """A workload built for one case: what is live, how to make an input, the methods (reference first)."""
    live: object
    make_input: Callable[[], list]
    unit_bytes: int                       # |x|: bytes of one activation of the layer
    methods: list
    notes: list = field(default_factory=list)
    #: optional: run after the methods; returns [(label, peak bytes), ...] (e.g. the parts of the reference)
    extras: Optional[Callable[[], list]] = None


class Workload:
    """A thing to benchmark. `cases(args)` lists the sizes; `setup(case, device, dtype, args)` builds the
    weights and returns a `Prepared` whose first method is the reference the others are compared with.
    `scaled(scale)`: a context for scaled CPU runs, for absolute token constants of the workload's own code
    (the runtime's are scaled by `scaled_runtime`), described by `scaling_notes(scale)`."""
    name = "?"
    title = "?"
    label: Optional[str] = None       # when set, the head of every table starts with it
    default_levels = "off,low,medium,high"
    default_cpu_scale = DEFAULT_CPU_SCALE
    # one torch thread on CPU, the docs' measured setting: 2 threads on a 2-core machine shared with other jobs ran
    # the many-small-ops paths 1.5-6x slower (OpenMP threads waiting on each other); --threads N overrides
    default_cpu_threads: Optional[int] = 1

    def scaled(self, scale: float):
        return contextlib.nullcontext()

    def scaling_notes(self, scale: float) -> list:
        return []

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        pass

    def cases(self, args) -> list:  # pragma: no cover - interface
        raise NotImplementedError

    def setup(self, case: Case, device, dtype, args) -> Prepared:  # pragma: no cover - interface
        raise NotImplementedError


class WanSelfAttentionWorkload(Workload):
    name = "wan-self-attention"
    title = ("Wan 2.x 14B self-attention layer (5120 wide, 40 heads x 128, q/k/v/o with bias, RMSNorm q/k "
             "over 5120, 3-axis RoPE; o included in both ways)")

    def add_arguments(self, parser):
        parser.add_argument("--stock-rope", choices=("auto", "eager", "kitchen"), default="auto",
                            help="the stock path's RoPE: comfy_kitchen.apply_rope1 when importable (auto), "
                                 "or ComfyUI's eager formula")

    def cases(self, args):
        if args.tokens:
            return [Case(f"{t:,} tokens", math.ceil(t / args.scale), t, RESOLUTIONS[0][1]) for t in args.tokens]
        out = []
        for name, grid in RESOLUTIONS:
            full = grid[0] * grid[1] * grid[2]
            out.append(Case(name, math.ceil(full / args.scale), full, grid))
        return out

    def setup(self, case, device, dtype, args):
        cfg = WAN_14B
        freqs = wan_rope_freqs(case.grid, case.tokens, cfg["head_dim"], cfg["theta"], device)
        layer = WanSelfAttentionLayer(cfg["dim"], cfg["heads"], cfg["head_dim"], cfg["eps"], freqs, device, dtype,
                                      seed=args.seed)
        generator = torch.Generator(device="cpu").manual_seed(args.seed + 1)
        x0 = torch.randn(1, case.tokens, cfg["dim"], generator=generator).to(device=device, dtype=dtype)
        rope, rope_name = stock_rope_fn(args.stock_rope)
        norm_rope = make_norm_rope(layer)
        methods = [Method("stock (ComfyUI 0.8.0)", lambda xl: stock_forward(layer, xl, rope), 1)]
        for level in args.levels:
            groups = qkv_core.group_count(cfg["heads"], case.tokens, level)
            methods.append(Method(f"qkv_core {qkv_core.LEVEL_NAMES[level].capitalize()}",
                                  lambda xl, level=level: qkv_forward(layer, xl, level, norm_rope), groups))
        return Prepared(live=[layer, x0], make_input=lambda: [x0.clone()],
                        unit_bytes=case.tokens * cfg["dim"] * x0.element_size(), methods=methods,
                        notes=[f"stock RoPE: {rope_name}"])


WORKLOADS: dict[str, Workload] = {w.name: w for w in (WanSelfAttentionWorkload(),)}


# ------------------------------------------------------------------------------------------------------
# scaling for CPU runs
# ------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def scaled_runtime(scale: float):
    """Scales the runtime's absolute token-count constants by 1/scale, with the token counts, so that a
    scaled run splits and chunks exactly as the full-size one: the Head Split floor (8192 tokens), the
    rows_ chunk bounds (2^23 and 2^16 elements) and the statistics pass's 256-token chunk multiple. Restored
    on exit."""
    saved = (_head_split.SPLIT_FLOOR_TOKENS, _runtime.ROWS_CHUNK_ELEMENTS, _runtime.ROWS_MIN_CHUNK_ELEMENTS,
             _runtime.STATS_CHUNK_MULTIPLE)
    if scale != 1:
        _head_split.SPLIT_FLOOR_TOKENS = max(1, math.ceil(saved[0] / scale))
        _runtime.ROWS_CHUNK_ELEMENTS = max(1, int(saved[1] / scale))
        _runtime.ROWS_MIN_CHUNK_ELEMENTS = max(1, int(saved[2] / scale))
        _runtime.STATS_CHUNK_MULTIPLE = max(1, math.ceil(saved[3] / scale))
    try:
        yield
    finally:
        (_head_split.SPLIT_FLOOR_TOKENS, _runtime.ROWS_CHUNK_ELEMENTS, _runtime.ROWS_MIN_CHUNK_ELEMENTS,
         _runtime.STATS_CHUNK_MULTIPLE) = saved


# ------------------------------------------------------------------------------------------------------
# measure
# ------------------------------------------------------------------------------------------------------

def _diff(output: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    diff = (output.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    return diff, diff / scale if scale else float("nan")


def measure(workload: Workload, case: Case, device, dtype, args) -> dict:
    """Runs every method of the workload on one case: peak, times, difference from the reference. The
    timed runs take turns (one run of every method per round, `repeats` rounds, after each method's
    warm-up), so a clock that drifts as the GPU warms up weighs on every method alike."""
    prepared = workload.setup(case, device, dtype, args)
    rows, reference = [], None
    make_args = lambda: (prepared.make_input(),)  # noqa: E731
    for method in prepared.methods:
        x_list = prepared.make_input()
        peak = measure_peak(method.run, x_list, device=device, live=prepared.live)
        output = peak.result
        peak = peak._replace(result=None)
        del x_list
        if reference is None:
            reference, diff, rel = output, 0.0, 0.0
        else:
            diff, rel = _diff(output, reference)
        del output
        time_call(method.run, setup=make_args, warmup=args.warmup, repeats=0, device=device)
        row = dict(method=method.name, groups=method.groups, peak_bytes=peak.peak_bytes,
                   peak_gib=peak.peak_bytes / GiB, peak_x=peak.peak_bytes / prepared.unit_bytes,
                   times_s=[], cpu_times_s=[], max_abs_diff=diff, rel_diff=rel)
        if device.type == "cpu":
            row["untracked_alias_bytes"] = peak.untracked_alias_bytes
            row["breakdown_bytes"] = peak.breakdown
        rows.append(row)
    del reference
    for _ in range(args.repeats):
        for method, row in zip(prepared.methods, rows):
            timing = time_call(method.run, setup=make_args, warmup=0, repeats=1, device=device)
            row["times_s"] += timing.times_s
            if timing.cpu_median_s is not None:
                row["cpu_times_s"].append(timing.cpu_median_s)
    for row in rows:
        row["time_s"] = statistics.median(row["times_s"]) if row["times_s"] else float("nan")
        cpu_times = row.pop("cpu_times_s")
        row["cpu_time_s"] = statistics.median(cpu_times) if cpu_times else None
        if args.verbose:
            print(f"  {case.name}: {row['method']}: peak {row['peak_x']:.2f}x |x|, {row['time_s'] * 1e3:.0f} ms",
                  file=sys.stderr, flush=True)
    parts = []
    if prepared.extras is not None:
        for label, peak_bytes in prepared.extras():
            parts.append(dict(part=label, peak_bytes=peak_bytes, peak_gib=peak_bytes / GiB,
                              peak_x=peak_bytes / prepared.unit_bytes))
    return dict(case=case.name, label=workload.label, tokens=case.tokens, full_tokens=case.full_tokens,
                unit_bytes=prepared.unit_bytes, notes=prepared.notes, rows=rows, parts=parts)


# results as tables, machine facts and plots: benchmarks/results.py
from benchmarks.results import format_table, machine_info, plot, pyplot  # noqa: E402


# ------------------------------------------------------------------------------------------------------
# --comfyui: ComfyUI's own Wan block, through the pack's adapter
# ------------------------------------------------------------------------------------------------------

# ComfyUI found and set up, the pack's workloads imported inside a package made for it: benchmarks/comfyui_setup.py
# (PACK_PACKAGE: the tests' GPU fixtures read it from here)
from benchmarks.comfyui_setup import PACK_PACKAGE, load_pack_module  # noqa: E402,F401


def load_comfyui_workload(path: Optional[str], device: torch.device, flags=()) -> Workload:
    """Sets ComfyUI up and loads the `--comfyui` workload, `benchmarks/wan_block.py`, as
    `<PACK_PACKAGE>.benchmarks.wan_block` (see `load_pack_module`); its `make_workload` gets this module (the
    running runner, `__main__` under `python -m`), whose `Workload`, `Method`, ... it builds on."""
    module, root, notes = load_pack_module("wan_block", path, device, flags)
    workload = module.make_workload(sys.modules[__name__])
    workload.comfyui_root = str(root)
    workload.setup_notes = [f"ComfyUI from {root}"] + notes
    return workload


def run_whole_model(argv) -> int:
    """`--comfyui PATH --whole-model ...`: a whole Wan 14B sampled through ComfyUI (benchmarks/wan_model.py,
    whose options follow). ComfyUI's Dynamic VRAM loader is turned off before ComfyUI is imported unless
    `--dynamic-vram` is given; then it is started as ComfyUI's main.py starts it (comfy-aimdo before CUDA,
    its devices after ComfyUI's import), and a machine where it cannot start says so and stops."""
    pre = argparse.ArgumentParser(add_help=False)
    _comfyui_option(pre)
    pre.add_argument("--whole-model", action="store_true")
    pre.add_argument("--device", default=None)
    known, rest = pre.parse_known_args(argv)
    flags = list(known.comfy_flag)
    dynamic = "--dynamic-vram" in rest
    if not dynamic:
        flags.append("?disable-dynamic-vram")   # v0.33+; older ComfyUI has only the estimate-based loader
    device = _device(known.device)
    module, root, notes = load_pack_module("wan_model", known.comfyui or None, device, flags)
    if dynamic:
        problem = dynamic_vram.enable()   # started at this module's import (before torch)
        if problem:
            raise SystemExit(f"--dynamic-vram: {problem}")
        notes.append("Dynamic VRAM on (comfy-aimdo, ModelPatcherDynamic)")
    print(f"ComfyUI from {root}; " + "; ".join(notes), flush=True)
    return module.main(rest + (["--device", known.device] if known.device else []))

def _run_pack_module(argv, flag: str, name: str) -> int:
    """`--comfyui PATH <flag> ...`: `benchmarks/<name>.py` loaded inside ComfyUI (`load_pack_module`), its
    `main` given the remaining options."""
    pre = argparse.ArgumentParser(add_help=False)
    _comfyui_option(pre)
    pre.add_argument(flag, action="store_true")
    pre.add_argument("--device", default=None)
    known, rest = pre.parse_known_args(argv)
    device = _device(known.device)
    module, root, notes = load_pack_module(name, known.comfyui or None, device, list(known.comfy_flag))
    print(f"ComfyUI from {root}; " + "; ".join(notes), flush=True)
    return module.main(rest + (["--device", known.device] if known.device else []))


# The workloads run inside ComfyUI by `_run_pack_module`: the flag, its module in benchmarks/ (whose options follow)
PACK_MODULES = {"--families": "family_blocks",          # one block of each adapted family, stock vs the pack
                "--references": "reference_steps",     # reference images kept across steps (Flux.2-shaped)
                "--family-models": "family_models",     # whole models of the non-Wan families, and memory factors
                "--minimax-model": "minimax_model",     # MiniMax H3 on a simulated card
                "--report-check": "report_check",       # the run report against CUDA's peaks
                "--raylight-model": "raylight_model"}   # Wan 14B through raylight's Ulysses, one process a GPU


# ------------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------------

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def _device(name: Optional[str]) -> torch.device:
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _comfyui_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--comfyui", nargs="?", const="", default=None, metavar="PATH",
                        help="benchmark ComfyUI's own Wan 2.x 14B block (WanAttentionBlock) stock against the pack's "
                             "adapter; ComfyUI from PATH, else $COMFYUI_PATH, else above this repo, else ~/ComfyUI")
    parser.add_argument("--comfy-flag", action="append", default=[], metavar="FLAG",
                        help="with --comfyui: a ComfyUI command-line switch turned on before ComfyUI is imported, "
                             "e.g. --comfy-flag use-ck-attention (repeatable)")


def parse_args(argv=None):
    # --comfyui first: its workload (and its options) exist only once ComfyUI is imported
    pre = argparse.ArgumentParser(add_help=False)
    _comfyui_option(pre)
    pre.add_argument("--device", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.comfyui is not None:
        workload = load_comfyui_workload(known.comfyui or None, _device(known.device), known.comfy_flag)
        WORKLOADS[workload.name] = workload

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                        help="default: wan-self-attention (comfyui-wan-block with --comfyui)")
    _comfyui_option(parser)
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    parser.add_argument("--tokens", default=None,
                        help="comma-separated token counts to run as given (default: 480p and 720p x 81 frames, "
                             "scaled on CPU)")
    parser.add_argument("--levels", default=None,
                        help="Head Split levels to run, comma-separated names or 0-3 (default: all; with "
                             "--comfyui: high)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per method (default: CUDA 10, CPU 3)")
    parser.add_argument("--warmup", type=int, default=0,
                        help="extra untimed runs before timing (the memory-measured run already warms up)")
    parser.add_argument("--cpu-scale", type=float, default=None,
                        help=f"CPU only: divide the default token counts by this (default {DEFAULT_CPU_SCALE}, "
                             "with --comfyui 32); "
                             "the runtime's token-count thresholds are scaled alike")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU: torch threads (default 1, as the docs measured). On a machine shared with other "
                             "jobs, 1 avoids OpenMP threads waiting on each other, which swamps paths of many small "
                             "ops")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print machine-readable results instead of tables")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="bar chart of peak and time (matplotlib)")
    parser.add_argument("--verbose", "-v", action="store_true", help="progress on stderr")
    for workload in WORKLOADS.values():
        workload.add_arguments(parser)
    args = parser.parse_args(argv)

    if args.comfyui is not None:
        if args.workload not in (None, "comfyui-wan-block"):
            parser.error("--comfyui runs the comfyui-wan-block workload; leave --workload out")
        args.workload = "comfyui-wan-block"
    elif args.workload is None:
        args.workload = "wan-self-attention"
    args.levels = args.levels or WORKLOADS[args.workload].default_levels
    args.device = _device(args.device)
    args.dtype_name, args.dtype = args.dtype, _DTYPES[args.dtype]
    args.tokens = [int(t.replace("_", "")) for t in args.tokens.split(",")] if args.tokens else None
    args.levels = [qkv_core.parse_level(int(v) if v.strip().isdigit() else v) for v in args.levels.split(",")]
    if args.repeats is None:
        args.repeats = 10 if args.device.type == "cuda" else 3
    if args.device.type == "cuda":
        if args.cpu_scale not in (None, 1):
            parser.error("--cpu-scale is for CPU runs")
        args.scale = 1.0
    elif args.tokens and args.cpu_scale is None:
        args.scale = 1.0
    else:
        args.scale = float(args.cpu_scale or WORKLOADS[args.workload].default_cpu_scale)
    return args


def scaling_note(args, cases) -> Optional[str]:
    if args.scale == 1:
        return None
    floor = math.ceil(qkv_core.SPLIT_FLOOR_TOKENS / args.scale)
    chunk = int(_runtime.ROWS_CHUNK_ELEMENTS / args.scale)
    multiple = math.ceil(_runtime.STATS_CHUNK_MULTIPLE / args.scale)
    sizes = ", ".join(f"{c.full_tokens:,} -> {c.tokens:,}" for c in cases)
    return (f"SCALED CPU RUN: token counts divided by {args.scale:g} ({sizes}); width, heads and head dim are the "
            f"real ones (5120 = 40 x 128). The runtime's absolute token constants are scaled alike so that it "
            f"splits and chunks as at full size: Head Split floor {qkv_core.SPLIT_FLOOR_TOKENS:,} -> {floor:,} "
            f"tokens, rows_ chunk {_runtime.ROWS_CHUNK_ELEMENTS:,} -> {chunk:,} elements, statistics chunks "
            f"in multiples of {_runtime.STATS_CHUNK_MULTIPLE} -> {multiple} tokens. Peaks as x|x| carry "
            f"over to full size; times do not (attention grows with tokens squared).")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--whole-model" in argv:
        return run_whole_model(argv)
    for flag, name in PACK_MODULES.items():
        if flag in argv:
            if torch.cuda.is_available() and "LOCAL_RANK" in os.environ and "cpu" not in argv:
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))   # torchrun: ComfyUI takes the current GPU
            return _run_pack_module(argv, flag, name)
    args = parse_args(argv)
    workload = WORKLOADS[args.workload]
    threads = args.threads or (workload.default_cpu_threads if args.device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    device, dtype = args.device, args.dtype
    if args.plot:
        pyplot()  # fail before the runs, not after
    cases = workload.cases(args)
    note = scaling_note(args, cases)
    if note:
        note = " ".join([note] + workload.scaling_notes(args.scale))
    started = time.perf_counter()
    if device.type == "cpu":
        problem = check_cpu_tracker()
        if problem:
            print(f"warning: the CPU memory measurement failed its self-check ({problem}); peaks may be wrong",
                  file=sys.stderr)
    results = []
    with torch.no_grad(), scaled_runtime(args.scale), workload.scaled(args.scale):
        for case in cases:
            results.append(measure(workload, case, device, dtype, args))
    elapsed = time.perf_counter() - started
    machine = machine_info(device)
    report = dict(workload=workload.name, title=workload.title, machine=machine, dtype=args.dtype_name,
                  scale=args.scale, scaling=note, setup=getattr(workload, "setup_notes", []), repeats=args.repeats,
                  warmup=args.warmup, elapsed_s=elapsed, results=results)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        where = machine.get("gpu") or f"CPU ({machine['cpu']}), {machine['cores']} cores, torch threads: {machine['threads']}"
        print(f"{workload.title}")
        print(f"{where}, torch {machine['torch']}, {args.dtype_name}; peak = working set above the live input and "
              f"weights (result included); time = median of {args.repeats} runs; "
              f"{'CUDA allocator peaks, CUDA events' if device.type == 'cuda' else 'MemTracker peaks; time = wall clock (perf_counter), CPU time = process CPU time, all threads'}")
        for line in report["setup"]:
            print(line)
        if note:
            print(note)
        for result in results:
            print()
            for line in result["notes"]:
                print(line)
            print(format_table(result, device))
        print(f"\ntotal {elapsed:.0f} s")
    if args.plot:
        plot(results, args.plot, workload.title + (f" [tokens / {args.scale:g}]" if args.scale != 1 else ""))
        if not args.json:
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
