"""Benchmark workload: reference images kept across sampler steps (the QKV Reference Cache node) on a
Flux.2-shaped model: ComfyUI's own Flux2 (its width: 48 heads x 128, MLP 3x, global modulation, patch 1, random
bf16 weights) cut to a few blocks, one model call ("a step") at a 1024^2 image (64 x 64 latent tokens) with one
and with two 1024^2 references, in one process:

    python -m benchmarks.bench --comfyui PATH --references [--refs 1,2] [--double 1] [--single 2] [--repeats 5]

Rows: stock ComfyUI; the pack (High, block bounds) without the cache; with the cache, the step that fills it and
a later step that reads it, for q8 in VRAM, q8 in RAM and 16 bits in VRAM; and, for comparison, the bf16 cache of
ComfyUI's newer core rebuilt on v0.33's hooks (`CoreStyleCache`: stock attention, no pack). Time is the median call; the peak is
CUDA's allocator peak above what was allocated before the call (weights, inputs and, in VRAM, the cache itself);
`cache MiB` is what the cache holds, `cache VRAM MiB` what of it stays on the GPU between steps. Loaded by
`benchmarks/bench.py` inside the package it makes for the pack. Not part of the node pack.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..nodes import patching, reference_cache
from .wan_block import fill_random_

MiB = 2 ** 20


def build(device, heads: int, double: int, single: int):
    import comfy.model_patcher
    import comfy.supported_models
    if not hasattr(comfy.supported_models, "Flux2"):
        raise SystemExit("--references needs a ComfyUI with Flux 2 (comfy.supported_models.Flux2; v0.8.0 and newer)")
    config = {"image_model": "flux2", "in_channels": 128, "out_channels": 128, "vec_in_dim": 768,
              "context_in_dim": 15360, "hidden_size": heads * 128, "mlp_ratio": 3.0, "num_heads": heads,
              "depth": double, "depth_single_blocks": single, "axes_dim": [32, 32, 32, 32], "theta": 2000,
              "patch_size": 1, "qkv_bias": False, "guidance_embed": False, "txt_ids_dims": [3],
              "global_modulation": True, "mlp_silu_act": True, "ops_bias": False, "default_ref_method": "index",
              "ref_index_scale": 10.0}
    model_config = comfy.supported_models.Flux2(config)
    model_config.set_inference_dtype(torch.bfloat16, None)
    model = model_config.get_model({}, device=device)
    model.diffusion_model.to(device=device, dtype=torch.bfloat16)
    fill_random_(model.diffusion_model, seed=0)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=device, offload_device=device)


def inputs(device, side: int, refs: int, text: int = 512):
    g = torch.Generator(device=device).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=g).to(torch.bfloat16)
    return dict(x=randn(1, 128, side, side), timestep=torch.tensor([0.8], device=device),
                context=randn(1, text, 15360), ref_latents=[randn(1, 128, side, side) for _ in range(refs)])


def call(base, applied, kwargs: dict, sigma: float):
    """One model call as a sampler makes it (the applied patcher's object patches, wrappers and sigmas)."""
    applied.patch_model(load_weights=False)
    try:
        options = dict(applied.model_options.get("transformer_options", {}), wrappers=applied.wrappers,
                       sample_sigmas=torch.tensor([0.8, 0.6, 0.0]), sigmas=torch.tensor([sigma]),
                       cond_or_uncond=[0])
        args = {k: (list(v) if isinstance(v, list) else v) for k, v in kwargs.items()}
        with torch.no_grad():
            return base.model.diffusion_model(**args, transformer_options=options)
    finally:
        applied.unpatch_model(unpatch_weights=False)


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def measured(fn, repeats: int) -> tuple[float, float]:
    """(median ms, peak MiB above the allocation before each call; 0 without CUDA: a CPU smoke run)."""
    times, peak = [], 0.0
    cuda = torch.cuda.is_available()
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = _allocated()
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak, (torch.cuda.max_memory_allocated() - before) / MiB)
        times.append((time.perf_counter() - start) * 1e3)
        del out
    return statistics.median(times), peak


class CoreStyleCache:
    """For comparison: the bf16 reference K/V cache of ComfyUI's newer core (its FluxKVCache node, in releases
    after v0.33.0), rebuilt from how it works on the hooks v0.33's Flux already has: an `attn1_patch` keeps each
    block's reference keys/values (the last `reference_image_num_tokens` of the joint sequence, 16-bit, on the
    GPU) at the first call and joins them to the call's keys/values at later calls (one concatenation per
    attention); a `post_input` patch drops the reference tokens from the image stream once the cache is full;
    references are modulated as at timestep zero, as that node sets."""

    def __init__(self):
        self.kv = {}

    def attn1_patch(self, q, k, v, extra_options=None, **_):
        refs = sum((extra_options or {}).get("reference_image_num_tokens", []))
        if not refs:
            return {}
        key = (extra_options["block_type"], extra_options["block_index"])
        if key in self.kv:
            cached_k, cached_v = self.kv[key]
            return {"k": torch.cat((k, cached_k), dim=2), "v": torch.cat((v, cached_v), dim=2)}
        self.kv[key] = (k[:, :, -refs:].clone(), v[:, :, -refs:].clone())
        return {}

    def post_input(self, inputs):
        refs = sum(inputs["transformer_options"].get("reference_image_num_tokens", []))
        if self.kv and refs:
            inputs["img"] = inputs["img"][:, :-refs]
        return inputs

    def patched(self, base):
        model = base.clone()
        model.set_model_attn1_patch(self.attn1_patch)
        model.set_model_post_input_patch(self.post_input)
        model.add_object_patch("diffusion_model.params.default_ref_method", "index_timestep_zero")
        return model

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kv.values() for t in pair)


