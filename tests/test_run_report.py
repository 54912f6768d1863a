"""The run report and the VRAM planner (issue 13): what a sampling run of a patched model reports (in the log
and to the node in the browser), and the planner's working-set estimates against MemTracker's measured peaks
of ComfyUI's Wan block at every head-split level."""
from __future__ import annotations

import importlib
import json
import logging

import pytest

from support import comfy_env
from support import working_set_check
import test_wan_memory as wan_memory
from test_node_in_comfyui import _prompt, loaded  # noqa: F401  (the prompt fixture)

pytestmark = pytest.mark.comfyui


@pytest.fixture(autouse=True)
def _wan_splits_at_the_memory_tests_size(monkeypatch):
    """Wan splits real sizes from 16,384 tokens an item (2x the runtime's floor, `wan.SPEC.measured.split_floor_scale`); the
    memory test's block has 12,288. The runtime's floor is halved in every copy of the pack in this process (the
    tests' own and the one ComfyUI's loader imported), so that the plans, the runs and the measured blocks (built
    with the runtime's own floor) all split as the node splits a Wan of 16,384+ tokens."""
    import sys
    comfy_env.require_comfyui()
    comfy_env.load_pack()
    for name, module in list(sys.modules.items()):
        if name.endswith("qkv_core.head_split") and hasattr(module, "SPLIT_FLOOR_TOKENS"):
            monkeypatch.setattr(module, "SPLIT_FLOOR_TOKENS", 4096)


@pytest.fixture
def sent(monkeypatch):
    """What the run wrapper sends to the browser: (event, payload) pairs."""
    comfy_env.require_comfyui()
    import sys
    comfy_env.load_pack()
    messages = []
    # every copy of the pack in this process: the tests' own and the one ComfyUI's loader imported
    copies = [module for name, module in list(sys.modules.items())
              if name.endswith(".nodes.patching") and hasattr(module, "make_run_wrappers")]
    for patching in copies:
        monkeypatch.setattr(patching, "send_to_ui", lambda event, payload: messages.append((event, payload)) or True)
    return messages


def test_a_prompt_sends_its_report_to_the_node(loaded, sent, caplog):  # noqa: F811
    _, suffix = loaded
    with caplog.at_level(logging.INFO, logger="ComfyUI-QKV"):
        ex = comfy_env.run_prompt(_prompt(suffix, "report", {"head_split": "High", "attention_backend": "auto",
                                                             "block_bounds": True}))
    assert ex.success, comfy_env.execution_error(ex)
    assert len(sent) == 1
    event, payload = sent[0]
    assert event == "comfyui_qkv.report" and payload["node"] == "2"   # the QKVAttentionPatch node's id
    report = payload["report"]
    json.dumps(report)   # what the browser receives
    assert report["family"] == "Wan" and report["ended"] == "finished"
    assert report["settings"] == "High, block bounds, backend auto"
    assert "Wan: 1 self_attn patched" in report["lines"] and "Wan: 1 block patched" in report["lines"]
    # a CPU run of a tiny Wan: auto is PyTorch's SDPA; 32 tokens are not split
    assert set(report["backends"]) == {"sdpa"} and sum(report["backends"].values()) >= 4
    assert report["head_groups"] == {"1": sum(report["head_groups"].values())}
    assert report["fallbacks"] == [] and "fallbacks: none" in report["lines"]
    for field in ("peak_bytes", "stock_estimate_bytes", "estimate_bytes", "plan"):
        assert field in report
    assert report["peak_bytes"] is None and "peak VRAM: not measured (no CUDA device)" in report["lines"]
    assert report["plan"]["tokens"] == 32 and report["level"] == "High"
    assert "run report:" in caplog.text and "attention: sdpa x" in caplog.text


