"""The Wan adapter against a real ComfyUI: patched output equals ComfyUI's own forward.

Tiny random-weight Wan models (T2V, I2V, 2.2 5B, VACE) built from `comfy.supported_models`; 2 x 4,224 tokens, the
runtime's floor lowered so that 4,096 tokens an item split (Wan's floor is twice the runtime's: real sizes split
from 16,384), so the head split really runs. Skipped with
the reason when no ComfyUI checkout is found (tests/comfy_env.py says where it looks).
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from support import comfy_env

pytestmark = pytest.mark.comfyui

SIZE = dict(frames=3, h=64, w=88, batch=2)   # 3 x 32 x 44 = 4,224 tokens per item
MODEL = dict(dim=256, heads=8, layers=1)     # head_dim 32; 8 heads split 1/4/8/8 at Off/Low/Medium/High
KINDS = ("t2v", "i2v", "wan22_5b", "vace")


@pytest.fixture(scope="module")
def env():
    # cond + uncond of 4,224 tokens each: split as 16,384+ tokens an item are (the floor counts one item; Wan's is
    # 2x the runtime's, `wan.SPEC.measured.split_floor_scale`)
    with comfy_env.split_floor_tokens(comfy_env.pack_modules(), 2048) as modules:
        yield modules


def inputs(patcher, kind):
    return comfy_env.make_inputs(patcher.model, kind, per_frame_t=(kind == "wan22_5b"), **SIZE)


def forward(patcher, kind, applied=None):
    """The diffusion model's output with `applied`'s object patches in place (None: as loaded)."""
    import torch
    if applied is not None:
        applied.patch_model(load_weights=False)
    try:
        with torch.no_grad():
            return patcher.model.diffusion_model(**inputs(patcher, kind))
    finally:
        if applied is not None:
            applied.unpatch_model(unpatch_weights=False)


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


SdpaHeads = comfy_env.SdpaHeads


@pytest.mark.parametrize("kind", KINDS)
def test_patched_equals_stock_at_every_level(env, kind):
    base = comfy_env.make_wan(kind, **MODEL)
    reference = forward(base, kind)
    for level in env.node.LEVELS:
        for block in (False, True):
            patched, report = env.node.apply_patch(base, level, "sdpa", block)
            assert report.any_patched and not report.skipped_reasons, report.lines()
            with SdpaHeads(env.torch) as spy:
                out = forward(base, kind, applied=patched)
            assert rel_err(out, reference) <= 1e-5, (kind, level, block)
            groups = env.core.group_count(8, SIZE["batch"] * 4224, env.node.LEVELS.index(level))
            assert set(spy.self_heads) == {8 // groups}, (level, spy.self_heads)  # really ran split
    # the unpatched model is stock again
    assert env.torch.equal(forward(base, kind), reference)


def test_block_patch_covers_every_block_and_vace_block(env):
    base = comfy_env.make_wan("vace", dim=128, heads=4, layers=2, vace_layers=1)
    patched, report = env.node.apply_patch(base, "High", "auto", True)
    paths = set(patched.object_patches)
    assert {"diffusion_model.blocks.0.forward", "diffusion_model.blocks.1.forward",
            "diffusion_model.vace_blocks.0.forward"} <= paths
    patched, report = env.node.apply_patch(base, "High", "auto", False)
    assert "diffusion_model.blocks.1.self_attn.forward" in patched.object_patches
    assert "diffusion_model.vace_blocks.0.cross_attn.forward" in patched.object_patches
    assert not any(p.endswith("blocks.0.forward") for p in patched.object_patches)


def test_sampling_gives_the_same_latent(env):
    """3 steps of `comfy.sample.sample`; cond and uncond are batched: 2 x 4,224 tokens, so it splits."""
    size = dict(SIZE, batch=1)
    base = comfy_env.make_wan("t2v", **MODEL)
    stock = comfy_env.run_sample(base, **size)
    patched, _ = env.node.apply_patch(base, "High", "auto", True)
    with SdpaHeads(env.torch) as spy:
        latent = comfy_env.run_sample(patched, **size)
    assert set(spy.self_heads) == {1}       # High: 8 groups of one head, in every step
    assert rel_err(latent, stock) <= 1e-5
    # the input MODEL (another branch of the workflow) still samples as stock
    assert rel_err(comfy_env.run_sample(base, **size), stock) <= 1e-6


@pytest.mark.parametrize("e_shape", [(2, 6, 32), (2, 1, 6, 32), (2, 5, 6, 32), (2, 7, 6, 32), (2, 40, 6, 32),
                                     (2, 41, 6, 32)], ids=["B6C", "B16C", "frames-divide", "frames-uneven",
                                                           "per-token", "more-than-tokens"])
def test_modulation_by_token_range_matches_repeat_e(env, e_shape):
    """The bounded block takes Wan's modulation a token range at a time, as `repeat_e` would repeat it."""
    torch = env.torch
    import comfy.ldm.wan.model as wan_model
    block = torch.nn.Module()
    block.modulation = torch.nn.Parameter(torch.randn(1, 6, 32))
    e, x = torch.randn(e_shape), torch.randn(2, 40, 32)
    if len(e_shape) < 4:
        stock = (block.modulation + e).chunk(6, dim=1)
    else:
        stock = (block.modulation.unsqueeze(0) + e).unbind(2)
    modulation = env.wan._Modulation(block, e, x)
    for index in range(6):
        full = wan_model.repeat_e(stock[index], x).expand_as(x)
        for a, b in ((0, 40), (3, 17), (39, 40)):
            assert torch.equal(modulation(index, a, b).expand(2, b - a, 32), full[:, a:b]), (index, a, b)


