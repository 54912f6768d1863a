"""The Lumina2 / Z-Image adapter (`nodes/families/lumina.py`) against a real ComfyUI: tiny random-weight models built
from ComfyUI's own config classes (Lumina 2 with grouped-query attention, Z-Image with its modulation and
token padding): the patched diffusion model's output equals ComfyUI's own at every head-split level, with and
without block bounds, and the head split really runs (the split floor is lowered to 0 so that a few hundred
tokens split). Skipped without ComfyUI."""
from __future__ import annotations

import importlib

import pytest

from support import adapter_checks
from support import comfy_env
from support.comfy_env import model_forward as forward, rel_err, stock_fallbacks

pytestmark = pytest.mark.comfyui

CAPTION_DIM = 32

# Lumina 2's layout (24 heads on 8 key/value heads), scaled down: 8 query heads on 4 key/value heads
LUMINA2 = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 128, "cap_feat_dim": CAPTION_DIM,
           "n_layers": 2, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 8, "n_kv_heads": 4,
           "axes_dims": [4, 6, 6], "axes_lens": [300, 512, 512], "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0,
           "multiple_of": 32}
# Z-Image's layout (as many key/value heads as heads, adaLN from 256 features, padded token streams)
# (the timestep embedding is 256 wide: the smallest width Z-Image's modulation takes)
ZIMAGE = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256, "cap_feat_dim": CAPTION_DIM,
          "n_layers": 2, "n_refiner_layers": 1, "qk_norm": True, "n_heads": 4, "n_kv_heads": 4,
          "axes_dims": [16, 24, 24], "axes_lens": [1536, 512, 512], "rope_theta": 256.0,
          "ffn_dim_multiplier": 8.0 / 3.0, "multiple_of": 32, "z_image_modulation": True, "time_scale": 1000.0,
          "pad_tokens_multiple": 32}


@pytest.fixture(scope="module")
def env():
    env = comfy_env.pack_modules()
    env.lumina = importlib.import_module(env.pack.__name__ + ".nodes.families.lumina")
    return env


def lumina_model(config: dict, config_class: str = "Lumina2"):
    """A tiny random-weight model from ComfyUI's own config class, float32 on the CPU, as a ModelPatcher."""
    import inspect
    import torch
    import comfy.ldm.lumina.model
    import comfy.model_patcher
    import comfy.supported_models
    if not hasattr(comfy.supported_models, config_class):
        pytest.skip(f"this ComfyUI has no {config_class}")
    takes = inspect.signature(comfy.ldm.lumina.model.NextDiT.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values()):   # older: fewer settings
        config = {k: v for k, v in config.items() if k in takes or k == "image_model"}
    model_config = getattr(comfy.supported_models, config_class)(dict(config))
    model_config.set_inference_dtype(torch.float32, None)
    try:
        model = model_config.get_model({}, device=torch.device("cpu"))
    except Exception as error:   # noqa: BLE001 - a ComfyUI whose model takes other settings
        pytest.skip(f"this ComfyUI builds no tiny {config_class} from this config: {error}")
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    with torch.no_grad():   # ComfyUI's parameters without "norm" in their name: pad tokens, as activations
        for name, p in model.diffusion_model.named_parameters():
            if name.endswith("pad_token"):
                p.normal_()
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def lumina_inputs(torch, latent=(1, 16, 32, 24), caption_tokens=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(*latent, generator=g), timesteps=torch.tensor([0.6] * latent[0]),
                context=torch.randn(latent[0], caption_tokens, CAPTION_DIM, generator=g),
                num_tokens=caption_tokens)


def _blocks(model) -> int:
    return sum(len(getattr(model, name, None) or ()) for name in ("context_refiner", "noise_refiner", "layers"))


def check_every_level(env, base, inputs, heads: int, kv_heads: int):
    blocks = _blocks(base.model.diffusion_model)
    adapter_checks.check_every_level(
        env, base, inputs, heads, lambda block: {"attention": blocks, **({"block": blocks} if block else {})},
        groups=lambda level: env.core.group_count(kv_heads, 10**6, level, split_floor_tokens=0))


def test_lumina2_grouped_query_equals_stock_at_every_level(env, split_everything):
    base = lumina_model(LUMINA2)
    attention = base.model.diffusion_model.layers[0].attention
    assert (attention.n_local_heads, attention.n_local_kv_heads) == (8, 4)
    check_every_level(env, base, lumina_inputs(env.torch), heads=8, kv_heads=4)


