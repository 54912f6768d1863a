"""Peak memory of a real ComfyUI Wan block, stock vs bounded (High, block switch on), bf16 on CPU.

|x| is one bf16 activation (tokens x width); peaks are the working set above the live inputs and weights,
measured with MemTracker through `qkv_core.memory`. Skipped without ComfyUI.
"""
from __future__ import annotations

import importlib

import pytest

import comfy_env

pytestmark = pytest.mark.comfyui

# 16 heads: Wan models have 12 to 40 (14B: 40, split in 20 groups at High). The split bounds a group's
# q/k/v to 1/groups of |x|, so a model of 4 heads (4 groups at most) could not show the bound.
WIDTH, HEADS, FFN, TOKENS, TEXT = 512, 16, 1384, 12288, 512   # Wan 14B's FFN ratio (13824 / 5120)


def build_block(torch):
    import comfy.ldm.wan.model as wan_model
    import comfy.ops
    settings = {"operations": comfy.ops.disable_weight_init, "device": torch.device("cpu"), "dtype": torch.bfloat16}
    block = wan_model.WanAttentionBlock("t2v_cross_attn", WIDTH, FFN, HEADS, qk_norm=True, cross_attn_norm=True,
                                        eps=1e-6, operation_settings=settings)
    comfy_env.fill_random_(block, seed=0)
    return block.eval()


def block_inputs(torch):
    from comfy.ldm.flux.layers import EmbedND
    g = torch.Generator().manual_seed(1)
    frames, h, w = 3, 64, 64                                        # 12,288 tokens
    ids = torch.stack(torch.meshgrid(torch.arange(frames), torch.arange(h), torch.arange(w), indexing="ij"),
                      dim=-1).reshape(1, -1, 3).float()
    head_dim = WIDTH // HEADS
    freqs = EmbedND(dim=head_dim, theta=10000.0, axes_dim=[head_dim - 4 * (head_dim // 6),
                                                            2 * (head_dim // 6), 2 * (head_dim // 6)])(ids)
    return dict(x=torch.randn(1, TOKENS, WIDTH, generator=g).to(torch.bfloat16),
                e=(torch.randn(1, 6, WIDTH, generator=g) * 0.1).to(torch.bfloat16),
                freqs=freqs.movedim(1, 2),
                context=torch.randn(1, TEXT, WIDTH, generator=g).to(torch.bfloat16))


def test_bounded_block_peak(request):
    comfy_env.require_comfyui()
    import torch
    pack = comfy_env.load_pack()
    wan = importlib.import_module(pack.__name__ + ".nodes.wan")
    node = importlib.import_module(pack.__name__ + ".nodes.patching")
    memory = importlib.import_module(pack.__name__ + ".qkv_core.memory")
    block, inp = build_block(torch), block_inputs(torch)
    x_bytes = inp["x"].numel() * inp["x"].element_size()
    live = [block, list(inp.values())]
    config = node.QKVConfig(level=3, backend="sdpa", block=True)
    with torch.no_grad():
        stock = memory.measure_peak(block, **inp, live=live)
        bounded = memory.measure_peak(wan.bounded_block_forward(block, config), **inp, live=live)
    ratio_stock, ratio_bounded = stock.peak_bytes / x_bytes, bounded.peak_bytes / x_bytes
    print(f"\nWan block {TOKENS} tokens x {WIDTH}: stock {ratio_stock:.2f}x|x|, bounded {ratio_bounded:.2f}x|x| "
          f"({bounded.peak_bytes / stock.peak_bytes:.2f} of stock)")
    assert ratio_bounded <= 2.5
    assert bounded.peak_bytes <= 0.4 * stock.peak_bytes
    err = (bounded.result.float() - stock.result.float()).abs().max() / stock.result.float().abs().max()
    assert err < 2e-2   # bf16 round-off: the same math in a different order of chunks