def test_a_failed_run_still_reports(loaded, sent):  # noqa: F811
    """An error inside sampling: the report says how the run ended, and the error reaches ComfyUI."""
    import comfy.k_diffusion.sampling as sampling
    _, suffix = loaded
    prompt = _prompt(suffix, "error", {"head_split": "High", "attention_backend": "auto", "block_bounds": True})

    def broken(*args, **kwargs):
        raise RuntimeError("broken on purpose")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampling, "sample_euler", broken)   # KSampler looks its sampler up at each run
        ex = comfy_env.run_prompt(prompt)
    assert not ex.success and "broken on purpose" in str(comfy_env.execution_error(ex))
    assert [event for event, _ in sent] == ["comfyui_qkv.report"]
    assert sent[0][1]["report"]["ended"] == "with an error (RuntimeError)"


_peaks = {}   # (pack, "stock" or level) -> measured peak: each is measured once a process


def _measured_block_peaks(pack, levels):
    """MemTracker's peaks of test_wan_memory's bf16 block (12,288 tokens x 512, 16 heads), as multiples of |x|:
    stock, then the bounded block at each of `levels` (measured once a process: both tests below read them)."""
    keys = ["stock", *levels]
    if all((pack.__name__, key) in _peaks for key in keys):
        return {key: _peaks[pack.__name__, key] for key in keys}
    import torch
    wan = importlib.import_module(pack.__name__ + ".nodes.families.wan")
    node = importlib.import_module(pack.__name__ + ".nodes.patching")
    memory = importlib.import_module(pack.__name__ + ".benchmarks.memory")
    block, inp = wan_memory.build_block(torch), wan_memory.block_inputs(torch)
    x_bytes = inp["x"].numel() * inp["x"].element_size()
    live = [block, list(inp.values())]
    peaks = {}
    with torch.no_grad():
        peaks["stock"] = memory.measure_peak(block, **inp, live=live).peak_bytes / x_bytes
        for level in levels:
            forward = wan.bounded_block_forward(block, node.QKVConfig(level=level, backend="sdpa", block=True))
            working_set_check.check_first_call(pack, forward, **inp)   # outside the measurement
            peaks[level] = memory.measure_peak(forward, **inp, live=live).peak_bytes / x_bytes
    _peaks.update({(pack.__name__, key): value for key, value in peaks.items()})
    return peaks


def _wan_like_memory_test(torch, layers=1):
    """A Wan with test_wan_memory's dimensions, bf16, and a latent of its 12,288 tokens."""
    model = comfy_env.make_wan("t2v", dim=wan_memory.WIDTH, heads=wan_memory.HEADS, layers=layers,
                               ffn_dim=wan_memory.FFN, text_dim=64, dtype=torch.bfloat16)
    latent_shape = (1, 16, 3, 128, 128)   # 3 x 64 x 64 tokens after Wan's (1, 2, 2) patches
    return model, latent_shape


@pytest.mark.xdist_group("wan_memory_block_peaks")
def test_planner_matches_memtracker_at_every_level():
    """`planner.plan` for a Wan of the memory test's dimensions against MemTracker's peaks of its block: stock
    and each head-split level within 15%."""
    comfy_env.require_comfyui()
    import torch
    pack = comfy_env.load_pack()
    planner = importlib.import_module(pack.__name__ + ".nodes.planner")
    node = importlib.import_module(pack.__name__ + ".nodes.patching")
    wan = importlib.import_module(pack.__name__ + ".nodes.families.wan")
    model, latent_shape = _wan_like_memory_test(torch)
    plan = planner.plan(wan, model.model.diffusion_model, latent_shape, node.QKVConfig(3, "sdpa", True),
                        dtype=torch.bfloat16)
    assert plan.tokens == wan_memory.TOKENS and plan.width == wan_memory.WIDTH
    assert plan.x_bytes == wan_memory.TOKENS * wan_memory.WIDTH * 2
    assert [(level.level, level.groups) for level in plan.levels] == [("Off", 1), ("Low", 4), ("Medium", 8),
                                                                       ("High", 16)]
    measured = _measured_block_peaks(pack, levels=(0, 1, 2, 3))
    estimates = {"stock": plan.stock_bytes, **{index: level.bytes for index, level in enumerate(plan.levels)}}
    for key, ratio in measured.items():
        estimate = estimates[key] / plan.x_bytes
        assert abs(estimate - ratio) <= 0.15 * ratio, (key, estimate, ratio)
    assert any("High: " in line and "16 head groups" in line for line in plan.lines())


