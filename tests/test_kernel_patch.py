"""Models no family adapter covers: the kernel-level patch (`nodes/kernel_patch.py`). ComfyUI's own attention
function, called as models call it, through the pack's `optimized_attention_override`: equal to ComfyUI's
kernel, and really run by the pack; other nodes' overrides and the user's kernel choice are kept; and real
models (a tiny SD1.x UNet; a tiny Flux with its adapter left out) run through it, equal to stock."""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def env():
    return comfy_env.pack_modules()


@pytest.fixture
def kernel(env, monkeypatch):
    """The kernel_patch module, its `pay_attention` counting its calls."""
    module = importlib.import_module(env.pack.__name__ + ".nodes.kernel_patch")
    calls = []
    real = module.pay_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, "pay_attention", counting)
    module.calls = calls
    return module


def _attention():
    import comfy.ldm.modules.attention as attention
    return attention


@pytest.mark.parametrize("layout", ["flat", "flat-mask2", "flat-mask3", "heads-first", "gqa"])
def test_comfyui_attention_calls_run_on_the_pack(env, kernel, layout):
    torch = env.torch
    attention = _attention()
    g = torch.Generator().manual_seed(0)
    b, n, m, h, d = 2, 40, 24, 4, 16
    q, k, v = (torch.randn(b, t, h * d, generator=g) for t in (n, m, m))
    args, kwargs = (), {}
    if layout == "flat-mask2":
        args = (torch.randn(n, m, generator=g),)                   # positional mask, as UNets pass it
    elif layout == "flat-mask3":
        kwargs["mask"] = torch.rand(b, n, m, generator=g) > 0.2
    elif layout == "heads-first":
        q, k, v = (t.unflatten(-1, (h, d)).transpose(1, 2) for t in (q, k, v))
        kwargs.update(skip_reshape=True, skip_output_reshape=True)
    elif layout == "gqa":
        import inspect
        if "enable_gqa" not in inspect.getsource(attention.attention_pytorch):
            pytest.skip("this ComfyUI's attention has no grouped-query calls")
        k, v = k[..., :2 * d].contiguous(), v[..., :2 * d].contiguous()
        kwargs["enable_gqa"] = True
    stock = attention.attention_pytorch(q, k, v, h, *args, **kwargs)
    options = {"optimized_attention_override": kernel.make_override("auto")}
    ours = attention.optimized_attention(q, k, v, h, *args, transformer_options=options, **kwargs)
    assert ours.shape == stock.shape
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)
    assert len(kernel.calls) == 1


def test_what_the_pack_leaves_to_comfyui(env, kernel, monkeypatch):
    """Another node's override (chained), the user's kernel flag (auto), a per-layer kernel choice and
    unknown arguments all go on to what would have run."""
    torch = env.torch
    attention = _attention()
    q = k = v = torch.randn(1, 8, 32)
    seen = []

    def other_node(func, *args, **kwargs):
        seen.append("other")
        return func(*args, **kwargs)
    attention.optimized_attention(q, k, v, 2, transformer_options={
        "optimized_attention_override": kernel.make_override("auto", previous=other_node)})
    assert seen == ["other"] and not kernel.calls
    ours = {"optimized_attention_override": kernel.make_override("auto")}
    attention.optimized_attention(q, k, v, 2, transformer_options=ours, some_new_argument=1)
    attention.optimized_attention(q, k, v, 2, transformer_options=ours, preferred_attention="sage")
    assert not kernel.calls
    monkeypatch.setattr(importlib.import_module(env.pack.__name__ + ".nodes.dispatch"), "comfy_kernel_chosen",
                        lambda: True)   # read by the one backend decision, `choose_backend`
    attention.optimized_attention(q, k, v, 2, transformer_options=ours)
    assert not kernel.calls
    attention.optimized_attention(q, k, v, 2, transformer_options={
        "optimized_attention_override": kernel.make_override("sdpa")})
    assert len(kernel.calls) == 1                                     # a forced backend is the user's choice


