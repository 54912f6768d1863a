"""ComfyUI's Flux-layout blocks one at a time, in the variants the models that use them build (Flux 1; Flux 2 and
Chroma: modulation from outside the block, SiLU-gated MLPs, no biases; the "yak" MLP; HunyuanVideo's text mask;
Kontext's per-range modulation), against the blocks' own forward with the head split forced; and their peak
memory on CPU (MemTracker), stock vs bounded. Skipped without ComfyUI."""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env
from support import working_set_check

pytestmark = pytest.mark.comfyui

VARIANTS = ("flux1", "flux2", "yak", "masked", "per_range")


@pytest.fixture(scope="module")
def env():
    return comfy_env.pack_modules()


@pytest.fixture(scope="module")
def flux(env):
    return importlib.import_module(env.pack.__name__ + ".nodes.families.flux")


def _settings(variant):
    """Constructor options of the blocks for `variant`; skips where this ComfyUI has no such option."""
    import inspect
    import comfy.ldm.flux.layers as layers
    double = {"qkv_bias": variant == "flux1"}
    single = {}
    if variant in ("flux2", "yak"):
        double.update(modulation=False, mlp_silu_act=variant == "flux2", proj_bias=False, yak_mlp=variant == "yak")
        single.update(modulation=False, mlp_silu_act=variant == "flux2", bias=False, yak_mlp=variant == "yak")
    for cls, options in ((layers.DoubleStreamBlock, double), (layers.SingleStreamBlock, single)):
        missing = set(options) - set(inspect.signature(cls.__init__).parameters)
        if missing:
            pytest.skip(f"this ComfyUI's {cls.__name__} has no {sorted(missing)}")
    return double, single


def build_blocks(torch, variant, width=128, heads=4, dtype=None):
    import comfy.ldm.flux.layers as layers
    import comfy.ops
    double, single = _settings(variant)
    ops = dict(dtype=dtype or torch.float32, device=torch.device("cpu"), operations=comfy.ops.disable_weight_init)
    blocks = (layers.DoubleStreamBlock(width, heads, mlp_ratio=4.0, **double, **ops),
              layers.SingleStreamBlock(width, heads, mlp_ratio=4.0, **single, **ops))
    for seed, block in enumerate(blocks):
        comfy_env.fill_random_(block, seed=seed)
    return [block.eval() for block in blocks]


def _modulations(torch, layers, batch, width, count, g, dtype):
    def out():
        return layers.ModulationOut(*(0.3 * torch.randn(batch, count, width, generator=g, dtype=torch.float32)
                                      .to(dtype) for _ in range(3)))
    return out


