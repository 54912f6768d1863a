"""Weight formats and layers against a real ComfyUI (tiny Wan models), each split and equal to stock or run as ComfyUI
runs it: GGUF (city96/ComfyUI-GGUF's layers, with LoRAs), fp8 stored weights and fp8-scaled checkpoints (with
LoRAs, their rows bit for bit), ComfyUI's `QuantizedTensor` and block-scaled weights, weights streamed through
ComfyUI's offload buffers, its fp8 matmul ops; ComfyUI's newer attention layout (q/k/v in containers); other nodes'
hooks at every level. The helpers and fixtures are tests/support/wan_runs.py's."""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env

from support.wan_runs import (MODEL, SIZE, SMALL, SdpaHeads, _fresh_verdicts, env,  # noqa: F401
                              forward, fp8_wan, inputs, other_node_hooks, rel_err)

pytestmark = pytest.mark.comfyui


# --- weight formats the pack does not know -----------------------------------------------------------------
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("block", [False, True], ids=["attention", "block"])
def test_gguf_weights_split_and_equal_stock(env, qtype, block):
    """city96/ComfyUI-GGUF layers (`comfy.ops.cast_bias_weight` returns their raw quantized blocks, which
    crashed the pack before): the layer's own dequantized weight, once per layer call, then rows: the head
    split runs and the result equals the stock GGUF model."""
    from support import gguf_env
    gguf_env.require_gguf()
    base = gguf_env.make_gguf_wan(qtype, "t2v", layers=1)
    heads = base.gguf_dims["heads"]
    reference = forward(base)
    patched, report = env.node.apply_patch(base, "High", "sdpa", block)
    assert not report.skipped_reasons, report.lines()
    with SdpaHeads(env.torch) as spy:
        out = forward(base, patched)
    assert rel_err(out, reference) <= 1e-5
    groups = env.core.group_count(heads, 2 * 4224, 3)
    assert set(spy.self_heads) == {heads // groups}
    assert env.wan.splits_projections(base.model.diffusion_model) is None   # the run's memory factor knows


@pytest.mark.parametrize("lowvram", [False, True], ids=["full-load", "lowvram"])
def test_gguf_with_a_lora_equals_stock(env, lowvram):
    """A LoRA on GGUF weights rides on the weight (ComfyUI-GGUF applies it when it dequantizes): the pack's
    rows come from that patched weight."""
    from support import gguf_env
    torch = env.torch
    gguf_env.require_gguf()
    base = gguf_env.make_gguf_wan("Q8_0", "t2v", layers=1)
    g = torch.Generator().manual_seed(3)
    patches = {}
    for name in ("q", "k", "v", "o"):
        key = f"diffusion_model.blocks.0.self_attn.{name}.weight"
        shape = base.model.diffusion_model.blocks[0].self_attn.q.weight.shape
        patches[key] = (torch.randn(tuple(shape), generator=g) * 0.05,)
    lora = base.clone()
    lora.add_patches(patches, 1.0)
    patched, _ = env.node.apply_patch(lora, "High", "sdpa", True)

    def run(patcher):
        patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1 if lowvram else 0)
        try:
            kwargs = inputs(patcher)
            with torch.no_grad():
                return patcher.model.diffusion_model(**kwargs)
        finally:
            patcher.unpatch_model()

    plain = run(base)
    stock = run(lora)
    assert rel_err(stock, plain) > 1e-3      # the LoRA changes the output
    assert rel_err(run(patched), stock) <= 1e-5


@pytest.mark.parametrize("block", [False, True], ids=["attention", "block"])
def test_fp8_stored_weights_split_and_equal_stock(env, block):
    """fp8 weights cast per call: the cast weight's rows are exact, so the head split runs (it ran whole
    before) and the result equals stock's."""
    torch = env.torch
    base = fp8_wan(torch)
    q = base.model.diffusion_model.blocks[0].self_attn.q
    assert q.weight.dtype == torch.float8_e4m3fn and q.comfy_cast_weights
    size = dict(frames=3, h=64, w=88, steps=1)   # cond + uncond: 2 x 4,224 tokens
    reference = comfy_env.run_sample(base, **size)
    patched, report = env.node.apply_patch(base, "High", "sdpa", block)
    assert not report.skipped_reasons, report.lines()
    with SdpaHeads(torch) as spy:
        out = comfy_env.run_sample(patched, **size)
    assert rel_err(out, reference) <= 1e-5
    assert set(spy.self_heads) == {1}


