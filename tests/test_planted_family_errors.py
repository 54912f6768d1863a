"""Errors planted in every adapted family's bounded block are found by the self-check (issue 46, item 3).

Each family's tiny model of tests/test_input_matrix.py (its inputs: cond + uncond in one batch, item 0 zeroed or
random text; HunyuanVideo and MiniMax H3 one item), in bf16 and fp8-scaled weights (and, unplanted and 1 % planted
with item 0 zeroed: fp8 cast per call, fp8-scaled in the scaled_fp8 file layout, GGUF Q8_0), patched at High with block
bounds. The plant is on the pack's side, in every bounded block at once: the update each block adds to its
residual stream(s) made 1 %, 2 % or 5 % larger (`Family.guard`'s forward, wrapped before the patch is made), each
with item 0 zeroed; nothing and the 1 % plant with random text too. Every planted row must send each planted block
to ComfyUI's own forward (`<family> <block> runs as ComfyUI's own: the outputs differ ...`, and the run report's
first line saying so); with nothing planted, nothing falls back. The Wan block's own plants (wrong-token queries,
a wrong head) are in tests/test_planted_errors.py.

Skipped without ComfyUI, or where this ComfyUI lacks a family or a format (with the reason); a pack that does not
import fails.
"""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env
from support import formats
import test_input_matrix as matrix

pytestmark = pytest.mark.comfyui

FORMATS = ("bf16", "fp8_scaled")
# the other formats users load (formats.py): kept unplanted, the smallest plant found with item 0 zeroed
OTHER_FORMATS = ("fp8_cast", "fp8_scaled_file", "gguf_q8_0")
CONDS = ("zeros", "random")
PLANTS = {"nothing": None, "update-1pct": 1.01, "update-2pct": 1.02, "update-5pct": 1.05}
# Wan I2V shares the Wan block (its own rows in the input matrix); every family of the registry is covered by the rest
FAMILIES = sorted(name for name in matrix.FAMILIES if name != "wan_i2v")
# every plant with item 0 zeroed (the case the old check was blind in); with random text, nothing and the smallest
ROWS = [(family, fmt, cond, plant) for family in FAMILIES for fmt in FORMATS for cond in CONDS for plant in PLANTS
        if cond == "zeros" or plant in ("nothing", "update-1pct")] + \
       [(family, fmt, cond, plant) for family in FAMILIES for fmt in OTHER_FORMATS
        for cond, plant in (("zeros", "nothing"), ("zeros", "update-1pct"))]


@pytest.fixture(scope="module")
def env():
    with comfy_env.split_floor_tokens(comfy_env.pack_modules(), matrix.MATRIX_FLOOR) as modules:
        yield modules


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(family, fmt):
        if family not in cache:
            cache[family] = matrix.FAMILIES[family].model()
        why = formats.unsupported(fmt)
        if why:
            pytest.skip(why)
        if (family, fmt) not in cache:
            cache[family, fmt] = formats.in_format(cache[family], fmt)
        return cache[family, fmt]
    yield get
    cache.clear()


@pytest.fixture(autouse=True)
def _fresh_verdicts(env):
    env.compat.forget_verdicts()
    env.core.reset_notices()
    env.core.drain_tally()
    yield
    env.compat.forget_verdicts()


def _scaled_update(run, residual, factor):
    """The bounded block `run` with the update it adds to each residual stream `factor` times as large (several
    streams: the block returns them in `residual`'s order)."""
    names = residual if isinstance(residual, tuple) else (residual,)

    def planted(module, config, **bound):
        bases = [bound[name].clone() for name in names]   # a bounded block may update its residual in place
        out = run(module, config, **bound)
        outs = out if isinstance(residual, tuple) else (out,)
        scaled = tuple(o if o is None else (b.float() + factor * (o.float() - b.float())).to(o.dtype)
                       for b, o in zip(bases, outs))   # None: a stream the block leaves out (SD3's last context)
        return scaled if isinstance(residual, tuple) else scaled[0]
    return planted


def plant_blocks(monkeypatch, env, factor) -> set:
    """Every bounded block's forward made by the patch from now on planted with `factor`; returns the set that
    collects the planted forwards' names (as their fallback notices name them)."""
    family = importlib.import_module(f"{env.pack.__name__}.nodes.families.family")
    guard = family.Family.guard
    planted = set()

    def planted_guard(self, kind, what, module, names, run, config, *, residual=None, **kwargs):
        if residual is not None:
            run = _scaled_update(run, residual, factor)
            planted.add(f"{self.name} {what}")
        return guard(self, kind, what, module, names, run, config, residual=residual, **kwargs)
    monkeypatch.setattr(family.Family, "guard", planted_guard)
    return planted


@pytest.mark.parametrize("family,fmt,cond,plant", ROWS, ids=["-".join(row) for row in ROWS])
def test_a_planted_error_in_a_familys_block_falls_back(env, models, monkeypatch, family, fmt, cond, plant):
    torch = env.torch
    patcher = models(family, fmt)
    spec = matrix.FAMILIES[family]
    planted = plant_blocks(monkeypatch, env, PLANTS[plant]) if PLANTS[plant] is not None else set()
    inputs = formats.as_compute(spec.inputs(torch, cond, patcher.model), patcher.qkv_format.compute)
    with matrix._floor(env, family, matrix.MATRIX_FLOOR):
        patched, report = env.node.apply_patch(patcher, "High", "sdpa", True)
        assert report.any_patched and not report.skipped_reasons, report.lines()
        env.core.reset_notices()
        env.core.drain_tally()
        comfy_env.model_forward(patcher, inputs, applied=patched)
        notices = env.core.drain_notices()
    fallbacks = [notice for notice in notices if notice.kind == env.core.notices.FALLBACK]
    adapter = importlib.import_module(f"{env.pack.__name__}.nodes.families.{spec.adapter}")
    config = env.node.QKVConfig(env.node.LEVELS.index("High"), "sdpa", True)
    run = env.node.RunReport(adapter.FAMILY, config.describe(), report)
    env.node.finish_report(run, patched, adapter, patcher.model.diffusion_model, None, config, False, notices)
    first = run.lines()[0]
    if PLANTS[plant] is None:
        assert fallbacks == [], fallbacks
        assert first.startswith(f"{adapter.FAMILY} (High, block bounds, backend sdpa)"), first
        return
    assert planted, "no bounded block was planted"
    ran_stock = {notice.subject: notice for notice in fallbacks}
    assert set(ran_stock) == planted, (planted, fallbacks)   # every planted block, and only they, fell back
    assert ran_stock, f"{plant} ({family}, {fmt}, {cond}) was kept by {sorted(planted)}"
    for what, notice in ran_stock.items():
        assert notice.reason.startswith("the outputs differ"), notice
        assert str(notice).startswith(f"[QKV] {what} runs as ComfyUI's own: the outputs differ"), notice
    assert first.startswith(("Part of the saving this run: ", "No saving this run: ")), first
    assert "ran as ComfyUI's own (the outputs differ" in first, first
