"""Peak memory of a real ComfyUI Lumina `JointTransformerBlock`, stock vs bounded (High, block bounds on),
computed in bf16 on CPU: Lumina 2's layout (grouped-query attention, FFN 4x) and Z-Image's (as many key/value
heads as heads, FFN 8/3x, its 256-wide modulation input).

|x| is one bf16 activation (tokens x width); peaks are the working set above the live inputs and weights, the
block's output included, measured with MemTracker through `benchmarks.memory`. Skipped without ComfyUI.
"""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env
from support import working_set_check

pytestmark = pytest.mark.comfyui

# 16 heads (Lumina 2: 24, Z-Image: 30): at High the split holds a group's q/k/v to 1/8-1/16 of |x|.
WIDTH, HEADS, TOKENS = 512, 16, 12288
LAYOUTS = {"lumina2": dict(kv_heads=8, ffn_dim_multiplier=4.0, z_image_modulation=False),
           "zimage": dict(kv_heads=16, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True)}


def build_block(torch, lumina_model, kv_heads, ffn_dim_multiplier, z_image_modulation):
    import inspect
    import comfy.ops
    settings = {"operations": comfy.ops.disable_weight_init, "device": torch.device("cpu"), "dtype": torch.bfloat16}
    extra = {"z_image_modulation": True} if z_image_modulation else {}
    if extra and "z_image_modulation" not in inspect.signature(lumina_model.JointTransformerBlock).parameters:
        pytest.skip("this ComfyUI's Lumina block has no Z-Image modulation")
    block = lumina_model.JointTransformerBlock(0, WIDTH, HEADS, kv_heads, 256, ffn_dim_multiplier, 1e-5, True,
                                               modulation=True, operation_settings=settings, **extra)
    comfy_env.fill_random_(block, seed=0)
    return block.eval()


def block_inputs(torch, lumina_model, z_image_modulation):
    from comfy.ldm.flux.layers import EmbedND
    g = torch.Generator().manual_seed(1)
    h, w = 96, 128                                                   # 12,288 image tokens
    ids = torch.zeros(1, h * w, 3)
    ids[0, :, 1] = torch.arange(h).repeat_interleave(w).float()
    ids[0, :, 2] = torch.arange(w).repeat(h).float()
    head_dim = WIDTH // HEADS
    freqs = EmbedND(dim=head_dim, theta=10000.0, axes_dim=[8, 12, 12])(ids).movedim(1, 2)
    if hasattr(lumina_model.JointAttention, "apply_rotary_emb"):   # older ComfyUI (v0.3.64): RoPE in the model dtype
        freqs = freqs.to(torch.bfloat16)
    return dict(x=torch.randn(1, TOKENS, WIDTH, generator=g).to(torch.bfloat16), x_mask=None, freqs_cis=freqs,
                adaln_input=torch.randn(1, 256 if z_image_modulation else WIDTH, generator=g).to(torch.bfloat16))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bounded_block_peak(layout):
    comfy_env.require_comfyui()
    import torch
    import comfy.ldm.lumina.model as lumina_model
    pack = comfy_env.load_pack()
    lumina = importlib.import_module(pack.__name__ + ".nodes.families.lumina")
    node = importlib.import_module(pack.__name__ + ".nodes.patching")
    try:
        memory = importlib.import_module(pack.__name__ + ".benchmarks.memory")
    except ImportError:   # before the benchmarks moved out of the runtime
        memory = importlib.import_module(pack.__name__ + ".qkv_core.memory")
    settings = LAYOUTS[layout]
    block = build_block(torch, lumina_model, **settings)
    inp = block_inputs(torch, lumina_model, settings["z_image_modulation"])
    x_bytes = inp["x"].numel() * inp["x"].element_size()
    live = [block, list(inp.values())]
    bounded_forward = lumina.block_forward(block, node.QKVConfig(level=3, backend="sdpa", block=True))
    with torch.no_grad():
        working_set_check.check_first_call(pack, bounded_forward, **inp)   # outside the measurement
        stock = memory.measure_peak(block, **inp, live=live)
        bounded = memory.measure_peak(bounded_forward, **inp, live=live)
    ratio_stock, ratio_bounded = stock.peak_bytes / x_bytes, bounded.peak_bytes / x_bytes
    working_set_check.assert_estimates(pack, lumina, layout, settings["kv_heads"], TOKENS, ratio_stock,
                                       ratio_bounded)
    print(f"\nLumina block ({layout}) {TOKENS} tokens x {WIDTH}: stock {ratio_stock:.2f}x|x|, bounded "
          f"{ratio_bounded:.2f}x|x| ({bounded.peak_bytes / stock.peak_bytes:.2f} of stock)")
    assert ratio_bounded <= 2.5
    assert bounded.peak_bytes <= 0.4 * stock.peak_bytes
    err = float((bounded.result.float() - stock.result.float()).abs().max() / stock.result.float().abs().max())
    assert err < 2e-2   # bf16 round-off of the same math in another order
