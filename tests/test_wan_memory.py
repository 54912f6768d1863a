"""Peak memory of a real ComfyUI Wan block, stock vs bounded (High, block switch on), computed in bf16 on CPU,
for each weight format people load: bf16, fp8 stored and cast per call, fp8-scaled (mixed-precision
`QuantizedTensor` layers) and GGUF Q8_0 (city96/ComfyUI-GGUF).

|x| is one bf16 activation (tokens x width); peaks are the working set above the live inputs and weights,
measured with MemTracker through `benchmarks.memory`. Skipped without ComfyUI.
"""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env
from support import working_set_check

pytestmark = pytest.mark.comfyui

# 16 heads: Wan models have 12 to 40 (14B: 40, split in 20 groups at High). The split bounds a group's
# q/k/v to 1/groups of |x|, so a model of 4 heads (4 groups at most) could not show the bound.
# FFN: about Wan 14B's ratio (13824 / 5120), a multiple of GGUF's block size (32).
WIDTH, HEADS, FFN, TOKENS, TEXT = 512, 16, 1376, 12288, 512


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


def format_block(torch, fmt):
    """Block 0 of a one-block Wan in `fmt`, loaded as ComfyUI loads that format, computing in bf16."""
    if fmt == "bf16":
        return build_block(torch)
    if fmt == "fp8_e4m3fn":   # the diffusion model loader's weight_dtype fp8_e4m3fn: manual cast per call
        cls, cfg = comfy_env._wan_config("t2v", WIDTH, HEADS, 1, FFN, WIDTH, 1, {})
        model_config = cls(cfg)
        model_config.set_inference_dtype(torch.float8_e4m3fn, torch.bfloat16)
        model = model_config.get_model({}, device=torch.device("cpu"))
        comfy_env.fill_random_(model.diffusion_model, seed=0)
        return model.diffusion_model.blocks[0].eval()
    if fmt == "fp8_scaled":
        import comfy.ops
        if not hasattr(comfy.ops, "CastBiasWeightContext"):
            pytest.skip("this ComfyUI has no mixed-precision layers with rows (no CastBiasWeightContext)")
        patcher = comfy_env.make_fp8_scaled_wan("t2v", dim=WIDTH, heads=HEADS, layers=1, ffn_dim=FFN,
                                                text_dim=WIDTH, dtype=torch.bfloat16, input_scale=False)
        return patcher.model.diffusion_model.blocks[0].eval()
    from support import gguf_env
    gguf_env.require_gguf()
    patcher = gguf_env.make_gguf_wan("Q8_0", "t2v", dim=WIDTH, heads=HEADS, layers=1, ffn_dim=FFN,
                                     text_dim=WIDTH, dtype=torch.bfloat16)
    return patcher.model.diffusion_model.blocks[0].eval()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3fn", "fp8_scaled", "gguf_q8_0"])
def test_bounded_block_peak(fmt):
    comfy_env.require_comfyui()
    import contextlib
    import torch
    pack = comfy_env.load_pack()
    wan = importlib.import_module(pack.__name__ + ".nodes.families.wan")
    node = importlib.import_module(pack.__name__ + ".nodes.patching")
    memory = importlib.import_module(pack.__name__ + ".benchmarks.memory")
    block, inp = format_block(torch, fmt), block_inputs(torch)
    x_bytes = inp["x"].numel() * inp["x"].element_size()
    live = [block, list(inp.values())]
    config = node.QKVConfig(level=3, backend="sdpa", block=True)
    bounded_forward = wan.bounded_block_forward(block, config)
    tracker_safe = contextlib.nullcontext()
    if fmt.startswith("gguf"):
        from support import gguf_env
        tracker_safe = gguf_env.under_memory_tracker()
    with torch.no_grad():
        working_set_check.check_first_call(pack, bounded_forward, **inp)   # outside the measurement
        with tracker_safe:
            stock = memory.measure_peak(block, **inp, live=live)
            bounded = memory.measure_peak(bounded_forward, **inp, live=live)
    ratio_stock, ratio_bounded = stock.peak_bytes / x_bytes, bounded.peak_bytes / x_bytes
    working_set_check.assert_estimates(pack, wan, "block", HEADS, TOKENS, ratio_stock,
                                       ratio_bounded)
    print(f"\nWan block {fmt} {TOKENS} tokens x {WIDTH}: stock {ratio_stock:.2f}x|x|, bounded "
          f"{ratio_bounded:.2f}x|x| ({bounded.peak_bytes / stock.peak_bytes:.2f} of stock)")
    assert ratio_bounded <= 2.5
    assert bounded.peak_bytes <= 0.4 * stock.peak_bytes
    err = float((bounded.result.float() - stock.result.float()).abs().max() / stock.result.float().abs().max())
    # bf16 round-off: the same math in a different order of chunks (fp8-scaled: the FFN's input quantized
    # by token chunk, each with its own scale, where the layer quantizes the whole input with one)
    assert err < (3e-2 if fmt == "fp8_scaled" else 2e-2)
