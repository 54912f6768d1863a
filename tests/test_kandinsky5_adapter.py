"""The Kandinsky 5 adapter (`nodes/families/kandinsky5.py`) against a real ComfyUI: tiny random-weight models built from
ComfyUI's own config classes (Kandinsky 5 video and image): the patched diffusion model's output equals
ComfyUI's own at every head-split level, with and without block bounds, and the head split really runs (the
split floor is lowered to 0 so that a few hundred tokens split); a CPU MemTracker peak of one bounded visual
block. Skipped without ComfyUI, or where ComfyUI has no Kandinsky 5 (before v0.4)."""
from __future__ import annotations

import importlib
import importlib.util

import pytest

from support import adapter_checks
from support import comfy_env
from support import working_set_check
from support.comfy_env import model_forward as forward, rel_err, stock_fallbacks

pytestmark = pytest.mark.comfyui

TEXT_DIM, POOLED_DIM = 48, 24
# Kandinsky 5 Lite's layout (head_dim 128, 3 RoPE axes), scaled down: 4 heads of 32
VIDEO = {"image_model": "kandinsky5", "in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": TEXT_DIM,
         "in_text_dim2": POOLED_DIM, "time_dim": 64, "model_dim": 128, "ff_dim": 256, "visual_embed_dim": 132,
         "patch_size": (1, 2, 2), "num_text_blocks": 1, "num_visual_blocks": 2, "axes_dims": (8, 12, 12)}


@pytest.fixture(scope="module")
def env():
    env = comfy_env.pack_modules()
    if importlib.util.find_spec("comfy.ldm.kandinsky5") is None:
        pytest.skip("this ComfyUI has no Kandinsky 5")
    env.kandinsky5 = importlib.import_module(env.pack.__name__ + ".nodes.families.kandinsky5")
    return env


def kandinsky_model(config: dict = VIDEO, config_class: str = "Kandinsky5"):
    """A tiny random-weight model from ComfyUI's own config class, float32 on the CPU, as a ModelPatcher."""
    import torch
    import comfy.model_patcher
    import comfy.supported_models
    model_config = getattr(comfy.supported_models, config_class)(dict(config))
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, device=torch.device("cpu"))
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def kandinsky_inputs(torch, latent=(1, 33, 3, 16, 12), text_tokens=10, seed=1):
    """Keyword arguments of the diffusion model: a video latent with its concat channels (16 + 16 + mask)."""
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(*latent, generator=g), timestep=torch.tensor([0.6] * latent[0]),
                context=torch.randn(latent[0], text_tokens, TEXT_DIM, generator=g),
                y=torch.randn(latent[0], POOLED_DIM, generator=g))


def test_video_equals_stock_at_every_level(env, split_everything):
    base = kandinsky_model()
    model = base.model.diffusion_model
    attentions = len(model.text_transformer_blocks) + len(model.visual_transformer_blocks)
    heads, blocks = model.visual_transformer_blocks[0].self_attention.num_heads, len(model.visual_transformer_blocks)
    adapter_checks.check_every_level(
        env, base, kandinsky_inputs(env.torch), heads,
        lambda block: {"self-attention": attentions, **({"block": blocks} if block else {})})


def test_image_model_batch_of_two(env, split_everything):
    """Kandinsky 5 image (4-D latents, no concat channels), two batch items (bf16: the contract test's video
    model)."""
    torch = env.torch
    base = kandinsky_model(dict(VIDEO, visual_embed_dim=64), "Kandinsky5Image")
    g = torch.Generator().manual_seed(4)
    inputs = dict(x=torch.randn(2, 16, 24, 20, generator=g), timestep=torch.tensor([0.3, 0.7]),
                  context=torch.randn(2, 7, TEXT_DIM, generator=g), y=torch.randn(2, POOLED_DIM, generator=g))
    reference = forward(base, inputs)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    env.core.reset_notices()
    assert rel_err(forward(base, inputs, applied=patched), reference) <= 1e-5
    assert not stock_fallbacks(env)


