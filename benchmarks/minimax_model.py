"""Benchmark: MiniMax H3 sampled through ComfyUI's own model management on a simulated card, stock against the
pack: the most frames each fits.

    python -m benchmarks.bench --comfyui PATH --minimax-model [--layers 4] [--card 16] [--size 1344x768]
                                                              [--first 124] [--frame-step 68] [--most 1500]
                                                              [--negative random|zeros] [--json FILE] [--tiny]

The model: ComfyUI's `MiniMaxH3Model` at H3's own widths (5376, 56 heads of 128, its 2 token-refiner blocks), with
`--layers` of its 50 DiT blocks (each block's activations are the model's; fewer blocks, fewer weights to hold or
stream), random bf16 weights made on the CPU and handed to ComfyUI as a loaded model is (load device CUDA,
offload device CPU). The card (`wan_model.plan_for_card`): ComfyUI plans for `--card` GiB plus its own default
reserve, and the card is enforced. A probe (`comfy.sample.sample`, euler, simple, cfg 5) of a `frames` x `--size`
audio + video latent (24 fps, 17k + 5 frames; 40 Hz stereo audio) with a 256-token prompt stops after its first
model call: every later call repeats its shapes and ComfyUI's loaded weights, so its peak is the run's. Stock
searches up from `--first` in `--frame-step` frames (`wan_model.search_frames`), the pack (High, block bounds)
from twice stock's frames; each fit is printed with its peak VRAM and the time of its model call.

The pack's first run in a process plans with ComfyUI's own estimate and self-checks its forwards: a short warm-up
run of the pack comes first. `--tiny`: the code path on the CPU (a small H3, no card), in seconds. Not part of the
node pack.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import comfy.model_management
import comfy.model_patcher
import comfy.nested_tensor
import comfy.sample
import comfy.supported_models

from ..nodes.patching import apply_patch
from .memory import GiB
from .wan_block import comfyui_version, fill_random_
from .wan_model import ProbeDone, free_everything, plan_for_card, search_frames

FPS, AUDIO_LATENT_FPS = 24, 40   # H3's video frame rate and audio latent rate (ComfyUI's MiniMax H3 latent nodes)
TEXT_TOKENS, TEXT_DIM = 256, 5120
TINY = {"hidden_size": 256, "num_attention_heads": 4, "attention_head_dim": 64, "ffn_hidden_size": 384,
        "text_dim": 96, "timestep_input_dim": 32, "time_embed_hidden_size": 64, "time_embed_dim": 48,
        "rope_inv_freq_len": 8}


def latent_t(frames: int) -> int:
    """Latent frames of `frames` video frames (17k + 5): H3's VAE packs 1 then 4 frames a latent frame."""
    return 2 if frames <= 5 else ((frames - 5) // 17) * 5 + 2


def build(layers: int, tiny: bool):
    """The ModelPatcher of an H3 with `layers` DiT blocks (ComfyUI's config class), random bf16 weights on the CPU."""
    device = torch.device("cuda") if torch.cuda.is_available() and not tiny else torch.device("cpu")
    config = {"image_model": "minimax_h3", "num_layers": layers, **(TINY if tiny else {})}
    model_config = comfy.supported_models.MiniMaxH3(config)
    model_config.set_inference_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32, None)
    model = model_config.get_model({}, device=torch.device("cpu"))
    fill_random_(model.diffusion_model, seed=0)
    inv_freq = model.diffusion_model.rope.inv_freq   # a buffer: RoPE's own frequencies, not noise
    inv_freq.copy_(1.0 / 10000.0 ** (torch.arange(inv_freq.numel(), dtype=torch.float32) / inv_freq.numel()))
    model.diffusion_model.requires_grad_(False)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=device, offload_device=torch.device("cpu"))


def conds(text_dim: int, negative: str):
    g = torch.Generator().manual_seed(0)
    positive = torch.randn(1, TEXT_TOKENS, text_dim, generator=g)
    uncond = torch.zeros_like(positive) if negative == "zeros" else torch.randn(1, TEXT_TOKENS, text_dim, generator=g)
    return [[positive, {}]], [[uncond, {}]]


