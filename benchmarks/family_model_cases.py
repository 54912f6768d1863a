"""The whole models of `benchmarks/family_models.py` (`--family-models`): each family's diffusion model as
`comfy/model_detection.py`'s `detect_unet_config` finds it in a checkpoint, its latent and text at the case's size,
the extra conditioning `BaseModel._apply_model` hands it, and a tiny version for `--tiny`. Not part of the node
pack."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

DTYPE = torch.bfloat16

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


def randn(shape, device, generator, dtype=DTYPE):
    return torch.randn(*shape, device=device, generator=generator, dtype=torch.float32).to(dtype)


def flux_conds(batch, text, device, g):
    """Flux.extra_conds: c_crossattn (T5), y = pooled CLIP-L, guidance (3.5 by default), each cast to bf16."""
    return dict(y=randn((batch, 768), device, g), guidance=torch.full((batch,), 3.5, device=device, dtype=DTYPE))


def qwen_conds(batch, text, device, g):
    """QwenImage.extra_conds: c_crossattn only. ComfyUI's Qwen text encoder drops the attention mask when nothing
    is masked (a prompt unpadded: comfy/text_encoders/qwen_image.py), as here."""
    return {}


def hunyuan_conds(batch, text, device, g):
    """HunyuanVideo.extra_conds: y = pooled CLIP-L, guidance 6.0. No attention mask: ComfyUI's Llama text encoder
    crops the prompt to its tokens and drops the mask when nothing is masked (comfy/text_encoders/
    hunyuan_video.py); the model folds a mask into one (1, 1, L) row, which a batch of 2 masks would not fit."""
    return dict(y=randn((batch, 768), device, g), guidance=torch.full((batch,), 6.0, device=device, dtype=DTYPE))


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
    return dict(y=randn((batch, 2048), device, g))


def cosmos_predict2_conds(batch, text, device, g):
    """CosmosPredict2 (Video2World).extra_conds: fps = the conditioning's frame_rate (None: no frame_rate given);
    concat_cond: mask_inverted, zeros without a denoise mask (text to video), concatenated to x."""
    return dict(fps=None, c_concat=1)


def kandinsky5_conds(batch, text, device, g):
    """Kandinsky5.extra_conds: y = pooled CLIP-L (encode_adm); concat_cond: a zero image and a zero mask (17
    channels) concatenated to x. No attention mask (a prompt unpadded)."""
    return dict(y=randn((batch, 768), device, g), c_concat=17)


def hidream_conds(batch, text, device, g):
    """HiDream.extra_conds: y = pooled CLIP-L + CLIP-G (2048), c_crossattn = T5 (128 tokens), and
    encoder_hidden_states_llama3 = every Llama 3.1 8B layer's hidden states, (B, 32, 128, 4096): its tokenizer pads
    to 128 as T5's does."""
    return dict(y=randn((batch, 2048), device, g),
                encoder_hidden_states_llama3=randn((batch, 32, text, 4096), device, g))


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


__all__ = ["CASES", "TINY", "Case", "DTYPE", "randn"]
