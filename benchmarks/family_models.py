"""Benchmark workload: the memory factor of the non-Wan families, measured on whole models. Each case is a whole
diffusion model as ComfyUI's model detection configures it (`comfy.model_detection.model_config_from_unet_config`
picks the `comfy.supported_models` class), random bf16 weights built on the device, called as
`BaseModel._apply_model` calls it (cond and uncond in one batch), stock and with the pack (High, block bounds):

    python -m benchmarks.bench --comfyui PATH --family-models [--cases flux-dev-1024,...] [--repeats 2]
                                                               [--backend auto] [--json FILE] [--tiny]
                                                               [--level High] [--split-floor TOKENS]

What it measures, per case (docs/benchmarks.md, "The memory estimate the pack gives ComfyUI"): ComfyUI plans a
run from its estimate E = `base_model.memory_required([2, C, ...])` (`comfy.sampler_helpers.estimate_memory`:
cond + uncond of one latent; memory_usage_factor x latent area), keeping as many weights on the GPU as fit beside
E. Stock's real working set is A, the pack's P (CUDA allocator peak of one model call above what was allocated
before it: weights, inputs; the output included). A patched run told `factor` x E peaks no higher than stock when
factor >= 1 - (A - P) / E: the "factor needed" column, to set against the family's `MEMORY_FACTORS`
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
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
import traceback
from typing import Callable

import torch

from ..nodes import patching
from ..nodes.dispatch import QKVConfig
from ..qkv_core import head_split
from .wan_block import comfyui_version, fill_random_, random_like

GiB = float(1 << 30)
DTYPE = torch.bfloat16
SIGMA = 0.8                 # a mid-schedule step
TINY_SPLIT_FLOOR = 64       # --tiny: the head split floor (8,192 tokens at full size), so that the split runs


# ------------------------------------------------------------------------------------------------------
# the models, as comfy/model_detection.py's detect_unet_config finds them in a checkpoint
# ------------------------------------------------------------------------------------------------------

#: Flux.1 dev: 19 double + 38 single blocks, 3072 wide, 24 heads of 128, guidance embedding, T5 + CLIP-L pooled
FLUX_DEV = dict(image_model="flux", axes_dim=[16, 56, 56], num_heads=24, mlp_ratio=4.0, theta=10000, out_channels=16,
                qkv_bias=True, txt_ids_dims=[], in_channels=16, hidden_size=3072, context_in_dim=4096, patch_size=2,
                vec_in_dim=768, depth=19, depth_single_blocks=38, guidance_embed=True, yak_mlp=False, txt_norm=False)
#: Qwen-Image (20B): 60 blocks, 24 heads of 128 (3072 wide), Qwen2.5-VL 7B text (3584), patch 2 over 16 channels
QWEN_IMAGE = dict(image_model="qwen_image", in_channels=64, num_layers=60)
#: HunyuanVideo (T2V, 13B): 20 double + 40 single blocks, 3072 wide, 24 heads of 128, Llama text (4096) + CLIP-L
HUNYUAN_VIDEO = dict(image_model="hunyuan_video", in_channels=16, patch_size=[1, 2, 2], out_channels=16,
                     vec_in_dim=768, axes_dim=[16, 56, 56], meanflow=False, context_in_dim=4096, hidden_size=3072,
                     mlp_ratio=4.0, num_heads=24, depth=20, depth_single_blocks=40, theta=256, qkv_bias=True,
                     byt5=False, guidance_embed=True, use_cond_type_embedding=False, vision_in_dim=None,
                     meanflow_sum=False)
#: LTX-Video 2B (0.9.x): 28 blocks, 32 heads of 64 (2048 wide), T5 text (4096) with its padding mask
LTXV_2B = dict(image_model="ltxv", num_layers=28, attention_head_dim=64, cross_attention_dim=2048,
               use_keyframes_abs_pos_embedding=False)
#: Lumina Image 2.0 (2.6B): 26 blocks (+ 2 noise, 2 context refiners), 2304 wide, 24 heads of 96 (8 kv heads),
#: Gemma 2 2B text (2304)
LUMINA2 = dict(image_model="lumina2", patch_size=2, in_channels=16, dim=2304, cap_feat_dim=2304, n_layers=26,
               qk_norm=True, n_heads=24, n_kv_heads=8, axes_dims=[32, 32, 32], axes_lens=[300, 512, 512],
               rope_theta=10000.0, ffn_dim_multiplier=4.0)
#: Z-Image (6B): 30 blocks (+ 2 + 2 refiners), 3840 wide, 30 heads of 128, Qwen3 4B text (2560), the caption
#: padded to a multiple of 32 (the checkpoints' cap_pad_token)
Z_IMAGE = dict(image_model="lumina2", patch_size=2, in_channels=16, dim=3840, cap_feat_dim=2560, n_layers=30,
               qk_norm=True, n_heads=30, n_kv_heads=30, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
               rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True, time_scale=1000.0,
               pad_tokens_multiple=32)
#: SD3.5 Large (8B): MMDiT of depth 38 (64 x 38 = 2432 wide, 38 heads of 64), RMS qk norm, pos embed 192^2,
#: CLIP-L + CLIP-G pooled (2048), T5 + CLIP context (4096)
SD35_LARGE = dict(in_channels=16, patch_size=2, out_channels=16, depth=38, input_size=None, adm_in_channels=2048,
                  context_embedder_config={"target": "torch.nn.Linear",
                                           "params": {"in_features": 4096, "out_features": 64 * 38}},
                  num_patches=192 * 192, pos_embed_max_size=192, qk_norm="rms", pos_embed_scaling_factor=None,
                  x_block_self_attn_layers=[])
#: SD3.5 Medium (2.5B): MMDiT-X of depth 24 (1536 wide, 24 heads of 64), a second image self-attention in blocks
#: 0-12, pos embed 384^2
SD35_MEDIUM = dict(SD35_LARGE, depth=24, num_patches=384 * 384, pos_embed_max_size=384,
                   context_embedder_config={"target": "torch.nn.Linear",
                                            "params": {"in_features": 4096, "out_features": 64 * 24}},
                   x_block_self_attn_layers=list(range(13)))
#: Cosmos-Predict2 2B Video2World: MiniTrainDIT, 28 blocks, 2048 wide, 16 heads of 128, adaLN-LoRA 256, the
#: inverted conditioning mask concatenated (17 in channels) and a padding mask inside; T5 text cross-attention (1024)
COSMOS_P2_2B = dict(image_model="cosmos_predict2", max_img_h=240, max_img_w=240, max_frames=128, in_channels=17,
                    out_channels=16, patch_spatial=2, patch_temporal=1, model_channels=2048,
                    concat_padding_mask=True, crossattn_emb_channels=1024, pos_emb_cls="rope3d",
                    pos_emb_learnable=True, pos_emb_interpolation="crop", min_fps=1, max_fps=30, use_adaln_lora=True,
                    adaln_lora_dim=256, num_blocks=28, num_heads=16, extra_per_block_abs_pos_emb=False,
                    rope_h_extrapolation_ratio=3.0, rope_w_extrapolation_ratio=3.0, rope_t_extrapolation_ratio=1.0)
#: Kandinsky 5.0 Video Lite (2B): 32 visual + 2 text blocks, 1792 wide, 28 heads of 64, the (zero) image and mask
#: concatenated (33 in channels, x 4 a patch = 132); Qwen2.5-VL 7B text (3584, its own blocks, then cross-attention),
#: CLIP-L pooled (768)
KANDINSKY5_LITE = dict(image_model="kandinsky5", model_dim=1792, axes_dims=(16, 24, 24), time_dim=512, ff_dim=7168,
                       visual_embed_dim=132, num_text_blocks=2, num_visual_blocks=32)
#: HiDream-I1 (Full, 17B): 16 double + 32 single blocks, 2560 wide, 20 heads of 128, MoE FFN (4 experts, top 2);
#: T5 (4096) + Llama 3.1 8B (every layer's hidden states, 4096) text in the sequence, CLIP-L + G pooled (2048)
HIDREAM_I1 = dict(image_model="hidream", attention_head_dim=128, axes_dims_rope=[64, 32, 32],
                  caption_channels=[4096, 4096], max_resolution=[128, 128], in_channels=16,
                  llama_layers=list(range(32)) + [31] * 16, num_attention_heads=20, num_routed_experts=4,
                  num_activated_experts=2, num_layers=16, num_single_layers=32, out_channels=16, patch_size=2,
                  text_emb_dim=2048)

#: --tiny: the same models cut down (width 256, 1-2 blocks); the text encoders' widths are kept
TINY = {
    "flux": dict(FLUX_DEV, hidden_size=256, num_heads=2, depth=1, depth_single_blocks=2),
    "qwen_image": dict(QWEN_IMAGE, num_layers=2, num_attention_heads=2, attention_head_dim=128),
    "hunyuan_video": dict(HUNYUAN_VIDEO, hidden_size=256, num_heads=2, depth=1, depth_single_blocks=1),
    "ltxv": dict(LTXV_2B, num_layers=2, num_attention_heads=4, cross_attention_dim=256),
    # (Lumina 2 and Z-Image share image_model "lumina2", SD3.5's MMDiT has none: these cases name their tiny config)
    "lumina2": dict(LUMINA2, dim=384, n_heads=4, n_kv_heads=2, n_layers=1, n_refiner_layers=1),   # heads of 96
    "z_image": dict(Z_IMAGE, dim=256, n_heads=2, n_kv_heads=2, n_layers=1, n_refiner_layers=1),
    # MMDiT is 64 x depth wide with depth heads: 4 blocks of 256
    "sd35_large": dict(SD35_LARGE, depth=4, num_patches=32 * 32, pos_embed_max_size=32,
                       context_embedder_config={"target": "torch.nn.Linear",
                                                "params": {"in_features": 4096, "out_features": 256}}),
    "sd35_medium": dict(SD35_MEDIUM, depth=4, num_patches=32 * 32, pos_embed_max_size=32,
                        context_embedder_config={"target": "torch.nn.Linear",
                                                 "params": {"in_features": 4096, "out_features": 256}},
                        x_block_self_attn_layers=[0, 1]),
    "cosmos_predict2": dict(COSMOS_P2_2B, model_channels=256, num_heads=2, num_blocks=2),
    "kandinsky5": dict(KANDINSKY5_LITE, model_dim=256, ff_dim=1024, num_text_blocks=1, num_visual_blocks=2),
    # every expert active: top-2 routing flips on near-ties under bf16 rounding, a discontinuity that a tiny random
    # model hits often enough to make the rel diff meaningless; with all 4 the mixture is continuous
    "hidream": dict(HIDREAM_I1, num_attention_heads=2, num_layers=1, num_single_layers=1, llama_layers=[30, 31],
                    num_activated_experts=4),
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    what: str
    config: dict            # the unet_config model detection produces
    expect: str             # the comfy.supported_models class it must select
    latent: tuple           # one latent item: (C, H, W) or (C, T, H, W)
    text: int               # prompt tokens
    context_dim: int
    conds: Callable         # (batch, text, device, generator) -> the extra kwargs _apply_model passes
    tiny_latent: tuple = ()
    tiny_text: int = 16
    text_in_sequence: int = 1   # copies of the text in the attention sequence: 0 = cross-attention only
    tiny: str = ""              # the TINY entry, when not the config's image_model
    tiny_expect: str = ""       # the class detection selects for the tiny config, when not `expect`

    def sized(self, tiny: bool) -> "Case":
        if not tiny:
            return self
        return dataclasses.replace(self, config=TINY[self.tiny or self.config["image_model"]], latent=self.tiny_latent,
                                   expect=self.tiny_expect or self.expect,
                                   text=self.tiny_text, what=f"TINY stand-in for {self.what}")


def _randn(shape, device, generator, dtype=DTYPE):
    return torch.randn(*shape, device=device, generator=generator, dtype=torch.float32).to(dtype)


def flux_conds(batch, text, device, g):
    """Flux.extra_conds: c_crossattn (T5), y = pooled CLIP-L, guidance (3.5 by default), each cast to bf16."""
    return dict(y=_randn((batch, 768), device, g), guidance=torch.full((batch,), 3.5, device=device, dtype=DTYPE))


def qwen_conds(batch, text, device, g):
    """QwenImage.extra_conds: c_crossattn only. ComfyUI's Qwen text encoder drops the attention mask when nothing
    is masked (a prompt unpadded: comfy/text_encoders/qwen_image.py), as here."""
    return {}


def hunyuan_conds(batch, text, device, g):
    """HunyuanVideo.extra_conds: y = pooled CLIP-L, guidance 6.0. No attention mask: ComfyUI's Llama text encoder
    crops the prompt to its tokens and drops the mask when nothing is masked (comfy/text_encoders/
    hunyuan_video.py); the model folds a mask into one (1, 1, L) row, which a batch of 2 masks would not fit."""
    return dict(y=_randn((batch, 768), device, g), guidance=torch.full((batch,), 6.0, device=device, dtype=DTYPE))


def ltxv_conds(batch, text, device, g):
    """LTXV.extra_conds: the T5 attention mask (its tokenizer pads to 128: ones over the prompt, zeros over the
    padding; integer, as the text encoder returns it, so the model makes it additive), frame_rate 25."""
    mask = torch.zeros(batch, text, dtype=torch.long, device=device)
    mask[:, :max(1, text * 3 // 8)] = 1          # a 48-token prompt padded to 128
    return dict(attention_mask=mask, frame_rate=25)


def lumina2_conds(batch, text, device, g):
    """Lumina2.extra_conds: c_crossattn, num_tokens = the prompt's length. ComfyUI's Gemma 2 / Qwen3 text encoders
    pad nothing (min_length 1), so there is no attention mask (it is only passed when something is masked)."""
    return dict(num_tokens=text)


def sd3_conds(batch, text, device, g):
    """SD3.extra_conds: y = pooled CLIP-L + CLIP-G (2048), via encode_adm."""
    return dict(y=_randn((batch, 2048), device, g))


def cosmos_predict2_conds(batch, text, device, g):
    """CosmosPredict2 (Video2World).extra_conds: fps = the conditioning's frame_rate (None: no frame_rate given);
    concat_cond: mask_inverted, zeros without a denoise mask (text to video), concatenated to x."""
    return dict(fps=None, c_concat=1)


def kandinsky5_conds(batch, text, device, g):
    """Kandinsky5.extra_conds: y = pooled CLIP-L (encode_adm); concat_cond: a zero image and a zero mask (17
    channels) concatenated to x. No attention mask (a prompt unpadded)."""
    return dict(y=_randn((batch, 768), device, g), c_concat=17)


def hidream_conds(batch, text, device, g):
    """HiDream.extra_conds: y = pooled CLIP-L + CLIP-G (2048), c_crossattn = T5 (128 tokens), and
    encoder_hidden_states_llama3 = every Llama 3.1 8B layer's hidden states, (B, 32, 128, 4096): its tokenizer pads
    to 128 as T5's does."""
    return dict(y=_randn((batch, 2048), device, g),
                encoder_hidden_states_llama3=_randn((batch, 32, text, 4096), device, g))


