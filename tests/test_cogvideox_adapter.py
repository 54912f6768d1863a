"""The CogVideoX adapter (`nodes/families/cogvideox.py`) against a real ComfyUI: tiny random-weight models built
from ComfyUI's own config class (CogVideoX 1.0-style RoPE, and 1.5's temporal patches), 4 heads of 32. The patched
model equals ComfyUI's own at every level, with and without block bounds, and the head split runs; a block without
RoPE (the 2B checkpoints' sincos embeddings); a CPU MemTracker peak of one bounded block. Skipped without ComfyUI,
or where ComfyUI has no CogVideoX (before v0.33)."""
from __future__ import annotations

import importlib
import importlib.util

import pytest

from support import adapter_checks
from support import comfy_env
from support.comfy_env import rel_err, stock_fallbacks

pytestmark = pytest.mark.comfyui

TEXT_DIM = 48
# CogVideoX 5B's layout (48 heads of 64, RoPE over three axes), scaled down: 4 heads of 32
CONFIG = {"image_model": "cogvideox", "num_attention_heads": 4, "attention_head_dim": 32, "in_channels": 16,
          "out_channels": 16, "time_embed_dim": 64, "text_embed_dim": TEXT_DIM, "num_layers": 2,
          "use_rotary_positional_embeddings": True, "sample_width": 16, "sample_height": 16, "sample_frames": 9,
          "max_text_seq_length": 12}


def has_cogvideox() -> bool:
    return importlib.util.find_spec("comfy.ldm.cogvideo") is not None


@pytest.fixture(scope="module")
def env():
    env = comfy_env.pack_modules()
    if not has_cogvideox():
        pytest.skip("this ComfyUI has no CogVideoX")
    env.cogvideox = importlib.import_module(env.pack.__name__ + ".nodes.families.cogvideox")
    return env


def cogvideox_model(config: dict = CONFIG):
    """A tiny random-weight CogVideoX (`adapter_checks.tiny_patcher`)."""
    return adapter_checks.tiny_patcher("CogVideoX_T2V", config)


def cogvideox_inputs(torch, latent=(2, 16, 4, 16, 16), text_tokens=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(*latent, generator=g), timestep=torch.tensor([500.0] * latent[0]),
                context=torch.randn(latent[0], text_tokens, TEXT_DIM, generator=g))


@pytest.mark.parametrize("temporal_patches", [None, 2])
def test_equals_stock_at_every_level(env, split_everything, temporal_patches):
    base = cogvideox_model(dict(CONFIG, patch_size_t=temporal_patches))
    model = base.model.diffusion_model
    adapter_checks.check_every_level(env, base, cogvideox_inputs(env.torch), model.blocks[0].num_heads,
                                     lambda block: {"block": len(model.blocks)})


def test_a_block_without_rope(env, split_everything):
    """The 2B checkpoints add sincos embeddings before the blocks and pass no RoPE: the block equals ComfyUI's."""
    torch = env.torch
    block = cogvideox_model().model.diffusion_model.blocks[0]
    g = torch.Generator().manual_seed(3)
    inputs = dict(hidden_states=torch.randn(2, 300, 128, generator=g),
                  encoder_hidden_states=torch.randn(2, 12, 128, generator=g), temb=torch.randn(2, 64, generator=g))
    stock = block(**inputs)
    ours = env.cogvideox.block_forward(block, env.node.QKVConfig(level=3, backend="sdpa", block=True))
    env.core.reset_notices()
    with torch.no_grad():
        out = ours(**inputs)
    assert not stock_fallbacks(env)
    assert rel_err(out, stock) <= 1e-5


# --- peak memory (CPU, MemTracker) ---------------------------------------------------------------------------
WIDTH, HEADS, TOKENS, TEXT = 512, 16, 16384, 226   # twice the runtime's split floor


def test_bounded_block_peak(env):
    """One block of 16,384 video tokens (2x the split floor) x width 512 and 226 text tokens in bf16, with RoPE: stock
    vs bounded (High, block bounds on), within the planner's working set."""
    torch = env.torch
    import comfy.ops
    cogvideo_model = importlib.import_module("comfy.ldm.cogvideo.model")
    head_dim = WIDTH // HEADS
    block = cogvideo_model.CogVideoXBlock(WIDTH, HEADS, head_dim, 64, device=torch.device("cpu"),
                                          dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init)
    comfy_env.fill_random_(block, seed=0)
    block.eval().requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    angles = torch.randn(TOKENS, head_dim // 2, generator=g)
    inp = dict(hidden_states=torch.randn(1, TOKENS, WIDTH, generator=g).to(torch.bfloat16),
               encoder_hidden_states=torch.randn(1, TEXT, WIDTH, generator=g).to(torch.bfloat16),
               temb=torch.randn(1, 64, generator=g).to(torch.bfloat16),
               image_rotary_emb=(angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)))
    adapter_checks.check_block_peak(env, env.cogvideox, block, inp, "hidden_states", HEADS, TOKENS,
                                    f"CogVideoX block {TOKENS} + {TEXT} tokens x {WIDTH}")