def test_auto_keeps_the_kernel_chosen_with_comfyui_flags(env, monkeypatch):
    """`--use-sage-attention`, `--use-ck-attention` and friends set ComfyUI's global attention function; with
    `auto` the pack's head groups go through it (here a stand-in named like ComfyUI's int8 kernel)."""
    import comfy.ldm.modules.attention as comfy_attention
    stock_kernel = comfy_attention.optimized_attention
    calls = []

    def attention_comfy_kitchen_int8(q, k, v, heads, *args, **kwargs):
        calls.append(heads)
        return stock_kernel(q, k, v, heads, *args, **kwargs)
    base = comfy_env.make_wan("t2v", **MODEL)
    reference = forward(base)
    monkeypatch.setattr(comfy_attention, "optimized_attention", attention_comfy_kitchen_int8)
    patched, _ = env.node.apply_patch(base, "High", "auto", False)
    out = forward(base, patched)
    assert rel_err(out, reference) <= 1e-5
    assert 1 in calls      # High: head groups of one head went through the user's kernel
    del calls[:]
    forced, _ = env.node.apply_patch(base, "High", "sdpa", False)
    forward(base, forced)
    assert 1 not in calls  # a forced backend runs its own kernel


def _container_self_attention(wan_model, attention):
    """WanSelfAttention.forward as newer ComfyUI (0.35+) writes it: q/k/v handed to attention in
    `AttentionTensorContainer`s (single owner: the backend may free them), attn1_patch after attention."""
    def forward(self, x, freqs, transformer_options={}):
        patches = transformer_options.get("patches", {})
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = wan_model.apply_rope1(self.norm_q(self.q(x)).view(b, s, n, d), freqs)
        k = wan_model.apply_rope1(self.norm_k(self.k(x)).view(b, s, n, d), freqs)
        q_patch, k_patch = q, k
        x = attention.optimized_attention(attention.AttentionTensorContainer(q.view(b, s, n * d)),
                                          attention.AttentionTensorContainer(k.view(b, s, n * d)),
                                          attention.AttentionTensorContainer(self.v(x).view(b, s, n * d)),
                                          heads=self.num_heads, transformer_options=transformer_options)
        for p in patches.get("attn1_patch", ()):
            x = p({"x": x, "q": q_patch, "k": k_patch, "transformer_options": transformer_options})
        return self.o(x)
    return forward


def test_newer_comfyui_attention_layout_keeps_the_patch(env, monkeypatch):
    """ComfyUI 0.35+ hands q/k/v to its dispatcher in AttentionTensorContainers: same math, so the
    self-check keeps the pack's forward (and its split); the result equals that ComfyUI's own."""
    attention = importlib.import_module("comfy.ldm.modules.attention")
    if not hasattr(attention, "AttentionTensorContainer"):
        pytest.skip("this ComfyUI has no AttentionTensorContainer")
    import comfy.ldm.wan.model as wan_model
    monkeypatch.setattr(wan_model.WanSelfAttention, "forward", _container_self_attention(wan_model, attention))
    base = comfy_env.make_wan("t2v", **MODEL)
    reference = forward(base)
    patched, _ = env.node.apply_patch(base, "High", "auto", True)
    with SdpaHeads(env.torch) as spy:
        out = forward(base, patched)
    assert rel_err(out, reference) <= 1e-5
    assert set(spy.self_heads) == {1}


@pytest.mark.parametrize("kind", ["t2v", "i2v", "vace"])
def test_every_level_with_other_nodes_hooks(env, kind):
    """T2V / I2V / VACE at every level, with another node's attn1_patch and double_block patch: equal to stock
    with the same patches (ComfyUI versions that do not call a hook ignore it in both)."""
    torch = env.torch
    base = comfy_env.make_wan(kind, **MODEL)
    stock_calls = []
    hooked = base.clone()
    for name in ("attn1_patch", "double_block"):
        hooked.set_model_patch(other_node_hooks(torch, stock_calls)[name], name)
    size = dict(SIZE, batch=1)
    reference = forward(base, hooked, kind=kind, **size)
    expected_calls = list(stock_calls)
    if comfy_env.version_tuple() >= (0, 33):   # older Wan code calls neither hook
        assert {name for name, _ in expected_calls} == {"attn1", "double_block"}
    for level in env.node.LEVELS:
        for block in (False, True):
            del stock_calls[:]
            env.compat.forget_verdicts()
            patched, _ = env.node.apply_patch(hooked, level, "sdpa", block)
            assert rel_err(forward(base, patched, kind=kind, **size), reference) <= 1e-5, (level, block)
            assert stock_calls == expected_calls


