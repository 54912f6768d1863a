"""Benchmark workload: the memory factor of the non-Wan families, measured on whole models. Each case is a whole
diffusion model as ComfyUI's model detection configures it (`comfy.model_detection.model_config_from_unet_config`
picks the `comfy.supported_models` class), random bf16 weights built on the device, called as
`BaseModel._apply_model` calls it (cond and uncond in one batch), stock and with the pack (High, block bounds):

    python -m benchmarks.bench --comfyui PATH --family-models [--cases flux-dev-1024,...] [--repeats 2]
                                                               [--backend auto] [--json FILE] [--tiny]
                                                               [--level High] [--split-floor-tokens TOKENS]

What it measures, per case (docs/benchmarks.md, "The memory estimate the pack gives ComfyUI"): ComfyUI plans a
run from its estimate E = `base_model.memory_required([2, C, ...])` (`comfy.sampler_helpers.estimate_memory`:
cond + uncond of one latent; memory_usage_factor x latent area), keeping as many weights on the GPU as fit beside
E. Stock's real working set is A, the pack's P (CUDA allocator peak of one model call above what was allocated
before it: weights, inputs; the output included). A patched run told `factor` x E peaks no higher than stock when
factor >= 1 - (A - P) / E: the "factor needed" column, to set against the family's memory factors
(`nodes/<family>.py`; `split` when the head split runs, `unsplit` when it does not: the "pack plan" column says
which `nodes.patching.memory_factor` picks for the case). A and P are one model call, without the sampler's own
buffers (the float32 denoised latent, the cfg arithmetic): the same for both, so A - P holds, while A / E of a
whole sampling run is somewhat higher.

The pack's first call in a process runs its self-check (and compiles its kernels): each method has one untimed
warm-up call, then `--repeats` measured calls (time: the median; peak: the largest). The model is freed between
cases (a case with the same model, Flux-dev at two sizes, reuses it), so only one is resident: Qwen-Image is 20B
parameters, 38 GiB in bf16. A case that fails prints its error and the others still run.

`--tiny`: a smoke run of every case's code path on the CPU in well under a minute: 1-2 blocks (SD3.5's MMDiT, 64 x
depth wide: 4), width 256 (heads of 128; LTX's, SD3.5's and Kandinsky's of 64; Lumina 2's 384 wide, heads of 96),
small latents and prompts, the head split floor lowered so that the split runs. Tiny Z-Image is detected as
Lumina2 (ZImage is selected by dim 3840 alone; the same NextDiT with Z-Image's options), tiny HiDream routes
to all 4 experts (top-2 routing flips on near-ties under bf16 rounding: a discontinuity, not the pack's error). Without CUDA
there are no allocator peaks (0 is printed) and no factor.

Loaded by `benchmarks/bench.py` inside the package it makes for the pack (see `load_pack_module`). Not part of
the node pack.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import traceback

import torch

from ..nodes import patching
from ..nodes.dispatch import QKVConfig
from ..qkv_core import head_split
from .wan_block import comfyui_version, fill_random_, random_like

GiB = float(1 << 30)
SIGMA = 0.8                 # a mid-schedule step
TINY_SPLIT_FLOOR = 64       # --tiny: the head split floor (8,192 tokens at full size), so that the split runs


# the models, as comfy/model_detection.py finds them in a checkpoint, and their cases:
# benchmarks/family_model_cases.py
from .family_model_cases import CASES, DTYPE, Case, randn  # noqa: E402


# ------------------------------------------------------------------------------------------------------
# build, call, measure
# ------------------------------------------------------------------------------------------------------

def build(case: Case, device):
    """The ModelPatcher of a whole model: the config class ComfyUI's detection selects for `case.config`, its
    diffusion model made on `device` in bf16 by ComfyUI's own ops, random weights."""
    import comfy.model_detection
    import comfy.model_patcher
    model_config = comfy.model_detection.model_config_from_unet_config(dict(case.config))
    if model_config is None or type(model_config).__name__ != case.expect:
        raise RuntimeError(f"model detection selected {type(model_config).__name__}, not {case.expect}")
    model_config.set_inference_dtype(DTYPE, None)
    model = model_config.get_model({}, device=device)
    model.diffusion_model.to(device=device)
    fill_random_(model.diffusion_model, seed=0)
    # checkpoint buffers ComfyUI makes with torch.empty (SD3's MMDiT pos_embed): random too, not garbage
    generator = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.diffusion_model.named_buffers():
            if name.rsplit(".", 1)[-1] == "pos_embed" and buffer.is_floating_point():
                buffer.copy_(random_like(tuple(buffer.shape), name, generator, buffer.device))
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=device, offload_device=device)