def block_inputs(torch, variant, blocks, img_tokens=160, txt_tokens=24, batch=2, dtype=None, seed=1):
    """(double block kwargs, single block kwargs) for `variant`."""
    import comfy.ldm.flux.layers as layers
    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed)
    width, heads = blocks[0].hidden_size, blocks[0].num_heads
    head_dim = width // heads
    total = img_tokens + txt_tokens
    ids = torch.stack((torch.zeros(total), torch.arange(total) // 16, torch.arange(total) % 16), -1)
    axes = [head_dim - 2 * (head_dim // 3 // 2 * 2), head_dim // 3 // 2 * 2, head_dim // 3 // 2 * 2]
    pe = layers.EmbedND(dim=head_dim, theta=10000, axes_dim=axes)(ids.unsqueeze(0).expand(batch, -1, -1))
    count = 2 if variant == "per_range" else 1

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)
    img, txt = randn(batch, img_tokens, width), randn(batch, txt_tokens, width)
    double = dict(img=img, txt=txt, pe=pe, transformer_options={})
    single = dict(x=torch.cat((txt, img), 1), pe=pe, transformer_options={})
    if variant in ("flux2", "yak"):   # modulation made by the model for all blocks at once
        mod = _modulations(torch, layers, batch, width, count, g, dtype)
        double["vec"] = ((mod(), mod()), (mod(), mod()))
        single["vec"] = mod()
    else:
        vec = randn(batch, count, width) if count > 1 else randn(batch, width)
        double["vec"] = single["vec"] = vec
    if variant == "masked":   # HunyuanVideo: a key mask over the text padding, (1, 1, L)
        mask = torch.zeros(1, 1, total, dtype=dtype)
        mask[..., txt_tokens // 2:txt_tokens] = -10000.0
        double["attn_mask"] = single["attn_mask"] = mask
    if variant == "per_range":   # Kontext: the reference image tokens get the second modulation
        double["modulation_dims_img"] = [(0, img_tokens // 2, 0), (img_tokens // 2, img_tokens, 1)]
        double["modulation_dims_txt"] = [(0, txt_tokens, 0)]
        single["modulation_dims"] = [(0, txt_tokens + img_tokens // 2, 0), (txt_tokens + img_tokens // 2, total, 1)]
    return double, single


def _clone(inputs):
    import torch
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bounds", [True, False], ids=["bounds", "attention-only"])
def test_blocks_equal_stock(env, flux, variant, bounds):
    torch = env.torch
    blocks = build_blocks(torch, variant)
    # per-range modulation: one batch item (ComfyUI v0.8's apply_mod indexes the ranges' vectors per item)
    double_in, single_in = block_inputs(torch, variant, blocks, batch=1 if variant == "per_range" else 2)
    config = env.node.QKVConfig(level=3, backend="sdpa", block=bounds, split_floor_tokens=0)
    env.core.reset_notices()
    with torch.no_grad():
        for block, inputs, make in ((blocks[0], double_in, flux.double_block_forward),
                                    (blocks[1], single_in, flux.single_block_forward)):
            stock = block(**_clone(inputs))
            with comfy_env.SdpaHeads(torch, check_tokens=0) as spy:
                ours = make(block, config)(**_clone(inputs))
            assert 1 in spy.heads                        # High: 4 heads in groups of 1
            stock, ours = (stock, ours) if isinstance(stock, tuple) else ((stock,), (ours,))
            for a, b in zip(ours, stock):
                assert rel_err(a, b) <= 1e-5, (variant, type(block).__name__, rel_err(a, b))
    assert not comfy_env.stock_fallbacks(env)


def test_a_block_another_node_hooks_runs_stock(env, flux):
    torch = env.torch
    blocks = build_blocks(torch, "flux1")
    double_in, _ = block_inputs(torch, "flux1", blocks)
    handle = blocks[0].img_mlp.register_forward_hook(lambda *args: None)
    forward = flux.double_block_forward(blocks[0], env.node.QKVConfig(3, "sdpa", True, 0))
    env.core.reset_notices()
    with torch.no_grad():
        forward(**_clone(double_in))
    handle.remove()
    assert any("another node hooks its img_mlp" in line for line in comfy_env.stock_fallbacks(env))


def test_unknown_layouts_are_not_patched(env, flux):
    torch = env.torch
    double, single = build_blocks(torch, "flux1")
    single.linear2 = torch.nn.Linear(8, 8)
    assert flux.probe_single(single) == "linear2 is not [attention, mlp] -> hidden"
    double.img_attn.qkv = torch.nn.Linear(double.hidden_size, 2 * double.hidden_size)
    assert "img_attn.qkv is not a Linear" in flux.probe_double(double)


# --- peak memory (CPU, MemTracker) ---------------------------------------------------------------------------
WIDTH, HEADS, IMG_TOKENS, TXT_TOKENS = 512, 16, 12288, 256


@pytest.mark.parametrize("variant", ["flux1", "masked"], ids=["flux", "hunyuan_video-text-mask"])
@pytest.mark.parametrize("which", ["double", "single"])
def test_bounded_block_peak(env, flux, which, variant):
    torch = env.torch
    memory = importlib.import_module(env.pack.__name__ + ".benchmarks.memory")
    blocks = build_blocks(torch, variant, width=WIDTH, heads=HEADS, dtype=torch.bfloat16)
    double_in, single_in = block_inputs(torch, variant, blocks, img_tokens=IMG_TOKENS, txt_tokens=TXT_TOKENS,
                                        batch=1, dtype=torch.bfloat16)
    block, inputs = (blocks[0], double_in) if which == "double" else (blocks[1], single_in)
    make = flux.double_block_forward if which == "double" else flux.single_block_forward
    x = inputs["img"] if which == "double" else inputs["x"]
    x_bytes = x.numel() * x.element_size()
    bounded_forward = make(block, env.node.QKVConfig(level=3, backend="sdpa", block=True))
    with torch.no_grad():
        working_set_check.check_first_call(env.pack, bounded_forward, **inputs)   # outside the measurement
        stock = memory.measure_peak(block, **_clone(inputs), live=[block, list(inputs.values())])
        bounded = memory.measure_peak(bounded_forward, **_clone(inputs), live=[block, list(inputs.values())])
    ratio_stock, ratio_bounded = stock.peak_bytes / x_bytes, bounded.peak_bytes / x_bytes
    working_set_check.assert_estimates(env.pack, flux, which, HEADS, IMG_TOKENS + TXT_TOKENS, ratio_stock,
                                       ratio_bounded)
    print(f"\n{variant} {which} block {IMG_TOKENS}+{TXT_TOKENS} tokens x {WIDTH}: stock {ratio_stock:.2f}x|x|, "
          f"bounded {ratio_bounded:.2f}x|x|")
    assert ratio_bounded <= 2.5
    assert bounded.peak_bytes <= 0.4 * stock.peak_bytes
    ours = bounded.result if isinstance(bounded.result, tuple) else (bounded.result,)
    ref = stock.result if isinstance(stock.result, tuple) else (stock.result,)
    for a, b in zip(ours, ref):
        assert rel_err(a, b) < 2e-2