@pytest.mark.parametrize("block", [False, True], ids=["attention", "block"])
def test_quantized_tensor_weights_run_as_comfyui_runs_them(env, block):
    """fp8-scaled checkpoints load as `QuantizedTensor` weights (per-tensor scale): those layers compute in
    their own format, so the pack runs them through the layer (no split yet) and equals stock."""
    torch = env.torch
    quant_ops = pytest.importorskip("comfy.quant_ops")
    if not getattr(quant_ops, "_CK_AVAILABLE", False):
        pytest.skip("comfy_kitchen is not installed: no QuantizedTensor weights in this ComfyUI")
    base = comfy_env.make_wan("t2v", **MODEL)
    for name, module in base.model.diffusion_model.blocks.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and weight is not None and weight.dim() == 2:
            module.weight = torch.nn.Parameter(
                quant_ops.QuantizedTensor.from_float(weight.detach(), "TensorCoreFP8E4M3Layout"),
                requires_grad=False)
    reference = forward(base, **SMALL)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", block)
    assert rel_err(forward(base, patched, **SMALL), reference) <= 1e-5


def _require_quantized_rows(rows: bool = True):
    import comfy.ops
    if not hasattr(comfy.ops, "mixed_precision_ops"):
        pytest.skip("this ComfyUI has no mixed-precision (fp8-scaled) ops")
    if rows and not hasattr(comfy.ops, "CastBiasWeightContext"):
        pytest.skip("this ComfyUI's mixed-precision layers run whole (no CastBiasWeightContext)")


@pytest.mark.parametrize("fmt,full_precision,tolerance", [
    ("float8_e4m3fn", False, 1e-2), ("float8_e5m2", False, 1e-2), ("float8_e4m3fn", True, 1e-5),
    ("int8_tensorwise", False, 1e-2)],
    ids=["e4m3", "e5m2", "full-precision", "int8-weight-only"])
@pytest.mark.parametrize("block", [False, True], ids=["attention", "block"])
def test_fp8_scaled_checkpoint_splits_and_equals_stock(env, fmt, full_precision, tolerance, block):
    """An fp8-scaled checkpoint (mixed-precision ops, per-tensor-scaled QuantizedTensor weights): the input is
    quantized once per layer call as the layer does, each head group is the layer's scaled fp8 matmul on a row
    slice of the quantized weight, so the split runs. Each projection equals the layer's own output bit for bit
    (`test_fp8_scaled_rows_equal_the_layer_bit_for_bit`); the split changes attention's float32 round-off
    (~1e-6), which the next layer's fp8 input quantization can turn into one fp8 step on a few elements: within
    the format's round-off, far below fp8's own error (float model vs this one: about 3e-2).
    Old `scaled_fp8` checkpoints that ask for a full-precision matmul (`full_precision_matrix_mult`): every
    layer dequantizes its weight, rows of that weight are exact and nothing is quantized on the way: float32
    round-off. Weight-only int8 (int8_tensorwise, one scale per weight): each group is the weight's own
    matmul on a row slice of its data (bit-equal columns), which quantizes its input by token: as with fp8,
    the split's float32 round-off can move the next layer's input by one int8 step (1/127) on a few elements."""
    torch = env.torch
    _require_quantized_rows()
    if fmt == "int8_tensorwise" and "int8_tensorwise" not in getattr(importlib.import_module("comfy.ops"),
                                                                     "QUANT_ALGOS", {}):
        pytest.skip("this ComfyUI has no int8_tensorwise format")
    base = comfy_env.make_fp8_scaled_wan("t2v", dim=256, heads=8, layers=1, fmt=fmt,
                                         full_precision_mm=full_precision)
    assert bool(base.model.diffusion_model.blocks[0].self_attn.q._full_precision_mm) == full_precision
    reference = forward(base)
    patched, report = env.node.apply_patch(base, "High", "sdpa", block)
    assert not report.skipped_reasons, report.lines()
    with SdpaHeads(torch) as spy:
        out = forward(base, patched)
    assert set(spy.self_heads) == {1}
    assert env.wan.splits_projections(base.model.diffusion_model) is None
    assert rel_err(out, reference) <= tolerance