def _lora_patches(torch, model, seed=3):
    g = torch.Generator().manual_seed(seed)
    patches = {}
    for name in ("q", "k", "v", "o"):
        key = f"diffusion_model.blocks.0.self_attn.{name}.weight"
        weight = model.get_parameter(key)
        patches[key] = (torch.randn(weight.shape, generator=g) * 0.05,)
    for name in ("q", "k", "v", "o"):
        key = f"diffusion_model.blocks.0.cross_attn.{name}.weight"
        patches[key] = (torch.randn(model.get_parameter(key).shape, generator=g) * 0.05,)
    return patches


@pytest.mark.parametrize("lowvram", [False, True], ids=["full-load", "lowvram-weight-function"])
def test_lora_on_qkvo_gives_the_same_output(env, lowvram):
    torch = env.torch
    base = comfy_env.make_wan("t2v", **MODEL)
    plain = forward(base, "t2v")
    lora = base.clone()
    lora.add_patches(_lora_patches(torch, base.model), 1.0)
    patched, _ = env.node.apply_patch(lora, "High", "auto", True)

    def run(patcher, ours):
        if lowvram:
            patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1)
            q = patcher.model.diffusion_model.blocks[0].self_attn.q
            assert len(q.weight_function) > 0 and q.comfy_cast_weights   # the LowVramPatch path
        else:
            patcher.patch_model(device_to=torch.device("cpu"))
        try:
            with torch.no_grad():
                return patcher.model.diffusion_model(**inputs(patcher, "t2v"))
        finally:
            patcher.unpatch_model()

    stock_lora = run(lora, False)
    ours_lora = run(patched, True)
    assert rel_err(stock_lora, plain) > 1e-3            # the LoRA does change the output
    assert rel_err(ours_lora, stock_lora) <= 1e-5
    assert rel_err(forward(base, "t2v"), plain) <= 1e-6  # and is gone afterwards


