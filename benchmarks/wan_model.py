"""Benchmark: a whole Wan 2.x 14B sampled through ComfyUI's own model management, planned for a consumer card.

`python -m benchmarks.bench --comfyui PATH --whole-model [options]` (`benchmarks/bench.py` sets ComfyUI up and
imports this file as `<pack package>.benchmarks.wan_model`, in the package it makes for the pack, as it does for
`wan_block.py`; see `load_pack_module` there). Not part of the node pack's runtime (until this change it was
`nodes/bench_wan_model.py`).

What it does, per weight format (one process, the state dict made once):
- a Wan 2.1 14B T2V state dict with random weights, in the format a user's file has (bf16; bf16 loaded with
  `weight_dtype fp8_e4m3fn`; an fp8-scaled file; a GGUF Q8_0 file through city96/ComfyUI-GGUF's own loader
  path), loaded by `comfy.sd.load_diffusion_model_state_dict` as the diffusion model loader does;
- for each simulated card (`--cards 16,24`, GiB): ComfyUI plans for the card (`EXTRA_RESERVED_VRAM`, what
  `--reserve-vram` sets, = the H200's memory less the card's, plus ComfyUI's own default reserve) and the
  card is enforced (`torch.cuda.set_per_process_memory_fraction`: going over it raises out-of-memory as on
  the card);
- stock, then the pack (`apply_patch`, High + block bounds): `comfy.sample.sample` (euler, simple) of a
  720p x 81-frame latent (`--frames`, `--size`), cfg 5, `--steps` steps. Reported: seconds per step (the
  model calls, CUDA-synchronised, of the steps after the first; of the first with --steps 1), weights ComfyUI
  kept on the GPU, peak VRAM allocated during sampling, ComfyUI's memory factor for the run, out-of-memory.
- `--search-frames`: the most frames (in steps of `--frame-step`) that sample without running out of memory
  on the first card: stock from `--frames` up, the pack from twice stock's frames up (or down, if that does
  not fit). A probe stops after the first model call of the first step: every later call repeats its shapes
  and ComfyUI's loaded weights, so its peak is the run's.

`--compile whole,blocks` runs each method again with a torch.compile node after it (`compile_ways.py`: ComfyUI's
TorchCompileModel, or the blocks compiled one by one as KJNodes' nodes do), after a small compiled warm-up in
which the pack's self-checks run again inside the compiled model, as in a user's first compiled run; every record has the device's whole
peak beside the allocator's (`device_peak.py`: what a real card must hold, comfy-aimdo's own memory included), and
`--smallest-card 16,14,12,10,8` finds the smallest simulated card on which each method's probe fits by that peak.

`--fast-paths-ab`: the pack's seconds per step with every host-time fast path on, with none (`--fast-paths`
for others: each one off, `-NAME`), in turns on the first card and negative (`benchmarks/fast_paths_ab.py`);
stock is not run.

The pack's first run in a process plans with ComfyUI's own estimate (its forwards are not verified yet); a
user's later runs plan with the measured factor. The benchmark does one small warm-up run of the pack first,
so that the runs it reports are those later runs. Dynamic VRAM (ComfyUI v0.33's default loader) is off
unless `--dynamic-vram`: on the lent H200 its stock load fails with "CUDA error: invalid argument".
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
from typing import Optional

import torch

import comfy.cli_args
import comfy.model_management

from ..nodes.compat import all_checked, forget_verdicts
from ..nodes.patching import apply_patch
from ..nodes.families.wan import stock_functions
from ..nodes.report import logger
from . import fast_paths_ab as ab
from .compile_ways import COMPILE_WAYS, DynamoLimits, compiled
from .device_peak import DevicePeak
from .wan_block import GGUF_Q8_0, comfyui_version, import_gguf_ops, kitchen_note
from .wan_weights import FORMATS, WAN_14B, load_model, wan_state_dict

GiB = float(1 << 30)
NEGATIVES = ("random", "zeros")
TEXT_TOKENS = 512


class _FactorLog(logging.Handler):
    """Keeps the pack's "[QKV] run: memory estimate xF (why)" line of a run."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.message = None

    def emit(self, record):
        text = record.getMessage()
        if "memory estimate" in text:
            self.message = text.split("run: ", 1)[-1]