def _stock_and_patched(env, model):
    """A random-weight `model` (ComfyUI's model_base) in a ModelPatcher, and the node's patch of it, which for
    a family without an adapter is the kernel-level one only."""
    import comfy.model_patcher
    torch = env.torch
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    base = comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))
    patched, report = env.node.apply_patch(base, "High", "auto", True)
    assert report.any_patched and not patched.object_patches
    return base, patched


FLUX = {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 32,
        "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 1, "depth_single_blocks": 1,
        "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "guidance_embed": False, "patch_size": 2,
        "txt_ids_dims": []}   # Flux 1 (v0.33 asks for it; older ComfyUI has no such setting: dropped there)


def test_a_tiny_flux_samples_through_the_kernel_patch(env, kernel, monkeypatch):
    """Flux has its own adapter (nodes/families/flux.py); without it, as a family no adapter covers, its attention
    calls (heads-first, with RoPE applied by the model) still run on the pack's kernel, equal to stock."""
    import comfy.supported_models
    monkeypatch.setattr(env.node, "ADAPTERS", tuple(a for a in env.node.ADAPTERS if a.FAMILY != "Flux"))
    torch = env.torch
    config = dict(FLUX)
    import comfy.ldm.flux.model as flux_model
    if "txt_ids_dims" not in getattr(flux_model.FluxParams, "__dataclass_fields__", {}):
        del config["txt_ids_dims"]
    model_config = comfy.supported_models.Flux(config)
    model_config.set_inference_dtype(torch.float32, None)
    try:
        model = model_config.get_model({}, device=torch.device("cpu"))
    except Exception as e:   # noqa: BLE001 - a ComfyUI whose Flux takes other settings
        pytest.skip(f"this ComfyUI builds no tiny Flux from this config: {e}")
    base, patched = _stock_and_patched(env, model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 16, 16, generator=g)
    context, y = torch.randn(1, 8, 32, generator=g), torch.randn(1, 32, generator=g)

    def run(patcher):
        options = dict(patcher.model_options["transformer_options"])
        with torch.no_grad():
            return model.diffusion_model(x, torch.tensor([0.5]), context=context, y=y,
                                         transformer_options=options)
    stock = run(base)
    assert not kernel.calls
    ours = run(patched)
    assert len(kernel.calls) == 2                                     # the double and the single block
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)


SD15_TINY = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
             "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 32,
             "num_res_blocks": [1, 1], "transformer_depth": [1, 1], "channel_mult": [1, 2],
             "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 32, "num_heads": 2,
             "transformer_depth_output": [1, 1, 1, 1], "use_temporal_attention": False,
             "use_temporal_resblock": False}


def test_a_tiny_sd15_unet_routes_through_the_pack(env, kernel):
    """A UNet (SD1.x, from ComfyUI's own config class): its self- and cross-attention calls (positional masks,
    flat layout) run on the pack's backend, and the output equals stock."""
    import comfy.supported_models
    torch = env.torch
    model_config = comfy.supported_models.SD15(dict(SD15_TINY))
    model_config.set_inference_dtype(torch.float32, None)
    base, patched = _stock_and_patched(env, model_config.get_model({}, device=torch.device("cpu")))
    model = base.model
    g = torch.Generator().manual_seed(1)
    x, context = torch.randn(1, 4, 16, 16, generator=g), torch.randn(1, 7, 32, generator=g)

    def run(patcher):
        options = dict(patcher.model_options["transformer_options"])
        with torch.no_grad():
            return model.diffusion_model(x, torch.tensor([500.0]), context=context, transformer_options=options)
    stock = run(base)
    assert not kernel.calls
    ours = run(patched)
    blocks = sum(type(m).__name__ == "BasicTransformerBlock" for m in model.diffusion_model.modules())
    assert blocks and len(kernel.calls) == 2 * blocks    # each transformer block's self and cross attention
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)
