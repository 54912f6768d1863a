"""The contract every family adapter meets, one parametrized test per promise (tests/support/family_cases.py builds
the tiny models, from ComfyUI's own configs, with more tokens than the split floor): the patched model equals stock
at every level, with and without block bounds, and really splits; a short sampling run equals stock; a LoRA on a
q/k/v (or fused qkv) weight gives the LoRA's output, merged or applied per call (low-VRAM loading); bf16 is as
close to float32 as stock; another node's attn1_patch and an argument the pack does not know leave the call to
ComfyUI; fp8 weights cast per call and GGUF weights equal stock; the unpatched model is stock again. Masks
(HunyuanVideo's text padding, LTX-Video's cross-attention text mask), Qwen-Image's reference latents, grouped-query
heads (Lumina 2), Kandinsky 5's text and visual blocks and HiDream's mixture-of-experts blocks are in the cases; every
family of the registry (nodes/families/__init__.py) has one. Skipped without ComfyUI."""
from __future__ import annotations

import importlib
import math

import pytest

from support import comfy_env
from support import family_cases
from support.family_runs import _family_floor, case_forward, env, family_groups, registered, rel_err  # noqa: F401

pytestmark = pytest.mark.comfyui


def test_the_cases_cover_every_registered_family(env):
    """family_cases has a case for every family the registry lists (the patch loop's and the node's description's),
    and no case of a family it does not list: the lists cannot disagree."""
    families = importlib.import_module(f"{env.pack.__name__}.nodes.families")
    description = importlib.import_module(f"{env.pack.__name__}.nodes.patch_node").QKVPatch.define_schema().description
    assert set(family_cases.ADAPTER_MODULES.values()) == set(families.MODULES)
    assert set(family_cases.ADAPTER_MODULES) == set(family_cases.CASES)
    assert families.ADAPTERS == env.node.ADAPTERS
    for family in families.FAMILIES:
        assert family.adapter is importlib.import_module(f"{env.pack.__name__}.nodes.families.{family.module}")
        assert family.names and all(name in description for name in family.names), family


def test_measured_constants_come_from_one_table(env):
    """Every registered family holds its row of nodes/families/measured.py (its adapter's `SPEC`), whose split
    policy enters a call's configuration through `Family.configure`, and every row cites sections of
    docs/benchmarks.md that exist."""
    import re
    families = importlib.import_module(f"{env.pack.__name__}.nodes.families")
    measured = importlib.import_module(f"{env.pack.__name__}.nodes.families.measured")
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', (comfy_env.REPO_ROOT / "docs" / "benchmarks.md").read_text()))
    assert set(measured.TABLE) == set(families.MODULES)
    plain = env.node.QKVConfig(3, "sdpa", True)
    for family in families.FAMILIES:
        row = measured.TABLE[family.module]
        assert family.measured is row and family.adapter.SPEC is family, family.module
        config = family.configure(plain)
        assert (config.floor_scale, config.short_runs_stock, config.group_scale) == \
            (row.split_floor_scale, row.short_runs_stock, row.group_scale), family.module
        for where in row.anchors():
            path, _, anchor = where.partition("#")
            assert path == "docs/benchmarks.md" and anchor in anchors, (family.module, where)


def _fallbacks(env):
    return comfy_env.stock_fallbacks(env)


@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_patched_equals_stock_at_every_level(env, family):
    case = family_cases.case(family)
    reference = case_forward(case)
    for level in env.node.LEVELS:
        for bounds in (False, True):
            patched, report = env.node.apply_patch(case.patcher, level, "sdpa", bounds)
            assert report.any_patched and not report.skipped_reasons, report.lines()
            env.core.reset_notices()
            with comfy_env.SdpaHeads(env.torch) as spy:
                out = case_forward(case, applied=patched)
            assert not _fallbacks(env), (family, level, bounds)
            assert rel_err(out, reference) <= 1e-5, (family, level, bounds, rel_err(out, reference))
            groups = family_groups(env, family, case.kv_heads, env.node.LEVELS.index(level))
            assert (case.heads or case.kv_heads) // groups in spy.self_heads, (family, level, spy.self_heads)
    assert rel_err(case_forward(case), reference) == 0   # the unpatched model is stock again