def test_without_qk_norms(env, split_everything):
    """`qk_norm=False` (an Identity in place of each norm): RoPE alone."""
    torch = env.torch
    base = lumina_model(dict(LUMINA2, qk_norm=False))
    assert isinstance(base.model.diffusion_model.layers[0].attention.q_norm, torch.nn.Identity)
    inputs = lumina_inputs(torch)
    reference = forward(base, inputs)
    for block in (False, True):
        patched, report = env.node.apply_patch(base, "High", "sdpa", block)
        assert not report.skipped_reasons, report.lines()
        env.core.reset_notices()
        assert rel_err(forward(base, inputs, applied=patched), reference) <= 1e-5
        assert not stock_fallbacks(env)


def test_zimage_equals_stock_at_every_level(env, split_everything):
    base = lumina_model(ZIMAGE, "ZImage")
    check_every_level(env, base, lumina_inputs(env.torch, latent=(1, 16, 30, 22), caption_tokens=9),
                      heads=4, kv_heads=4)


def test_zimage_omni_modulation_ranges(env, split_everything):
    """Z-Image Omni (reference latents): the batch's modulation is doubled and token ranges take the other
    half (`timestep_zero_index`); the bounded block applies each chunk's share of the ranges."""
    import inspect
    torch = env.torch
    base = lumina_model(ZIMAGE, "ZImage")
    if "ref_latents" not in inspect.signature(type(base.model.diffusion_model)._forward).parameters:
        pytest.skip("this ComfyUI's Lumina model takes no reference latents (no Z-Image Omni)")
    # long enough for several token chunks (256 tokens at least each): the ranges cross chunk boundaries
    inputs = lumina_inputs(torch, latent=(1, 16, 48, 48), caption_tokens=9)
    inputs["ref_latents"] = [torch.randn(1, 16, 32, 32, generator=torch.Generator().manual_seed(3))]
    reference = forward(base, inputs)
    for block in (False, True):
        patched, _ = env.node.apply_patch(base, "High", "sdpa", block)
        env.core.reset_notices()
        out = forward(base, inputs, applied=patched)
        assert not stock_fallbacks(env)
        assert rel_err(out, reference) <= 1e-5, (block, rel_err(out, reference))


def test_unsupported_layouts_pass_through(env, split_everything, caplog):
    """A block whose feed-forward is not w1/w3/w2 and an attention with an unknown argument keep ComfyUI's
    forwards, each with its reason in the report (one log line); the rest is patched, the output is stock's."""
    import logging
    torch = env.torch
    base = lumina_model(LUMINA2)
    model = base.model.diffusion_model
    layer = model.layers[1]
    layer.feed_forward = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))

    class TakesMore(type(layer.attention)):
        def forward(self, x, x_mask, freqs_cis, transformer_options={}, something_new=None):
            return super().forward(x, x_mask, freqs_cis, transformer_options=transformer_options)
    model.layers[0].attention.__class__ = TakesMore
    inputs = lumina_inputs(torch)
    reference = forward(base, inputs)
    with caplog.at_level(logging.INFO, logger="ComfyUI-QKV"):
        patched, report = env.node.apply_patch(base, "High", "sdpa", True)
    reasons = {reason: paths for (family, reason), paths in report.skipped_reasons.items()}
    assert reasons["its feed_forward is not w1, w3, w2"] == ["diffusion_model.layers.1 (block)"]
    assert reasons["its forward takes arguments the pack's does not (something_new)"] == \
        ["diffusion_model.layers.0.attention"]
    assert reasons["attention: its forward takes arguments the pack's does not (something_new)"] == \
        ["diffusion_model.layers.0 (block)"]
    logged = [r.getMessage() for r in caplog.records if "runs as before" in r.getMessage()]
    assert len(logged) == 3, logged
    env.core.reset_notices()
    assert rel_err(forward(base, inputs, applied=patched), reference) <= 1e-5
    assert not stock_fallbacks(env)


def test_unknown_call_arguments_run_stock(env, split_everything):
    """A call with an argument the pack's forward does not take (a newer ComfyUI's block handing its own
    q/k/v product to the attention) runs ComfyUI's forward, with one notice."""
    torch = env.torch
    base = lumina_model(LUMINA2)
    attention = base.model.diffusion_model.layers[0].attention
    forward_ours = env.lumina.attention_forward(attention, env.node.QKVConfig(3, "sdpa", True))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 40, 128, generator=g)
    freqs = base.model.diffusion_model.rope_embedder(torch.zeros(1, 40, 3)).movedim(1, 2)
    env.core.reset_notices()
    with torch.no_grad():
        with pytest.raises(TypeError):   # stock has no such argument either: it is ComfyUI's error, not ours
            forward_ours(x, None, freqs, transformer_options={}, unknown=1)
    assert any("does not take (unknown)" in line for line in stock_fallbacks(env))
    with torch.no_grad():
        stock = attention(x, None, freqs)
        ours = forward_ours(x, None, freqs)
    assert not stock_fallbacks(env)
    assert rel_err(ours, stock) <= 1e-5