def probe(patcher, frames: int, size: tuple, text_dim: int, negative: str, full: bool = False) -> dict:
    """One sampling run of `frames` frames stopped after its first model call (`full`: two whole steps)."""
    width, height = size
    audio = round(frames / FPS * AUDIO_LATENT_FPS)
    latent = comfy.nested_tensor.NestedTensor([torch.zeros(1, 24, latent_t(frames), height // 16, width // 16),
                                               torch.zeros(1, 32, 2, audio)])
    noise = comfy.sample.prepare_noise(latent, 0)
    positive, negative_cond = conds(text_dim, negative)
    cuda = torch.cuda.is_available()
    record = {"frames": frames, "video_tokens": latent_t(frames) * (height // 32) * (width // 32),
              "audio_rows": 2 * audio}
    calls = []

    def timed(apply_model, args):
        if cuda:
            torch.cuda.synchronize()
        if not calls:
            record["weights_on_gpu_gib"] = patcher.loaded_size() / GiB
        start = time.perf_counter()
        out = apply_model(args["input"], args["timestep"], **args["c"])
        if cuda:
            torch.cuda.synchronize()
        calls.append(time.perf_counter() - start)
        if not full:
            raise ProbeDone()
        return out

    run = patcher.clone()
    run.set_model_unet_function_wrapper(timed)
    free_everything()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        comfy.sample.sample(run, noise, 2, 5.0, "euler", "simple", positive, negative_cond, latent, disable_pbar=True,
                            seed=0)
        record["fits"] = True
    except ProbeDone:
        record["fits"] = True
    except torch.OutOfMemoryError as error:
        record["fits"], record["error"] = False, str(error).split("\n")[0][:160]
    if cuda:
        record["peak_vram_gib"] = torch.cuda.max_memory_allocated() / GiB
    if calls:
        record["call_s"] = calls[0]
    run = None
    free_everything()
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.bench --comfyui PATH --minimax-model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="DiT blocks of H3's 50 (default 4)")
    parser.add_argument("--card", type=float, default=16.0, help="the simulated card, GiB (default 16)")
    parser.add_argument("--size", default="1344x768", help="width x height (default H3's canvas, 1344x768)")
    parser.add_argument("--first", type=int, default=124, help="stock's first frame count (17k + 5)")
    parser.add_argument("--frame-step", type=int, default=68, help="frames a search step (a multiple of 17)")
    parser.add_argument("--most", type=int, default=1500, help="the most frames tried")
    parser.add_argument("--negative", choices=("random", "zeros"), default="random")
    parser.add_argument("--json", default=None, help="write the records to this file")
    parser.add_argument("--tiny", action="store_true", help="a small H3 on the CPU: the code path in seconds")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    size = tuple(int(v) for v in args.size.lower().split("x"))
    base = build(1 if args.tiny else args.layers, args.tiny)
    text_dim = TINY["text_dim"] if args.tiny else TEXT_DIM
    cuda = torch.cuda.is_available() and not args.tiny
    print(f"MiniMax H3, {1 if args.tiny else args.layers} of 50 blocks, {args.size}, ComfyUI {comfyui_version()}, "
          f"{'simulated ' + str(args.card) + ' GiB card' if cuda else 'CPU (no card)'}", flush=True)
    if cuda:
        plan_for_card(args.card, comfy.model_management.EXTRA_RESERVED_VRAM)
    pack, _ = apply_patch(base, "High", "auto", True)
    print("warm-up:", probe(pack, 5, size, text_dim, args.negative, full=True), flush=True)   # self-checks
    records = []

    def fits(patcher, label):
        def check(frames):
            record = dict(probe(patcher, frames, size, text_dim, args.negative), method=label)
            records.append(record)
            print(json.dumps(record), flush=True)
            return record["fits"]
        return check

    most = 22 if args.tiny else args.most
    stock = search_frames(fits(base, "stock"), 5 if args.tiny else args.first, 17 if args.tiny else args.frame_step,
                          most)
    start = (2 * (stock or args.first) - 5) // 17 * 17 + 5
    ours = search_frames(fits(pack, "pack"), start, 17 if args.tiny else args.frame_step, max(most, start))
    summary = {"stock_frames": stock, "pack_frames": ours, "ratio": (ours / stock) if stock and ours else None,
               "layers": args.layers, "card_gib": args.card if cuda else None, "size": args.size,
               "negative": args.negative}
    print("summary:", json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "records": records}, f, indent=1)
    return 0