@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_sampling_equals_stock(env, family):
    import comfy.sample
    case = family_cases.case(family)

    def sample(patcher):
        positive, negative = case.conds()
        noise = comfy.sample.prepare_noise(case.latent, 0)
        return comfy.sample.sample(patcher, noise, 2, 4.0, "euler", "simple", positive, negative, case.latent,
                                   disable_pbar=True, seed=0)
    stock = sample(case.patcher)
    patched, _ = env.node.apply_patch(case.patcher, "High", "auto", True)
    env.core.reset_notices()
    ours = sample(patched)
    assert not _fallbacks(env)
    assert rel_err(ours, stock) <= 1e-4


@pytest.mark.parametrize("lowvram", [False, True], ids=["full-load", "lowvram-weight-function"])
@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_lora_on_the_projection_weight(env, family, lowvram):
    """A LoRA on every weight matrix of the block that holds the case's q/k/v (or fused qkv) weight (its
    attentions' projections, the text stream's where it has one, the outputs, the feed-forward, the modulation),
    merged into the weights or (low-VRAM loading) applied by each layer's weight function at every call: the
    patched model gives the LoRA's output, and none once removed."""
    import re
    torch = env.torch
    case = family_cases.case(family)
    plain = case_forward(case)
    block = re.match(r"(diffusion_model\.[a-z_]+\.\d+)\.", case.lora_key).group(1)
    g = torch.Generator().manual_seed(3)
    patches = {f"{block}.{name}": (torch.randn(weight.shape, generator=g) * 0.05,)
               for name, weight in case.patcher.model.get_submodule(block).named_parameters()
               if name.endswith("weight") and weight.dim() == 2}
    assert case.lora_key in patches
    lora = case.patcher.clone()
    lora.add_patches(patches, 1.0)
    layer = case.lora_key[len("diffusion_model."):-len(".weight")] if lowvram else None
    stock_lora = case_forward(case, applied=lora, weights=True, lowvram_layer=layer)
    patched, _ = env.node.apply_patch(lora, "High", "sdpa", True)
    env.core.reset_notices()
    ours_lora = case_forward(case, applied=patched, weights=True, lowvram_layer=layer)
    assert not _fallbacks(env)
    assert rel_err(stock_lora, plain) > 1e-3             # the LoRA changes the output
    assert rel_err(ours_lora, stock_lora) <= 1e-5
    assert rel_err(case_forward(case), plain) <= 1e-6         # and is gone afterwards


def _in_bf16(patcher):
    """`patcher`'s model as ComfyUI loads it in bf16: built by its config at that inference dtype (the layers it
    keeps in float32 stay so), with the same weights; a layer of another shape than the config's (one the case
    put in, Mochi's smaller feed-forward) is the case's, cast."""
    import copy
    import torch
    import comfy.model_patcher
    model_config = type(patcher.model.model_config)(dict(patcher.model.model_config.unet_config))
    model_config.set_inference_dtype(torch.bfloat16, None)
    model = model_config.get_model({}, device=torch.device("cpu"))
    weights, built = patcher.model.diffusion_model.state_dict(), model.diffusion_model.state_dict()
    for key in [key for key in weights if built[key].shape != weights[key].shape]:
        owner, _, _ = key.rpartition(".")
        parent, _, name = owner.rpartition(".")
        layer = copy.deepcopy(patcher.model.diffusion_model.get_submodule(owner)).to(torch.bfloat16)
        setattr(model.diffusion_model.get_submodule(parent), name, layer)
    model.diffusion_model.load_state_dict(weights)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_bf16_is_as_close_to_float32_as_stock(env, family):
    """The case's model and inputs in bf16 (both batch items): the self-checks pass and the patched output is as
    far from the float32 output as bf16 round-off of a reordered computation takes it, next to stock's own
    distance from it."""
    torch = env.torch
    case = family_cases.case(family)
    reference = case_forward(case)
    case = case._replace(patcher=_in_bf16(case.patcher))
    stock16 = case_forward(case, dtype=torch.bfloat16)
    patched, _ = env.node.apply_patch(case.patcher, "High", "sdpa", True)
    env.core.reset_notices()
    ours16 = case_forward(case, applied=patched, dtype=torch.bfloat16)
    assert not _fallbacks(env)
    assert rel_err(ours16, reference) <= 2 * rel_err(stock16, reference) + 1e-2, \
        (family, rel_err(ours16, reference), rel_err(stock16, reference))


