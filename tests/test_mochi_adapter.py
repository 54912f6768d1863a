"""The Mochi adapter (`nodes/families/mochi.py`) against a real ComfyUI: a tiny random-weight Mochi built from
ComfyUI's own config class (4 heads of 32, the text stream half the video's width, the last block not updating
the text, per-head RoPE tables), the patched model equals ComfyUI's own at every level, with and without block
bounds, and the head split runs; a padded prompt (`num_tokens` under the text's length: the text cropped); a CPU
MemTracker peak of one bounded block. Skipped without ComfyUI."""
from __future__ import annotations

import importlib

import pytest

from support import adapter_checks
from support import comfy_env

pytestmark = pytest.mark.comfyui

TEXT_DIM = 48
# Mochi 1's layout (24 heads of 128, text 1536 wide beside the video's 3072), scaled down; ComfyUI's block asserts
# a video feed-forward of 1536 x 8 (its mlp_ratio_x times the width)
CONFIG = {"image_model": "mochi_preview", "depth": 2, "patch_size": 2, "num_heads": 4, "hidden_size_x": 128,
          "hidden_size_y": 64, "mlp_ratio_x": 96.0, "mlp_ratio_y": 4.0, "learn_sigma": False, "in_channels": 12,
          "qk_norm": True, "qkv_bias": False, "out_bias": True, "attn_drop": 0.0, "patch_embed_bias": True,
          "posenc_preserve_area": True, "timestep_mlp_bias": True, "attend_to_padding": False,
          "timestep_scale": 1000.0, "use_t5": True, "t5_feat_dim": TEXT_DIM, "t5_token_length": 12}


@pytest.fixture(scope="module")
def env():
    env = comfy_env.pack_modules()
    env.mochi = importlib.import_module(env.pack.__name__ + ".nodes.families.mochi")
    if env.mochi.mochi_model is None:
        pytest.skip("this ComfyUI has no Mochi")
    return env


def mochi_model(config: dict = CONFIG, small_feed_forward: bool = True):
    """A tiny random-weight Mochi (`adapter_checks.tiny_patcher`). `small_feed_forward`: its video feed-forward 4x
    the width as Mochi 1's (ComfyUI's block asserts Mochi's own 12,288: a FeedForward of ComfyUI's class stands in,
    random too); False: as ComfyUI's config class builds it (a model rebuilt from its state dict must be)."""
    import torch
    import comfy.ops
    layers = importlib.import_module("comfy.ldm.genmo.joint_model.layers")
    patcher = adapter_checks.tiny_patcher("GenmoMochi", config)
    if not small_feed_forward:
        return patcher
    width = config["hidden_size_x"]
    for index, block in enumerate(patcher.model.diffusion_model.blocks):
        block.mlp_x = layers.FeedForward(width, 4 * width, multiple_of=256, ffn_dim_multiplier=None,
                                         device=torch.device("cpu"), dtype=torch.float32,
                                         operations=comfy.ops.disable_weight_init)
        comfy_env.fill_random_(block.mlp_x, seed=index + 1)
    return patcher


def mochi_inputs(torch, latent=(2, 12, 3, 16, 16), text_tokens=12, real_tokens=None, seed=1):
    """The diffusion model's arguments as ComfyUI passes them: the T5 states, their mask and the real tokens."""
    g = torch.Generator().manual_seed(seed)
    real = text_tokens if real_tokens is None else real_tokens
    mask = torch.zeros(latent[0], text_tokens, dtype=torch.bool)
    mask[:, :real] = True
    return dict(x=torch.randn(*latent, generator=g), timestep=torch.tensor([0.6] * latent[0]),
                context=torch.randn(latent[0], text_tokens, TEXT_DIM, generator=g), attention_mask=mask,
                num_tokens=real)


@pytest.mark.parametrize("real_tokens", [None, 5])
def test_equals_stock_at_every_level(env, split_everything, real_tokens):
    base = mochi_model()
    model = base.model.diffusion_model
    assert not model.blocks[-1].update_y   # the last block leaves the text as it is
    blocks = len(model.blocks)
    adapter_checks.check_every_level(env, base, mochi_inputs(env.torch, real_tokens=real_tokens),
                                     model.blocks[0].attn.num_heads,
                                     lambda block: {"attention": blocks, **({"block": blocks} if block else {})})


# --- peak memory (CPU, MemTracker) ---------------------------------------------------------------------------
WIDTH, HEADS, TOKENS, TEXT = 512, 16, 16384, 256   # twice the runtime's split floor


def test_bounded_block_peak(env):
    """One block of 16,384 video tokens (2x the split floor) x width 512 and 256 text tokens in bf16, per-head RoPE,
    Mochi's proportions (its video feed-forward 4x the width: ComfyUI's block asserts Mochi's own 12,288, so a
    FeedForward of 4 x 512 stands in): stock vs bounded (High, block bounds on), within the planner's working set."""
    torch = env.torch
    import comfy.ops
    block = env.mochi.mochi_model.AsymmetricJointBlock(WIDTH, WIDTH // 2, HEADS, mlp_ratio_x=12288 / WIDTH,
                                                       qk_norm=True, qkv_bias=False, device=torch.device("cpu"),
                                                       dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init)
    layers = importlib.import_module("comfy.ldm.genmo.joint_model.layers")
    block.mlp_x = layers.FeedForward(WIDTH, 4 * WIDTH, multiple_of=256, ffn_dim_multiplier=None,
                                     device=torch.device("cpu"), dtype=torch.bfloat16,
                                     operations=comfy.ops.disable_weight_init)
    comfy_env.fill_random_(block, seed=0)
    block.eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    angles = torch.randn(TOKENS, HEADS, WIDTH // HEADS // 2, generator=g)
    inp = dict(x=torch.randn(1, TOKENS, WIDTH, generator=g).to(torch.bfloat16),
               c=torch.randn(1, WIDTH, generator=g).to(torch.bfloat16),
               y=torch.randn(1, TEXT, WIDTH // 2, generator=g).to(torch.bfloat16),
               rope_cos=angles.cos(), rope_sin=angles.sin(), crop_y=TEXT)
    adapter_checks.check_block_peak(env, env.mochi, block, inp, "x", HEADS, TOKENS,
                                    f"Mochi block {TOKENS} + {TEXT} tokens x {WIDTH}")