def inputs(base, case: Case, batch: int, device) -> dict:
    """The diffusion model's arguments as `BaseModel._apply_model` passes them: x in the compute dtype,
    t = model_sampling.timestep(sigma) in float32, the context and the family's extra conds."""
    g = torch.Generator(device=device).manual_seed(1)
    sigma = torch.full((batch,), SIGMA, device=device)
    args = dict(x=randn((batch,) + tuple(case.latent), device, g),
                timestep=base.model.model_sampling.timestep(sigma).float(),
                context=randn((batch, case.text, case.context_dim), device, g))
    extra = case.conds(batch, case.text, device, g)
    concat = extra.pop("c_concat", 0)     # channels concat_cond adds to x (_apply_model concatenates c_concat)
    if concat:
        args["x"] = torch.cat([args["x"], torch.zeros_like(args["x"][:, :1]).expand(
            -1, concat, *args["x"].shape[2:])], dim=1)
    args.update(extra)
    return args


def call(base, applied, args: dict, batch: int):
    """One model call as the sampler makes it: the applied patcher's object patches and wrappers, the sigmas."""
    applied.patch_model(load_weights=False)
    try:
        options = dict(applied.model_options.get("transformer_options", {}), wrappers=applied.wrappers,
                       sample_sigmas=torch.tensor([1.0, SIGMA, 0.0]), sigmas=torch.tensor([SIGMA]),
                       cond_or_uncond=[0, 1] if batch > 1 else [0])
        with torch.no_grad():
            args = dict(args)   # x and the timestep positional, as _apply_model passes them (HiDream's is `t`)
            return base.model.diffusion_model(args.pop("x"), args.pop("timestep"), **args,
                                              transformer_options=options)
    finally:
        applied.unpatch_model(unpatch_weights=False)


def measured(fn, repeats: int, device) -> tuple:
    """(median ms, largest peak bytes above the allocation before each call (0 without CUDA), the first output
    as float32 on the CPU)."""
    cuda = device.type == "cuda"
    times, peak, first = [], 0, None
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize(device)
            peak = max(peak, torch.cuda.max_memory_allocated(device) - before)
        times.append((time.perf_counter() - start) * 1e3)
        if first is None:
            first = out.detach().float().cpu()
        del out
    return statistics.median(times), peak, first


def pack_plan(base, patched, backend: str, shape, level: str = "High") -> tuple:
    """What `nodes.patching.memory_factor` tells ComfyUI for a run of this case with the family's current
    memory factors (its row of nodes/families/measured.py), and why (split, unsplit, not verified yet, ...); the adapter's name."""
    diffusion_model = base.model.diffusion_model
    adapter = patching.find_adapter(diffusion_model)
    if adapter is None:
        return None, "no adapter: the kernel-level patch", "-"
    factor, why = patching.memory_factor(QKVConfig(patching.LEVELS.index(level), backend, True), adapter,
                                         diffusion_model, shape,
                                         patched.model_options.get("transformer_options", {}))
    return factor, why, adapter.FAMILY