@pytest.mark.parametrize("bounds", [False, True], ids=["attention", "block"])
@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_another_nodes_attn1_patch_runs_stock(env, family, bounds):
    """Another node's `attn1_patch`, in the form ComfyUI's forward calls it: the hook runs as often as on stock
    and the output is stock's. On q/k/v before the self-attention (Flux, Qwen-Image, Cosmos, ...) the pack's
    attention steps aside, saying why (Wan's, on the attention's output, its attention runs and its block's
    self-check steps aside); where ComfyUI never calls it, neither does the pack."""
    case = family_cases.case(family)
    seen = []

    def hook(*args, **kwargs):
        if len(args) == 1 and isinstance(args[0], dict):   # Wan's: the attention's output x (and q, k) in a dict
            seen.append("output")
            return args[0]["x"] * 1.5
        seen.append("qkv")
        return {"q": args[0] * 1.5}
    hooked = case.patcher.clone()
    hooked.set_model_attn1_patch(hook)
    reference = case_forward(case, applied=hooked)
    count = len(seen)
    patched, _ = env.node.apply_patch(hooked, "High", "sdpa", bounds)
    env.core.reset_notices()
    out = case_forward(case, applied=patched)
    assert seen[count:] == seen[:count], family
    if "qkv" in seen:
        assert any("attn1_patch hook needs whole q/k/v" in line for line in _fallbacks(env)), _fallbacks(env)
    assert rel_err(out, reference) <= 1e-5


@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_an_argument_the_pack_does_not_know_runs_stock(env, family, monkeypatch):
    """A newer ComfyUI whose attention takes an argument the pack's forward does not know (`new_argument`): the
    pack leaves that module to ComfyUI when it patches, or a call that passes the argument runs ComfyUI's forward;
    either way the reason names the argument and the result is ComfyUI's."""
    torch = env.torch
    case = family_cases.case(family)
    patched, _ = env.node.apply_patch(case.patcher, "High", "sdpa", False)   # the attention patches alone
    key = next(key for key in patched.object_patches if key.endswith(".forward"))
    module = case.patcher.model.get_submodule(key[:-len(".forward")])
    args, kwargs = comfy_env.first_call(module, lambda: case_forward(case))
    stock = type(module).forward

    def newer_forward(self, *args, new_argument=None, **kwargs):   # a ComfyUI that added an argument
        return stock(self, *args, **kwargs)
    monkeypatch.setattr(type(module), "forward", newer_forward)
    patched, report = env.node.apply_patch(case.patcher, "High", "sdpa", False)
    env.core.reset_notices()
    with torch.no_grad():
        expected = stock(module, *map(comfy_env.fresh, args), **{k: comfy_env.fresh(v) for k, v in kwargs.items()})
        if key not in patched.object_patches:   # refused when patching
            assert any("new_argument" in line for line in report.lines()), report.lines()
            return
        out = patched.object_patches[key](*map(comfy_env.fresh, args),
                                          **{k: comfy_env.fresh(v) for k, v in kwargs.items()}, new_argument=1)
    assert any("new_argument" in line for line in _fallbacks(env)), _fallbacks(env)
    assert rel_err(out, expected) == 0


@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_projections_are_row_sliceable_and_a_foreign_layer_is_named(env, family):
    """`splits_projections` (the shared `family.unsliceable_projection`): None for the plain layers of every case;
    a layer of a class that computes its own way is named with the reason."""
    import importlib
    import torch
    case = family_cases.case(family)
    model = case.patcher.model.diffusion_model
    patching = importlib.import_module(env.pack.__name__ + ".nodes.patching")
    adapter = patching.find_adapter(model)
    assert adapter.splits_projections(model) is None
    owner_path, _, name = case.lora_key[len("diffusion_model."):-len(".weight")].rpartition(".")
    kind = owner_path.split(".")[-1]   # that layer in every block's module of that kind (the adapter reads one)
    owners = [m for path, m in model.named_modules() if path.split(".")[-1] == kind and hasattr(m, name)]
    originals = [getattr(owner, name) for owner in owners]

    class Foreign(torch.nn.Module):   # a layer the pack cannot slice by rows
        def __init__(self, layer):
            super().__init__()
            self.layer = layer
            self.weight = layer.weight

        def forward(self, x):
            return self.layer(x)
    for owner, original in zip(owners, originals):
        setattr(owner, name, Foreign(original))
    try:
        reason = adapter.splits_projections(model)
    finally:
        for owner, original in zip(owners, originals):
            setattr(owner, name, original)
    assert reason is not None and name in reason, reason


