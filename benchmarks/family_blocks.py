"""Benchmark workload: one block of each family the pack adapts, ComfyUI's own block with random weights, stock
against the pack's bounded forward (High, block bounds), peak memory and time in one process.

    python -m benchmarks.bench --comfyui PATH --families [--cases flux-double-2048,...] [--level high]
                                                          [--split-floor-tokens N] [--chain N] [--json FILE]
                                                          [--fast-paths-ab [--fast-paths none,each]]

Loaded by `benchmarks/bench.py` inside the package it makes for the pack (see `load_pack_module`), so the
adapters' relative imports resolve. Peaks are the working set above the live inputs and weights
(`benchmarks.memory`: CUDA peak stats, or MemTracker on CPU), as multiples of |x|, the block's main input
(the image stream of a double block, the joined stream of a single block). Outputs: "diff", the largest
difference relative to stock's largest value; "moved", the share of tokens moved by over 5% of their norm; for
blocks that route tokens to experts (HiDream), "rerouted", the tokens whose error is over `REROUTED_FACTOR` x the
median nonzero token error (other experts than stock's: a tie crossed by round-off), and "rest diff", "diff"
over the other tokens. With `--fast-paths-ab`, each case's pack forward is timed with the host-time fast paths on,
off and each one off instead (`benchmarks/fast_paths_ab.py`). Not part of the node pack.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, NamedTuple, Optional

import torch

from ..nodes.families import cogvideox, flux, hidream, minimax, mochi, qwen_image, wan
from ..nodes.dispatch import QKVConfig
from ..qkv_core import parse_level
from . import fast_paths_ab as ab
from . import memory


class Case(NamedTuple):
    name: str
    what: str
    build: Callable      # (device, dtype) -> (block, inputs dict, |x| tensor name, pack forward factory)
    routed: bool = False  # the block routes each token to some of its experts (HiDream's mixture of experts)


# A routed block's token whose error is over this many times the median of the tokens' nonzero errors took other
# experts than stock's (round-off before the router moved it across a tie: its error is an expert's output); the
# others differ by round-off (measured on the CPU, tests/test_hidream_adapter.py: the rerouted token at 70 x, the
# others up to 1.8 x)
REROUTED_FACTOR = 10


def rerouted_tokens(pack: torch.Tensor, stock: torch.Tensor) -> tuple:
    """(the tokens whose error is over `REROUTED_FACTOR` x the median nonzero token error, the largest difference
    over the other tokens relative to stock's largest value, as `max_rel_diff`)."""
    diff = (pack - stock).flatten(0, -2)
    error = diff.norm(dim=-1)
    nonzero = error[error > 0]
    if nonzero.numel() == 0:
        return 0, 0.0
    outliers = error > REROUTED_FACTOR * nonzero.median()
    rest = diff[~outliers]
    return int(outliers.sum()), float(rest.abs().max() / stock.abs().max()) if rest.numel() else 0.0


def _random_block_(block, device) -> None:
    """Random weights at a trained model's scale (matrices 1 / sqrt(fan-in), norms near 1, biases near 0)."""
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) / p.shape[1] ** 0.5)
            else:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.02 * torch.randn(p.shape, generator=g, device=device))
    block.requires_grad_(False)


def _flux_blocks(width: int, heads: int, device, dtype, qkv_bias=True):
    import comfy.ldm.flux.layers as layers
    import comfy.ops
    ops = dict(dtype=dtype, device=device, operations=comfy.ops.disable_weight_init)
    double = layers.DoubleStreamBlock(width, heads, mlp_ratio=4.0, qkv_bias=qkv_bias, **ops)
    single = layers.SingleStreamBlock(width, heads, mlp_ratio=4.0, **ops)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for block in (double, single):
            for name, p in block.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) / p.shape[1] ** 0.5)
                elif "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g, device=device, dtype=torch.float32))
    return double.eval(), single.eval()


def _pe(tokens: int, head_dim: int, device):
    import comfy.ldm.flux.layers as layers
    ids = torch.stack((torch.arange(tokens, device=device) // 4096, (torch.arange(tokens, device=device) // 64) % 64,
                       torch.arange(tokens, device=device) % 64), -1).float().unsqueeze(0)
    third = head_dim // 3 // 2 * 2
    return layers.EmbedND(dim=head_dim, theta=10000, axes_dim=[head_dim - 2 * third, third, third])(ids)