def test_another_family_gets_the_kernel_level_patch(env, caplog):
    """A model no adapter covers: its attention calls go through the pack's override (nothing else of the
    model is touched); with attention_backend=comfy it passes through untouched, said in one log line; the
    node applied again replaces its own override."""
    torch = env.torch

    class NotWan(torch.nn.Module):
        def forward(self, x):
            return x
    patcher = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
    clone = patcher.clone()
    clone.model = SimpleNamespace(diffusion_model=NotWan())  # what apply_patch probes
    caplog.set_level("INFO")
    out, report = env.node.apply_patch(clone, "High", "auto", True)
    override = out.model_options["transformer_options"]["optimized_attention_override"]
    assert not out.object_patches and report.any_patched and override.comfyui_qkv_kernel_patch
    assert "NotWan: kernel only (no family adapter yet)" in caplog.text
    again, _ = env.node.apply_patch(out, "High", "sdpa", True)
    assert again.model_options["transformer_options"]["optimized_attention_override"].previous is None
    untouched, report = env.node.apply_patch(clone, "High", "comfy", True)
    assert "optimized_attention_override" not in untouched.model_options.get("transformer_options", {})
    assert not untouched.object_patches and not report.any_patched
    assert "not patched: NotWan has no family adapter here, and attention_backend=comfy keeps" in caplog.text


def test_quantized_weight_is_not_row_sliceable(env):
    torch = env.torch
    import comfy.ops
    ops = env.pack.nodes.comfy_ops
    plain = comfy.ops.disable_weight_init.Linear(8, 8)
    assert ops.not_row_sliceable(plain) is None
    assert ops.not_row_sliceable(comfy.ops.manual_cast.Linear(8, 8)) is None
    fp8 = comfy.ops.manual_cast.Linear(8, 8, dtype=torch.float8_e4m3fn)   # fp8 stored, cast per call
    assert ops.not_row_sliceable(fp8) is None
    raw = comfy.ops.disable_weight_init.Linear(8, 8)
    raw.weight = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.uint8), requires_grad=False)  # raw bytes
    assert "weight" in ops.not_row_sliceable(raw)
    custom = type("GGUFLinear", (comfy.ops.disable_weight_init.Linear,), {
        "forward_comfy_cast_weights": lambda self, x: x})(8, 8)
    assert "computes its own way" in ops.not_row_sliceable(custom)
    quant_ops = pytest.importorskip("comfy.quant_ops")
    if not getattr(quant_ops, "_CK_AVAILABLE", False):
        pytest.skip("comfy_kitchen is not installed: no QuantizedTensor weights in this ComfyUI")
    for layout in ("TensorCoreFP8E4M3Layout", "TensorCoreNVFP4Layout"):
        linear = comfy.ops.disable_weight_init.Linear(32, 16)
        weight = quant_ops.QuantizedTensor.from_float(torch.randn(16, 32), layout)
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        assert "QuantizedTensor" in ops.not_row_sliceable(linear), layout


def test_unsliceable_projection_runs_unsplit_with_one_notice(env, caplog):
    """A q projection with no row slice (e.g. a block-scaled QuantizedTensor) on a long stream: the call
    runs unsplit, with the same numbers, and says so once."""
    torch = env.torch
    base = comfy_env.make_wan("t2v", **MODEL)
    reference = forward(base, "t2v")
    patched, _ = env.node.apply_patch(base, "High", "sdpa", False)
    ops = env.pack.nodes.comfy_ops
    original = ops.ComfyLinearRows.__init__

    def refuse_q(self, linear):
        original(self, linear)
        if linear is base.model.diffusion_model.blocks[0].self_attn.q:
            self._reason = "test: block-scaled weight"
    env.core.reset_notices()
    caplog.set_level("INFO")
    ops.ComfyLinearRows.__init__ = refuse_q
    try:
        with SdpaHeads(torch) as spy:
            out = forward(base, "t2v", applied=patched)
    finally:
        ops.ComfyLinearRows.__init__ = original
    assert rel_err(out, reference) <= 1e-5
    assert set(spy.self_heads) == {8}   # self-attention ran with all heads together
    assert caplog.text.count("[Attention] Head Split is not applied") == 1


