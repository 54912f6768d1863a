"""One tiny random-weight model per adapted family, built from ComfyUI's own config classes, for the contract test
(tests/test_family_contract.py). Each case's forward is two batch items (cond + uncond) of 1,024+ tokens each; the
contract test lowers the runtime's split floor (8,192 tokens of one item) to 1,024, so the head split runs as on
real sizes.

A case: `build()` -> `Case` with the ModelPatcher, fresh forward inputs of its diffusion model, the key of one
fused or q projection weight (for a LoRA), and conditioning for a short `comfy.sample.sample` run.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import pytest

from support import comfy_env


class Case(NamedTuple):
    patcher: object
    inputs: Callable[[], dict]          # fresh kwargs of patcher.model.diffusion_model
    lora_key: str                       # a q/k/v (or fused qkv) weight the LoRA test patches
    latent: object                      # an empty latent for sampling
    conds: Callable[[], tuple]          # (positive, negative) for comfy.sample.sample
    kv_heads: int
    heads: Optional[int] = None         # query heads, where more than kv_heads (grouped-query attention)


def _patcher(model):
    import torch
    import comfy.model_patcher
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def _model(config_class: str, config: dict):
    import torch
    import comfy.supported_models
    cls = getattr(comfy.supported_models, config_class, None)
    if cls is None:
        pytest.skip(f"this ComfyUI has no {config_class}")
    model_config = cls(dict(config))
    model_config.set_inference_dtype(torch.float32, None)
    try:
        return model_config.get_model({}, device=torch.device("cpu"))
    except Exception as error:   # noqa: BLE001 - a ComfyUI whose model takes other settings
        pytest.skip(f"this ComfyUI builds no tiny {config_class}: {type(error).__name__}: {error}")


def wan() -> Case:
    import torch
    patcher = comfy_env.make_wan("t2v", dim=128, heads=4, layers=1)
    size = dict(frames=3, h=64, w=88, batch=2)   # 2 x 4,224 tokens

    def conds():
        return comfy_env.make_conds(patcher, "t2v", frames=2, h=64, w=88)
    return Case(patcher, lambda: comfy_env.make_inputs(patcher.model, "t2v", **size),
                "diffusion_model.blocks.0.self_attn.q.weight",
                torch.zeros(1, 16, 2, 64, 88), conds, 4)


FLUX1 = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 32,
         "hidden_size": 128, "mlp_ratio": 4.0, "num_heads": 4, "depth": 1, "depth_single_blocks": 1,
         "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "guidance_embed": False, "patch_size": 2,
         "txt_ids_dims": []}


def flux() -> Case:
    import torch
    import comfy.ldm.flux.model as flux_model
    config = dict(FLUX1)
    if "txt_ids_dims" not in getattr(flux_model.FluxParams, "__dataclass_fields__", {}):
        del config["txt_ids_dims"]
    patcher = _patcher(_model("Flux", config))

    def inputs():
        g = torch.Generator().manual_seed(1)
        return dict(x=torch.randn(2, 16, 64, 64, generator=g), timestep=torch.tensor([0.7, 0.7]),
                    context=torch.randn(2, 12, 32, generator=g), y=torch.randn(2, 32, generator=g))

    def conds():
        g = torch.Generator().manual_seed(2)
        return ([[torch.randn(1, 12, 32, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]],
                [[torch.randn(1, 12, 32, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]])
    return Case(patcher, inputs, "diffusion_model.double_blocks.0.img_attn.qkv.weight",
                torch.zeros(1, 16, 64, 64), conds, 4)


HUNYUAN_VIDEO = {"image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32,
                 "context_in_dim": 32, "hidden_size": 128, "mlp_ratio": 4.0, "num_heads": 4, "depth": 1,
                 "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 256, "patch_size": [1, 2, 2],
                 "qkv_bias": True, "guidance_embed": False}


def hunyuan_video() -> Case:
    """HunyuanVideo 1.0 with a text padding mask (its `attention_mask`: the last text tokens are padding; the
    model takes one mask for the batch, so the forward is one item of 2,048 tokens and sampling goes without)."""
    import inspect
    import torch
    import comfy.ldm.hunyuan_video.model as hunyuan_model
    config = dict(HUNYUAN_VIDEO)
    fields = getattr(hunyuan_model.HunyuanVideoParams, "__dataclass_fields__", {})
    for name, value in (("byt5", False), ("meanflow", False), ("use_cond_type_embedding", False),
                        ("vision_in_dim", None), ("meanflow_sum", False)):
        if name in fields:
            config.setdefault(name, value)
    patcher = _patcher(_model("HunyuanVideo", config))
    takes_mask = "attention_mask" in inspect.signature(hunyuan_model.HunyuanVideo.forward).parameters

    def text_mask(batch):
        mask = torch.ones(batch, 16)
        mask[:, 10:] = 0   # padding
        return mask

    def inputs():
        g = torch.Generator().manual_seed(1)
        out = dict(x=torch.randn(1, 16, 2, 32, 128, generator=g), timestep=torch.tensor([700.0]),
                   context=torch.randn(1, 16, 32, generator=g), y=torch.randn(1, 32, generator=g))
        if takes_mask:
            out["attention_mask"] = text_mask(1)
        return out

    def conds():
        g = torch.Generator().manual_seed(2)
        extra = {"pooled_output": torch.randn(1, 32, generator=g)}
        return ([[torch.randn(1, 16, 32, generator=g), dict(extra)]],
                [[torch.randn(1, 16, 32, generator=g), dict(extra)]])
    return Case(patcher, inputs, "diffusion_model.double_blocks.0.img_attn.qkv.weight",
                torch.zeros(1, 16, 2, 32, 64), conds, 4)


QWEN_IMAGE = {"image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16,
              "num_layers": 1, "attention_head_dim": 32, "num_attention_heads": 4, "joint_attention_dim": 48,
              "axes_dims_rope": [8, 12, 12]}


def qwen_image() -> Case:
    """Qwen-Image-Edit: the image and one reference latent joined to its tokens (2 x (4,096 + 1,024))."""
    import torch
    patcher = _patcher(_model("QwenImage", QWEN_IMAGE))
    reference = torch.randn(1, 16, 1, 64, 64, generator=torch.Generator().manual_seed(4))

    def inputs():
        g = torch.Generator().manual_seed(1)
        return dict(x=torch.randn(2, 16, 1, 128, 128, generator=g), timestep=torch.tensor([0.5, 0.5]),
                    context=torch.randn(2, 12, 48, generator=g), ref_latents=[reference.expand(2, -1, -1, -1, -1)])

    def conds():
        g = torch.Generator().manual_seed(2)
        return ([[torch.randn(1, 12, 48, generator=g), {"reference_latents": [reference]}]],
                [[torch.randn(1, 7, 48, generator=g), {"reference_latents": [reference]}]])
    return Case(patcher, inputs, "diffusion_model.transformer_blocks.0.attn.to_k.weight",
                torch.zeros(1, 16, 1, 128, 128), conds, 4)


def lumina2() -> Case:
    """Lumina 2's grouped-query layout (8 query heads on 4 key/value heads; tests/test_lumina_adapter.py)."""
    import torch
    from test_lumina_adapter import CAPTION_DIM, LUMINA2, lumina_model
    patcher = lumina_model(LUMINA2)

    def inputs():
        g = torch.Generator().manual_seed(1)
        return dict(x=torch.randn(2, 16, 64, 64, generator=g), timesteps=torch.tensor([0.6, 0.6]),
                    context=torch.randn(2, 12, CAPTION_DIM, generator=g), num_tokens=12)

    def conds():
        g = torch.Generator().manual_seed(2)
        mask = {"attention_mask": torch.ones(1, 12, dtype=torch.long)}
        return ([[torch.randn(1, 12, CAPTION_DIM, generator=g), dict(mask)]],
                [[torch.randn(1, 12, CAPTION_DIM, generator=g), dict(mask)]])
    return Case(patcher, inputs, "diffusion_model.layers.0.attention.qkv.weight", torch.zeros(1, 16, 64, 64),
                conds, kv_heads=4, heads=8)