class ProbeDone(Exception):
    """Raised after the first model call of a probe: its peak is the run's."""


def plan_for_card(card_gib: float, default_reserve: float) -> None:
    """ComfyUI plans as on a card of `card_gib` GiB (what `--reserve-vram` sets) and the card is enforced."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    card = card_gib * GiB
    if card > total:
        raise SystemExit(f"--cards: {card_gib} GiB is more than this GPU's {total / GiB:.1f} GiB")
    comfy.model_management.EXTRA_RESERVED_VRAM = int(total - card + default_reserve)
    torch.cuda.set_per_process_memory_fraction(card / total)


def free_everything() -> None:
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def conditioning(seed: int, text_dim: int, negative: str = "random"):
    """Text embeddings (umt5's width) for cond and uncond, as ComfyUI's text encoder hands them over: a random
    positive; the negative another random text, or (`negative="zeros"`) zeros, as ConditioningZeroOut gives it."""
    g = torch.Generator().manual_seed(seed)
    positive = [[torch.randn(1, TEXT_TOKENS, text_dim, generator=g), {}]]
    uncond = torch.randn(1, TEXT_TOKENS, text_dim, generator=g)
    if negative == "zeros":
        uncond.zero_()
    elif negative != "random":
        raise ValueError(f"negative {negative!r}: one of {', '.join(NEGATIVES)}")
    return positive, [[uncond, {}]]


def sample_once(patcher, frames: int, size, steps: int, cfg: float, probe: bool, text_dim: int, seed: int = 0,
                negative_kind: str = "random", keep: Optional[dict] = None):
    """One `comfy.sample.sample` run (euler, simple) of a `frames` x `size` (w, h) latent: a result record.
    `keep`: a dict that gets the sampled latent under "samples" (on the CPU)."""
    import comfy.sample
    width, height = size
    latent = torch.zeros(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    noise = comfy.sample.prepare_noise(latent, seed)
    positive, negative = conditioning(seed, text_dim, negative_kind)
    calls, step_marks = [], []
    cuda = torch.cuda.is_available()

    def timed(apply_model, args):
        if cuda:
            torch.cuda.synchronize()
        if not calls:   # ComfyUI has loaded what it keeps on the GPU by the first call
            record["weights_on_gpu_gib"] = patcher.loaded_size() / GiB
        start = time.perf_counter()
        out = apply_model(args["input"], args["timestep"], **args["c"])
        if cuda:
            torch.cuda.synchronize()
        calls.append((len(step_marks), time.perf_counter() - start, args["input"].shape[0]))
        if probe:
            raise ProbeDone()
        return out

    run = patcher.clone()
    run.set_model_unet_function_wrapper(timed)
    record = {"frames": frames, "size": f"{width}x{height}", "tokens": noise.shape[2] * (height // 16) * (width // 16),
              "steps": steps, "cfg": cfg, "negative": negative_kind}
    free_everything()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    factor, dynamo = _FactorLog(), DynamoLimits()
    logger.addHandler(factor)
    logging.getLogger("torch._dynamo").addHandler(dynamo)
    start = time.perf_counter()
    device_peak = DevicePeak()
    try:
        with device_peak:
            samples = comfy.sample.sample(run, noise, steps, cfg, "euler", "simple", positive, negative, latent,
                                          callback=lambda *a: step_marks.append(time.perf_counter()),
                                          disable_pbar=True, seed=seed)
        if keep is not None:
            keep["samples"] = samples.cpu()
        record["fits"] = True
    except ProbeDone:
        record["fits"] = True
    except torch.OutOfMemoryError as e:
        record["fits"], record["error"] = False, str(e).split("\n")[0][:160]
    finally:
        logger.removeHandler(factor)
        logging.getLogger("torch._dynamo").removeHandler(dynamo)
    record["wall_s"] = time.perf_counter() - start
    if factor.message:
        record["pack_memory_estimate"] = factor.message
    if dynamo.hits:
        record["dynamo_recompile_limit"] = dynamo.hits
    if cuda:
        record["peak_vram_gib"] = torch.cuda.max_memory_allocated() / GiB
        record["device_peak_gib"], record["reserved_peak_gib"] = device_peak.gib, device_peak.reserved_gib
    timed_steps = {step for step, _, _ in calls if step > 0 or steps == 1}
    if calls and timed_steps:
        record["s_per_step"] = sum(t for step, t, _ in calls if step in timed_steps) / len(timed_steps)
        record["calls_per_step"] = sum(1 for step, _, _ in calls if step in timed_steps) / len(timed_steps)
    run = None   # the clone (and with it the wrapper's references) before the memory is handed back
    free_everything()
    return record


def search_frames(fits, first: int, step: int, most: int):
    """The most frames (`first` + a multiple of `step`, at most `most`) for which `fits(frames)` holds: up from
    `first` while it fits, else down until it does. None when nothing down to `step` frames fits."""
    frames, best = first, None
    if fits(frames):
        best = frames
        while frames + step <= most and fits(frames + step):
            frames += step
            best = frames
        return best
    while frames - step >= 1:
        frames -= step
        if fits(frames):
            return frames
    return None


def smallest_card(models: dict, methods, fmt: str, size, config: dict, args, default_reserve, negative: str,
                  emit) -> None:
    """`--smallest-card`: for each method, a probe (the first model call, whose peak is the run's) of
    `--frames` frames on each card, largest first, until one does not fit: it fits when it runs out of no memory
    and the device's whole peak (`DevicePeak`: the allocator's cache, the CUDA context, comfy-aimdo's own
    memory) stays under the card. The smallest that fits is reported."""
    cards = [float(c) for c in args.smallest_card.split(",") if c.strip()]
    for method in methods:
        smallest = None
        for card in cards:
            plan_for_card(card, default_reserve)
            record = sample_once(models[method], args.frames, size, 1, args.cfg, True, config["text_dim"],
                                 negative_kind=negative)
            fits = record["fits"] and record.get("device_peak_gib") is not None and \
                record["device_peak_gib"] <= card
            emit(dict(record, format=fmt, card_gib=card, method=method, probe=True, fits_card=fits))
            if not fits:
                break
            smallest = card
        emit({"format": fmt, "method": method, "frames": args.frames, "size": args.size, "negative": negative,
              "dynamic_vram": args.dynamic_vram, "smallest_card_gib": smallest, "cards_tried": cards})


def fast_paths_runs(patched, fmt: str, card: float, negative: str, size, config: dict, args, default_reserve,
                    cuda: bool, emit) -> None:
    """`--fast-paths-ab`: the pack's seconds per step under each variant of `--fast-paths`, in turns."""
    if cuda:
        plan_for_card(card, default_reserve)

    def step_seconds() -> float:
        record = sample_once(patched, args.frames, size, args.steps, args.cfg, False, config["text_dim"],
                             negative_kind=negative)
        if "s_per_step" not in record:
            raise SystemExit(f"[{fmt}] --fast-paths-ab: the run did not sample: {record.get('error', record)}")
        return record["s_per_step"]
    rows = ab.rows(ab.interleaved(step_seconds, ab.variants(args.fast_paths), args.ab_rounds))
    print(ab.table(f"[{fmt}] pack, {args.frames} frames {args.size}, {card:g} GiB card, negative {negative}: ms a "
                   f"step ({args.steps} steps a run, the first not timed when there are more)", rows), flush=True)
    emit({"format": fmt, "card_gib": card, "negative": negative, "frames": args.frames, "size": args.size,
          "steps": args.steps, "fast_paths_ab": rows})


def compiled_warm_up(model, method: str, way: str, fmt: str, negative: str, base, args, config) -> None:
    """A user's first run of a compiled workflow, small: the pack's self-checks run again inside the compiled
    model (the verdicts of the uncompiled warm-up forgotten), and dynamo compiles once before the timed run."""
    if method == "pack":
        forget_verdicts()
    warm = sample_once(model, 5, (480, 272), 1, args.cfg, True, config["text_dim"], negative_kind=negative)
    checks = ""
    if method == "pack":
        passed = all_checked(stock_functions(base.model.diffusion_model))
        checks = "; every check passed" if passed else "; a check failed"
    print(f"[{fmt}] {method} + compile {way} warm-up, negative {negative}: {warm['wall_s']:.1f} s, "
          f"recompile_limit hits {warm.get('dynamo_recompile_limit', 0)}{checks}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench --comfyui PATH --whole-model",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="fp8_scaled",
                        help=f"comma-separated, of {', '.join(FORMATS)} (default fp8_scaled); FORMAT:GIB runs "
                             f"that format on that card only (repeatable)")
    parser.add_argument("--cards", default="16,24", help="simulated card sizes in GiB (default 16,24)")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--size", default="1280x720", help="width x height (default 1280x720)")
    parser.add_argument("--steps", type=int, default=2,
                        help="sampling steps of the timed runs (default 2; 0: none, only the probes of "
                             "--smallest-card / --search-frames)")
    parser.add_argument("--cfg", type=float, default=5.0)
    parser.add_argument("--methods", default="stock,pack")
    parser.add_argument("--negatives", default="zeros,random",
                        help=f"comma-separated, of {', '.join(NEGATIVES)}: the negative prompt's embedding, "
                             f"zeros as ConditioningZeroOut gives it (default zeros,random; the frames search "
                             f"uses the first)")
    parser.add_argument("--level", default="High", help="the pack's head split level (default High)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--search-frames", action="store_true",
                        help="also find the most frames that fit on the first card, stock and pack")
    parser.add_argument("--search-only", action="store_true", help="only the search (implies --search-frames)")
    parser.add_argument("--frame-step", type=int, default=40, help="frames between search probes (default 40)")
    parser.add_argument("--max-frames", type=int, default=321)
    parser.add_argument("--layers", type=int, default=WAN_14B["num_layers"],
                        help="blocks (default 40; fewer only for a quick check)")
    parser.add_argument("--compile", default="none",
                        help=f"comma-separated, of {', '.join(COMPILE_WAYS)}: each method also run with that "
                             f"torch.compile node after it (whole: TorchCompileModel; blocks: block by block, "
                             f"KJNodes' way; default none)")
    parser.add_argument("--smallest-card", default=None,
                        help="comma-separated card sizes in GiB, largest first: the smallest on which a probe of "
                             "each method runs with the device's whole peak under the card")
    parser.add_argument("--dynamic-vram", action="store_true", help="keep ComfyUI's Dynamic VRAM loader on")
    parser.add_argument("--gguf-pack", default=os.environ.get("COMFYUI_GGUF_PATH"),
                        help="a city96/ComfyUI-GGUF checkout, for gguf_q8_0 (default: $COMFYUI_GGUF_PATH)")
    parser.add_argument("--json", default=None, help="also write the records to this file (JSON lines)")
    parser.add_argument("--device", default=None)
    ab.add_arguments(parser, spec="none", rounds=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")   # ComfyUI's loading lines and the pack's
    logging.getLogger().setLevel(logging.INFO)
    cards = [float(c) for c in args.cards.split(",") if c.strip()]
    formats, format_cards = [], {}
    for entry in (e.strip() for e in args.formats.split(",") if e.strip()):
        fmt, _, card = entry.partition(":")   # "fp8_e4m3fn:16": this format on this card only
        if fmt not in FORMATS:
            raise SystemExit(f"--formats: {fmt!r} is not one of {', '.join(FORMATS)}")
        if fmt not in formats:
            formats.append(fmt)
        if card:
            format_cards.setdefault(fmt, []).append(float(card))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ways = [w.strip() for w in args.compile.split(",") if w.strip()]
    if not ways or any(w not in COMPILE_WAYS for w in ways):
        raise SystemExit(f"--compile: one or more of {', '.join(COMPILE_WAYS)}")
    negatives = [n.strip() for n in args.negatives.split(",") if n.strip()]
    if not negatives or any(n not in NEGATIVES for n in negatives):
        raise SystemExit(f"--negatives: one or more of {', '.join(NEGATIVES)}")
    size = tuple(int(v) for v in args.size.lower().split("x"))
    cuda = torch.cuda.is_available() and (args.device or "cuda").startswith("cuda")
    config = dict(WAN_14B, num_layers=args.layers)
    device = torch.device("cuda" if cuda else "cpu")
    default_reserve = comfy.model_management.EXTRA_RESERVED_VRAM
    print(f"ComfyUI {comfyui_version()}, torch {torch.__version__}, {kitchen_note()}; "
          f"{torch.cuda.get_device_name() if cuda else 'CPU'}; Dynamic VRAM "
          f"{'on' if args.dynamic_vram else 'off'}; Wan 14B T2V, {args.layers} blocks, random weights", flush=True)
    out = open(args.json, "a") if args.json else None

    def emit(record):
        print(json.dumps(record), flush=True)
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()

    def probe(model, method: str, fmt: str, frames: int) -> bool:
        record = sample_once(model, frames, size, 1, args.cfg, True, config["text_dim"], negative_kind=negatives[0])
        emit(dict(record, format=fmt, card_gib=format_cards.get(fmt, cards)[0], method=method, probe=True))
        return record["fits"]

    for fmt in formats:
        t0 = time.perf_counter()
        gguf_ops = import_gguf_ops(args.gguf_pack) if fmt == GGUF_Q8_0 else None
        sd = wan_state_dict(fmt, config, device, gguf_ops=gguf_ops)
        base = load_model(fmt, sd, args.dynamic_vram, args.gguf_pack)
        del sd
        print(f"[{fmt}] state dict + load: {time.perf_counter() - t0:.1f} s", flush=True)
        patched, report = apply_patch(base, args.level, args.backend, True)
        if not report.any_patched:
            print(f"[{fmt}] the pack did not patch the model: {report.lines()}")
        models = {"stock": base, "pack": patched}
        for negative in negatives:
            if "pack" in methods:
                # a user's first run with this workflow: the self-checks run on its conditioning (small), and
                # later runs plan as measured; the verdicts of another negative are not carried over
                forget_verdicts()
                warm = sample_once(patched, 5, (480, 272), 1, args.cfg, True, config["text_dim"],
                                   negative_kind=negative)
                print(f"[{fmt}] pack warm-up, negative {negative} (self-check): {warm['wall_s']:.1f} s; "
                      f"{'every check passed' if all_checked(stock_functions(base.model.diffusion_model)) else 'a check failed'}",
                      flush=True)
            if args.fast_paths_ab:
                fast_paths_runs(patched, fmt, format_cards.get(fmt, cards)[0], negative, size, config, args,
                                default_reserve, cuda, emit)
                break   # the first negative only: each variant's run is a whole sampling run
            for card in ([] if args.search_only or args.steps == 0 else format_cards.get(fmt, cards)):
                if cuda:
                    plan_for_card(card, default_reserve)
                for method in methods:
                    for way in ways:
                        model = compiled(models[method], way)
                        if way != "none":
                            compiled_warm_up(model, method, way, fmt, negative, base, args, config)
                        record = sample_once(model, args.frames, size, args.steps,
                                             args.cfg, False, config["text_dim"], negative_kind=negative)
                        emit(dict(record, format=fmt, card_gib=card, method=method, compile=way))
                        model = None
            if args.search_frames or args.search_only:
                break   # the search below runs on the first negative's verdicts
        if args.smallest_card and cuda:
            smallest_card(models, methods, fmt, size, config, args, default_reserve, negatives[0], emit)
        if args.search_frames or args.search_only:
            if cuda:
                plan_for_card(format_cards.get(fmt, cards)[0], default_reserve)
            stock_best = None
            for method in methods:
                first = args.frames if method == "stock" or not stock_best else min(2 * stock_best - 1,
                                                                                      args.max_frames)
                model = models[method]
                best = search_frames(lambda frames: probe(model, method, fmt, frames), first, args.frame_step,
                                     args.max_frames)
                emit({"format": fmt, "card_gib": format_cards.get(fmt, cards)[0], "method": method,
                      "most_frames": best, "frame_step": args.frame_step, "max_frames": args.max_frames})
                if method == "stock":
                    stock_best = best
        models = patched = base = model = None   # the model's weights go before the next format's load
        free_everything()
    if out is not None:
        out.close()
    return 0
