"""The nodes Wan workflows chain next to QKV Attention, in both orders (QKV Attention then the node; the node then
QKV Attention), against a real ComfyUI on a tiny float32 Wan sampled for a few steps (`comfy.sample`): ComfyUI's
caches (EasyCache, LazyCache), guidance nodes (CFGZeroStar, CFGNorm, APG, NAGuidance, SkipLayerGuidanceDiT and
its Simple form), context windows, ModelSamplingSD3, a LoRA (loaded on the model, or a hook on the positive
conditioning) and KJNodes' Wan nodes (WanVideoNAG, WanVideoTeaCacheKJ, WanVideoEnhanceAVideoKJ,
SkipLayerGuidanceWanVideo; skipped without ~/ComfyUI-KJNodes).

For every node and order: (1) the result equals the node alone on the unpatched model; (2) no module of the pack
ran ComfyUI's own forward, except the block whose part the node replaces (that fallback, with its reason);
(3) the head split ran (High: one head a group) where the node does not own the self-attention; (4) the node
acted: its result differs from the run without it, or its own log says what it did. The fixtures are
tests/support/wan_runs.py's, with the split floor lowered further (fixture `env`: 1,056 tokens an item split)."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
from pathlib import Path
from typing import Callable, Optional

import pytest

from support import comfy_env

from support.wan_runs import _fresh_verdicts  # noqa: F401

pytestmark = pytest.mark.comfyui

MODEL = dict(dim=256, heads=8, layers=2)
SIZE = dict(frames=3, h=32, w=44, batch=1)   # 1,056 tokens an item, cond + uncond batched: split (fixture `env`)
WINDOWED = dict(SIZE, frames=5)              # 5 latent frames in windows of 3 (9 real frames), overlap 1: 2 windows
FRAME_TOKENS = 16 * 22
# float32, same kernels: the pack's results differ from stock's by ~1e-6 (measured: 0.8e-6 to 1.7e-6 over these
# cases; the nodes' own effects are 0.11 to 1.3)
TOLERANCE = 1e-4
KJNODES = Path.home() / "ComfyUI-KJNodes"
ORDERS = ("qkv-then-node", "node-then-qkv")
_lora = {}      # the LoRA file in ComfyUI's "loras" folder (fixture `lora_file`)
_results = {}   # runs without the pack, by key: each is computed once a process
_kj_module = {}


@pytest.fixture(scope="module")
def env():
    """The pack's modules with the runtime's split floor at 512: Wan's (2x it) at 1,024, under SIZE's 1,056 tokens
    an item, as 16,384+ tokens an item split on real sizes."""
    with comfy_env.split_floor_tokens(comfy_env.pack_modules(), 512) as modules:
        yield modules


def _node(module, name):
    """ComfyUI's node class `name` from `module`, or a skip where this ComfyUI has none (older releases)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pytest.skip(f"this ComfyUI has no {module}.{name}")


def _model(output):
    """The MODEL output of a node: a V3 node's NodeOutput, or a V1 node's tuple."""
    return output.result[0] if hasattr(output, "result") else output[0]


