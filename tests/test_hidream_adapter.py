"""The HiDream-I1 adapter (`nodes/hidream.py`) against a real ComfyUI, on a tiny random-weight HiDream built from
ComfyUI's own config class (the split floor lowered to 0 so that a few hundred tokens split): every attention and
block is patched and the model equals stock at every level, in float32 and bf16; the bounded block's peak (CPU
MemTracker, its mixture of experts by token chunks); the routed self-check's tolerance; what the pack does not
take runs ComfyUI's own with a log line: a RoPE that covers only part of each head (other configurations), a
per-token key multiplier (`image_tokens_masks`), another node's `attn1_patch`, a processor another node put in. (The contract test runs the split at real sizes, a 2-step
sample and a LoRA: tests/test_family_contract.py.) Skipped without ComfyUI."""
from __future__ import annotations

import importlib

import pytest

import comfy_env
import working_set_check
import family_cases
from comfy_env import model_forward as forward, rel_err, stock_fallbacks

pytestmark = pytest.mark.comfyui

LEVELS = ("Off", "Low", "Medium", "High")
HEADS = 4


@pytest.fixture(scope="module")
def env():
    return comfy_env.pack_modules()


@pytest.fixture(scope="module")
def hidream(env):
    return importlib.import_module(env.pack.__name__ + ".nodes.hidream")


def hidream_model(**config):
    import torch
    import comfy.model_patcher
    import comfy.supported_models
    if not hasattr(comfy.supported_models, "HiDream"):
        pytest.skip("this ComfyUI has no HiDream")
    model_config = comfy.supported_models.HiDream({**family_cases.HIDREAM, **config})
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, device=torch.device("cpu"))
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def hidream_inputs(torch, batch=1, side=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(batch, 16, side, side, generator=g), t=torch.tensor([0.5] * batch),
                y=torch.randn(batch, 32, generator=g), context=torch.randn(batch, 12, 32, generator=g),
                encoder_hidden_states_llama3=torch.randn(batch, 2, 8, 32, generator=g))


def patched_counts(report) -> dict:
    return {what: n for (family, what), n in report.patched_counts.items()}


def test_every_attention_equals_stock_at_every_level(env, split_everything):
    torch = env.torch
    base = hidream_model()
    inputs = hidream_inputs(torch, batch=2)
    reference = forward(base, inputs)
    for level in LEVELS:
        for bounds in (False, True):
            patched, report = env.node.apply_patch(base, level, "sdpa", bounds)
            assert patched_counts(report) == ({"attention": 2, "block": 2} if bounds else {"attention": 2})
            assert not report.skipped_reasons, report.lines()
            env.core.reset_notices()
            with comfy_env.SdpaHeads(torch, check_tokens=0) as spy:
                out = forward(base, inputs, applied=patched)
            assert not stock_fallbacks(env), (level, bounds)
            assert rel_err(out, reference) <= 1e-5, (level, bounds, rel_err(out, reference))
            groups = env.core.group_count(HEADS, 10**6, LEVELS.index(level), floor=0)
            assert HEADS // groups in spy.self_heads, (level, spy.self_heads)   # the split really ran
    assert torch.equal(forward(base, inputs), reference)


def test_bf16_is_as_close_to_float32_as_stock(env, split_everything):
    torch = env.torch
    base = hidream_model()
    inputs = hidream_inputs(torch)
    reference = forward(base, inputs)
    base16 = hidream_model()
    base16.model.diffusion_model.to(torch.bfloat16)
    inputs16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    stock16 = forward(base16, inputs16).float()
    patched, _ = env.node.apply_patch(base16, "High", "sdpa", True)
    env.core.reset_notices()
    ours16 = forward(base16, inputs16, applied=patched).float()
    assert not stock_fallbacks(env)
    assert rel_err(ours16, reference) <= 2 * rel_err(stock16, reference) + 1e-2


def test_partial_rope_runs_stock(env, split_everything):
    """A configuration whose RoPE covers half of each head (ComfyUI rotates the first channels only): every
    attention runs ComfyUI's own, with the reason in the log, and the output is stock's."""
    torch = env.torch
    base = hidream_model(axes_dims_rope=[8, 4, 4])   # 16 of the head's 32 channels
    inputs = hidream_inputs(torch)
    reference = forward(base, inputs)
    patched, report = env.node.apply_patch(base, "High", "sdpa", False)
    assert patched_counts(report) == {"attention": 2}
    env.core.reset_notices()
    out = forward(base, inputs, applied=patched)
    fallbacks = stock_fallbacks(env)
    assert fallbacks and all("partial RoPE" in line for line in fallbacks), fallbacks
    assert torch.equal(out, reference)


def test_key_multiplier_and_hooks_run_stock(env, hidream, split_everything):
    """`image_tokens_masks` (a per-token key multiplier ComfyUI's model never passes) and another node's
    `attn1_patch` make the attention run ComfyUI's own: the same numbers, a log line each."""
    torch = env.torch
    base = hidream_model()
    attn = base.model.diffusion_model.double_stream_blocks[0].block.attn1
    ours = hidream.attention_forward(attn, env.node.QKVConfig(3, "sdpa", False))
    g = torch.Generator().manual_seed(5)
    img, txt = torch.randn(1, 64, 128, generator=g), torch.randn(1, 28, 128, generator=g)
    rope = base.model.diffusion_model.pe_embedder(torch.zeros(1, 92, 3))
    mask = (torch.rand(1, 64, generator=g) > 0.3).float()
    with torch.no_grad():
        stock = attn(img, mask, txt, rope=rope)
        env.core.reset_notices()
        out = ours(img, mask, txt, rope=rope)
    assert any("image_tokens_masks" in line for line in stock_fallbacks(env))
    assert all(torch.equal(a, b) for a, b in zip(out, stock))

    def hook(q, k, v, pe=None, attn_mask=None, extra_options=None):
        return {"q": q * 1.5}
    options = {"patches": {"attn1_patch": [hook]}}
    with torch.no_grad():
        env.core.reset_notices()
        ours(img, None, txt, rope=rope, transformer_options=options)
    assert any("attn1_patch" in line for line in stock_fallbacks(env))