def test_attention_override_is_chained(env, split_everything):
    """Another node's `optimized_attention_override`: with backend auto the pack's head groups go through
    ComfyUI's dispatcher, so the override sees every group."""
    torch = env.torch
    base = lumina_model(LUMINA2)
    inputs = lumina_inputs(torch)
    reference = forward(base, inputs)
    seen = []

    def override(func, *args, **kwargs):
        seen.append(args[0].shape)
        return func(*args, **kwargs)
    base.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = override
    patched, _ = env.node.apply_patch(base, "High", "auto", True)
    env.core.reset_notices()
    out = forward(base, inputs, applied=patched)
    assert not stock_fallbacks(env)
    assert rel_err(out, reference) <= 1e-5
    assert seen


FUSED_NORM_CHECK = """
import sys
sys.path.insert(0, {tests!r})
import torch
from support import comfy_env
import test_lumina_adapter as t
env = comfy_env.pack_modules()
env.core.head_split.SPLIT_FLOOR_TOKENS = 0   # as conftest.py does for the tests: tiny sequences take the pack's path
kernels = env.core.kernels
assert kernels.INTERPRET and kernels.triton is not None
fused = []
for name in ("norm_rope_", "norm_rope_launch", "norm_rope_pass"):   # every entry point of the fused kernel
    if hasattr(kernels, name):
        def spy(*args, _real=getattr(kernels, name), **kwargs):
            fused.append(_real(*args, **kwargs))
            return fused[-1]
        setattr(kernels, name, spy)
base = t.lumina_model(t.ZIMAGE, "ZImage")
with torch.no_grad():   # small q/k activations: where the norms' epsilon shows
    for module in base.model.diffusion_model.modules():
        if hasattr(module, "qkv"):
            module.qkv.weight.mul_(0.05)
base.model.diffusion_model.to(torch.bfloat16)
inputs = {{k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
          for k, v in t.lumina_inputs(torch, latent=(1, 16, 16, 16)).items()}}
stock = t.forward(base, inputs).float()
patched, _ = env.node.apply_patch(base, "High", "sdpa", False)
env.core.reset_notices()
ours = t.forward(base, inputs, applied=patched).float()
print("fallbacks", t.stock_fallbacks(env), "fused", any(fused), "error", t.rel_err(ours, stock))
"""


def test_norms_without_epsilon_in_the_fused_triton_pass():
    """Lumina's q/k norms have no epsilon of their own: torch's default is float32's for 16-bit tensors too,
    and the fused Triton norm + RoPE (CUDA; here Triton's interpreter, in a child process) must use the same
    (with bf16's, Z-Image's attention failed its self-check and ran stock)."""
    import re
    comfy_env.require_comfyui()
    lumina_model(ZIMAGE, "ZImage")   # skips where this ComfyUI builds none
    stdout = comfy_env.run_interpreted(FUSED_NORM_CHECK)
    found = re.search(r"fallbacks \[\] fused True error (\S+)", stdout)
    assert found, stdout[-2000:]
    assert float(found.group(1)) <= 2e-2   # bf16 round-off: the kernel rounds the norm once, as torch does


def test_another_nodes_hook_on_a_part_runs_the_stock_block(env, split_everything):
    """A forward hook another node put on a block's feed-forward: that block runs ComfyUI's forward (which
    calls the hook); the others and every attention stay the pack's."""
    torch = env.torch
    base = lumina_model(LUMINA2)
    inputs = lumina_inputs(torch)
    calls = []
    handle = base.model.diffusion_model.layers[1].feed_forward.register_forward_hook(
        lambda module, args, out: calls.append(out.shape) or out * 1.5)
    try:
        reference = forward(base, inputs)
        count = len(calls)
        patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
        env.core.reset_notices()
        out = forward(base, inputs, applied=patched)
        fallbacks = stock_fallbacks(env)
    finally:
        handle.remove()
    assert fallbacks == ["[QKV] Lumina2 block runs as ComfyUI's own: another node hooks its feed_forward"]
    assert len(calls) == 2 * count   # the hook ran again
    assert rel_err(out, reference) <= 1e-5