def _kj(name):
    """An instance of KJNodes' node class `name` (nodes/model_optimization_nodes.py), or a skip saying why not."""
    path = KJNODES / "nodes" / "model_optimization_nodes.py"
    if not path.is_file():
        pytest.skip(f"no KJNodes checkout at {KJNODES}")
    if not _kj_module:
        spec = importlib.util.spec_from_file_location("kjnodes_model_optimization_nodes", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - the reason goes to the skip
            pytest.skip(f"KJNodes' {path.name} does not import here: {type(error).__name__}: {error}")
        _kj_module["module"] = module
    if not hasattr(_kj_module["module"], name):
        pytest.skip(f"this KJNodes snapshot has no {name}")
    return getattr(_kj_module["module"], name)()


# --- the nodes, as ComfyUI calls them: make(model) -> (model, extra arguments of the sampling run) ----------------
def easycache(model):
    return _model(_node("comfy_extras.nodes_easycache", "EasyCacheNode").execute(
        model, reuse_threshold=3.0, start_percent=0.0, end_percent=0.95, verbose=False)), {}


def lazycache(model):
    return _model(_node("comfy_extras.nodes_easycache", "LazyCacheNode").execute(
        model, reuse_threshold=3.0, start_percent=0.0, end_percent=0.95, verbose=False)), {}


def cfg_zero_star(model):
    return _model(_node("comfy_extras.nodes_cfg", "CFGZeroStar").execute(model)), {}


def cfg_norm(model):
    return _model(_node("comfy_extras.nodes_cfg", "CFGNorm").execute(model, strength=1.0)), {}


def apg(model):
    return _model(_node("comfy_extras.nodes_apg", "APG").execute(model, eta=0.5, norm_threshold=2.0,
                                                                 momentum=-0.5)), {}


def nag_guidance(model):
    return _model(_node("comfy_extras.nodes_nag", "NAGuidance").execute(model, nag_scale=5.0, nag_alpha=0.5,
                                                                        nag_tau=1.5)), {}


def slg_dit(model):   # block 1 skipped in a third pass of the cond (a 2-layer model: blocks 0 and 1)
    return _model(_node("comfy_extras.nodes_slg", "SkipLayerGuidanceDiT").execute(
        model, scale=3.0, start_percent=0.0, end_percent=1.0, double_layers="1", single_layers="",
        rescaling_scale=0.0)), {}


def slg_dit_simple(model):   # the uncond runs apart, without block 0
    return _model(_node("comfy_extras.nodes_slg", "SkipLayerGuidanceDiTSimple").execute(
        model, start_percent=0.0, end_percent=1.0, double_layers="0", single_layers="")), {}


def context_windows(model):   # 9 real frames = 3 latent frames a window, 4 real = 1 latent frame of overlap
    import comfy.context_windows as cw
    return _model(_node("comfy_extras.nodes_context_windows", "WanContextWindowsManualNode").execute(
        model, context_length=9, context_overlap=4, context_schedule=cw.ContextSchedules.STATIC_STANDARD,
        context_stride=1, closed_loop=False, fuse_method=cw.ContextFuseMethods.PYRAMID, freenoise=True)), {}


def model_sampling_sd3(model):   # Wan's own shift is 8
    return _model(_node("comfy_extras.nodes_model_advanced", "ModelSamplingSD3")().patch(model, shift=3.0)), {}


def lora_loader(model):
    import nodes
    return _model(nodes.LoraLoaderModelOnly().load_lora_model_only(model, _lora["name"], 1.0)), {}


def hook_lora(model):
    """CreateHookLora + SetModelHooksOnCond on the positive: ComfyUI patches the weights for the cond's batch only
    (cond and uncond then run apart). The hook lives on the conditioning, so "order" has one meaning."""
    hooks = _node("comfy_extras.nodes_hooks", "CreateHookLora")().create_hook(_lora["name"], 1.0, 0.0)[0]
    positive, negative = comfy_env.make_conds(model, "t2v", SIZE["frames"], SIZE["h"], SIZE["w"], SIZE["batch"])
    positive = _node("comfy_extras.nodes_hooks", "SetModelHooksOnCond")().attach_hook(positive, hooks)[0]
    return model, {"positive": positive, "negative": negative}


def kj_nag(model):   # NAG on every block's cross-attention, a negative text of its own
    negative = comfy_env.make_conds(model, "t2v", SIZE["frames"], SIZE["h"], SIZE["w"], 1, seed=7)[1]
    return _model(_kj("WanVideoNAG").patch(model, negative, nag_scale=11.0, nag_alpha=0.25, nag_tau=2.5)), {}


def kj_teacache(model):   # deprecated in this snapshot: hands its model back untouched
    out = _model(_kj("WanVideoTeaCacheKJ").patch_teacache(model, 0.275, 0.1, 1.0, "offload_device", "i2v_480"))
    assert out is model
    return out, {}


def kj_enhance(model):   # Enhance-A-Video: its own forward on every block's self-attention
    import torch
    latent = {"samples": torch.zeros(SIZE["batch"], 16, SIZE["frames"], SIZE["h"], SIZE["w"])}
    return _model(_kj("WanVideoEnhanceAVideoKJ").enhance(model, weight=2.0, latent=latent)), {}


def kj_slg(model):   # a dit replacement of block 1 that asks TeaCacheKJ's transformer_options
    return _model(_kj("SkipLayerGuidanceWanVideo").slg(model, start_percent=0.0, end_percent=1.0, blocks="1")), {}


# --- how each node shows it acted: (result alone, result without the node, log of the chained run) ------------
def differs(alone, plain, log):
    assert comfy_env.rel_err(alone, plain) > 1e-3


def skipped_a_step(name):
    def acted(alone, plain, log):
        differs(alone, plain, log)
        assert f"{name} - skipped 1/3 steps" in log   # the third step reused the cache, with the pack too
    return acted


def no_effect_on_wan(alone, plain, log):
    """NAGuidance sets `attn1_output_patch`, which ComfyUI's Wan (v0.33) never calls: the node alone equals the
    plain run (CFG is 5: its disabled cfg1 optimisation changes nothing)."""
    assert comfy_env.rel_err(alone, plain) == 0.0


def returns_its_input(alone, plain, log):   # WanVideoTeaCacheKJ (asserted in kj_teacache)
    assert comfy_env.rel_err(alone, plain) == 0.0


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable
    steps: int = 2
    size: dict = dataclasses.field(default_factory=lambda: SIZE)
    acted: Callable = differs
    owns: Optional[str] = None       # the block part whose forward the node replaces (that block runs stock)
    orders: tuple = ORDERS
    raises: Optional[str] = None     # the error the node alone raises on this ComfyUI (the chain must raise it too)
    windowed: bool = False           # context windows: no call may see the whole latent


CASES = [
    Case("EasyCache", easycache, steps=3, acted=skipped_a_step("EasyCache")),
    Case("LazyCache", lazycache, steps=3, acted=skipped_a_step("LazyCache")),
    Case("CFGZeroStar", cfg_zero_star),
    Case("CFGNorm", cfg_norm),
    Case("APG", apg),
    Case("NAGuidance", nag_guidance, acted=no_effect_on_wan),
    Case("SkipLayerGuidanceDiT", slg_dit),
    Case("SkipLayerGuidanceDiTSimple", slg_dit_simple),
    Case("WanContextWindowsManual", context_windows, size=WINDOWED, windowed=True),
    Case("ModelSamplingSD3", model_sampling_sd3),
    Case("LoraLoaderModelOnly", lora_loader),
    Case("CreateHookLora", hook_lora, orders=("on-the-positive",)),
    Case("WanVideoNAG", kj_nag, owns="cross_attn"),
    Case("WanVideoTeaCacheKJ", kj_teacache, acted=returns_its_input),
    Case("WanVideoEnhanceAVideoKJ", kj_enhance, owns="self_attn"),
    Case("SkipLayerGuidanceWanVideo", kj_slg, raises="currently SkipLayerGuidanceWanVideo only works with TeaCacheKJ"),
]


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    """A small random LoRA (rank 4 on every attention projection of both blocks) in ComfyUI's "loras" folder."""
    import torch
    import folder_paths
    from safetensors.torch import save_file
    folder = tmp_path_factory.mktemp("loras")
    g = torch.Generator().manual_seed(5)
    dim, rank, weights = MODEL["dim"], 4, {}
    for block in range(MODEL["layers"]):
        for part in ("self_attn", "cross_attn"):
            for name in ("q", "k", "v", "o"):
                key = f"diffusion_model.blocks.{block}.{part}.{name}"
                weights[key + ".lora_up.weight"] = torch.randn(dim, rank, generator=g) * 0.1
                weights[key + ".lora_down.weight"] = torch.randn(rank, dim, generator=g) / dim ** 0.5
    save_file(weights, str(folder / "tiny_wan_lora.safetensors"))
    folder_paths.add_model_folder_path("loras", str(folder))
    _lora["name"] = "tiny_wan_lora.safetensors"
    return _lora["name"]


def _sample(case, model, extra):
    return comfy_env.run_sample(model, steps=case.steps, cfg=5.0, **case.size, **extra)


def _without_pack(case, key):
    """The node alone on the unpatched model ("alone") or the run without the node ("plain"): once a process."""
    cache_key = (key, case.steps, tuple(sorted(case.size.items()))) if key == "plain" else (key, case.name)
    if cache_key not in _results:
        base = comfy_env.make_wan("t2v", **MODEL)
        model, extra = case.make(base) if key == "alone" else (base, {})
        if case.raises is None:
            _results[cache_key] = _sample(case, model, extra)
        else:
            with pytest.raises(Exception, match=case.raises) as raised:
                _sample(case, model, extra)
            _results[cache_key] = raised.value
    return _results[cache_key]


def _fallbacks(env, records):
    """Every line of the pack saying a module ran ComfyUI's own forward during the run: its notices are drained
    by the run report at the end of a sampling run, so those logged (logger `qkv_core`) count too."""
    logged = comfy_env.logged_of_kind(records, env.core.notices.FALLBACK)
    return sorted(set(logged + comfy_env.stock_fallbacks(env)))


@pytest.mark.parametrize("case,order", [pytest.param(case, order, id=f"{case.name}-{order}")
                                        for case in CASES for order in case.orders])
def test_a_workflow_node_with_qkv_attention_equals_the_node_alone(env, lora_file, caplog, case, order):
    torch = env.torch
    alone = _without_pack(case, "alone")
    plain = _without_pack(case, "plain")
    base = comfy_env.make_wan("t2v", **MODEL)
    if order == "node-then-qkv":
        model, extra = case.make(base)
        model, report = env.node.apply_patch(model, "High", "sdpa", True)
    else:
        patched, report = env.node.apply_patch(base, "High", "sdpa", True)
        model, extra = case.make(patched)
    caplog.clear()
    caplog.set_level(logging.INFO)
    with comfy_env.SdpaHeads(torch) as spy:
        if case.raises is None:
            out = _sample(case, model, extra)
        else:
            with pytest.raises(type(alone)) as raised:
                _sample(case, model, extra)
    # (1) the node alone's result (or its error)
    if case.raises is None:
        assert comfy_env.rel_err(out, alone) <= TOLERANCE
    else:
        assert str(raised.value) == str(alone)
    # (2) no module ran ComfyUI's own forward, but the block whose part the node replaced: patched after the pack,
    # the pack's block meets the node's forward and runs ComfyUI's (one notice); patched before, the pack leaves
    # that part and its block alone and its report says why
    skipped = {reason for _, reason in report.skipped_reasons}
    if case.owns is None:
        assert not skipped and _fallbacks(env, caplog.records) == []
    elif order == "qkv-then-node":
        assert not skipped
        assert _fallbacks(env, caplog.records) == [
            f"[QKV] Wan block runs as ComfyUI's own: another node patched its {case.owns}"]
    else:
        assert skipped == {"another node patched it (its patch is kept)",
                           f"another node patched its {case.owns} (kept; it runs as ComfyUI's)"}
        assert _fallbacks(env, caplog.records) == []
    # (3) the head split ran: High, 8 heads, 2 x 1,056 tokens -> one head a group; a node that owns the
    # self-attention runs it whole (its own forward calls ComfyUI's attention on all heads)
    heads = MODEL["heads"]
    groups = env.core.group_count(heads, 2 * 3 * FRAME_TOKENS, 3)
    assert groups == heads
    assert set(spy.self_heads) == ({heads} if case.owns == "self_attn" else {heads // groups})
    if case.windowed:   # the windows really split the latent: 3 frames a window (4 with the causal fix frame that
        # v0.33 puts before a window not at frame 0; v0.8.0 puts none), never the whole 5
        assert 3 * FRAME_TOKENS in spy.self_tokens and set(spy.self_tokens) <= {3 * FRAME_TOKENS, 4 * FRAME_TOKENS}
    # (4) the node acted (a node that raises did: its own code raised)
    if case.raises is None:
        case.acted(alone, plain, caplog.text)