@pytest.mark.xdist_group("wan_memory_block_peaks")
def test_run_report_estimate_matches_memtracker(sent):
    """A sampling run of a Wan of the memory test's dimensions (one block, one step): the report's estimate of
    the block's working set at High is within 15% of MemTracker's measured peak of that block."""
    import torch
    pack = comfy_env.load_pack()
    node = importlib.import_module(pack.__name__ + ".nodes.patching")
    model, latent_shape = _wan_like_memory_test(torch)
    patched, _ = node.apply_patch(model, "High", "sdpa", True, node_id="7")
    latent = torch.zeros(latent_shape)
    comfy_env.run_sample(patched, frames=3, h=128, w=128, steps=1, cfg=1.0, latent=latent)
    (event, payload), = sent
    report = payload["report"]
    assert payload["node"] == "7" and report["level"] == "High"
    assert report["plan"]["batch"] == 1 and report["plan"]["tokens"] == wan_memory.TOKENS
    # the block's self-attention split in 16 groups; its cross-attention runs by token chunks, each whole
    assert report["head_groups"]["16"] == 1 and set(report["head_groups"]) == {"16", "1"}
    measured = _measured_block_peaks(pack, levels=(3,))
    estimate = report["estimate_bytes"] / report["plan"]["x_bytes"]
    assert abs(estimate - measured[3]) <= 0.15 * measured[3], (estimate, measured[3])
    stock = report["plan"]["stock_bytes"] / report["plan"]["x_bytes"]
    assert abs(stock - measured["stock"]) <= 0.15 * measured["stock"], (stock, measured["stock"])


def test_the_stock_estimate_follows_the_comfyui_release(monkeypatch):
    """ComfyUI's own block peaks higher on releases before v0.8.0 for some families (v0.3.64 rotated q and k in
    float32 copies: a Flux double block 17.4 x |x| against 10.1): the planner's stock figure is the one of the
    running release (`comfy_release`), the newest where the release is unknown."""
    comfy_env.require_comfyui()
    import torch
    pack = comfy_env.load_pack()
    planner = importlib.import_module(pack.__name__ + ".nodes.planner")
    node = importlib.import_module(pack.__name__ + ".nodes.patching")
    flux = importlib.import_module(pack.__name__ + ".nodes.families.flux")
    double = flux.SPEC.measured.working_sets["double"]
    assert double.stock_on((0, 3, 64)) == 17.36 and double.stock_on((0, 8, 0)) == double.stock_on(None) == 10.06
    assert flux.SPEC.measured.working_sets["single"].stock_on((0, 33, 0)) == 14.06
    release = planner.comfy_release()
    assert release is not None and release == tuple(int(p) for p in comfy_env.comfyui_version().split(".")[:3])
    model, latent_shape = _wan_like_memory_test(torch)
    wan = importlib.import_module(pack.__name__ + ".nodes.families.wan")
    config = node.QKVConfig(3, "sdpa", True)
    flux_sets = {"double": double}
    monkeypatch.setattr(planner, "working_sets", lambda adapter, model: flux_sets)
    for version, peak in (((0, 3, 64), 17.36), ((0, 33, 0), 10.06)):
        monkeypatch.setattr(planner, "comfy_release", lambda version=version: version)
        plan = planner.plan(wan, model.model.diffusion_model, latent_shape, config, dtype=torch.bfloat16)
        assert plan.stock_bytes == int(peak * plan.x_bytes), (version, plan.stock_bytes / plan.x_bytes)
        assert plan.levels[0].bytes < plan.stock_bytes   # Off: the pack's bounded block, not stock's


