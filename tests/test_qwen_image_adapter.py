"""The Qwen-Image adapter (`nodes/families/qwen_image.py`) against a real ComfyUI: a tiny random-weight Qwen-Image built
from ComfyUI's own config class: the patched diffusion model's output equals ComfyUI's own at every head-split
level, with and without block bounds, and the head split really runs (the split floor is lowered to 0 so that
a few hundred tokens split); Qwen-Image-Edit's reference latents (both ways of indexing them, with the zero
timestep's modulation for the reference tokens), the text mask, a batch of two and bf16; other nodes' hooks,
block replacements and an unsupported layout. Skipped without ComfyUI."""
from __future__ import annotations

import importlib

import pytest

from support import adapter_checks
from support import comfy_env
from support.comfy_env import model_forward as forward, rel_err, stock_fallbacks

pytestmark = pytest.mark.comfyui

HEADS = 4
TEXT_WIDTH = 48
QWEN = {"image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 2,
        "attention_head_dim": 32, "num_attention_heads": HEADS, "joint_attention_dim": TEXT_WIDTH,
        "axes_dims_rope": [8, 12, 12]}


@pytest.fixture(scope="module")
def env():
    return comfy_env.pack_modules()


@pytest.fixture(scope="module")
def qwen(env):
    return importlib.import_module(env.pack.__name__ + ".nodes.families.qwen_image")


def qwen_model(config: dict = QWEN, config_class: str = "QwenImage"):
    import torch
    import comfy.model_patcher
    import comfy.supported_models
    if not hasattr(comfy.supported_models, config_class):
        pytest.skip(f"this ComfyUI has no {config_class}")
    model_config = getattr(comfy.supported_models, config_class)(dict(config))
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, device=torch.device("cpu"))
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def qwen_inputs(torch, latent=(1, 16, 1, 32, 24), text_tokens=12, seed=1, **extra):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(*latent, generator=g), timestep=torch.tensor([0.5] * latent[0]),
                context=torch.randn(latent[0], text_tokens, TEXT_WIDTH, generator=g), **extra)


def patched_counts(report) -> dict:
    return {what: n for (family, what), n in report.patched_counts.items()}


def check_every_level(env, base, inputs, layers=2):
    adapter_checks.check_every_level(env, base, inputs, HEADS,
                                     lambda block: {"attention": layers, **({"block": layers} if block else {})})


def test_qwen_image_equals_stock_at_every_level(env, split_everything):
    base = qwen_model()
    check_every_level(env, base, qwen_inputs(env.torch))


