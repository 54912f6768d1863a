"""The HiDream-I1 adapter (`nodes/hidream.py`) against a real ComfyUI, on a tiny random-weight HiDream built from
ComfyUI's own config class (the split floor lowered to 0 so that a few hundred tokens split): every attention is
patched and the model equals stock at every level, in float32 and bf16; the blocks keep ComfyUI's forward (one
report line); what the pack does not take runs ComfyUI's own with a log line: a RoPE that covers only part of
each head (other configurations), a per-token key multiplier (`image_tokens_masks`), another node's
`attn1_patch`, a processor another node put in. (The contract test runs the split at real sizes, a 2-step
sample and a LoRA: tests/test_family_contract.py.) Skipped without ComfyUI."""
from __future__ import annotations

import importlib

import pytest

import comfy_env
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
            assert patched_counts(report) == {"attention": 2}
            kept = [line for line in report.lines() if "runs as before" in line]
            assert kept == (["HiDream: blocks (block) runs as before: the blocks keep ComfyUI's forward: their "
                             "feed-forward routes tokens to experts, which round-off would flip (the attention is "
                             "patched)"] if bounds else [])
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
