"""Sanity tests of tests/gguf_env.py: a tiny Wan with GGUF weights through the real ComfyUI-GGUF pack runs as
stock ComfyUI + ComfyUI-GGUF run it. Skipped (with the reason) without ComfyUI, ComfyUI-GGUF or ``gguf``.

They also pin down what ComfyUI-GGUF does, which the QKV pack has to live with:
  * ``comfy.ops.cast_bias_weight(layer, x)`` (ComfyUI's module function) returns the *raw* quantized blocks
    cast to x's dtype, not the weight; ``layer.cast_bias_weight(x)`` (GGMLLayer's method) dequantizes;
  * LoRA patches ride on the weight (``GGMLTensor.patches``) and are applied by ``GGMLLayer.get_weight`` after
    dequantizing, in full and in low-VRAM loads alike (no ``weight_function`` on GGUF layers).
"""
from __future__ import annotations

import pytest

from support import comfy_env
from support import gguf_env

pytestmark = pytest.mark.comfyui

SIZE = dict(frames=2, h=8, w=8)          # 2 x 4 x 4 = 32 tokens
# Bound of max|GGUF - float32| / max|float32| over the model output, per type (measured: Q8_0 0.004, Q4_K 0.045)
FLOAT_TOLERANCE = {"Q8_0": 0.02, "Q4_K": 0.15}


@pytest.fixture(scope="module")
def ops():
    return gguf_env.require_gguf()


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def forward(patcher, kind="t2v"):
    import torch
    with torch.no_grad():
        return patcher.model.diffusion_model(**comfy_env.make_inputs(patcher.model, kind, **SIZE))


# ------------------------------------------------------------------------------------------- finding

def test_find_gguf_pack_order(tmp_path, monkeypatch):
    def pack(path):
        path.mkdir(parents=True)
        for f in ("ops.py", "loader.py", "dequant.py", "nodes.py"):
            (path / f).write_text("")
        return path.resolve()

    comfy = tmp_path / "ComfyUI"
    (comfy / "comfy").mkdir(parents=True)
    (comfy / "nodes.py").write_text("")
    (comfy / "execution.py").write_text("")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setattr(gguf_env.Path, "home", classmethod(lambda cls: home))
    monkeypatch.setenv("COMFYUI_PATH", str(comfy))
    monkeypatch.delenv(gguf_env.ENV_VAR, raising=False)
    assert gguf_env.find_gguf_pack() is None
    in_home = pack(home / "ComfyUI-GGUF")
    assert gguf_env.find_gguf_pack() == in_home
    in_comfy = pack(comfy / "custom_nodes" / "ComfyUI-GGUF")
    assert gguf_env.find_gguf_pack() == in_comfy                  # ComfyUI's custom_nodes before ~
    explicit = pack(tmp_path / "elsewhere")
    monkeypatch.setenv(gguf_env.ENV_VAR, str(explicit))
    assert gguf_env.find_gguf_pack() == explicit                  # the variable first
    monkeypatch.setenv(gguf_env.ENV_VAR, str(tmp_path / "nowhere"))
    assert gguf_env.find_gguf_pack() is None                      # explicit but wrong: not replaced


def test_pack_is_imported_under_a_private_name(ops):
    import sys
    assert ops.__name__ == gguf_env.PACKAGE + ".ops"
    assert {"GGMLOps", "GGMLLayer", "GGMLTensor"} <= set(vars(ops))
    assert "nodes" not in sys.modules or not sys.modules["nodes"].__name__.startswith(gguf_env.PACKAGE)
    assert gguf_env.require_gguf() is ops                         # idempotent


# ---------------------------------------------------------------------------------------- quantizing

@pytest.mark.parametrize("qtype,tolerance", [("Q8_0", 0.01), ("Q4_0", 0.15), ("Q5_1", 0.06), ("BF16", 0.01),
                                             ("Q4_K", 0.12), ("Q6_K", 0.03)])
