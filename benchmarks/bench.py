"""Benchmark: a Wan 2.x 14B self-attention layer, the way ComfyUI runs it ("stock") against `qkv_core`.

    python -m benchmarks.bench                     # CUDA if present, else a scaled CPU run
    python -m benchmarks.bench --json              # machine-readable results
    python -m benchmarks.bench --plot bench-wan.png
    python -m benchmarks.bench --comfyui [PATH]    # ComfyUI's real Wan 14B block (benchmarks/wan_block.py)
    python -m benchmarks.bench --comfyui [PATH] --whole-model [options]   # benchmarks/wan_model.py
    python -m benchmarks.bench --comfyui [PATH] --families [options]      # benchmarks/family_blocks.py
    python -m benchmarks.bench --comfyui [PATH] --family-models [options] # benchmarks/family_models.py
    python -m benchmarks.bench --comfyui [PATH] --report-check [options]  # benchmarks/report_check.py (CUDA)

Run from the repository root (`scripts/bench` does). Until this change the runner was `qkv_core/bench.py`
(`python -m qkv_core.bench`); the benchmarks are not part of the node pack's runtime.

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
import importlib
import importlib.machinery
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import textwrap
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from benchmarks import dynamic_vram

if "--dynamic-vram" in sys.argv[1:]:   # comfy-aimdo loads before torch does, as ComfyUI's main.py has it
    dynamic_vram.start()

import torch  # noqa: E402 - after comfy-aimdo's start (above)
import torch.nn as nn
import torch.nn.functional as F

import qkv_core
from qkv_core import head_split as _head_split
from qkv_core import runtime as _runtime
from benchmarks.memory import GiB, measure_peak, time_call, check_cpu_tracker

# ------------------------------------------------------------------------------------------------------
# the model: Wan 2.x 14B self-attention
# ------------------------------------------------------------------------------------------------------

WAN_14B = dict(dim=5120, heads=40, head_dim=128, eps=1e-6, theta=10000.0)

#: (name, latent grid (t, h, w)): 81 frames -> 21 latent frames; 480p -> 30 x 52, 720p -> 45 x 80 patches
RESOLUTIONS = [("480p x 81 frames", (21, 30, 52)), ("720p x 81 frames", (21, 45, 80))]

DEFAULT_CPU_SCALE = 16


def wan_rope_axes(head_dim: int) -> list[int]:
    """Wan's split of the head dim over (t, h, w): [44, 42, 42] for 128 (comfy/ldm/wan/model.py)."""
    return [head_dim - 4 * (head_dim // 6), 2 * (head_dim // 6), 2 * (head_dim // 6)]


def wan_rope_freqs(grid, tokens: int, head_dim: int, theta: float, device) -> torch.Tensor:
    """ComfyUI's RoPE table for the first `tokens` positions of the latent grid (t, h, w), float32
    `(1, tokens, 1, head_dim // 2, 2, 2)`: per pair the rotation [[cos, -sin], [sin, cos]]."""
    t, h, w = grid
    if tokens > t * h * w:
        t = math.ceil(tokens / (h * w))
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)
    pos = pos.reshape(-1, 3)[:tokens].to(torch.float64)
    tables = []
    for axis, dim in enumerate(wan_rope_axes(head_dim)):
        scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64)
        angle = pos[:, axis, None] * (1.0 / theta ** scale)                     # (tokens, dim/2)
        rot = torch.stack([angle.cos(), -angle.sin(), angle.sin(), angle.cos()], dim=-1)
        tables.append(rot.view(tokens, dim // 2, 2, 2))
    freqs = torch.cat(tables, dim=-3).to(torch.float32)                          # (tokens, D/2, 2, 2)
    return freqs[None, :, None].contiguous().to(device)


class WanSelfAttentionLayer(nn.Module):
    """Weights of one Wan self-attention layer (random), with the RoPE table of its tokens as a buffer."""

    def __init__(self, dim, heads, head_dim, eps, freqs, device, dtype, seed=0):
        super().__init__()
        self.dim, self.heads, self.head_dim, self.eps = dim, heads, head_dim, eps
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for name in ("q", "k", "v", "o"):
            linear = nn.Linear(dim, dim, bias=True, device="meta")
            bound = 1.0 / math.sqrt(dim)
            weight = (torch.rand(dim, dim, generator=generator) * 2 - 1) * bound
            bias = (torch.rand(dim, generator=generator) * 2 - 1) * bound
            linear.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
            linear.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
            setattr(self, name, linear)
            del weight, bias
        # Wan's norm_q / norm_k: RMSNorm over the full width, with a (trained, here random) weight
        self.norm_q_weight = nn.Parameter((1 + 0.1 * torch.randn(dim, generator=generator)).to(device, dtype),
                                          requires_grad=False)
        self.norm_k_weight = nn.Parameter((1 + 0.1 * torch.randn(dim, generator=generator)).to(device, dtype),
                                          requires_grad=False)
        self.register_buffer("freqs", freqs)


# --- stock: ComfyUI v0.8.0 --------------------------------------------------------------------------------

def apply_rope1_eager(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """ComfyUI's apply_rope1 (comfy/ldm/flux/math.py fallback = comfy_kitchen's eager backend): float32
    copies of x, a new float32 result, cast back."""
    x_ = x.to(dtype=freqs_cis.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    x_out = freqs_cis[..., 0] * x_[..., 0]
    x_out.addcmul_(freqs_cis[..., 1], x_[..., 1])
    return x_out.reshape(*x.shape).type_as(x)


def stock_rope_fn(choice: str) -> tuple[Callable, str]:
    """ComfyUI calls comfy_kitchen.apply_rope1 when comfy_kitchen is installed (CUDA: a fused kernel),
    else the eager formula."""
    if choice in ("auto", "kitchen"):
        try:
            import comfy_kitchen
            return comfy_kitchen.apply_rope1, "comfy_kitchen.apply_rope1"
        except Exception as e:
            if choice == "kitchen":
                raise SystemExit(f"--stock-rope kitchen: comfy_kitchen is not importable ({e})")
    return apply_rope1_eager, "eager apply_rope1 (comfy_kitchen not installed)"


def stock_forward(layer: WanSelfAttentionLayer, x_list: list, apply_rope1=apply_rope1_eager) -> torch.Tensor:
    """WanSelfAttention.forward of ComfyUI v0.8.0 with attention_pytorch (SDPA), o included."""
    x = x_list.pop()
    b, s, n, d = *x.shape[:2], layer.heads, layer.head_dim
    freqs = layer.freqs

    def rms_norm(t, weight):  # comfy.rmsnorm.rms_norm -> torch's rms_norm with the weight cast to t
        return F.rms_norm(t, weight.shape, weight=weight.to(t.dtype), eps=layer.eps)

    def qkv_fn_q(x):
        q = rms_norm(layer.q(x), layer.norm_q_weight).view(b, s, n, d)
        return apply_rope1(q, freqs)

    def qkv_fn_k(x):
        k = rms_norm(layer.k(x), layer.norm_k_weight).view(b, s, n, d)
        return apply_rope1(k, freqs)

    q = qkv_fn_q(x)
    k = qkv_fn_k(x)

    def attention_pytorch(q, k, v, heads):
        b, _, dim_head = q.shape
        dim_head //= heads
        q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
        return out.transpose(1, 2).reshape(b, -1, heads * dim_head)

    x = attention_pytorch(q.view(b, s, n * d), k.view(b, s, n * d), layer.v(x).view(b, s, n * d), heads=n)
    x = layer.o(x)
    return x


# --- qkv_core -----------------------------------------------------------------------------------------------

def make_norm_rope(layer: WanSelfAttentionLayer) -> Callable:
    """Wan's norm_q/norm_k + RoPE for `qkv_core`, in place, by bounded token chunks (`qkv_core.rows_`).
    With `group.mean_squares` the group's heads are normalized by the full-width statistics; without, the
    group must hold every head (unsplit). Same arithmetic as the stock path: normalize in float32, round to
    the model dtype, times the weight; rotate in float32, round."""
    d, eps, freqs = layer.head_dim, layer.eps, layer.freqs

    def one(t: torch.Tensor, heads: range, weight: torch.Tensor, mean_squares: Optional[torch.Tensor]):
        if mean_squares is None and len(heads) * d != layer.dim:
            raise RuntimeError("a norm over all heads needs group.mean_squares when the heads are split")
        w = weight[heads.start * d:heads.stop * d].to(t.dtype).view(len(heads), d)
        if t.is_cuda:   # the fused Triton pass the Wan adapter runs (nodes/attention.py), where it can
            ms = mean_squares if mean_squares is not None else \
                torch.linalg.vector_norm(t, dim=(-2, -1), dtype=torch.float32).square_().div_(layer.dim)
            if qkv_core.kernels.norm_rope_(t, torch.rsqrt(ms + eps), w, freqs):
                return

        def fn(part, a, b):
            f = part.float()
            ms = (f.square().mean(dim=(-2, -1), keepdim=True) if mean_squares is None
                  else mean_squares[:, a:b].unsqueeze(-1))
            f.mul_(torch.rsqrt(ms + eps))
            part.copy_(f)                 # rounded to the model dtype, as rms_norm does before the weight
            part.mul_(w)
            f.copy_(part)
            pairs = f.view(*part.shape[:-1], -1, 1, 2)
            fr = freqs[:, a:b]
            out = fr[..., 0] * pairs[..., 0]
            out.addcmul_(fr[..., 1], pairs[..., 1])
            part.copy_(out.view(part.shape))
            return part

        qkv_core.rows_(t, fn)

    def norm_rope(query, key, group):
        ms = group.mean_squares or (None, None)
        if query is not None:
            one(query, group.q, layer.norm_q_weight, ms[0])
        if key is not None:
            one(key, group.kv, layer.norm_k_weight, ms[1])

    return norm_rope


def qkv_forward(layer: WanSelfAttentionLayer, x_list: list, level: int, norm_rope: Callable) -> torch.Tensor:
    """The same layer through `qkv_core.qkv_attention` (x handed off), then o."""
    out = qkv_core.qkv_attention(x_list, layer.q, layer.k, layer.v, layer.heads, layer.head_dim, norm_rope,
                                 norm_spans_heads=True, head_split_level=level, force_attention="sdpa")
    return layer.o(out.flatten(2))


# ------------------------------------------------------------------------------------------------------
# workloads
# ------------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    info = dict(torch=torch.__version__, python=platform.python_version(), device=device.type)
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["cpu"] = _cpu_name()
        info["cores"] = os.cpu_count()
        info["threads"] = torch.get_num_threads()
    return info


def format_table(result: dict, device: torch.device) -> str:
    scaled = result["tokens"] != result["full_tokens"]
    head = result["case"]
    if result.get("label"):
        head = f"{result['label']}, {head}"
    if not head.endswith(" tokens") or scaled:
        head += f": {result['tokens']:,} tokens run"
    if scaled:
        head += f" (stands for {result['full_tokens']:,})"
    head += f", |x| = {result['unit_bytes'] / 2**20:,.1f} MiB"
    cpu = device.type == "cpu"
    lines = [head, "",
             "| method | head groups | peak GiB | peak x|x| | time ms |" + (" CPU time ms |" if cpu else "")
             + " max abs diff vs stock | relative |",
             "| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if cpu else "") + " ---: | ---: |"]
    for row in result["rows"]:
        cpu_time = f" {row['cpu_time_s'] * 1e3:,.0f} |" if cpu else ""
        lines.append(f"| {row['method']} | {row['groups'] or '-'} | {row['peak_gib']:.4f} | {row['peak_x']:.2f} | "
                     f"{row['time_s'] * 1e3:,.0f} |{cpu_time} {row['max_abs_diff']:.3g} | {row['rel_diff']:.2g} |")
    if result.get("parts"):
        reference = result["rows"][0]["method"]
        lines += ["", f"{reference}, parts alone (peak above the part's input, its result included): " + ", ".join(
            f"{p['part']} {p['peak_gib']:.4f} GiB = {p['peak_x']:.2f} x|x|" for p in result["parts"])]
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib, which is not installed: python3 -m pip install matplotlib "
                         "(scripts/bench --plot FILE installs it)") from None
    return plt


def plot(results: list, path: str, title: str) -> None:
    plt = _pyplot()
    methods = [row["method"] for row in results[0]["rows"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    width = 0.8 / max(1, len(results))
    for ax, key, label in ((axes[0], "peak_x", "peak working set, x |x| (lower is better)"),
                           (axes[1], "time_s", "time, ms (lower is better)")):
        for index, result in enumerate(results):
            values = [row[key] * (1e3 if key == "time_s" else 1) for row in result["rows"]]
            positions = [m + (index - (len(results) - 1) / 2) * width for m in range(len(methods))]
            bars = ax.bar(positions, values, width, label=result["case"] if result["case"].endswith(" tokens")
                          else f"{result['case']} ({result['tokens']:,} tokens)")
            ax.bar_label(bars, fmt="%.2f" if key == "peak_x" else "%.0f", fontsize=7)
        ax.set_xticks(range(len(methods)), methods, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.margins(y=0.25)   # room for the bar labels and the legend above the tallest bars
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)



# ------------------------------------------------------------------------------------------------------
# --comfyui: ComfyUI's own Wan block, through the pack's adapter
# ------------------------------------------------------------------------------------------------------

#: the repository root = the node pack's folder (benchmarks/ sits next to nodes/ and qkv_core/)
PACK_ROOT = Path(__file__).resolve().parent.parent
#: the package name the pack is loaded under for the benchmark (never ComfyUI's top-level `nodes`)
PACK_PACKAGE = "comfyui_qkv_bench"
#: top-level packages of this process that the pack package shares (same module objects): see `load_pack_module`
SHARED_PACKAGES = ("qkv_core", "benchmarks")


def _is_comfyui_root(path: Path) -> bool:
    return (path / "comfy").is_dir() and (path / "comfyui_version.py").is_file()


def find_comfyui(path: Optional[str] = None) -> Path:
    """ComfyUI's root: `path`, else $COMFYUI_PATH, else the ComfyUI this repository is installed in
    (ComfyUI/custom_nodes/<pack>), else ~/ComfyUI. SystemExit with the places looked at when none is."""
    if path or os.environ.get("COMFYUI_PATH"):
        given = Path(path or os.environ["COMFYUI_PATH"]).expanduser().resolve()
        if not _is_comfyui_root(given):
            raise SystemExit(f"--comfyui: {given} is not a ComfyUI checkout (needs comfy/ and comfyui_version.py)")
        return given
    # custom_nodes/<pack>/benchmarks/bench.py -> ComfyUI, as given (a symlinked pack) and resolved
    given_root = Path(os.path.abspath(__file__)).parent.parent
    candidates = [given_root.parent.parent, PACK_ROOT.parent.parent, Path.home() / "ComfyUI"]
    for candidate in candidates:
        if _is_comfyui_root(candidate):
            return candidate.resolve()
    raise SystemExit("--comfyui: no ComfyUI found (give its path: --comfyui PATH, or set COMFYUI_PATH); looked at "
                     + ", ".join(str(c) for c in candidates))


# Packages ComfyUI imports unguarded at module level for models and nodes the benchmarks never run: a bare
# machine (a CPU-only torch, a GPU image without PyAV) may have none that imports
STUBBED = ("torchvision", "torchaudio", "av")


class _StubSubmodules:
    """`<stubbed>.<anything>` as an empty stub package while that package is a stub below: `comfy.model_base`
    (v0.33) imports `torchvision.ops.roi_align` (SAM3), comfy_api's video types `av.container`. Attributes of
    the stub modules are placeholders that raise when called; no workload calls them. A real package is never
    shadowed."""

    STUB_VERSION = "0.0.0+qkv_bench_stub"

    @classmethod
    def active(cls, name: str) -> bool:
        top = sys.modules.get(name)
        return top is not None and getattr(top, "__version__", "") == cls.STUB_VERSION

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        top, dot, _ = fullname.partition(".")
        if not dot or top not in STUBBED or not cls.active(top):
            return None
        return importlib.machinery.ModuleSpec(fullname, cls, is_package=True)

    @classmethod
    def create_module(cls, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    @classmethod
    def exec_module(cls, module):
        pass


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        top = self.__name__.split(".")[0]

        def unavailable(*args, **kwargs):
            raise ImportError(f"{self.__name__}.{name}: {top} is not installed (bench.py's stub)")
        return type(name, (), {"__init__": unavailable, "__module__": self.__name__})


def _stubs_if_missing() -> list:
    """A bare stub package for each of `STUBBED` that does not import (missing, or built for another torch);
    the names stubbed."""
    stubbed = []
    for top in STUBBED:
        try:
            importlib.import_module(top)
            continue
        except Exception:  # noqa: BLE001 - missing, or built for another torch
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]
        module = _StubModule(top)
        # a real spec: transformers calls importlib.util.find_spec("torchvision"), which needs one
        module.__spec__ = importlib.machinery.ModuleSpec(top, None, is_package=True)
        module.__path__ = []
        module.__version__ = _StubSubmodules.STUB_VERSION
        sys.modules[top] = module
        stubbed.append(top)
    if stubbed and _StubSubmodules not in sys.meta_path:
        sys.meta_path.append(_StubSubmodules)
    if "torchvision" in stubbed:   # imported with the package, as the real one does
        sys.modules["torchvision"].transforms = importlib.import_module("torchvision.transforms")
    return stubbed


def setup_comfyui(root: Path, device: torch.device, flags=()) -> list:
    """Makes ComfyUI at `root` importable and imports `comfy.model_management`. Without CUDA (or with a CPU
    `--device`) ComfyUI runs in its CPU mode with its PyTorch (SDPA) attention, flags set before
    `comfy.model_management` reads them; on CUDA its own defaults stay (SDPA on NVIDIA). Returns notes."""
    notes = []
    sys.path[:] = [p for p in sys.path if not (p and os.path.abspath(p) == str(root))]
    sys.path.insert(0, str(root))
    comfy = sys.modules.get("comfy")
    if comfy is not None and not str(Path(comfy.__path__[0]).resolve()).startswith(str(root)):
        raise SystemExit(f"--comfyui: `comfy` is already imported from {comfy.__path__[0]}, not from {root}")
    for name in _stubs_if_missing():
        notes.append(f"{name}: not importable, a stub stands in")
    import comfy.cli_args
    if device.type != "cuda":
        if "comfy.model_management" in sys.modules and not comfy.cli_args.args.cpu:
            raise SystemExit("--comfyui: comfy.model_management was imported before its CPU flag could be set")
        comfy.cli_args.args.cpu = True
        comfy.cli_args.args.use_pytorch_cross_attention = True
        notes.append("ComfyUI flags: --cpu --use-pytorch-cross-attention")
    for flag in flags:   # ComfyUI's command-line flags, e.g. use_ck_attention for --use-ck-attention
        name = flag.lstrip("?-").replace("-", "_")
        if not hasattr(comfy.cli_args.args, name):
            if flag.startswith("?"):   # wanted where this ComfyUI has it
                continue
            raise SystemExit(f"--comfy-flag: this ComfyUI has no flag {flag!r}")
        setattr(comfy.cli_args.args, name, True)
        notes.append(f"ComfyUI flag: --{name.replace('_', '-')}")
    importlib.import_module("comfy.model_management")
    return notes


def _package(name: str, path: Path) -> types.ModuleType:
    """An empty package `name` whose submodules are found in `path` (its __init__.py is not run)."""
    spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    spec.submodule_search_locations = [str(path)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    return module


def load_comfyui_workload(path: Optional[str], device: torch.device, flags=()) -> Workload:
    """Sets ComfyUI up and loads the `--comfyui` workload, `benchmarks/wan_block.py`, as
    `<PACK_PACKAGE>.benchmarks.wan_block` (see `load_pack_module`); its `make_workload` gets this module (the
    running runner, `__main__` under `python -m`), whose `Workload`, `Method`, ... it builds on."""
    module, root, notes = load_pack_module("wan_block", path, device, flags)
    workload = module.make_workload(sys.modules[__name__])
    workload.comfyui_root = str(root)
    workload.setup_notes = [f"ComfyUI from {root}"] + notes
    return workload


def load_pack_module(name: str, path: Optional[str], device: torch.device, flags=()):
    """ComfyUI set up (`setup_comfyui`), then `benchmarks/<name>.py` imported as `<PACK_PACKAGE>.benchmarks.<name>`:
    returns (module, ComfyUI root, notes).

    The workloads import the pack's adapter relatively (`from ..nodes.families import wan`, `from ..qkv_core import
    ...`, `from .memory import ...`), so they are imported inside a package made for the whole pack: `PACK_PACKAGE`
    and `<PACK_PACKAGE>.nodes` are empty package objects over the repository root and `nodes/` (neither
    `__init__.py` runs: they import comfy_api, i.e. pydantic, av, ... that a bare benchmark machine lacks),
    so the relative imports of `nodes/families/wan.py` (`from ...qkv_core import ...`, `from ..comfy_ops import
    ...`) resolve inside it. `<PACK_PACKAGE>.qkv_core` and `<PACK_PACKAGE>.benchmarks` are this process's
    `qkv_core` and `benchmarks` (`SHARED_PACKAGES`: the same module objects), so `scaled_runtime` and the
    notices reach the code the adapter calls and the workloads measure with this runner's `memory`. Nothing
    in `qkv_core/` or `nodes/` imports `benchmarks`."""
    if not (PACK_ROOT / "nodes" / "families" / "wan.py").is_file() or \
            not (PACK_ROOT / "benchmarks" / f"{name}.py").is_file():
        raise SystemExit(f"--comfyui needs the repository checkout (nodes/families/wan.py and benchmarks/{name}.py "
                         f"under {PACK_ROOT})")
    root = find_comfyui(path)
    notes = setup_comfyui(root, device, flags)
    if PACK_PACKAGE not in sys.modules:
        pack = _package(PACK_PACKAGE, PACK_ROOT)
        pack.nodes = _package(PACK_PACKAGE + ".nodes", PACK_ROOT / "nodes")
        for module_name, module in list(sys.modules.items()):
            if module_name.split(".", 1)[0] in SHARED_PACKAGES:
                sys.modules[f"{PACK_PACKAGE}.{module_name}"] = module
        for package in SHARED_PACKAGES:
            setattr(pack, package, sys.modules[package])
    return importlib.import_module(f"{PACK_PACKAGE}.benchmarks.{name}"), root, notes


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


def run_families(argv) -> int:
    """`--comfyui PATH --families ...`: one block of each adapted family, stock vs the pack
    (benchmarks/family_blocks.py, whose options follow)."""
    return _run_pack_module(argv, "--families", "family_blocks")


def run_references(argv) -> int:
    """`--comfyui PATH --references ...`: reference images kept across steps on a Flux.2-shaped model
    (benchmarks/reference_steps.py, whose options follow)."""
    return _run_pack_module(argv, "--references", "reference_steps")


def run_family_models(argv) -> int:
    """`--comfyui PATH --family-models ...`: whole models of the non-Wan families, stock vs the pack, and the
    memory factor each needs (benchmarks/family_models.py, whose options follow)."""
    return _run_pack_module(argv, "--family-models", "family_models")


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
    if "--families" in argv:
        return run_families(argv)
    if "--references" in argv:
        return run_references(argv)
    if "--family-models" in argv:
        return run_family_models(argv)
    if "--report-check" in argv:
        return _run_pack_module(argv, "--report-check", "report_check")
    args = parse_args(argv)
    workload = WORKLOADS[args.workload]
    threads = args.threads or (workload.default_cpu_threads if args.device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    device, dtype = args.device, args.dtype
    if args.plot:
        _pyplot()  # fail before the runs, not after
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