@pytest.mark.parametrize("lowvram", [True, False], ids=["lowvram", "full-load"])
def test_fp8_scaled_with_a_lora_splits_and_equals_stock(env, lowvram):
    """With a LoRA loaded as a low-VRAM weight function the layer dequantizes its weight (LoRA applied) for a
    full-precision matmul: rows of that weight; fully loaded, ComfyUI writes the patched weight back as a
    quantized weight: rows of its data. Either way the split still runs and equals stock's (up to one fp8
    step at the next layers' input quantization), and the model without the LoRA is itself again."""
    torch = env.torch
    _require_quantized_rows()
    base = comfy_env.make_fp8_scaled_wan("t2v", dim=256, heads=8, layers=1)
    key = "diffusion_model.blocks.0.self_attn.q.weight"
    lora = base.clone()
    lora.add_patches({key: (torch.randn(256, 256, generator=torch.Generator().manual_seed(3)) * 0.05,)}, 1.0)
    patched, _ = env.node.apply_patch(lora, "High", "sdpa", True)

    def run(patcher):
        with torch.no_grad():
            patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1 if lowvram else 0)
        try:
            if patcher.patches and lowvram:
                assert patcher.model.diffusion_model.blocks[0].self_attn.q.weight_function   # low-VRAM LoRA
            with torch.no_grad(), SdpaHeads(torch) as spy:
                return patcher.model.diffusion_model(**inputs(patcher, "t2v", **SIZE)), spy.self_heads
        finally:
            patcher.unpatch_model()
    plain, _ = run(base)
    stock, _ = run(lora)
    assert rel_err(stock, plain) > 1e-4
    out, heads = run(patched)
    assert set(heads) == {1}
    assert rel_err(out, stock) <= 1e-2
    assert rel_err(run(base)[0], plain) <= 1e-6


def test_fp8_scaled_rows_equal_the_layer_bit_for_bit(env):
    """QuantizedRows: the input quantized once, the scaled fp8 matmul on a row slice of the quantized weight:
    every row range equals the layer's own output exactly (whole, head-group rows, odd ranges)."""
    torch = env.torch
    _require_quantized_rows()
    ops = env.pack.nodes.comfy_ops
    base = comfy_env.make_fp8_scaled_wan("t2v", dim=256, heads=8, layers=1)
    for name in ("q", "k", "v"):
        layer = getattr(base.model.diffusion_model.blocks[0].self_attn, name)
        x = torch.randn(2, 300, 256)
        with torch.no_grad():
            stock = layer(x)
            prepared = ops.ComfyLinearRows(layer).prepare(x)
            assert isinstance(prepared, ops.QuantizedRows)
            assert torch.equal(prepared.full(), stock)
            for a, b in ((0, 32), (32, 64), (224, 256), (5, 77)):
                assert torch.equal(prepared.rows(a, b), stock[..., a:b]), (name, a, b)
            for first, count in ((0, 300), (17, 100), (256, 44)):
                out = torch.empty(2, count, 40)
                prepared.rows_into(out, 100, 140, first)
                assert torch.equal(out, stock[:, first:first + count, 100:140]), (name, first, count)
            prepared.release()
    # q, k and v of one layer call quantize their input once between them
    attention = base.model.diffusion_model.blocks[0].self_attn
    x = torch.randn(2, 100, 256)
    q, k = (ops.ComfyLinearRows(getattr(attention, name)).prepare(x) for name in ("q", "k"))
    assert q.qx is k.qx
    other = ops.ComfyLinearRows(attention.v).prepare(x.clone())
    assert other.qx is not q.qx
    for prepared in (q, k, other):
        prepared.release()


# --- weights streamed through ComfyUI's offload buffers ----------------------------------------------------
class _Stream:
    def wait_stream(self, other):
        pass