def test_memory_estimate_follows_what_the_run_does(env, monkeypatch):
    """ComfyUI plans weights vs activations from `memory_usage_factor`: inside a patched run it is lowered
    by what the run will really do, once the pack's forwards have passed their self-check in this process,
    and restored afterwards. Attention patched alone leaves the FFN's peak (1.0); a sequence under the split
    floor, or head split Off, gets the unsplit block's factor."""
    import comfy.patcher_extension
    env.pack.nodes.compat.forget_verdicts()
    base = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
    stock_factor = base.model.memory_usage_factor
    seen = []

    def probe(executor, *args, **kwargs):
        model = executor.class_obj.model_patcher.model
        seen.append(model.memory_usage_factor)
        return executor(*args, **kwargs)

    def run(level, block):
        patched, _ = env.node.apply_patch(base, level, "auto", block)
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, "zz_probe", probe)
        comfy_env.run_sample(patched, frames=3, h=8, w=8, steps=1)   # 48 tokens
        assert base.model.memory_usage_factor == stock_factor
        return seen[-1] / stock_factor

    assert run("High", True) == pytest.approx(1.0)        # first run: nothing verified yet
    assert run("High", True) == pytest.approx(env.wan.SPEC.measured.memory_factors.unsplit)   # 48 tokens: no split
    monkeypatch.setattr(env.core.head_split, "SPLIT_FLOOR_TOKENS", 16)
    assert run("High", True) == pytest.approx(env.wan.SPEC.measured.memory_factors.split)
    assert run("Off", True) == pytest.approx(env.wan.SPEC.measured.memory_factors.unsplit)
    assert run("High", False) == pytest.approx(1.0)
    assert env.wan.SPEC.measured.memory_factors.split < env.wan.SPEC.measured.memory_factors.unsplit < 1


def test_memory_estimate_is_restored_after_a_cancel(env):
    """An interrupted run (ComfyUI raises InterruptProcessingException from inside the model) leaves the
    model's estimate as it was."""
    import comfy.model_management
    import comfy.patcher_extension
    base = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
    stock_factor = base.model.memory_usage_factor
    patched, _ = env.node.apply_patch(base, "High", "auto", True)

    def cancel(executor, *args, **kwargs):
        raise comfy.model_management.InterruptProcessingException()

    patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.PREDICT_NOISE, "zz_cancel", cancel)
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        comfy_env.run_sample(patched, frames=3, h=8, w=8, steps=1)
    assert base.model.memory_usage_factor == stock_factor


