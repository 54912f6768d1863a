"""Peak memory of a real ComfyUI Qwen-Image block (`QwenImageTransformerBlock`), stock vs bounded (High, block
bounds on), computed in bf16 on CPU.

|x| is the block's image input in bf16 (image tokens x width); peaks are the working set above the live inputs
and weights (the block's outputs included), measured with MemTracker through `benchmarks.memory`. Skipped
without ComfyUI."""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env
from support import working_set_check

pytestmark = pytest.mark.comfyui

# 16 heads (Qwen-Image has 24): the split bounds a group's q/k/v to 1/groups of |x|, which a model of a few
# heads could not show. 12,288 image tokens (a 1024 x 768 image: 64 x 48 latent pixels of 2 x 2 patches
# would be 3,072; this is the sequence of a ~1.8 MP image) and a prompt of 256 tokens.
WIDTH, HEADS, HEIGHT_TOKENS, WIDTH_TOKENS, TEXT = 512, 16, 96, 128, 256
TOKENS = HEIGHT_TOKENS * WIDTH_TOKENS


def build_block(torch):
    import comfy.ldm.qwen_image.model as qwen_model
    import comfy.ops
    block = qwen_model.QwenImageTransformerBlock(WIDTH, HEADS, WIDTH // HEADS, dtype=torch.bfloat16,
                                                 device=torch.device("cpu"),
                                                 operations=comfy.ops.disable_weight_init)
    comfy_env.fill_random_(block, seed=0)
    return block.eval()


def block_inputs(torch):
    """The block's arguments as the model makes them: text ids on the diagonal after the image's, image ids
    on the grid, the RoPE frequencies in the model's dtype."""
    from comfy.ldm.flux.layers import EmbedND
    g = torch.Generator().manual_seed(1)
    rows, cols = torch.meshgrid(torch.arange(HEIGHT_TOKENS), torch.arange(WIDTH_TOKENS), indexing="ij")
    img_ids = torch.stack((torch.zeros_like(rows), rows - HEIGHT_TOKENS // 2, cols - WIDTH_TOKENS // 2), -1)
    txt_ids = (WIDTH_TOKENS // 2 + torch.arange(TEXT)).view(-1, 1).expand(-1, 3)
    ids = torch.cat((txt_ids, img_ids.reshape(-1, 3))).unsqueeze(0).float()
    head_dim = WIDTH // HEADS
    freqs = EmbedND(dim=head_dim, theta=10000, axes_dim=[8, 12, 12])(ids).to(torch.bfloat16).contiguous()
    import comfy.ldm.qwen_image.model as qwen_model
    if not hasattr(qwen_model, "apply_rope1"):   # older ComfyUI (v0.3.x): tokens-first, as its model passes them
        freqs = freqs.squeeze(1).unsqueeze(2)
    return dict(hidden_states=torch.randn(1, TOKENS, WIDTH, generator=g).to(torch.bfloat16),
                encoder_hidden_states=torch.randn(1, TEXT, WIDTH, generator=g).to(torch.bfloat16),
                encoder_hidden_states_mask=None,
                temb=torch.randn(1, WIDTH, generator=g).to(torch.bfloat16),
                image_rotary_emb=freqs)


def test_bounded_block_peak():
    comfy_env.require_comfyui()
    import torch
    pack = comfy_env.load_pack()
    qwen = importlib.import_module(pack.__name__ + ".nodes.families.qwen_image")
    node = importlib.import_module(pack.__name__ + ".nodes.patching")
    block, inp = build_block(torch), block_inputs(torch)
    bounded_forward = qwen.block_forward(block, node.QKVConfig(level=3, backend="sdpa", block=True))
    stock, bounded, ratio_stock, ratio_bounded = working_set_check.measure_block_peaks(pack, block, bounded_forward,
                                                                                       inp, "hidden_states")
    working_set_check.assert_estimates(pack, qwen, "block", HEADS, TOKENS + TEXT, ratio_stock,
                                       ratio_bounded)
    print(f"\nQwen-Image block bf16 {TOKENS} + {TEXT} tokens x {WIDTH}, {HEADS} heads: stock {ratio_stock:.2f}x|x|, "
          f"bounded {ratio_bounded:.2f}x|x| ({bounded.peak_bytes / stock.peak_bytes:.2f} of stock)")
    assert ratio_bounded <= 2.5
    assert bounded.peak_bytes <= 0.4 * stock.peak_bytes
    for ours, theirs in zip(bounded.result, stock.result):   # (text, image), bf16 round-off
        err = float((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max())
        assert err < 2e-2