def test_quantized_blocks_dequantize_like_gguf(ops, qtype, tolerance):
    """gguf's numpy dequantizer and ComfyUI-GGUF's torch one read our blocks alike (Q4_K/Q6_K are packed by
    gguf_env: gguf 0.19 cannot quantize K-quants in numpy), and they are close to the input."""
    import gguf
    import numpy as np
    import torch
    a = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32) / 20
    raw = gguf_env.quantize_array(a, qtype)
    qt = gguf.GGMLQuantizationType[qtype]
    assert raw.dtype == np.uint8 and raw.shape == (16, 512 // gguf.GGML_QUANT_SIZES[qt][0] * gguf.GGML_QUANT_SIZES[qt][1])
    by_gguf = gguf.quants.dequantize(raw, qt)
    assert np.abs(by_gguf - a).max() / np.abs(a).max() <= tolerance
    t = gguf_env.quantize_tensor(torch.from_numpy(a), qtype)
    assert isinstance(t, ops.GGMLTensor) and t.tensor_type == qt and t.shape == (16, 512)
    by_gguf = torch.from_numpy(by_gguf)
    assert torch.equal(gguf_env.dequantize(t, dequant_dtype=torch.float32), by_gguf)
    # the layers' default (dequant_dtype None): block math in the scales' float16, so float16 round-off
    assert torch.allclose(gguf_env.dequantize(t), by_gguf, rtol=0, atol=2e-3 * float(by_gguf.abs().max()))


def test_rows_of_the_raw_blocks_are_rows_of_the_weight(ops):
    """Blocks run along the input dimension: rows [a:b] of the raw data, with tensor_shape (b - a, in),
    dequantize to rows [a:b] of the weight (a GGUF projection can be sliced by output rows)."""
    import torch
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    for qtype in ("Q8_0", "Q4_K"):
        t = gguf_env.quantize_tensor(w, qtype)
        rows = ops.GGMLTensor(torch.Tensor(t)[16:48], tensor_type=t.tensor_type, tensor_shape=torch.Size((32, 256)))
        assert torch.equal(gguf_env.dequantize(rows), gguf_env.dequantize(t)[16:48])


# ------------------------------------------------------------------------------------------ the model

@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_stock_gguf_wan_runs_close_to_float(ops, qtype):
    patcher = gguf_env.make_gguf_wan(qtype, "t2v", layers=2)
    nodes_mod = gguf_env.pack_module("nodes")
    assert isinstance(patcher, nodes_mod.GGUFModelPatcher)
    dims = gguf_env.dims_for(qtype)
    assert {k: patcher.gguf_dims[k] for k in dims} == dims
    dm = patcher.model.diffusion_model
    expected = {f"blocks.{i}.{a}.{p}.weight" for i in range(2) for a in ("self_attn", "cross_attn")
                for p in ("q", "k", "v", "o")} | {f"blocks.{i}.ffn.{j}.weight" for i in range(2) for j in (0, 2)}
    assert set(patcher.gguf_keys) == expected
    layers = gguf_env.linear_layers(patcher)
    assert set(layers) == {k[:-len(".weight")] for k in expected}
    for layer in layers.values():
        assert type(layer) is ops.GGMLOps.Linear and isinstance(layer.weight, ops.GGMLTensor)
        assert layer.weight.tensor_type.name == qtype and layer.weight.dtype.itemsize == 1   # raw uint8 blocks
    # the other weights are F32 GGMLTensors on GGMLOps layers, as the loader makes them
    assert type(dm.text_embedding[0].weight) is ops.GGMLTensor and not gguf_env.is_quantized(dm.text_embedding[0].weight)

    out = forward(patcher)
    float_model = comfy_env.make_wan("t2v", layers=2, **dims)            # the weights it was quantized from
    assert 1e-4 < rel_err(out, forward(float_model)) <= FLOAT_TOLERANCE[qtype]
    # against float32 weights equal to the dequantized ones: the same numbers up to float round-off
    assert rel_err(out, forward(gguf_env.make_dequantized_wan(patcher))) <= 1e-5


def test_i2v_quantizes_the_image_projections_too(ops):
    patcher = gguf_env.make_gguf_wan("Q8_0", "i2v", layers=1)
    assert {"blocks.0.cross_attn.k_img.weight", "blocks.0.cross_attn.v_img.weight"} <= set(patcher.gguf_keys)
    out = forward(patcher, "i2v")
    assert rel_err(out, forward(gguf_env.make_dequantized_wan(patcher), "i2v")) <= 1e-5


def test_cast_bias_weight_on_a_gguf_layer(ops):
    import torch
    import torch.nn.functional as F
    import comfy.ops
    patcher = gguf_env.make_gguf_wan("Q8_0", "t2v", layers=1)
    layer = patcher.model.diffusion_model.blocks[0].self_attn.q
    x = torch.randn(3, layer.in_features)
    weight_now = gguf_env.dequantize(layer.weight)

    # ComfyUI's module function returns the RAW quantized data, not the weight: the uint8 blocks cast to x's
    # dtype (values 0..255 of scale and int8 bytes), still a GGMLTensor whose .shape claims the logical
    # (out, in) = (128, 128) while the storage is (out, bytes per row) = (128, 136) for Q8_0. F.linear then
    # fails with "mat1 and mat2 shapes cannot be multiplied" (what the QKV pack hit on a Q8_0 Wan block).
    weight, bias = comfy.ops.cast_bias_weight(layer, x)
    assert isinstance(weight, ops.GGMLTensor) and weight.dtype == torch.float32
    assert tuple(weight.shape) == (128, 128)                       # the GGMLTensor.shape property
    assert tuple(torch.Tensor.size(weight)) == (128, 136)          # the real storage: 4 blocks of 34 bytes
    assert torch.equal(torch.Tensor(weight), torch.Tensor(layer.weight).float())
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        F.linear(x, weight, bias)

    # GGMLLayer's own method (what the layer's forward uses) dequantizes: a plain float tensor of the weight
    # (LoRA patches included, see below), bias as a plain float tensor.
    weight, bias = layer.cast_bias_weight(x)
    assert type(weight) is torch.Tensor and weight.shape == (128, 128) and torch.equal(weight, weight_now)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, weight, bias))