@pytest.mark.parametrize("tokens,per_token,budget", [
    (75600, 13824, 75600 * 5120 // 2), (32760, 13824, 32760 * 5120 // 2), (12288, 1536, 12288 * 512 // 2),
    (300, 10, 1000), (1000, 1, 10 ** 9)])
def test_even_chunks_respect_the_budget(env, tokens, per_token, budget):
    """FFN / cross-attention chunks: never above what the budget allows, as few chunks as that allows, as
    equal as possible, and whole multiples of 256 tokens where that still fits."""
    ops = importlib.import_module(env.pack.__name__ + ".nodes.comfy_ops")
    most = ops.chunk_tokens(tokens, per_token, budget)
    step = ops.even_chunk_tokens(tokens, per_token, budget)
    assert step <= most
    assert -(-tokens // step) == -(-tokens // most)       # no more chunks than the budget needs
    sizes = [b - a for a, b in ops.token_ranges(tokens, step)]
    assert sum(sizes) == tokens and max(sizes) - min(sizes) <= max(256, -(-tokens // len(sizes)))
    if -(-(-(-tokens // len(sizes))) // 256) * 256 <= most:
        assert step % 256 == 0


def test_every_adapter_meets_the_family_contract(env):
    """nodes/families/family.py: what patching, the memory estimate and the report need of a family adapter, and
    the checked fields of its measured row (`SPEC.measured`, measured.py)."""
    import dataclasses
    family = env.pack.nodes.families.family
    for adapter in env.node.ADAPTERS:
        assert isinstance(adapter, family.FamilyAdapter), adapter
        family.check_adapter(adapter)
        factors = adapter.SPEC.measured.memory_factors
        assert 0 < factors.split <= factors.unsplit <= 1
        # below ComfyUI's own estimate only where a whole model of the family was measured
        assert factors.unsplit == 1 or "not measured" not in factors.measured
    assert {adapter.FAMILY for adapter in env.node.ADAPTERS} >= {"Wan", "Flux", "Qwen-Image", "Lumina2"}
    broken = SimpleNamespace(FAMILY="Broken", matches=lambda m: False)
    with pytest.raises(TypeError, match=r"is not a family adapter: it lacks SPEC, patch, "):
        family.check_adapter(broken)
    names = ("FAMILY", "matches", "patch", "stock_functions", "tokens_per_item", "kv_heads", "splits_projections",
             "block_kinds")
    row = env.wan.SPEC.measured

    def adapter_with(**fields):
        spec = dataclasses.replace(env.wan.SPEC, measured=dataclasses.replace(row, **fields))
        return SimpleNamespace(**{name: getattr(env.wan, name) for name in names}, SPEC=spec)
    with pytest.raises(ValueError, match=r"0 < split <= unsplit <= 1"):
        family.check_adapter(adapter_with(memory_factors=family.MemoryFactors(split=0.9, unsplit=0.6,
                                                                               measured="test")))
    # the planner's working sets: the pack's bounded block below stock's, for every kind of block
    for adapter in env.node.ADAPTERS:
        for kind, working_set in adapter.SPEC.measured.working_sets.items():
            assert working_set.bounded(16) < working_set.bounded(1) < working_set.stock, (adapter.FAMILY, kind)
    with pytest.raises(ValueError, match=r"working set is out of order"):
        family.check_adapter(adapter_with(working_sets={"block": family.WorkingSet(stock=1.0, bounded_whole=3.0,
                                                                                   measured="test")}))
    # the split floor's scale and the short-runs flag are checked fields of every family's row
    for adapter in env.node.ADAPTERS:
        measured = adapter.SPEC.measured
        assert measured.split_floor_scale >= 1 and isinstance(measured.short_runs_stock, bool), adapter.FAMILY
    for bad in (0.5, True, "2"):
        with pytest.raises(ValueError, match=r"split_floor_scale must be a number >= 1"):
            family.check_adapter(adapter_with(split_floor_scale=bad))
    with pytest.raises(ValueError, match=r"short_runs_stock must be True or False"):
        family.check_adapter(adapter_with(short_runs_stock=1))
    for bad in (0, -1, True, "2"):   # the family's multiple of the level's head groups
        with pytest.raises(ValueError, match=r"group_scale must be a number > 0"):
            family.check_adapter(adapter_with(group_scale=bad))
    family.check_adapter(adapter_with())


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_cross_attention_counts_one_item_against_the_floor(env, kind):
    """The text context is a short stream (projected whole once, sliced per head group) when one item's tokens are
    under the split floor, as the runtime counts them: a batch of items that together pass the floor does not
    change that; a context of one item as long as the floor is projected by head group. Both equal ComfyUI's."""
    import torch
    wan = env.wan
    core = importlib.import_module(env.pack.__name__ + ".qkv_core")
    base = comfy_env.make_wan(kind, **MODEL)
    module = base.model.diffusion_model.blocks[0].cross_attn
    g = torch.Generator().manual_seed(5)
    image_tokens = 257 if kind == "i2v" else 0
    batch, text = 4, 64
    x = torch.randn(batch, 96, MODEL["dim"], generator=g)
    context = torch.randn(batch, image_tokens + text, MODEL["dim"], generator=g)
    with torch.no_grad():
        reference = module(x, context, context_img_len=image_tokens or None)
    for floor, whole in ((text + 1, True), (text * batch - 1, True), (text, False)):
        assert (batch * text >= floor) or whole
        config = env.node.QKVConfig(3, "sdpa", True, split_floor_tokens=floor)
        cross = wan.CrossAttention(module, context, image_tokens or None, config, {}, like=x)
        try:
            assert isinstance(cross.rows[1], core.WholeProjection) == whole, (floor, cross.rows)
        finally:
            cross.release()
        with torch.no_grad():
            out = wan.run_cross_attention(module, config, x.clone(), context, image_tokens or None)
        assert rel_err(out, reference) <= 1e-5, (floor, rel_err(out, reference))