def run_case(case: Case, base, device, batch: int, backend: str, repeats: int, row: dict,
             level: str = "High") -> dict:
    """Fills `row` as it goes (a case that fails half-way keeps what it measured)."""
    args = inputs(base, case, batch, device)
    x = args["x"]
    diffusion_model = base.model.diffusion_model
    width = next(getattr(diffusion_model, name) for name in ("hidden_size", "inner_dim", "dim", "model_channels",
                                                               "model_dim") if getattr(diffusion_model, name, None))
    image_tokens = _image_tokens(diffusion_model, x.shape)
    tokens = image_tokens + case.text * case.text_in_sequence    # LTX's, Cosmos', Kandinsky's text: cross-attention
    x_bytes = batch * tokens * width * x.element_size()
    estimate = base.model.memory_required([2] + list(x.shape[1:]))
    row.update(what=case.what, batch=batch, latent=list(x.shape), image_tokens=image_tokens, text_tokens=case.text,
               tokens=tokens, width=width, x_GiB=x_bytes / GiB, E_GiB=estimate / GiB,
               memory_usage_factor=base.model.memory_usage_factor,
               params_B=sum(p.numel() for p in diffusion_model.parameters()) / 1e9)

    call(base, base, args, batch)   # warm-up
    row["stock_ms"], stock_peak, stock_out = measured(lambda: call(base, base, args, batch), repeats, device)
    row["A_GiB"] = stock_peak / GiB

    patched, _ = patching.apply_patch(base, level, backend, True)
    call(base, patched, args, batch)   # warm-up: the pack's self-check runs on its first call
    row["pack_ms"], pack_peak, pack_out = measured(lambda: call(base, patched, args, batch), repeats, device)
    row["P_GiB"] = pack_peak / GiB
    row["plan_factor"], row["plan_why"], row["adapter"] = pack_plan(base, patched, backend, list(x.shape), level)

    scale = stock_out.abs().max()
    row["finite"] = bool(torch.isfinite(stock_out).all() and torch.isfinite(pack_out).all())
    row["max_rel_diff"] = float((pack_out - stock_out).abs().max() / scale) if scale > 0 else float("nan")
    if stock_peak:
        row["A_over_E"] = stock_peak / estimate
        row["P_over_A"] = pack_peak / stock_peak
        row["factor_needed"] = 1 - (stock_peak - pack_peak) / estimate
    return row