def test_unsupported_layouts_and_foreign_hooks_run_stock(env, split_everything):
    """A self-attention whose forward takes another argument is not patched (its block neither), one reason in
    the report; a block whose feed-forward another node hooks runs ComfyUI's forward (calling the hook)."""
    torch = env.torch
    base = kandinsky_model()
    model = base.model.diffusion_model
    first = model.visual_transformer_blocks[0].self_attention

    class TakesMore(type(first)):
        def forward(self, x, freqs, transformer_options={}, something_new=None):
            return super().forward(x, freqs, transformer_options=transformer_options)
    first.__class__ = TakesMore
    calls = []
    handle = model.visual_transformer_blocks[1].feed_forward.register_forward_hook(
        lambda module, args, out: calls.append(out.shape) or out * 1.5)
    try:
        inputs = kandinsky_inputs(torch)
        reference = forward(base, inputs)
        count = len(calls)
        patched, report = env.node.apply_patch(base, "High", "sdpa", True)
        env.core.reset_notices()
        out = forward(base, inputs, applied=patched)
        fallbacks = stock_fallbacks(env)
    finally:
        handle.remove()
    reasons = {reason: paths for (family, reason), paths in report.skipped_reasons.items()}
    takes = "its forward takes (x, freqs, transformer_options, something_new), the pack's (x, freqs, " \
            "transformer_options)"
    assert reasons == {takes: ["diffusion_model.visual_transformer_blocks.0.self_attention"],
                       f"self_attention: {takes}": ["diffusion_model.visual_transformer_blocks.0 (block)"]}
    assert fallbacks == ["[QKV] Kandinsky5 block runs as ComfyUI's own: another node hooks its feed_forward"]
    assert len(calls) == 2 * count
    assert rel_err(out, reference) <= 1e-5


# --- peak memory (CPU, MemTracker) ---------------------------------------------------------------------------
WIDTH, HEADS, TOKENS, TEXT = 512, 16, 12288, 256


def test_bounded_block_peak(env):
    """One visual block (Kandinsky 5 Lite's FFN ratio, 4x), bf16: stock vs bounded (High, block bounds on)."""
    torch = env.torch
    import comfy.ops
    from comfy.ldm.flux.layers import EmbedND
    kandinsky_model_module = importlib.import_module("comfy.ldm.kandinsky5.model")
    memory = importlib.import_module(env.pack.__name__ + ".benchmarks.memory")
    settings = {"operations": comfy.ops.disable_weight_init, "device": torch.device("cpu"), "dtype": torch.bfloat16}
    head_dim = WIDTH // HEADS
    block = kandinsky_model_module.TransformerDecoderBlock(WIDTH, 128, 4 * WIDTH, head_dim,
                                                           operation_settings=settings)
    comfy_env.fill_random_(block, seed=0)
    block.eval()
    g = torch.Generator().manual_seed(1)
    t, h, w = 3, 64, 64                                                 # 12,288 tokens
    ids = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"),
                      dim=-1).reshape(1, -1, 3).float()
    freqs = EmbedND(dim=head_dim, theta=10000.0, axes_dim=[8, 12, 12])(ids).movedim(1, 2)
    inp = dict(visual_embed=torch.randn(1, TOKENS, WIDTH, generator=g).to(torch.bfloat16),
               text_embed=torch.randn(1, TEXT, WIDTH, generator=g).to(torch.bfloat16),
               time_embed=torch.randn(1, 128, generator=g).to(torch.bfloat16), freqs=freqs)
    x_bytes = inp["visual_embed"].numel() * inp["visual_embed"].element_size()
    live = [block, list(inp.values())]
    bounded_forward = env.kandinsky5.block_forward(block, env.node.QKVConfig(level=3, backend="sdpa", block=True))
    with torch.no_grad():
        env.core.reset_notices()
        working_set_check.check_first_call(env.pack, bounded_forward, **inp)   # outside the measurement
        assert not stock_fallbacks(env)
        stock = memory.measure_peak(block, **inp, live=live)
        bounded = memory.measure_peak(bounded_forward, **inp, live=live)
    ratio_stock, ratio_bounded = stock.peak_bytes / x_bytes, bounded.peak_bytes / x_bytes
    working_set_check.assert_estimates(env.pack, env.kandinsky5, "block", HEADS, TOKENS, ratio_stock,
                                       ratio_bounded)
    print(f"\nKandinsky 5 block {TOKENS} tokens x {WIDTH}: stock {ratio_stock:.2f}x|x|, bounded "
          f"{ratio_bounded:.2f}x|x| ({bounded.peak_bytes / stock.peak_bytes:.2f} of stock)")
    assert ratio_bounded <= 2.5
    assert bounded.peak_bytes <= 0.4 * stock.peak_bytes
    assert rel_err(bounded.result.float(), stock.result.float()) < 2e-2   # bf16 round-off