def _equals_stock_and_splits(env, case, family):
    """`case`'s weights as loaded: patched (High, block bounds) equals stock without a fallback, and the head
    split runs (the self-attention sees the heads of one group)."""
    reference = case_forward(case)
    patched, report = env.node.apply_patch(case.patcher, "High", "sdpa", True)
    assert report.any_patched and not report.skipped_reasons, report.lines()
    env.core.reset_notices()
    with comfy_env.SdpaHeads(env.torch) as spy:
        out = case_forward(case, applied=patched)
    assert not _fallbacks(env), family
    assert rel_err(out, reference) <= 1e-5, (family, rel_err(out, reference))
    groups = family_groups(env, family, case.kv_heads, 3)
    assert (case.heads or case.kv_heads) // groups in spy.self_heads, (family, spy.self_heads)


@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_fp8_weights_cast_per_call(env, family):
    """The weight format most people load on 12-24 GB cards: an fp8 checkpoint computed in a wider dtype (every
    Linear's weight stored as float8_e4m3fn, cast for each call by ComfyUI). Patched equals stock on the same
    weights at High with block bounds, without a fallback, and the head split runs."""
    case = family_cases.case(family)
    assert comfy_env.fp8_cast_per_call_(case.patcher.model.diffusion_model) > 0
    _equals_stock_and_splits(env, case, family)


@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_gguf_weights(env, family):
    """GGUF (Q8_0) weights through city96's ComfyUI-GGUF (its GGMLOps, each Linear dequantizing its own weight):
    patched equals stock on the same weights at High with block bounds, without a fallback, and the split runs.
    Skipped without ComfyUI-GGUF or `gguf`."""
    from support import gguf_env
    case = family_cases.case(family)
    gguf = gguf_env.as_gguf(case.patcher)
    assert gguf.gguf_keys
    case = case._replace(patcher=gguf)
    _equals_stock_and_splits(env, case, family)


@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_each_family_splits_from_its_own_floor(env, family):
    """The runtime's floor set just under the case's tokens of one item (its longest self-attention in a stock
    forward, / 1.2: some guards count the image stream alone): families whose floor is that times
    its registered row's `split_floor_scale` > 1 (their split blocks are bound by the host's launches there) keep
    the items whole, the others split them; the output is stock's either way."""
    case = family_cases.case(family)
    scale = registered(env, family).measured.split_floor_scale
    with comfy_env.SdpaHeads(env.torch) as stock_spy:
        reference = case_forward(case)
    with comfy_env.split_floor_tokens(env, round(max(stock_spy.self_tokens) / 1.2)):
        patched, _ = env.node.apply_patch(case.patcher, "High", "sdpa", True)
        env.core.reset_notices()
        case_forward(case, applied=patched)   # the self-checks (the split forced) run at the first call of a kind
        with comfy_env.SdpaHeads(env.torch) as spy:
            out = case_forward(case, applied=patched)
    assert not _fallbacks(env), family
    assert rel_err(out, reference) <= 1e-5, (family, rel_err(out, reference))
    heads = case.heads or case.kv_heads
    if scale > 1:
        assert set(spy.self_heads) == {heads}, (family, scale, spy.self_heads)   # whole: all heads in one call
    else:
        assert heads // family_groups(env, family, case.kv_heads, 3) in spy.self_heads, (family, spy.self_heads)