def run_core_style(base, kwargs: dict, repeats: int) -> list:
    """Rows for `CoreStyleCache` (filling step, cached step), or one row saying why it does not run here."""
    core = CoreStyleCache()
    try:
        model = core.patched(base)
        before = _allocated()
        fill_ms, fill_peak = measured(lambda: call(base, model, kwargs, 0.8), 1)
        held = core.nbytes() / MiB
        on_gpu = (_allocated() - before) / MiB
        use_ms, use_peak = measured(lambda: call(base, model, kwargs, 0.6), repeats)
    except Exception as error:  # noqa: BLE001 - reported, the pack's rows still stand
        return [(f"core-style bf16 cache: does not run here ({type(error).__name__}: {error})"[:160],
                 float("nan"), 0.0, 0.0, 0.0)]
    finally:
        core.kv.clear()
    return [("core-style bf16 cache: filling step", fill_ms, fill_peak, held, on_gpu),
            ("core-style bf16 cache: cached step", use_ms, use_peak, held, on_gpu)]


def run(base, device, side: int, refs: int, backend: str, repeats: int, formats: list) -> list:
    kwargs = inputs(device, side, refs)
    rows = []
    ms, peak = measured(lambda: call(base, base, kwargs, 0.8), repeats)
    rows.append(("stock", ms, peak, 0.0, 0.0))
    patched, _ = patching.apply_patch(base, "High", backend, True)
    ms, peak = measured(lambda: call(base, patched, kwargs, 0.8), repeats)
    rows.append(("pack, no cache", ms, peak, 0.0, 0.0))
    for fmt, storage in formats:
        state = reference_cache.ReferenceCache(1, storage, fmt)
        cached = reference_cache.add_reference_cache(patched, state)
        with state.run():
            before = _allocated()
            fill_ms, fill_peak = measured(lambda: call(base, cached, kwargs, 0.8), 1)
            on_gpu = (_allocated() - before) / MiB
            (entry,) = state.entries.values()
            held = entry.held / MiB
            use_ms, use_peak = measured(lambda: call(base, cached, kwargs, 0.6), repeats)
            assert state.counts["use"] == repeats and not entry.refused, (state.counts, entry.refused)
        rows.append((f"cache {fmt} {storage}: filling step", fill_ms, fill_peak, held, on_gpu))
        rows.append((f"cache {fmt} {storage}: cached step", use_ms, use_peak, held, on_gpu))
    rows += run_core_style(base, kwargs, repeats)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench --comfyui PATH --references")
    parser.add_argument("--refs", default="1,2", help="reference counts to run (default 1,2)")
    parser.add_argument("--heads", type=int, default=48, help="attention heads of 128 (Flux.2 dev: 48)")
    parser.add_argument("--side", type=int, default=64, help="latent side: 64 is a 1024^2 image")
    parser.add_argument("--double", type=int, default=1)
    parser.add_argument("--single", type=int, default=2)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--formats", default="q8:vram,q8:ram,16-bit:vram",
                        help="cache format:storage pairs (formats q8, 16-bit, native; storage vram, ram)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    formats = [tuple(pair.split(":")) for pair in args.formats.split(",")]
    base = build(device, args.heads, args.double, args.single)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (a smoke run: no peaks)"
    print(f"{gpu}; Flux2-shaped, {args.heads} heads x 128, {args.double} double + "
          f"{args.single} single blocks; image {args.side}x{args.side} tokens; backend {args.backend}")
    for refs in (int(n) for n in args.refs.split(",")):
        print(f"\n{refs} reference(s) of {args.side * args.side} tokens\n"
              f"| method | ms | peak MiB | cache MiB | cache VRAM MiB |\n| --- | ---: | ---: | ---: | ---: |")
        rows = run(base, device, args.side, refs, args.backend, args.repeats, formats)
        for name, ms, peak, held, on_gpu in rows:
            print(f"| {name} | {ms:.1f} | {peak:.0f} | {held:.0f} | {on_gpu:.0f} |", flush=True)
        by_name = {name: (ms, held) for name, ms, _, held, _ in rows}
        uncached = by_name["pack, no cache"][0]
        speed = ", ".join(f"{name.split(':')[0].removeprefix('cache ')} {uncached / ms:.2f}x"
                          for name, (ms, _) in by_name.items() if name.endswith("cached step"))
        print(f"cached step vs the pack without cache: {speed} faster")
        core = by_name.get("core-style bf16 cache: cached step", (None, 0))[0]
        if core:
            versus = ", ".join(f"{name.split(':')[0].removeprefix('cache ')} {ms / core:.2f}"
                               for name, (ms, _) in by_name.items()
                               if name.endswith("cached step") and name.startswith("cache "))
            print(f"cached step time / the core-style bf16 cache's: {versus}")
        bytes16 = by_name.get("cache 16-bit vram: cached step", (0, 0))[1]
        for fmt in ("q8", "native"):
            held = next((h for name, (_, h) in by_name.items() if name.startswith(f"cache {fmt} ")), None)
            if held is not None and bytes16:
                print(f"{fmt} / 16-bit bytes {held / bytes16:.3f}")
    return 0