def _image_tokens(diffusion_model, shape) -> int:
    patch = getattr(diffusion_model, "patch_size", 1)
    if not isinstance(patch, (list, tuple)):
        patch = [patch] * 2
    if hasattr(diffusion_model, "patchifier"):   # LTX: patch 1 (its VAE does the 32x)
        patch = [1, 1, 1]
    if hasattr(diffusion_model, "patch_spatial"):   # Cosmos
        patch = [diffusion_model.patch_temporal, diffusion_model.patch_spatial, diffusion_model.patch_spatial]
    dims = list(shape[2:])
    patch = ([1] * len(dims) + list(patch))[-len(dims):]
    return math.prod(-(-d // p) for d, p in zip(dims, patch))


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------------

HEAD = ("| case | tokens (batch x) | \\|x\\| GiB | E GiB | stock A GiB (A/E) | pack P GiB (P/A) | factor needed | "
        "pack plan (factor now) | stock ms | pack ms | rel diff |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")


def table_row(row: dict) -> str:
    if "error" in row:
        done = ", ".join(f"{key} {row[key]:.2f}" for key in ("E_GiB", "A_GiB", "stock_ms", "P_GiB", "pack_ms")
                         if key in row)
        return f"| {row['case']} | failed: {row['error']}" + (f" (measured before: {done})" if done else "") + " |"
    plan = f"{row['plan_why']} ({row['plan_factor']})" if row.get("plan_factor") is not None else row["plan_why"]
    if "factor_needed" in row:
        stock = f"{row['A_GiB']:.2f} ({row['A_over_E']:.2f})"
        pack = f"{row['P_GiB']:.2f} ({row['P_over_A']:.2f})"
        factor = f"{row['factor_needed']:.2f}"
    else:
        stock, pack, factor = "0", "0", "- (no CUDA: a smoke run)"
    diff = f"{row['max_rel_diff']:.1e}" + ("" if row["finite"] else " (non-finite)")
    return (f"| {row['case']} | {row['tokens']:,} x {row['batch']} | {row['x_GiB']:.3f} | {row['E_GiB']:.2f} | "
            f"{stock} | {pack} | {factor} | {plan} | {row['stock_ms']:.0f} | {row['pack_ms']:.0f} | {diff} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench --comfyui PATH --family-models")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--device", default=None)
    parser.add_argument("--backend", default="auto", help="the node's attention_backend for the pack")
    parser.add_argument("--repeats", type=int, default=2, help="measured calls per method (after one warm-up)")
    parser.add_argument("--batch", type=int, default=2,
                        help="the model call's batch: 2 = cond + uncond (cfg > 1); 1 = cfg 1 (Flux-dev and "
                             "HunyuanVideo usually run so). E is ComfyUI's estimate either way: it always plans "
                             "for cond + uncond")
    parser.add_argument("--level", default="High", help="the node's head_split_level for the pack (default High)")
    parser.add_argument("--split-floor-tokens", type=int, default=None,
                        help="the runtime's head split floor in tokens of one item (default 8,192; each family "
                             "splits from its split_floor_scale times it); 0: every call is split")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: every case cut down to run on the CPU")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads (default 1)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    names = args.cases.split(",")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; the cases are {', '.join(CASES)}")
    floor = head_split.SPLIT_FLOOR_TOKENS
    if args.tiny:
        head_split.SPLIT_FLOOR_TOKENS = TINY_SPLIT_FLOOR
    if args.split_floor_tokens is not None:
        head_split.SPLIT_FLOOR_TOKENS = args.split_floor_tokens
    try:
        return _run(args, names, device)
    finally:
        head_split.SPLIT_FLOOR_TOKENS = floor   # the process (a test run) keeps the runtime's own


def _run(args, names, device) -> int:

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no CUDA: a smoke run, no peaks)"
    print(f"{gpu}; torch {torch.__version__}; ComfyUI {comfyui_version()}; pack: {args.level}, block bounds, backend "
          f"{args.backend}; batch {args.batch}; {args.repeats} measured call(s) per method after a warm-up"
          + (f"; TINY models, head split floor {TINY_SPLIT_FLOOR} tokens" if args.tiny else "")
          + (f"; the runtime's head split floor {args.split_floor_tokens} tokens"
             if args.split_floor_tokens is not None else ""),
          flush=True)
    print("E = ComfyUI's estimate for cond + uncond (memory_required"
          + ("; without CUDA ComfyUI's non-flash formula, not the GPU's" if device.type != "cuda" else "")
          + "); A, P = allocator peak of one model call above weights and inputs; factor needed = 1 - (A - P) / E\n",
          flush=True)
    print(HEAD, flush=True)
    rows, resident, resident_key = [], None, None
    for name in names:
        case = CASES[name].sized(args.tiny)
        key = json.dumps(case.config, sort_keys=True)
        row = dict(case=name)
        try:
            if resident_key != key:
                resident = resident_key = None
                free(device)
                started = time.perf_counter()
                resident = build(case, device)
                resident_key = key
                built_s = time.perf_counter() - started
            else:
                built_s = 0.0
            row["build_s"] = built_s
            run_case(case, resident, device, args.batch, args.backend, args.repeats, row, args.level)
        except Exception as error:  # noqa: BLE001 - one failed case must not stop the others
            traceback.print_exc()
            first_line = str(error).splitlines()[0][:200] if str(error) else ""
            row["error"] = f"{type(error).__name__}: {first_line}"
            resident = resident_key = None
        rows.append(row)
        print(table_row(row), flush=True)
        free(device)
    resident = None
    free(device)

    print()
    for row in rows:
        if "error" not in row:
            print(f"{row['case']}: {row['what']}; latent {row['latent']}, {row['params_B']:.2f}B parameters, "
                  f"memory_usage_factor {row['memory_usage_factor']:.3g}, width {row['width']}, "
                  f"adapter {row['adapter']}" + (f", built in {row['build_s']:.0f} s" if row["build_s"] else ""))
    if device.type == "cuda":
        print(f"allocated after the last case: {torch.cuda.memory_allocated(device) / GiB:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "gpu": gpu, "torch": torch.__version__, "comfyui": comfyui_version(),
                       "backend": args.backend, "level": args.level, "split_floor_tokens": args.split_floor_tokens,
                       "batch": args.batch, "repeats": args.repeats, "tiny": args.tiny,
                       "rows": rows}, f, indent=1)
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":   # pragma: no cover - run through benchmarks.bench
    sys.exit(main())