def test_stock_estimate_swaps_the_working_sets():
    """The stock peak the report gives: the measured peak less the pack's estimated working set plus stock's."""
    comfy_env.require_comfyui()
    pack = comfy_env.load_pack()
    report = importlib.import_module(pack.__name__ + ".nodes.report")
    planner = importlib.import_module(pack.__name__ + ".nodes.planner")
    levels = (planner.LevelPlan("High", 16, 2 * 2**30, ""),)
    run = report.RunReport("Wan", "High, block bounds, backend auto", report.PatchReport())
    run.plan = planner.Plan("Wan", "block", 75600, 1, 5120, 2**30, 9 * 2**30, levels, True)
    run.level, run.peak_bytes = "High", 20 * 2**30
    assert run.estimate_bytes == 2 * 2**30 and run.stock_estimate_bytes == 27 * 2**30
    assert any("stock ComfyUI would need about 27.00 GiB" in line for line in run.lines())
    run.peak_bytes = None
    assert run.stock_estimate_bytes is None
    json.dumps(run.as_payload())


def test_planner_node_shows_every_level(loaded):  # noqa: F811
    """The QKV VRAM Planner node in a prompt: its text (on the node and as its output) names every level with
    its head groups, for cond and uncond batched; a model the pack does not adapt gets one line saying so."""
    import torch
    nodes, _ = loaded
    planner_node = nodes.NODE_CLASS_MAPPINGS["QKVVRAMPlanner"]
    model, latent_shape = _wan_like_memory_test(torch)
    out = planner_node.execute(model, {"samples": torch.zeros(latent_shape)}, True, True)
    text = out.result[0]
    assert text.startswith("Wan, 2 x 12,288 tokens, width 512")
    for line in ("  Off: ", "  Low: ", "  Medium: ", "  High: "):
        assert line in text
    assert "(16 head groups)" in text and "ComfyUI's own block" in text
    assert out.ui is not None
    odd = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
    odd.model.diffusion_model.blocks = torch.nn.ModuleList()   # no Wan blocks: not a Wan the pack knows
    text = planner_node.execute(odd, {"samples": torch.zeros(1, 16, 2, 8, 8)}, True, True).result[0]
    assert "no estimate" in text


def test_a_failing_report_does_not_fail_the_run(loaded, monkeypatch, caplog):  # noqa: F811
    """The browser message raising (a server going away, say) leaves the run and its result alone."""
    import sys
    _, suffix = loaded

    def broken(event, payload):
        raise ConnectionError("the browser went away")
    for name, module in list(sys.modules.items()):
        if name.endswith(".nodes.patching") and hasattr(module, "make_run_wrappers"):
            monkeypatch.setattr(module, "send_to_ui", broken)
    with caplog.at_level(logging.WARNING, logger="ComfyUI-QKV"):
        ex = comfy_env.run_prompt(_prompt(suffix, "no-report", {"head_split": "High", "attention_backend": "auto",
                                                                "block_bounds": True}))
    assert ex.success, comfy_env.execution_error(ex)
    assert "no run report for this run: ConnectionError: the browser went away" in caplog.text


# --- a fallback the user sees (issue 34, item 4) ----------------------------------------------------------------
def _changed_math(monkeypatch, *classes):
    """Each class's forward as ComfyUI's own, but with another math (its output scaled): the pack's self-check
    finds the outputs differ and that module runs ComfyUI's own forward."""
    import functools
    for cls in classes:
        original = cls.forward

        @functools.wraps(original)
        def forward(self, *args, _original=original, **kwargs):
            return _original(self, *args, **kwargs) * 1.25
        monkeypatch.setattr(cls, "forward", forward)


def _factor_probe(patched, stock_factor, seen):
    """Records, inside the pack's run wrapper, the model's estimate as a multiple of stock's: at the run's start
    (OUTER_SAMPLE) and before each batch of conds (CALC_COND_BATCH, where ComfyUI reads it to size the batch)."""
    import comfy.patcher_extension as ext

    def outer(executor, *args, **kwargs):
        seen.append(("run", executor.class_obj.model_patcher.model.memory_usage_factor / stock_factor))
        return executor(*args, **kwargs)

    def batch(executor, model, *args, **kwargs):
        seen.append(("batch", model.memory_usage_factor / stock_factor))
        return executor(model, *args, **kwargs)
    patched.add_wrapper_with_key(ext.WrappersMP.OUTER_SAMPLE, "zz_probe", outer)
    patched.add_wrapper_with_key(ext.WrappersMP.CALC_COND_BATCH, "zz_probe", batch)