CASES = {case.name: case for case in (
    Case("flux-dev-1024", "Flux.1-dev, 1024^2 (4,096 image + 512 text tokens)", FLUX_DEV, "Flux",
         (16, 128, 128), 512, 4096, flux_conds, tiny_latent=(16, 24, 24)),
    Case("flux-dev-2048", "Flux.1-dev, 2048^2 (16,384 image + 512 text tokens)", FLUX_DEV, "Flux",
         (16, 256, 256), 512, 4096, flux_conds, tiny_latent=(16, 32, 32)),
    Case("qwen-image-1328", "Qwen-Image, 1328^2 (6,889 image + 256 text tokens)", QWEN_IMAGE, "QwenImage",
         (16, 1, 166, 166), 256, 3584, qwen_conds, tiny_latent=(16, 1, 24, 24)),
    Case("hunyuan-video-720p129", "HunyuanVideo, 1280x720 x 129 frames (118,800 video + 256 text tokens)",
         HUNYUAN_VIDEO, "HunyuanVideo", (16, 33, 90, 160), 256, 4096, hunyuan_conds, tiny_latent=(16, 3, 12, 16)),
    Case("ltxv-768x512x97", "LTX-Video 2B, 768x512 x 97 frames (4,992 video tokens; 128 text tokens, masked)",
         LTXV_2B, "LTXV", (128, 13, 16, 24), 128, 4096, ltxv_conds, tiny_latent=(128, 3, 8, 8), tiny_text=32,
         text_in_sequence=0),
    Case("ltxv-1216x704x121", "LTX-Video 2B, 1216x704 x 121 frames (13,376 video tokens; 128 text tokens, masked)",
         LTXV_2B, "LTXV", (128, 16, 22, 38), 128, 4096, ltxv_conds, tiny_latent=(128, 3, 8, 8), tiny_text=32,
         text_in_sequence=0),
    Case("ltxv-1216x704x257", "LTX-Video 2B, 1216x704 x 257 frames (27,588 video tokens; 128 text tokens, masked)",
         LTXV_2B, "LTXV", (128, 33, 22, 38), 128, 4096, ltxv_conds, tiny_latent=(128, 3, 8, 8), tiny_text=32,
         text_in_sequence=0),
    Case("lumina2-2048", "Lumina Image 2.0, 2048^2 (16,384 image + 256 text tokens)", LUMINA2, "Lumina2",
         (16, 256, 256), 256, 2304, lumina2_conds, tiny_latent=(16, 24, 24), tiny="lumina2"),
    Case("sd35-large-2048", "SD3.5 Large, 2048^2 (16,384 image + 154 text tokens)", SD35_LARGE,
         "SD3", (16, 256, 256), 154, 4096, sd3_conds, tiny_latent=(16, 24, 24), tiny="sd35_large"),
    Case("lumina2-1024", "Lumina Image 2.0, 1024^2 (4,096 image + 256 text tokens)", LUMINA2, "Lumina2",
         (16, 128, 128), 256, 2304, lumina2_conds, tiny_latent=(16, 24, 24), tiny="lumina2"),
    Case("z-image-1024", "Z-Image, 1024^2 (4,096 image + 256 text tokens)", Z_IMAGE, "ZImage",
         (16, 128, 128), 256, 2560, lumina2_conds, tiny_latent=(16, 24, 24), tiny_text=32, tiny="z_image",
         tiny_expect="Lumina2"),   # ZImage is selected by dim 3840 only; the same NextDiT, Z-Image's options
    Case("sd35-large-1024", "SD3.5 Large, 1024^2 (4,096 image + 154 text tokens: 77 CLIP + 77 T5)", SD35_LARGE,
         "SD3", (16, 128, 128), 154, 4096, sd3_conds, tiny_latent=(16, 24, 24), tiny="sd35_large"),
    Case("sd35-medium-1024", "SD3.5 Medium, 1024^2 (4,096 image + 154 text tokens: 77 CLIP + 77 T5)",
         SD35_MEDIUM, "SD3", (16, 128, 128), 154, 4096, sd3_conds, tiny_latent=(16, 24, 24), tiny="sd35_medium"),
    Case("cosmos-p2-2b-1280x704x93", "Cosmos-Predict2 2B Video2World, 1280x704 x 93 frames (84,480 video tokens; "
         "512 T5 tokens, cross-attention)", COSMOS_P2_2B, "CosmosI2VPredict2", (16, 24, 88, 160), 512, 1024,
         cosmos_predict2_conds, tiny_latent=(16, 3, 16, 16), text_in_sequence=0),
    Case("kandinsky5-lite-768x512x61", "Kandinsky 5.0 Video Lite, 768x512 x 61 frames (24,576 video tokens; 256 "
         "text tokens, cross-attention)", KANDINSKY5_LITE, "Kandinsky5", (16, 16, 64, 96), 256, 3584,
         kandinsky5_conds, tiny_latent=(16, 3, 12, 16), text_in_sequence=0),
    Case("cosmos-p2-2b-1280x704x9", "Cosmos-Predict2 2B Video2World, 1280x704 x 9 frames (10,560 video tokens; "
         "512 T5 tokens, cross-attention)", COSMOS_P2_2B, "CosmosI2VPredict2", (16, 3, 88, 160), 512, 1024,
         cosmos_predict2_conds, tiny_latent=(16, 3, 16, 16), text_in_sequence=0),
    Case("kandinsky5-lite-768x512x25", "Kandinsky 5.0 Video Lite, 768x512 x 25 frames (10,752 video tokens; 256 "
         "text tokens, cross-attention)", KANDINSKY5_LITE, "Kandinsky5", (16, 7, 64, 96), 256, 3584,
         kandinsky5_conds, tiny_latent=(16, 3, 12, 16), text_in_sequence=0),
    Case("hidream-i1-1024", "HiDream-I1 Full, 1024^2 (4,096 image + 384 text tokens: 128 T5 + 2 x 128 Llama)",
         HIDREAM_I1, "HiDream", (16, 128, 128), 128, 4096, hidream_conds, tiny_latent=(16, 24, 24),
         text_in_sequence=3),
)}


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
    args = dict(x=_randn((batch,) + tuple(case.latent), device, g),
                timestep=base.model.model_sampling.timestep(sigma).float(),
                context=_randn((batch, case.text, case.context_dim), device, g))
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
    MEMORY_FACTORS, and why (split, unsplit, not verified yet, ...); the adapter's name."""
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
    parser.add_argument("--split-floor", type=int, default=None,
                        help="the runtime's head split floor in tokens of one item (default 8,192; each family "
                             "splits from its SPLIT_FLOOR_SCALE times it); 0: every call is split")
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
    if args.split_floor is not None:
        head_split.SPLIT_FLOOR_TOKENS = args.split_floor
    try:
        return _run(args, names, device)
    finally:
        head_split.SPLIT_FLOOR_TOKENS = floor   # the process (a test run) keeps the runtime's own


def _run(args, names, device) -> int:

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no CUDA: a smoke run, no peaks)"
    print(f"{gpu}; torch {torch.__version__}; ComfyUI {comfyui_version()}; pack: {args.level}, block bounds, backend "
          f"{args.backend}; batch {args.batch}; {args.repeats} measured call(s) per method after a warm-up"
          + (f"; TINY models, head split floor {TINY_SPLIT_FLOOR} tokens" if args.tiny else "")
          + (f"; the runtime's head split floor {args.split_floor} tokens" if args.split_floor is not None else ""),
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
                       "backend": args.backend, "level": args.level, "split_floor": args.split_floor,
                       "batch": args.batch, "repeats": args.repeats, "tiny": args.tiny,
                       "rows": rows}, f, indent=1)
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":   # pragma: no cover - run through benchmarks.bench
    sys.exit(main())