def flux_case(which: str, img_tokens: int, txt_tokens: int, width=3072, heads=24, text_mask=False):
    def build(device, dtype):
        double, single = _flux_blocks(width, heads, device, dtype)
        g = torch.Generator(device=device).manual_seed(1)
        total = img_tokens + txt_tokens

        def randn(*shape):
            return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)
        img, txt, vec = randn(1, img_tokens, width), randn(1, txt_tokens, width), randn(1, width)
        pe = _pe(total, width // heads, device)
        mask = None
        if text_mask:   # HunyuanVideo: the text padding masked out of the keys, (1, 1, L)
            mask = torch.zeros(1, 1, total, device=device, dtype=dtype)
            mask[..., img_tokens + txt_tokens // 2:] = -torch.inf if dtype == torch.float32 else -65504.0
        if which == "double":
            inputs = dict(img=img, txt=txt, vec=vec, pe=pe, attn_mask=mask, transformer_options={})
            return double, inputs, "img", flux.double_block_forward
        inputs = dict(x=torch.cat((txt, img), 1), vec=vec, pe=pe, attn_mask=mask, transformer_options={})
        return single, inputs, "x", flux.single_block_forward
    return build


def qwen_image_case(side_tokens: int, text_tokens: int, width=3072, heads=24, batch=1):
    """ComfyUI's `QwenImageTransformerBlock` (Qwen-Image: width 3072, 24 heads of 128) on a square image of
    `side_tokens`^2 patches and a prompt, RoPE ids as the model makes them; `batch` 2: cond and uncond in one
    call, as ComfyUI's sampler runs cfg."""
    def build(device, dtype):
        import comfy.ldm.qwen_image.model as qwen_model
        import comfy.ldm.flux.layers as layers
        import comfy.ops
        block = qwen_model.QwenImageTransformerBlock(width, heads, width // heads, dtype=dtype, device=device,
                                                     operations=comfy.ops.disable_weight_init)
        _random_block_(block, device)
        rows, cols = torch.meshgrid(torch.arange(side_tokens), torch.arange(side_tokens), indexing="ij")
        img_ids = torch.stack((torch.zeros_like(rows), rows - side_tokens // 2, cols - side_tokens // 2), -1)
        txt_ids = (side_tokens // 2 + torch.arange(text_tokens)).view(-1, 1).expand(-1, 3)
        ids = torch.cat((txt_ids, img_ids.reshape(-1, 3))).unsqueeze(0).float().to(device)
        freqs = layers.EmbedND(dim=width // heads, theta=10000, axes_dim=[16, 56, 56])(ids).to(dtype).contiguous()
        g = torch.Generator(device=device).manual_seed(1)

        def randn(*shape):
            return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)
        inputs = dict(hidden_states=randn(batch, side_tokens ** 2, width),
                      encoder_hidden_states=randn(batch, text_tokens, width), encoder_hidden_states_mask=None,
                      temb=randn(batch, width), image_rotary_emb=freqs)
        return block.eval(), inputs, "hidden_states", qwen_image.block_forward
    return build


def hidream_case(side_tokens: int, text_tokens: int = 384, width=2560, heads=20):
    """HiDream-I1's double block (width 2560, 20 heads of 128, 4 routed experts of which 2 per token, one shared
    expert): `side_tokens`^2 image tokens and the text stream (T5 + two Llama layers' tokens)."""
    def build(device, dtype):
        import comfy.ldm.hidream.model as hidream_model
        import comfy.ops
        block = hidream_model.HiDreamImageTransformerBlock(width, heads, width // heads, 4, 2, dtype=dtype,
                                                           device=device, operations=comfy.ops.disable_weight_init)
        _random_block_(block, device)
        tokens = side_tokens ** 2
        ids = torch.zeros(1, tokens + text_tokens, 3, device=device)
        ids[0, :tokens, 1] = (torch.arange(tokens, device=device) // side_tokens).float()
        ids[0, :tokens, 2] = (torch.arange(tokens, device=device) % side_tokens).float()
        rope = hidream_model.EmbedND(theta=10000, axes_dim=[64, 32, 32])(ids)
        g = torch.Generator(device=device).manual_seed(1)

        def randn(*shape):
            return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)
        inputs = dict(image_tokens=randn(1, tokens, width), image_tokens_masks=None,
                      text_tokens=randn(1, text_tokens, width), adaln_input=randn(1, width), rope=rope,
                      transformer_options={})
        return block.eval(), inputs, "image_tokens", hidream.block_forward
    return build


def wan_case(grid: tuple):
    """ComfyUI's Wan 2.x 14B `WanAttentionBlock` (`benchmarks/wan_block.py`) on a latent grid (t, h, w) of a
    video, a 512-token prompt, as `WanModel` calls it."""
    def build(device, dtype):
        from .wan_block import TEXT_TOKENS, WIDTH, build_block, rope_freqs
        block = build_block(device, dtype, 0)
        tokens = grid[0] * grid[1] * grid[2]
        g = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(1, tokens, WIDTH, generator=g).to(device=device, dtype=dtype)
        e = (torch.randn(1, 1, 6, WIDTH, generator=g) * 0.1).to(device=device, dtype=dtype)
        context = torch.randn(1, TEXT_TOKENS, WIDTH, generator=g).to(device=device, dtype=dtype)
        inputs = dict(x=x, e=e, freqs=rope_freqs(grid, tokens, device, dtype), context=context)
        return block, inputs, "x", wan.bounded_block_forward
    return build


def minimax_case(latent_t: int, rows: int, columns: int, audio_rows: int, text_tokens: int = 512):
    """MiniMax H3's `DiTBlock` (hidden 5376, 56 heads of 128 with RoPE on 96 channels, SwiGLU FFN of 14336) on
    one packed sequence [text | audio | video] of `latent_t` x `rows` x `columns` video patches, `audio_rows`
    stereo audio rows and `text_tokens`, as `MiniMaxH3Model` calls it (two timesteps: video/text and audio)."""
    def build(device, dtype):
        import comfy.ldm.minimax.model as minimax_model
        import comfy.ops
        width, heads, head_dim = 5376, 56, 128
        block = minimax_model.DiTBlock(width, heads, head_dim, 14336, 2688, 1e-5, 1e-5, dtype=dtype, device=device,
                                       operations=comfy.ops.disable_weight_init)
        _random_block_(block, device)
        video = latent_t * rows * columns
        tokens = text_tokens + audio_rows + video
        g = torch.Generator(device="cpu").manual_seed(1)
        positions = torch.rand(tokens, 48, generator=g) * 64   # angles of the three axes' 16 frequencies
        rope = minimax_model.rope_rotation_table(torch.cat((positions, positions), dim=-1).to(device), dtype)
        segments = [(0, text_tokens, 1), (text_tokens, text_tokens + audio_rows, 5), (text_tokens + audio_rows,
                                                                                       tokens, 0)]
        inputs = dict(x=torch.randn(tokens, width, generator=g).to(device=device, dtype=dtype),
                      t_emb=torch.randn(2, 2688, generator=g).to(device=device, dtype=dtype),
                      mod_segments=segments, rope_freqs=rope, transformer_options={})
        return block.eval(), inputs, "x", minimax.block_forward
    return build


def cogvideox_case(latent_t: int, rows: int, columns: int, text_tokens: int = 226):
    """CogVideoX 1.5 5B's `CogVideoXBlock` (width 3072, 48 heads of 64, RoPE over three axes) on `latent_t` x `rows`
    x `columns` video patches after a 226-token prompt, as `CogVideoXTransformer3DModel` calls it."""
    def build(device, dtype):
        import comfy.ldm.cogvideo.model as cogvideo_model
        import comfy.ops
        block = cogvideo_model.CogVideoXBlock(3072, 48, 64, 512, device=device, dtype=dtype,
                                              operations=comfy.ops.disable_weight_init)
        _random_block_(block, device)
        video = latent_t * rows * columns
        g = torch.Generator(device="cpu").manual_seed(1)
        angles = (torch.rand(video, 32, generator=g) * 64).to(device)
        rotary = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))
        inputs = dict(hidden_states=torch.randn(1, video, 3072, generator=g).to(device=device, dtype=dtype),
                      encoder_hidden_states=torch.randn(1, text_tokens, 3072, generator=g).to(device=device,
                                                                                               dtype=dtype),
                      temb=torch.randn(1, 512, generator=g).to(device=device, dtype=dtype),
                      image_rotary_emb=rotary, transformer_options={})
        return block.eval(), inputs, "hidden_states", cogvideox.block_forward
    return build


def mochi_case(latent_t: int, rows: int, columns: int, text_tokens: int = 256):
    """Mochi 1's `AsymmetricJointBlock` (video 3072 wide, text 1536, 24 heads of 128, per-head RoPE) on `latent_t`
    x `rows` x `columns` video patches and a 256-token prompt, as `AsymmDiTJoint` calls it."""
    def build(device, dtype):
        import comfy.ldm.genmo.joint_model.asymm_models_joint as mochi_model
        import comfy.ops
        block = mochi_model.AsymmetricJointBlock(3072, 1536, 24, mlp_ratio_x=4.0, mlp_ratio_y=4.0, qk_norm=True,
                                                 qkv_bias=False, device=device, dtype=dtype,
                                                 operations=comfy.ops.disable_weight_init)
        _random_block_(block, device)
        video = latent_t * rows * columns
        g = torch.Generator(device="cpu").manual_seed(1)
        angles = (torch.rand(video, 24, 64, generator=g) * 64).to(device)
        inputs = dict(x=torch.randn(1, video, 3072, generator=g).to(device=device, dtype=dtype),
                      c=torch.randn(1, 3072, generator=g).to(device=device, dtype=dtype),
                      y=torch.randn(1, text_tokens, 1536, generator=g).to(device=device, dtype=dtype),
                      rope_cos=angles.cos(), rope_sin=angles.sin(), crop_y=text_tokens, transformer_options={})
        return block.eval(), inputs, "x", mochi.block_forward
    return build


HUNYUAN_720P_129 = 33 * 45 * 80   # 129 frames -> 33 latent frames, 720 x 1280 -> 45 x 80 patches
CASES = {case.name: case for case in (
    Case("flux-double-2048", "Flux-dev double block, 2048^2 (16,384 image + 512 text tokens)",
         flux_case("double", 16384, 512)),
    Case("flux-single-2048", "Flux-dev single block, 2048^2 (16,896 tokens)", flux_case("single", 16384, 512)),
    Case("flux-double-1024", "Flux-dev double block, 1024^2 (4,096 image + 512 text tokens, under the split floor)",
         flux_case("double", 4096, 512)),
    Case("flux-single-1024", "Flux-dev single block, 1024^2 (4,608 tokens, under the split floor)",
         flux_case("single", 4096, 512)),
    Case("flux-double-kontext", "Flux Kontext double block, 1 MP + 1 MP reference (8,192 image + 512 text tokens, "
                                "under Flux's split floor)", flux_case("double", 8192, 512)),
    Case("flux-single-kontext", "Flux Kontext single block, 1 MP + 1 MP reference (8,704 tokens, under Flux's "
                                "split floor)", flux_case("single", 8192, 512)),
    Case("qwen-image-1328", "Qwen-Image block, 1328^2 (6,889 image + 256 text tokens)", qwen_image_case(83, 256)),
    Case("qwen-image-1328-cfg", "Qwen-Image block, 1328^2, cond + uncond in one call (2 x 7,145 tokens)",
         qwen_image_case(83, 256, batch=2)),
    # Qwen-Image-Edit: the output's image tokens and a reference image's, joined (a 1 MP edit: 2 x ~4,100)
    Case("qwen-edit-1024", "Qwen-Image-Edit block, 1 MP output + 1 MP reference (8,281 image + 256 text tokens, "
                           "under Qwen-Image's split floor)", qwen_image_case(91, 256)),
    Case("qwen-edit-1024-cfg", "Qwen-Image-Edit block, 1 MP + 1 MP reference, cond + uncond (2 x 8,537 tokens)",
         qwen_image_case(91, 256, batch=2)),
    Case("hidream-double-1024", "HiDream-I1 double block, 1024^2 (4,096 image + 384 text tokens)", hidream_case(64),
         routed=True),
    Case("hidream-double-2048", "HiDream-I1 double block, 2048^2 (16,384 image + 384 text tokens)", hidream_case(128),
         routed=True),
    # Wan 2.x 14B, 81 frames (21 latent frames): 480p and 720p, as a whole model runs each of its 40 blocks
    Case("wan-block-480p", "Wan 2.x 14B block, 832x480 x 81 frames (32,760 tokens + 512 text)", wan_case((21, 30, 52))),
    Case("wan-block-720p", "Wan 2.x 14B block, 1280x720 x 81 frames (75,600 tokens + 512 text)",
         wan_case((21, 45, 80))),
    # MiniMax H3 at its default canvas, 1344x768 (42 x 24 patches a latent frame), 24 fps (124 frames: 37 latent
    # frames, 362: 107) with 40 Hz stereo audio
    Case("minimax-1344x768x124", "MiniMax H3 block, 1344x768 x 124 frames (37,296 video + 414 audio + 512 text)",
         minimax_case(37, 24, 42, 414)),
    Case("minimax-1344x768x362", "MiniMax H3 block, 1344x768 x 362 frames (107,856 video + 1,206 audio + 512 text)",
         minimax_case(107, 24, 42, 1206)),
    # CogVideoX 1.5 5B at 1360x768 x 81 frames: 21 latent frames in 11 temporal patches, 48 x 85 patches a frame
    Case("cogvideox-1360x768x81", "CogVideoX 1.5 5B block, 1360x768 x 81 frames (44,880 video + 226 text)",
         cogvideox_case(11, 48, 85)),
    # Mochi 1 at 848x480 x 163 frames: 28 latent frames, 30 x 53 patches a frame
    Case("mochi-848x480x163", "Mochi 1 block, 848x480 x 163 frames (44,520 video + 256 text)", mochi_case(28, 30, 53)),
    Case("hunyuan-double-720p129", "HunyuanVideo double block, 720p x 129 frames (118,800 + 256 text, masked)",
         flux_case("double", HUNYUAN_720P_129, 256, text_mask=True)),
    Case("hunyuan-single-720p129", "HunyuanVideo single block, 720p x 129 frames (119,056 tokens, masked)",
         flux_case("single", HUNYUAN_720P_129, 256, text_mask=True)),
)}


def _fresh(inputs: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}


def _run_all(fn, calls: list) -> None:
    """`fn(**inputs)` for each of `calls` in turn (the list is emptied: each call's inputs and result are
    dropped before the next)."""
    while calls:
        fn(**calls.pop(0))


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def pack_forward(block, factory, backend: str, level: int, split_floor_tokens: Optional[int]):
    """The pack's forward of `block` at `level` with block bounds, with the family's split floor as the node
    applies it (Flux and Qwen-Image split from 12,288 tokens an item), or `split_floor_tokens`."""
    config = sys.modules[factory.__module__].SPEC.configure(QKVConfig(level=level, backend=backend, block=True))
    if split_floor_tokens is not None:
        config = config._replace(split_floor_tokens=split_floor_tokens)
    return factory(block, config)


def timed_ms(fn, inputs: dict, chain: int, repeats: int, device) -> float:
    """ms a call of `fn` on fresh copies of `inputs`, `chain` calls back to back in each timed run."""
    timing = memory.time_call(lambda calls: _run_all(fn, calls),
                              setup=lambda: ([_fresh(inputs) for _ in range(chain)],), warmup=1, repeats=repeats,
                              device=device)
    return timing.median_s * 1000 / chain


def run_case(case: Case, device, dtype, backend: str, repeats: int, level: int = 3,
             split_floor_tokens: Optional[int] = None, chain: int = 1) -> dict:
    """Stock against the pack at `level` with block bounds. `split_floor_tokens`: the fewest tokens of one item that
    are split (None: the family's own floor, as the node applies it; 0 forces the split). `chain`: each timed
    run makes that many calls back to back, as a model runs its blocks (the host's launches for one call then
    overlap the GPU's work of the one before), and the time is per call; 1: one call and its end."""
    block, inputs, main, factory = case.build(device, dtype)
    x_bytes = inputs[main].numel() * inputs[main].element_size()
    ours = pack_forward(block, factory, backend, level, split_floor_tokens)
    row = {"case": case.name, "what": case.what, "x_GiB": x_bytes / 2**30}
    results = {}
    with torch.no_grad():
        ours(**_fresh(inputs))   # the self-check, once, outside the measurement
        for label, fn in (("stock", block), ("pack", ours)):
            peak = memory.measure_peak(fn, **_fresh(inputs), device=device, live=[block, list(inputs.values())])
            results[label] = _first(peak.result).float()
            row[f"{label}_peak_x"] = peak.peak_bytes / x_bytes
            row[f"{label}_ms"] = timed_ms(fn, inputs, chain, repeats, device)
            del peak
    row["time_ratio"] = row["pack_ms"] / row["stock_ms"]
    row["max_rel_diff"] = float((results["pack"] - results["stock"]).abs().max() / results["stock"].abs().max())
    # tokens whose output moved by more than 5% of their norm: 0 but for blocks that route tokens to experts
    # (HiDream), where round-off sends a few tokens near a tie to another expert
    token_error = (results["pack"] - results["stock"]).norm(dim=-1) / results["stock"].norm(dim=-1).clamp_min(1e-30)
    row["moved_tokens"] = float((token_error > 0.05).float().mean())
    if case.routed:   # ties (a few tokens far off, the rest at round-off) told from errors (the rest far off too)
        row["rerouted_tokens"], row["max_rel_diff_rest"] = rerouted_tokens(results["pack"], results["stock"])
    inputs.clear()   # the block's inputs and weights go before the next case
    del block, results
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def fast_paths_case(case: Case, device, dtype, backend: str, repeats: int, level: int,
                    split_floor_tokens: Optional[int],
                    chain: int, spec: str, rounds: int) -> dict:
    """The pack's forward of `case` timed with the fast paths of each variant of `spec` (`fast_paths_ab`), and
    stock's once beside them."""
    block, inputs, _, factory = case.build(device, dtype)
    ours = pack_forward(block, factory, backend, level, split_floor_tokens)
    with torch.no_grad():
        ours(**_fresh(inputs))   # the self-check, once, outside the measurement
        stock_ms = timed_ms(block, inputs, chain, repeats, device)
        times = ab.interleaved(lambda: timed_ms(ours, inputs, chain, repeats, device) / 1000, ab.variants(spec),
                               rounds)
    inputs.clear()
    del block, ours
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"case": case.name, "what": case.what, "stock_ms": stock_ms, "chain": chain, "rows": ab.rows(times)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench --comfyui PATH --families")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--device", default=None)
    parser.add_argument("--backend", default="auto", help="the node's attention_backend for the pack")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--level", default="high", help="the pack's head split level (default high)")
    parser.add_argument("--split-floor-tokens", type=int, default=None,
                        help="the fewest tokens of one item that are split (default: each family's floor, as "
                             "the node applies it; 0 splits every case)")
    parser.add_argument("--chain", type=int, default=1,
                        help="calls back to back in each timed run, as a model runs its blocks (default 1: "
                             "each call timed to its end on its own); the time is per call")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    ab.add_arguments(parser)
    args = parser.parse_args(argv)
    level = parse_level(int(args.level) if args.level.strip().isdigit() else args.level)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = args.cases.split(",")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; the cases are {', '.join(CASES)}")
    if args.fast_paths_ab:
        return main_fast_paths(args, names, level, device)
    rows = []
    print(f"{'case':26} {'stock x|x|':>10} {'pack x|x|':>10} {'stock ms':>9} {'pack ms':>9} {'time':>6} {'diff':>8} "
          f"{'moved':>7} {'rerouted':>8} {'rest diff':>9}")
    for name in names:
        row = run_case(CASES[name], device, torch.bfloat16, args.backend, args.repeats, level, args.split_floor_tokens,
                       max(1, args.chain))
        rows.append(row)
        routed = (f" {row['rerouted_tokens']:8d} {row['max_rel_diff_rest']:9.2e}" if "rerouted_tokens" in row
                  else f" {'-':>8} {'-':>9}")
        print(f"{name:26} {row['stock_peak_x']:10.2f} {row['pack_peak_x']:10.2f} {row['stock_ms']:9.1f} "
              f"{row['pack_ms']:9.1f} {row['time_ratio']:6.2f} {row['max_rel_diff']:8.2e} {row['moved_tokens']:7.2%}"
              + routed, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda"
                       else None, "backend": args.backend, "level": level,
                       "split_floor_tokens": args.split_floor_tokens, "chain": args.chain,
                       "rows": rows}, f, indent=1)
    return 0


def main_fast_paths(args, names: list, level: int, device) -> int:
    """`--fast-paths-ab`: a table a case (ms a call of the pack's forward under each variant), stock's beside."""
    results = []
    for name in names:
        result = fast_paths_case(CASES[name], device, torch.bfloat16, args.backend, args.repeats, level,
                                 args.split_floor_tokens, max(1, args.chain), args.fast_paths, args.ab_rounds)
        results.append(result)
        print(ab.table(f"{name}: pack ms a call ({result['chain']} back to back), stock {result['stock_ms']:.2f} ms",
                       result["rows"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda"
                       else None, "backend": args.backend, "level": level,
                       "split_floor_tokens": args.split_floor_tokens,
                       "fast_paths_ab": results}, f, indent=1)
    return 0


if __name__ == "__main__":   # pragma: no cover - run through benchmarks.bench
    sys.exit(main())