def ltx_video() -> Case:
    """LTX-Video with its text padding mask on the cross-attention (2 x 1,024 video tokens;
    tests/test_ltx_adapter.py's tiny model)."""
    import torch
    from test_ltx_adapter import CAPTION, ltx_model, text_mask
    patcher = ltx_model()

    def inputs():
        g = torch.Generator().manual_seed(1)
        return dict(x=torch.randn(2, 16, 4, 16, 16, generator=g), timestep=torch.tensor([0.5, 0.5]),
                    context=torch.randn(2, 12, CAPTION, generator=g), attention_mask=text_mask(torch, 2),
                    frame_rate=25)

    def conds():
        g = torch.Generator().manual_seed(2)
        return ([[torch.randn(1, 12, CAPTION, generator=g), {"attention_mask": text_mask(torch, 1)}]],
                [[torch.randn(1, 12, CAPTION, generator=g), {"attention_mask": text_mask(torch, 1)}]])
    return Case(patcher, inputs, "diffusion_model.transformer_blocks.0.attn1.to_q.weight",
                torch.zeros(1, 16, 4, 16, 16), conds, 4)


def sd3() -> Case:
    """SD3.5 Medium's layout (per-head RMSNorm q/k, an `x_block_self_attn` block, the last context `pre_only`;
    2 x 1,024 image tokens; tests/test_sd3_adapter.py's tiny model)."""
    import torch
    from test_sd3_adapter import CONTEXT, sd3_model
    patcher = sd3_model("sd35_medium", num_blocks=2, x_block_self_attn_layers=[0], pos_embed_max_size=64,
                        num_patches=64 * 64)

    def inputs():
        g = torch.Generator().manual_seed(1)
        return dict(x=torch.randn(2, 16, 64, 64, generator=g), timesteps=torch.tensor([700.0, 700.0]),
                    context=torch.randn(2, 12, CONTEXT, generator=g), y=torch.randn(2, 32, generator=g))

    def conds():
        g = torch.Generator().manual_seed(2)
        return ([[torch.randn(1, 12, CONTEXT, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]],
                [[torch.randn(1, 12, CONTEXT, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]])
    return Case(patcher, inputs, "diffusion_model.joint_blocks.0.x_block.attn.qkv.weight",
                torch.zeros(1, 16, 64, 64), conds, 4)


def cosmos_predict2() -> Case:
    """Cosmos predict2 (text-to-image: one frame; split-half RoPE, per-head norms, text cross-attention, adaLN-LoRA;
    2 x 34 x 34 = 2 x 1,156 tokens; tests/test_cosmos_adapter.py's tiny model)."""
    import torch
    from test_cosmos_adapter import TEXT_DIM, cosmos_model
    patcher = cosmos_model()

    def inputs():
        g = torch.Generator().manual_seed(1)
        return dict(x=torch.randn(2, 16, 1, 68, 68, generator=g), timesteps=torch.tensor([0.5, 0.5]),
                    context=torch.randn(2, 12, TEXT_DIM, generator=g))

    def conds():
        g = torch.Generator().manual_seed(2)
        return ([[torch.randn(1, 12, TEXT_DIM, generator=g), {}]], [[torch.randn(1, 12, TEXT_DIM, generator=g), {}]])
    return Case(patcher, inputs, "diffusion_model.blocks.0.self_attn.q_proj.weight",
                torch.zeros(1, 16, 1, 68, 68), conds, 4)


HIDREAM = {"image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 1,
           "num_single_layers": 1, "attention_head_dim": 32, "num_attention_heads": 4, "caption_channels": [32, 32],
           "text_emb_dim": 32, "num_routed_experts": 2, "num_activated_experts": 1, "axes_dims_rope": [16, 8, 8],
           "max_resolution": [128, 128], "llama_layers": [0, 1]}


def hidream() -> Case:
    """HiDream-I1 (RMSNorms over all heads, [image, text] joint double blocks, single blocks over image + text,
    a routed mixture-of-experts feed-forward run by token chunks; 2 x (1,024 + 28) tokens)."""
    import torch
    patcher = _patcher(_model("HiDream", HIDREAM))

    def text(g, batch):
        return dict(y=torch.randn(batch, 32, generator=g), context=torch.randn(batch, 12, 32, generator=g),
                    encoder_hidden_states_llama3=torch.randn(batch, 2, 8, 32, generator=g))

    def inputs():
        g = torch.Generator().manual_seed(1)
        return dict(x=torch.randn(2, 16, 64, 64, generator=g), t=torch.tensor([0.5, 0.5]), **text(g, 2))

    def conds():
        g = torch.Generator().manual_seed(2)
        out = []
        for _ in range(2):
            extra = text(g, 1)
            out.append([[extra["context"], {"pooled_output": extra["y"],
                                            "conditioning_llama3": extra["encoder_hidden_states_llama3"]}]])
        return tuple(out)
    return Case(patcher, inputs, "diffusion_model.double_stream_blocks.0.block.attn1.to_k.weight",
                torch.zeros(1, 16, 64, 64), conds, 4)


def kandinsky5() -> Case:
    """Kandinsky 5 video (a text block, then visual blocks with per-head RMSNorm q/k, pair RoPE over three axes and
    a text cross-attention; 2 x 4 x 16 x 16 = 2 x 1,024 tokens; tests/test_kandinsky5_adapter.py's tiny model).
    Skipped where ComfyUI has no Kandinsky 5 (before v0.4)."""
    import importlib.util
    import torch
    if importlib.util.find_spec("comfy.ldm.kandinsky5") is None:
        pytest.skip("this ComfyUI has no Kandinsky 5")
    from test_kandinsky5_adapter import POOLED_DIM, TEXT_DIM, kandinsky_inputs, kandinsky_model
    patcher = kandinsky_model()

    def conds():
        g = torch.Generator().manual_seed(2)
        return ([[torch.randn(1, 12, TEXT_DIM, generator=g), {"pooled_output": torch.randn(1, POOLED_DIM, generator=g)}]],
                [[torch.randn(1, 12, TEXT_DIM, generator=g), {"pooled_output": torch.randn(1, POOLED_DIM, generator=g)}]])
    return Case(patcher, lambda: kandinsky_inputs(torch, latent=(2, 33, 4, 32, 32), text_tokens=12),
                "diffusion_model.visual_transformer_blocks.0.self_attention.to_query.weight",
                torch.zeros(1, 16, 4, 32, 32), conds, 4)


def minimax_h3() -> Case:
    """MiniMax H3 (one packed sequence [text | audio | video] of batch 1, a fused qkv_proj, per-head RMSNorm q/k and
    split-half RoPE on part of each head's channels; 4 x 32 x 32 = 4,096 video tokens + 32 audio + 12 text;
    tests/test_minimax_adapter.py's tiny model). Skipped where ComfyUI has no MiniMax H3 (before v0.33)."""
    import torch
    from test_minimax_adapter import TEXT_DIM, has_minimax, minimax_inputs, minimax_model
    if not has_minimax():
        pytest.skip("this ComfyUI has no MiniMax H3")
    import comfy.nested_tensor
    patcher = minimax_model(dict(__import__("test_minimax_adapter").CONFIG, num_layers=1))

    def conds():
        g = torch.Generator().manual_seed(2)
        return ([[torch.randn(1, 12, TEXT_DIM, generator=g), {}]], [[torch.randn(1, 12, TEXT_DIM, generator=g), {}]])
    latent = comfy.nested_tensor.NestedTensor([torch.zeros(1, 24, 4, 64, 64), torch.zeros(1, 32, 2, 16)])
    return Case(patcher, lambda: minimax_inputs(torch, video=(1, 24, 4, 64, 64), audio_frames=16),
                "diffusion_model.blocks.0.attn.qkv_proj.weight", latent, conds, 4)


def cogvideox() -> Case:
    """CogVideoX (one joint [text | video] sequence through the block's own q/k/v, per-head LayerNorms, RoPE on the
    video tokens; 2 x (4 x 32 x 32 = 4,096 + 12) tokens; tests/test_cogvideox_adapter.py's tiny model). Skipped
    where ComfyUI has no CogVideoX (before v0.33)."""
    import torch
    from test_cogvideox_adapter import CONFIG, TEXT_DIM, cogvideox_inputs, cogvideox_model, has_cogvideox
    if not has_cogvideox():
        pytest.skip("this ComfyUI has no CogVideoX")
    patcher = cogvideox_model(dict(CONFIG, num_layers=1))

    def conds():
        g = torch.Generator().manual_seed(2)
        return ([[torch.randn(1, 12, TEXT_DIM, generator=g), {}]], [[torch.randn(1, 12, TEXT_DIM, generator=g), {}]])
    return Case(patcher, lambda: cogvideox_inputs(torch, latent=(2, 16, 4, 64, 64)), "diffusion_model.blocks.0.k.weight",
                torch.zeros(1, 16, 4, 64, 64), conds, 4)


def mochi() -> Case:
    """Mochi ([video, text] joint attention of two widths, fused qkv per stream, per-head RMSNorms and per-head RoPE
    tables on the video; 2 x (4 x 32 x 32 = 4,096 + 12) tokens; tests/test_mochi_adapter.py's tiny model)."""
    import torch
    from test_mochi_adapter import CONFIG, TEXT_DIM, mochi_inputs, mochi_model
    patcher = mochi_model(dict(CONFIG, depth=1))

    def conds():
        g = torch.Generator().manual_seed(2)
        mask = torch.ones(1, 12, dtype=torch.bool)
        return ([[torch.randn(1, 12, TEXT_DIM, generator=g), {"attention_mask": mask}]],
                [[torch.randn(1, 12, TEXT_DIM, generator=g), {"attention_mask": mask}]])
    return Case(patcher, lambda: mochi_inputs(torch, latent=(2, 12, 4, 64, 64)), "diffusion_model.blocks.0.attn.qkv_x.weight",
                torch.zeros(1, 12, 4, 64, 64), conds, 4)


CASES = {"wan": wan, "flux": flux, "hunyuan_video": hunyuan_video, "qwen_image": qwen_image, "lumina2": lumina2,
         "kandinsky5": kandinsky5, "ltx_video": ltx_video, "sd3": sd3, "cosmos_predict2": cosmos_predict2,
         "hidream": hidream, "minimax_h3": minimax_h3, "cogvideox": cogvideox,
         "mochi": mochi}
# each case's adapter module (nodes/families/<name>.py): together they cover every family of the registry
# (nodes/families/__init__.py; tests/test_family_contract.py checks it)
ADAPTER_MODULES = {"wan": "wan", "flux": "flux", "hunyuan_video": "flux", "qwen_image": "qwen_image",
                   "lumina2": "lumina", "kandinsky5": "kandinsky5", "ltx_video": "ltx", "sd3": "sd3",
                   "cosmos_predict2": "cosmos", "hidream": "hidream", "minimax_h3": "minimax",
                   "cogvideox": "cogvideox", "mochi": "mochi"}


def case(name: str) -> Optional[Case]:
    return CASES[name]()