@pytest.mark.parametrize("block", [False, True], ids=["attention", "block"])
def test_weights_cast_through_a_shared_offload_buffer(env, monkeypatch, block):
    """A partially loaded model casts its offloaded weights on an offload stream into ONE buffer per stream,
    which the next cast overwrites (ComfyUI's `get_cast_buffer`). Its own layers use a weight before the next
    cast; the pack holds q, k and v (and the FFN's two) at once. Here every offloadable cast goes into one
    shared buffer, as on a GPU with one stream: the pack's head split still runs and equals stock (before
    `cast_owned`, an H200 run found its held weights overwritten: the self-check saw other outputs)."""
    import comfy.ops
    torch = env.torch
    base = comfy_env.make_wan("t2v", **MODEL)
    for module in base.model.diffusion_model.blocks.modules():
        if hasattr(module, "comfy_cast_weights"):
            module.comfy_cast_weights = True   # what ComfyUI's low-VRAM load sets on layers it leaves offloaded
    reference = forward(base)
    real_cast, shared = comfy.ops.cast_bias_weight, {}

    def cast_into_shared_buffer(s, input=None, *args, offloadable=False, **kwargs):
        weight, bias = real_cast(s, input, *args, **kwargs)
        if not offloadable:
            return weight, bias
        need = weight.numel() + (0 if bias is None else bias.numel())
        buffer = shared.get("buffer")
        if buffer is None or buffer.numel() < need or buffer.dtype != weight.dtype:
            buffer = shared["buffer"] = torch.empty(need, dtype=weight.dtype)
        w = buffer[:weight.numel()].view_as(weight).copy_(weight)
        b = None if bias is None else buffer[weight.numel():need].view_as(bias).copy_(bias)
        return w, b, (_Stream(), w, b)

    monkeypatch.setattr(comfy.ops, "cast_bias_weight", cast_into_shared_buffer)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", block)
    with SdpaHeads(torch) as spy:
        out = forward(base, patched)
    assert rel_err(out, reference) <= 1e-5
    assert set(spy.self_heads) == {MODEL["heads"] // env.core.group_count(MODEL["heads"], 2 * 4224, 3)}


@pytest.mark.parametrize("lowvram", [False, True], ids=["full-load", "lowvram"])
def test_fp8_stored_weights_with_a_lora_equal_stock(env, lowvram):
    """A LoRA on fp8 weights cast per call: fully loaded, ComfyUI writes the patched weight back in fp8 (rows
    of it are cast per head group); low-VRAM, the patch is a weight function on the cast (the pack casts
    that layer's weight whole, through it). Both equal stock, the split runs, and the unpatched model is
    stock again afterwards."""
    torch = env.torch
    base = fp8_wan(torch)
    size = dict(frames=3, h=64, w=88, batch=2, dtype=torch.float32)   # the compute dtype, not the stored one
    plain = forward(base, **size)
    g = torch.Generator().manual_seed(3)
    patches = {}
    for attention in ("self_attn", "cross_attn"):
        for name in ("q", "k", "v", "o"):
            key = f"diffusion_model.blocks.0.{attention}.{name}.weight"
            shape = base.model.get_parameter(key).shape
            patches[key] = (torch.randn(tuple(shape), generator=g) * 0.05,)
    lora = base.clone()
    lora.add_patches(patches, 1.0)
    patched, _ = env.node.apply_patch(lora, "High", "sdpa", True)

    def run(patcher):
        with torch.no_grad():   # as ComfyUI loads (its executor runs under inference mode)
            patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1 if lowvram else 0)
        try:
            if lowvram:
                assert len(patcher.model.diffusion_model.blocks[0].self_attn.q.weight_function) > 0
            with torch.no_grad():
                return patcher.model.diffusion_model(**inputs(patcher, **size))
        finally:
            patcher.unpatch_model()

    stock = run(lora)
    with SdpaHeads(torch) as spy:
        ours = run(patched)
    assert rel_err(stock, plain) > 1e-3      # the LoRA changes the output
    assert rel_err(ours, stock) <= 1e-5
    assert set(spy.self_heads) == {1}
    assert rel_err(forward(base, **size), plain) <= 1e-6