@pytest.fixture
def pack_node():
    """nodes.patching of the pack copy the tests patch with, its verdicts forgotten before and after."""
    comfy_env.require_comfyui()
    pack = comfy_env.load_pack()
    compat = importlib.import_module(pack.__name__ + ".nodes.compat")
    compat.forget_verdicts()
    yield importlib.import_module(pack.__name__ + ".nodes.patching")
    compat.forget_verdicts()


@pytest.mark.parametrize("block_bounds", [True, False], ids=["block-bounds", "attention-only"])
def test_a_failed_check_says_no_saving_on_the_first_line(pack_node, sent, monkeypatch, caplog, block_bounds):
    """Every patched module's self-check fails (ComfyUI's attention with another math): the run is ComfyUI's
    own. The report's first line (log and node) says this run had no saving, what ran ComfyUI's own and why;
    the payload carries the state (the bar is not drawn as a saving: tests/test_report_bar.py); no stock
    estimate is set against the peak; and ComfyUI's memory estimate stays its own, in this run and the next."""
    import comfy.ldm.wan.model as wan_model
    _changed_math(monkeypatch, wan_model.WanSelfAttention, wan_model.WanT2VCrossAttention)
    base = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
    stock_factor = base.model.memory_usage_factor
    patched, _ = pack_node.apply_patch(base, "High", "sdpa", block_bounds, node_id="5")
    seen = []
    _factor_probe(patched, stock_factor, seen)
    with caplog.at_level(logging.INFO, logger="ComfyUI-QKV"):
        for _ in range(2):
            comfy_env.run_sample(patched, frames=3, h=8, w=8, steps=2)
    assert base.model.memory_usage_factor == stock_factor
    assert len(seen) == 6 and all(factor == pytest.approx(1.0) for _, factor in seen)   # both runs, every batch
    for _, payload in sent:
        report = payload["report"]
        json.dumps(report)
        assert report["saving"] == "none" and report["backends"] == {}
        ran_stock = {entry["what"]: entry["reason"] for entry in report["ran_stock"]}
        assert {"Wan self-attention", "Wan cross-attention"} <= set(ran_stock)
        assert ("Wan block" in ran_stock) == block_bounds
        assert all(reason.startswith("the outputs differ") for reason in ran_stock.values())
        first = report["lines"][0]
        assert first == report["headline"] and first.startswith("No saving this run: ")
        assert "Wan self-attention ran as ComfyUI's own (the outputs differ" in first
        assert report["lines"][1].startswith("Wan (High, ") and report["stock_estimate_bytes"] is None
        assert report["memory_estimate"]["factor"] == 1.0
        assert any(line.startswith("memory estimate: ComfyUI's own (") for line in report["lines"])
    assert len(sent) == 2
    block = caplog.text.split("run report:\n")[-1]
    assert block.splitlines()[0].strip().startswith("No saving this run: ")   # the log's first line too


def test_a_failed_block_check_is_part_of_the_saving(pack_node, sent, monkeypatch):
    """Only the block's check fails (ComfyUI's block with another math): ComfyUI's block runs, calling the pack's
    attention modules, which passed theirs. The first line says which share ran ComfyUI's own and why; the
    estimate stays ComfyUI's (the block's memory is stock's)."""
    import comfy.ldm.wan.model as wan_model
    _changed_math(monkeypatch, wan_model.WanAttentionBlock)
    base = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
    patched, _ = pack_node.apply_patch(base, "High", "sdpa", True, node_id="5")
    seen = []
    _factor_probe(patched, base.model.memory_usage_factor, seen)
    for _ in range(2):
        comfy_env.run_sample(patched, frames=3, h=8, w=8, steps=1)
    assert len(seen) == 4 and all(factor == pytest.approx(1.0) for _, factor in seen)
    report = sent[-1][1]["report"]
    assert report["saving"] == "partial" and [entry["what"] for entry in report["ran_stock"]] == ["Wan block"]
    calls = sum(report["backends"].values())
    assert calls > 0
    assert report["lines"][0] == (f"Part of the saving this run: Wan block ran as ComfyUI's own "
                                  f"({report['ran_stock'][0]['reason']}); the rest ran the pack's "
                                  f"({calls} attention calls)")