@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_the_planner_splits_as_the_runtime_does(env, family):
    """Around the family's split floor, the planner and the memory estimate decide the split as the runtime's
    calls do (one `SplitPolicy`): with the family's floor at the case's tokens of one item as the planner counts
    them, and just above its longest attention (a joint one adds the text's tokens, which the planner does not
    know before a run), the planner's head groups at High are those the patched forward ran in (the run's
    tally), and a family that leaves short calls to ComfyUI's forwards plans stock's block exactly where none of
    the pack's calls ran."""
    planner = importlib.import_module(f"{env.pack.__name__}.nodes.planner")
    adapter = registered(env, family).adapter
    case = family_cases.case(family)
    model = case.patcher.model.diffusion_model
    x = case.inputs()["x"]
    shape = tuple((x[0] if isinstance(x, list) else x).shape)   # MiniMax H3: [video, audio], the video's
    tokens = adapter.tokens_per_item(model, shape)
    with comfy_env.SdpaHeads(env.torch) as stock_spy:
        case_forward(case)
    longest = max(stock_spy.self_tokens)
    assert tokens <= longest, (family, tokens, longest)
    scale = adapter.SPEC.measured.split_floor_scale
    config = env.node.QKVConfig(3, "sdpa", True)
    patched, _ = env.node.apply_patch(case.patcher, "High", "sdpa", True)
    seen = {}
    # the runtime's floor that puts the family's (x its scale) at `tokens` or under, then just above `longest`
    for name, runtime_floor in (("at the floor", int(tokens // scale)),
                                ("under it", math.ceil((longest + 1) / scale))):
        with comfy_env.split_floor_tokens(env, runtime_floor):
            env.core.drain_tally()
            case_forward(case, applied=patched)   # the self-checks of a first call are not counted
            tally = env.core.drain_tally()
            plan = planner.plan(adapter, model, shape, config, batch=shape[0])
            factor, why = env.node.memory_factor(config, adapter, model, shape, {})
        ran = max(tally.splits, default=1)
        seen[name] = ran
        assert plan.levels[3].groups == ran, (family, name, plan.levels[3], tally.splits)
        assert (why == "head split") == (ran > 1) or "self-check" in why, (family, name, why)
        if adapter.SPEC.measured.short_runs_stock:
            assert (plan.levels[3].bytes == plan.stock_bytes) == (not tally.splits), (family, name, tally)
    assert seen["at the floor"] > 1 and seen["under it"] == 1, (family, seen)
    assert not _fallbacks(env), family


def test_the_planner_counts_the_groups_of_calls_attended_over_their_queries(env, monkeypatch):
    """Where the runtime would attend a split call over its queries (short SDPA calls on CUDA:
    `runtime.attends_over_queries`, which the planner asks), the planner counts the level's groups times
    `OVER_QUERIES_GROUP_SCALE`, each holding that share of a plain group's transients, as the runtime plans them."""
    planner = importlib.import_module(f"{env.pack.__name__}.nodes.planner")
    wan = env.wan
    model = comfy_env.make_wan("t2v", dim=128, heads=4, layers=1).model.diffusion_model
    config = env.node.QKVConfig(3, "sdpa", True)
    shape = (2, 16, 4, 128, 128)   # 4 x 64 x 64 = 16,384 tokens an item: Wan's floor (2 x 8,192)
    with comfy_env.split_floor_tokens(env, 8192):
        assert not planner.over_queries(config, 16384, 4, 128, env.torch.bfloat16, env.torch.device("cpu"))
        plain = planner.plan(wan, model, shape, config)
        monkeypatch.setattr(planner, "over_queries", lambda *args, **kwargs: True)
        over = planner.plan(wan, model, shape, config)
    scale = env.core.head_split.OVER_QUERIES_GROUP_SCALE
    assert [level.groups for level in plain.levels] == [1, 4, 4, 4]
    assert [level.groups for level in over.levels] == [1, 2, 4, 4]   # Low: 4 x 2/3 -> 2 of 4 heads
    working_set = wan.SPEC.measured.working_sets["block"]
    assert over.levels[1].bytes == int(working_set.bounded(2, scale) * over.x_bytes)
    assert over.levels[3].bytes == int(working_set.bounded(4, scale) * over.x_bytes) < plain.levels[3].bytes
    assert [env.core.SplitPolicy(level).plan(4, 16384, over_queries=True).groups for level in range(4)] == \
        [level.groups for level in over.levels]