def test_a_foreign_processor_is_not_patched(env):
    """Another node's attention processor: that module keeps its forward (one report line)."""
    base = hidream_model()
    attn = base.model.diffusion_model.single_stream_blocks[0].block.attn1

    class Other:
        def __call__(self, attn, *args, **kwargs):
            return kwargs["image_tokens"]
    attn.processor = Other()
    patched, report = env.node.apply_patch(base, "High", "sdpa", False)
    assert patched_counts(report) == {"attention": 1}
    assert any("single_stream_blocks.0.block.attn1 runs as before: its processor is Other" in line
               for line in report.lines())


def test_bounded_block_peak():
    """A HiDream double block (bf16, CPU MemTracker, 12,288 image + 256 text tokens, 16 heads): the bounded block's
    peak, its mixture of experts by token chunks, against stock's; outputs equal stock's but for tokens routed to
    other experts by round-off."""
    comfy_env.require_comfyui()
    import torch
    import comfy.ldm.hidream.model as hidream_model
    import comfy.ops
    pack = comfy_env.load_pack()
    node = importlib.import_module(pack.__name__ + ".nodes.patching")
    hidream = importlib.import_module(pack.__name__ + ".nodes.hidream")
    compat = importlib.import_module(pack.__name__ + ".nodes.compat")
    from test_qwen_image_memory import measurement_module
    memory = measurement_module(pack)
    width, heads, side, text = 512, 16, 96, 256
    block = hidream_model.HiDreamImageTransformerBlock(width, heads, width // heads, 4, 2, dtype=torch.bfloat16,
                                                       device=torch.device("cpu"),
                                                       operations=comfy.ops.disable_weight_init)
    comfy_env.fill_random_(block, seed=0)
    block.eval()
    g = torch.Generator().manual_seed(1)
    tokens = side * 128
    ids = torch.zeros(1, tokens + text, 3)
    ids[0, :tokens, 1] = (torch.arange(tokens) // 128).float()
    ids[0, :tokens, 2] = (torch.arange(tokens) % 128).float()
    inp = dict(image_tokens=torch.randn(1, tokens, width, generator=g).to(torch.bfloat16), image_tokens_masks=None,
               text_tokens=torch.randn(1, text, width, generator=g).to(torch.bfloat16),
               adaln_input=torch.randn(1, width, generator=g).to(torch.bfloat16),
               rope=hidream_model.EmbedND(theta=10000, axes_dim=[16, 8, 8])(ids))
    x_bytes = inp["image_tokens"].numel() * inp["image_tokens"].element_size()
    live = [block, list(inp.values())]
    bounded_forward = hidream.block_forward(block, node.QKVConfig(level=3, backend="sdpa", block=True))
    pack.qkv_core.reset_notices()
    with torch.no_grad():
        bounded_forward(**inp)   # the self-check, once per process, outside the measurement
        assert not [line for line in pack.qkv_core.drain_notices() if "runs as ComfyUI's own" in line]
        stock = memory.measure_peak(block, **inp, live=live)
        bounded = memory.measure_peak(bounded_forward, **inp, live=live)
    ratio_stock, ratio_bounded = stock.peak_bytes / x_bytes, bounded.peak_bytes / x_bytes
    working_set_check.assert_estimates(pack, hidream, "block", heads, tokens + text, ratio_stock, ratio_bounded)
    print(f"\nHiDream double block bf16 {tokens} + {text} tokens x {width}, {heads} heads: stock {ratio_stock:.2f}x|x|, "
          f"bounded {ratio_bounded:.2f}x|x| ({bounded.peak_bytes / stock.peak_bytes:.2f} of stock)")
    assert ratio_bounded <= 3.5   # its mixture of experts by chunks of MOE_CHUNK_BUDGET = 3 x |x|
    assert bounded.peak_bytes <= 0.25 * stock.peak_bytes
    base = (inp["image_tokens"], inp["text_tokens"])
    assert compat.compare(stock.result, bounded.result, base, routed=True) is None


def test_routed_check_leaves_out_a_few_rerouted_tokens(env):
    """`compat.compare(routed=True)`: a token or two of 256 with another expert's output pass, 5% of them do not."""
    torch = env.torch
    compat = importlib.import_module(env.pack.__name__ + ".nodes.compat")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 256, 64, generator=g)
    stock = base + torch.randn(1, 256, 64, generator=g)
    ours = stock + 1e-6 * torch.randn(1, 256, 64, generator=g)
    rerouted = ours.clone()
    rerouted[0, 7] += torch.randn(64, generator=g)    # one token took another expert
    assert compat.compare(stock, rerouted, base) is not None
    assert compat.compare(stock, rerouted, base, routed=True) is None
    many = ours.clone()
    many[0, :13] += torch.randn(13, 64, generator=g)  # 5%: not round-off
    assert compat.compare(stock, many, base, routed=True) is not None