def test_a_passing_run_reports_as_before(pack_node, sent):
    """Checks that pass: the report is unchanged (its first line the family and settings), the state is the full
    saving, and the next run's estimate is lowered."""
    base = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
    stock_factor = base.model.memory_usage_factor
    patched, _ = pack_node.apply_patch(base, "High", "sdpa", True, node_id="5")
    seen = []
    _factor_probe(patched, stock_factor, seen)
    for _ in range(2):
        comfy_env.run_sample(patched, frames=3, h=8, w=8, steps=1)
    runs = [factor for kind, factor in seen if kind == "run"]
    assert runs[0] == pytest.approx(1.0) and runs[1] < 1.0   # lowered once every forward has passed
    for _, payload in sent:
        report = payload["report"]
        assert report["saving"] == "full" and report["headline"] is None and report["ran_stock"] == []
        assert report["lines"][0] == "Wan (High, block bounds, backend sdpa), run finished"
        assert not any(line.startswith(("No saving", "Part of the saving", "memory estimate"))
                       for line in report["lines"])


def test_a_module_that_runs_stock_mid_run_puts_the_estimate_back(pack_node, sent):
    """A run that started with the lowered estimate (every forward passed before) in which a module then runs
    ComfyUI's own forward (here its notice, as `compat.guarded` logs it, raised from inside the first model call):
    ComfyUI's own estimate is back from the next batch of conds on, for the rest of the run, and the report says
    so; the run after starts lowered again (nothing failed a check)."""
    import comfy.patcher_extension as ext
    pack = comfy_env.load_pack()
    core = importlib.import_module(pack.__name__ + ".qkv_core")
    base = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
    stock_factor = base.model.memory_usage_factor
    patched, _ = pack_node.apply_patch(base, "High", "sdpa", True, node_id="5")
    comfy_env.run_sample(patched, frames=3, h=8, w=8, steps=1)   # every forward passes its check
    seen = []
    _factor_probe(patched, stock_factor, seen)
    fail = []

    def stock_once(executor, *args, **kwargs):
        if fail:
            core.notices.notice_once("stock:test", core.Notice(
                core.notices.FALLBACK, "Wan block", "a check failed here",
                "[QKV] Wan block runs as ComfyUI's own: a check failed here"))
            fail.clear()
        return executor(*args, **kwargs)
    patched.add_wrapper_with_key(ext.WrappersMP.DIFFUSION_MODEL, "zz_stock", stock_once)
    fail.append(True)
    comfy_env.run_sample(patched, frames=3, h=8, w=8, steps=3)
    lowered = seen[0][1]
    assert seen[0][0] == "run" and lowered < 1.0
    assert [factor for _, factor in seen[1:]] == [pytest.approx(lowered)] + [pytest.approx(1.0)] * 2
    assert base.model.memory_usage_factor == stock_factor
    report = sent[-1][1]["report"]
    assert report["saving"] == "partial" and report["memory_estimate"]["restored"] is True
    assert report["lines"][0].startswith("Part of the saving this run: Wan block ran as ComfyUI's own "
                                         "(a check failed here)")
    assert any("ComfyUI's own from the first module that ran ComfyUI's forward on" in line
               for line in report["lines"])
    seen.clear()
    comfy_env.run_sample(patched, frames=3, h=8, w=8, steps=1)
    assert seen[0] == ("run", pytest.approx(lowered)) and sent[-1][1]["report"]["saving"] == "full"