@pytest.mark.parametrize("method", ["index", "index_timestep_zero"])
def test_edit_reference_latents_equal_stock(env, split_everything, method):
    """Qwen-Image-Edit: the reference latents' tokens join the image stream; with `index_timestep_zero` they
    take the zero timestep's modulation (the block gets `timestep_zero_index`)."""
    torch = env.torch
    base = qwen_model()
    g = torch.Generator().manual_seed(7)
    inputs = qwen_inputs(torch, ref_latents=[torch.randn(1, 16, 1, 16, 16, generator=g),
                                             torch.randn(1, 16, 1, 8, 24, generator=g)], ref_latents_method=method)
    seen = []
    block = base.model.diffusion_model.transformer_blocks[0]
    handle = block.register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        kwargs.get("timestep_zero_index")), with_kwargs=True)
    try:
        reference = forward(base, inputs)
    finally:
        handle.remove()
    if method == "index_timestep_zero":
        if comfy_env.version_tuple() < (0, 8) and seen == [None]:
            pytest.skip("this ComfyUI's Qwen-Image has no index_timestep_zero")
        assert seen == [32 * 24 // 4]   # the reference tokens start after the image's 192
    for level in ("Low", "High"):
        for bounds in (False, True):
            patched, _ = env.node.apply_patch(base, level, "sdpa", bounds)
            env.core.reset_notices()
            out = forward(base, inputs, applied=patched)
            assert not stock_fallbacks(env), (method, level, bounds)
            assert rel_err(out, reference) <= 1e-5, (method, level, bounds, rel_err(out, reference))


def test_check_inputs_cover_both_modulations_and_masked_text(env, qwen):
    """The self-check's tokens: image tokens on both sides of `timestep_zero_index`, text tokens both masked
    and not, with their RoPE rows and mask entries."""
    torch = env.torch
    text, img, zero_from = 300, 1000, 700
    mask = torch.zeros(2, text)
    mask[:, 250:] = -1e30                                    # padding at the end of the text
    freqs = torch.arange(text + img).float().view(1, 1, -1, 1, 1, 1).expand(1, 1, -1, 1, 2, 2)   # heads-first
    bound = dict(hidden_states=torch.arange(img).float().view(1, -1, 1).expand(2, -1, 8),
                 encoder_hidden_states=torch.arange(text).float().view(1, -1, 1).expand(2, -1, 8),
                 encoder_hidden_states_mask=mask, temb=torch.zeros(4, 8), image_rotary_emb=freqs,
                 timestep_zero_index=zero_from, transformer_options={})
    check = qwen._check_inputs(bound)
    img_ids = check["hidden_states"][0, :, 0].long()
    txt_ids = check["encoder_hidden_states"][0, :, 0].long()
    zero = check["timestep_zero_index"]
    assert 0 < zero < len(img_ids) and bool((img_ids[:zero] < zero_from).all()) and \
        bool((img_ids[zero:] >= zero_from).all())
    masked = check["encoder_hidden_states_mask"] != 0
    assert bool(masked.any()) and not bool(masked.all())
    assert torch.equal(check["encoder_hidden_states_mask"], mask[:, txt_ids])
    rows = check["image_rotary_emb"][0, 0, :, 0, 0, 0].long()
    assert torch.equal(rows, torch.cat((txt_ids, text + img_ids)))


def test_text_mask_equals_stock(env, split_everything):
    """A text mask (padding at the end of a prompt): where ComfyUI's attention applies it (v0.33), the pack
    does too; where it ignores it (v0.8.0), the self-check sees that and the call runs ComfyUI's own."""
    torch = env.torch
    base = qwen_model()
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[:, 8:] = 0
    inputs = qwen_inputs(torch, attention_mask=mask)
    reference = forward(base, inputs)
    applies_mask = rel_err(forward(base, qwen_inputs(torch)), reference) > 1e-6
    for bounds in (False, True):
        patched, _ = env.node.apply_patch(base, "High", "sdpa", bounds)
        env.core.reset_notices()
        out = forward(base, inputs, applied=patched)
        fallbacks = stock_fallbacks(env)
        assert rel_err(out, reference) <= 1e-5, (bounds, rel_err(out, reference))
        if applies_mask:
            assert not fallbacks, fallbacks
        else:
            assert fallbacks and all("the outputs differ" in line for line in fallbacks), fallbacks


@pytest.mark.parametrize("bounds", [False, True], ids=["attention", "block"])
def test_a_dit_block_replacement_wraps_the_pack_block(env, split_everything, bounds):
    """`patches_replace["dit"]` (block swap, caching nodes): the replacement calls the original block, which
    runs the pack's forwards, and may read its input after the call (the pack's block does not write it)."""
    torch = env.torch
    base = qwen_model()
    inputs = qwen_inputs(torch)
    calls = []

    def replace(args, extra):
        before = args["img"].clone()
        out = extra["original_block"](args)
        calls.append(torch.equal(args["img"], before))
        return {"img": out["img"] * 0.9 + args["img"] * 0.1, "txt": out["txt"]}
    hooked = base.clone()
    hooked.set_model_patch_replace(replace, "dit", "double_block", 0)
    reference = forward(hooked, inputs)
    assert calls == [True]
    del calls[:]
    patched, _ = env.node.apply_patch(hooked, "High", "sdpa", bounds)
    env.core.reset_notices()
    assert rel_err(forward(base, inputs, applied=patched), reference) <= 1e-5
    assert calls == [True]
    assert not stock_fallbacks(env)


def test_unsupported_layout_runs_stock(env, split_everything):
    """A block whose MLP is not Qwen-Image's FeedForward keeps ComfyUI's block (one report line; its attention is
    still patched; an argument the pack does not know: the contract test)."""
    torch = env.torch
    base = qwen_model()
    inputs = qwen_inputs(torch)
    block = base.model.diffusion_model.transformer_blocks[1]
    mlp = block.img_mlp
    block.img_mlp = torch.nn.Sequential(mlp.net[0], mlp.net[2])   # the same math in another layout
    reference = forward(base, inputs)
    patched, report = env.node.apply_patch(base, "High", "sdpa", True)
    assert patched_counts(report) == {"attention": 2, "block": 1}
    lines = [line for line in report.lines() if "runs as before" in line]
    assert lines == ["Qwen-Image: diffusion_model.transformer_blocks.1 (block) runs as before: img_mlp is not "
                     "Qwen-Image's FeedForward"]
    env.core.reset_notices()
    assert rel_err(forward(base, inputs, applied=patched), reference) <= 1e-5
    assert not stock_fallbacks(env)


def test_mageflow_blocks_are_patched(env, split_everything):
    """MageFlow (ComfyUI v0.33+) is built from Qwen-Image's blocks."""
    torch = env.torch
    config = {"image_model": "mage_flow", "in_channels": 16, "out_channels": 16, "num_layers": 1,
              "attention_head_dim": 32, "num_attention_heads": HEADS, "joint_attention_dim": TEXT_WIDTH,
              "axes_dims_rope": [8, 12, 12]}
    try:
        base = qwen_model(config, "MageFlow")
    except TypeError as error:   # a ComfyUI whose MageFlow takes other settings
        pytest.skip(f"this ComfyUI builds no tiny MageFlow from this config: {error}")
    g = torch.Generator().manual_seed(1)
    inputs = dict(x=torch.randn(1, 16, 16, 16, generator=g), timestep=torch.tensor([0.5]),
                  context=torch.randn(1, 12, TEXT_WIDTH, generator=g))
    check_every_level(env, base, inputs, layers=1)


def test_sampling_an_edit_gives_the_same_latent(env, split_everything):
    """3 steps of `comfy.sample.sample` with a reference latent (Qwen-Image-Edit), cond and uncond batched."""
    torch = env.torch
    base = qwen_model()
    g = torch.Generator().manual_seed(5)
    reference = torch.randn(1, 16, 1, 16, 16, generator=g)
    positive = [[torch.randn(1, 12, TEXT_WIDTH, generator=g), {"reference_latents": [reference]}]]
    negative = [[torch.randn(1, 7, TEXT_WIDTH, generator=g), {"reference_latents": [reference]}]]
    latent = torch.zeros(1, 16, 1, 16, 24)
    stock = comfy_env.run_sample(base, "qwen_image", positive=positive, negative=negative, latent=latent)
    patched, _ = env.node.apply_patch(base, "High", "auto", True)
    env.core.reset_notices()
    with comfy_env.SdpaHeads(torch, check_tokens=0) as spy:
        ours = comfy_env.run_sample(patched, "qwen_image", positive=positive, negative=negative,
                                    latent=latent)
    assert not stock_fallbacks(env)
    # High: groups of one head in every block of every step (3 steps x 2 blocks x 4 heads at least; the
    # self-check's runs add a few of one head and ComfyUI's own of four)
    assert spy.self_heads.count(1) >= 3 * 2 * HEADS
    assert rel_err(ours, stock) <= 1e-5


def test_a_streams_modulation_parts_are_the_blocks_own_bitwise(env, qwen):
    """`modulation_parts`: a stream's shifts, `1 + scale`s and gates as views of its modulations and one sum,
    the numbers ComfyUI's `_modulate` makes from each half (bf16, bitwise); the chunk modulation and the gated
    add built on them give the block's own results. Not taken with a zero timestep's index."""
    import torch
    patcher = qwen_model()
    block = patcher.model.diffusion_model.transformer_blocks[0].to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    width = block.img_norm1.normalized_shape[0]
    mods = torch.randn(2, 6 * width, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 5, width, generator=g).to(torch.bfloat16)
    out = torch.randn(2, 5, width, generator=g).to(torch.bfloat16)
    assert qwen.modulation_parts(block, mods, 3) is None
    parts = qwen.modulation_parts(block, mods, None)
    for half, (shift, scale, gate) in zip(mods.chunk(2, dim=-1), parts):
        stock_shift, stock_scale, stock_gate = torch.chunk(half, 3, dim=-1)
        assert torch.equal(shift, stock_shift.unsqueeze(1)) and torch.equal(gate, stock_gate.unsqueeze(1))
        assert torch.equal(scale, 1 + stock_scale.unsqueeze(1))
        modulated, stock_gate = block._modulate(x, half)
        assert torch.equal(qwen.ChunkModulation(block, half, None, (shift, scale, gate))(x, 0, 5), modulated)
        residual = x.clone()
        qwen.gated_add(half, None, gate)(residual, out, 0, 5)
        assert torch.equal(residual, torch.addcmul(x, stock_gate, out))   # v0.33's `_apply_gate`


def test_a_feed_forward_is_read_once_and_again_when_its_layers_change(env, qwen):
    """`feed_forward_layers`: the FeedForward's own layers as one Sequential, the same object at every call, a
    new one when a layer or the GELU's approximation changes; None for an active dropout."""
    import torch
    mlp = qwen_model().model.diffusion_model.transformer_blocks[0].img_mlp
    layers = qwen.feed_forward_layers(mlp)
    assert layers is qwen.feed_forward_layers(mlp)
    assert layers[0] is mlp.net[0].proj and layers[2] is mlp.net[2] and layers[1].approximate == mlp.net[0].approximate
    mlp.net[2] = torch.nn.Linear(mlp.net[2].in_features, mlp.net[2].out_features)
    again = qwen.feed_forward_layers(mlp)
    assert again is not layers and again[2] is mlp.net[2]
    mlp.net[0].approximate = "none" if mlp.net[0].approximate == "tanh" else "tanh"
    assert qwen.feed_forward_layers(mlp)[1].approximate == mlp.net[0].approximate
    mlp.net[1] = torch.nn.Dropout(0.5).train()
    assert qwen.feed_forward_layers(mlp) is None