@pytest.mark.parametrize("layout", ["TensorCoreNVFP4Layout", "TensorCoreMXFP8Layout"])
def test_block_scaled_weights_slice_by_128_row_blocks(env, layout):
    """nvfp4 / mxfp8 weights keep their block scales by blocks of 128 weight rows (cuBLAS's blocked layout):
    whole blocks of the data and of the scales slice exactly (their dequantization equals the whole
    weight's rows, the last, padded block included); a head group inside a block is computed from its
    whole block and sliced; rows not on block bounds are refused. Their matmul kernels need a Blackwell GPU
    (not run here): on a CPU the layer's product dequantizes, which the rows are compared through."""
    import torch.nn.functional as F
    torch = env.torch
    _require_quantized_rows()
    quant_ops = pytest.importorskip("comfy.quant_ops")
    if layout not in getattr(env.ops, "BLOCK_ROW_LAYOUTS", {}) or not getattr(quant_ops, "_CK_AVAILABLE", False):
        pytest.skip("no block-scaled QuantizedTensor in this ComfyUI")
    try:
        weight = quant_ops.QuantizedTensor.from_float(torch.randn(320, 256, dtype=torch.bfloat16), layout)
    except Exception as e:   # noqa: BLE001 - a comfy_kitchen without this layout
        pytest.skip(f"{layout} not available: {e}")
    import comfy.ops
    quant_format = {"TensorCoreNVFP4Layout": "nvfp4", "TensorCoreMXFP8Layout": "mxfp8"}[layout]
    layer = comfy.ops.mixed_precision_ops({}, torch.bfloat16).Linear(256, 320, bias=False, dtype=torch.bfloat16)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.layout_type, layer.quant_format = layout, quant_format
    assert env.ops.quantized_rows_mode(layer) == ("quantized", None)   # the head split runs on such layers
    whole = weight.dequantize()
    rows = env.ops.QuantizedRows
    for start, stop in ((0, 128), (128, 256), (256, 320), (0, 320)):
        assert torch.equal(rows._row_slice(weight, start, stop).dequantize(), whole[start:stop])
    with pytest.raises(ValueError, match="128-row blocks"):
        rows._row_slice(weight, 64, 192)
    x = torch.randn(2, 50, 256, dtype=torch.bfloat16)
    prepared = rows.__new__(rows)                     # the layer's product on a 16-bit input, as on a CPU
    prepared.shape, prepared.qx, prepared.weight, prepared.bias = x.shape, x.reshape(-1, 256), weight, None
    full = F.linear(x, weight)
    torch.testing.assert_close(prepared.full(), full, rtol=0, atol=0)
    for start, stop in ((0, 128), (64, 192), (256, 320), (96, 100)):
        torch.testing.assert_close(prepared.rows(start, stop), full[..., start:stop], rtol=0, atol=0)


def test_fp8_matrix_multiplication_ops_split_and_equal_stock(env):
    """ComfyUI's fp8 ops (`--fast fp8_matrix_mult`: `fp8_linear`, the input clamped and cast to fp8, one fp8
    matmul with scale 1): each head group is that matmul on rows of the fp8 weight, the input cast once
    for q, k and v. The split runs and equals stock to the format's round-off (bf16 compute; an fp8 step of
    the next layer's input where the split's round-off moves it; the projections themselves are bit-equal)."""
    import comfy.model_patcher
    import comfy.ops
    torch = env.torch
    if not hasattr(comfy.ops, "fp8_linear") or not hasattr(comfy.ops, "CastBiasWeightContext"):
        pytest.skip("this ComfyUI's fp8 ops predate QuantizedTensor")
    cls, cfg = comfy_env._wan_config("t2v", 256, 8, 1, None, 32, 1, {})
    model_config = cls(cfg)
    model_config.set_inference_dtype(torch.float8_e4m3fn, torch.bfloat16)
    model_config.custom_operations = comfy.ops.fp8_ops
    model = model_config.get_model({}, device=torch.device("cpu"))
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    base = comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))
    q = model.diffusion_model.blocks[0].self_attn.q
    assert isinstance(q, comfy.ops.fp8_ops.Linear) and env.ops.fp8_matmul_rows(q)
    size = dict(frames=3, h=64, w=88, batch=2, dtype=torch.bfloat16)
    reference = forward(base, **size)
    patched, report = env.node.apply_patch(base, "High", "sdpa", True)
    assert not report.skipped_reasons, report.lines()
    with SdpaHeads(torch) as spy:
        out = forward(base, patched, **size)
    assert set(spy.self_heads) == {1}
    # fp8 with scale 1 rounds O(1) activations in steps of 1/16 to 1/8: the split's bf16 round-off moves a few
    # elements of the next layers' inputs by one step (measured 0.013; 0.042 while the output projection and
    # the FFN still ran as bf16 matmuls of the cast weight instead of the layers' own fp8 matmul)
    assert rel_err(out, reference) <= 3e-2
    ffn_up = model.diffusion_model.blocks[0].ffn[0]
    assert env.ops.CastLinear(ffn_up, torch.zeros(1, 1, 256, dtype=torch.bfloat16)).own_format   # the layer's own
    x = torch.randn(2, 40, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        prepared = env.ops.ComfyLinearRows(q).prepare(x.clone())
        layer = q(x.clone())
        assert torch.equal(prepared.rows(64, 128), layer[..., 64:128])   # bit for bit, as the layer computes