@pytest.mark.parametrize("lowvram", [False, True], ids=["full-load", "lowvram"])
def test_lora_patches_ride_on_the_gguf_weight(ops, lowvram):
    import torch
    patcher = gguf_env.make_gguf_wan("Q8_0", "t2v", layers=1)
    plain = forward(patcher)
    g = torch.Generator().manual_seed(3)
    patches = {}
    for key in ("blocks.0.self_attn.q.weight", "blocks.0.cross_attn.k.weight", "text_embedding.0.weight"):
        key = "diffusion_model." + key
        patches[key] = (torch.randn(patcher.model.get_parameter(key).shape, generator=g) * 0.05,)
    lora = patcher.clone()
    lora.add_patches(patches, 1.0)
    float_lora = gguf_env.make_dequantized_wan(patcher)
    float_lora.add_patches(patches, 1.0)
    cpu = torch.device("cpu")
    float_lora.patch_model(device_to=cpu)
    try:
        expected = forward(float_lora)
    finally:
        float_lora.unpatch_model()

    lora.patch_model(device_to=cpu, lowvram_model_memory=1 if lowvram else 0)
    try:
        q = lora.model.diffusion_model.blocks[0].self_attn.q
        # GGUFModelPatcher.patch_weight_to_device: the quantized weight is not merged; a copy carrying
        # .patches = [(patches, key)] replaces it; also in a low-VRAM load (GGUFModelPatcher.load forces
        # force_patch_weights=True), so GGUF layers never get ComfyUI's weight_function / LowVramPatch.
        assert isinstance(q.weight, ops.GGMLTensor) and gguf_env.is_quantized(q.weight)
        assert len(q.weight.patches) == 1 and q.weight.patches[0][1] == "diffusion_model.blocks.0.self_attn.q.weight"
        assert len(q.weight_function) == 0
        # GGMLLayer.get_weight: dequantize, then comfy.lora.calculate_weight(patches, weight, key)
        x = torch.randn(2, q.in_features)
        assert torch.allclose(q.cast_bias_weight(x)[0],
                              gguf_env.dequantize(q.weight) + patches["diffusion_model.blocks.0.self_attn.q.weight"][0],
                              rtol=0, atol=1e-6)
        out = forward(lora)
    finally:
        lora.unpatch_model()
    assert rel_err(out, plain) > 1e-3                               # the LoRA changes the output
    assert rel_err(out, expected) <= 1e-5                           # as the same LoRA on float32 weights
    assert rel_err(forward(patcher), plain) <= 1e-6                # and is gone afterwards
    assert not patcher.model.diffusion_model.blocks[0].self_attn.q.weight.patches


def test_via_file_equals_direct(ops):
    """Through a real .gguf file and the pack's own UnetLoaderGGUF node (ComfyUI's model detection picks
    the config: head_dim 128) the model is the one make_gguf_wan builds directly."""
    dims = dict(dim=256, heads=2, ffn_dim=512, layers=1)
    by_file = gguf_env.make_gguf_wan("Q8_0", "t2v", via_file=True, **dims)
    direct = gguf_env.make_gguf_wan("Q8_0", "t2v", **dims)
    assert type(by_file) is type(direct)
    assert by_file.model.model_config.unet_config["num_heads"] == 2
    q = by_file.model.diffusion_model.blocks[0].self_attn.q
    assert isinstance(q, ops.GGMLOps.Linear) and q.weight.tensor_type.name == "Q8_0"
    assert rel_err(forward(by_file), forward(direct)) == 0.0


def test_sampling_runs_like_the_dequantized_float_model(ops):
    """comfy.sample.sample (GGUFModelPatcher.load, cond + uncond batched) matches the float32 model with the
    dequantized weights."""
    patcher = gguf_env.make_gguf_wan("Q8_0", "t2v", layers=1)
    out = comfy_env.run_sample(patcher, steps=2, **SIZE)
    ref = comfy_env.run_sample(gguf_env.make_dequantized_wan(patcher), steps=2, **SIZE)
    assert rel_err(out, ref) <= 1e-5
