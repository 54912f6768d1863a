"""The bounded Wan block on a staged core that can reuse its modulated input (`reuse_input`, as SageAttention 2's
sm90 core does), in the weight formats people load: a real ComfyUI, a tiny Wan, the fake row-tiled core of
tests/support/fake_backends.py (float copies as its "quantized" forms, so the results must equal stock's).

Where the layers compute their projections by token ranges, the self-attention runs in its input (k projected
once); fp8-scaled layers quantize their input once per layer call for every head group, so their projections do
not take token ranges cheaply and the usual split runs. Either way the output is stock's.
"""
from __future__ import annotations

import pytest

from support import comfy_env
from support.fake_backends import ROWS_NAME as NAME, row_tiled_backend
from support.wan_runs import forward, rel_err, wan_in_format

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def env():
    # cond + uncond of 4,224 tokens each split (the floor counts one item; lowered as in test_wan_compat)
    with comfy_env.split_floor_tokens(comfy_env.pack_modules(), 2048) as modules:
        yield modules


@pytest.fixture
def reuse_runs(env, monkeypatch, request):
    """Registers the fake backend with the pack's runtime; returns the list `run_in_input` appends to."""
    import importlib
    env.core.backends.register_backend(row_tiled_backend(env.core))
    request.addfinalizer(lambda: env.core.backends.unregister_backend(NAME))
    runtime = importlib.import_module(env.core.__name__ + ".runtime")
    runs, run_in_input = [], runtime.run_in_input

    def counted(*args, **kwargs):
        runs.append(1)
        return run_in_input(*args, **kwargs)
    monkeypatch.setattr(runtime, "run_in_input", counted)
    env.compat.forget_verdicts()
    yield runs
    env.compat.forget_verdicts()


# format: (tolerance against stock, does the self-attention run in its input)
FORMATS = {"float32": (1e-5, True), "bf16": (2e-2, True), "fp8": (1e-5, True), "gguf": (1e-5, True),
           "fp8-scaled": (1e-2, False)}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_bounded_block_reuses_its_input_where_the_layers_allow_and_equals_stock(env, reuse_runs, fmt):
    base = wan_in_format(env, fmt)
    tolerance, reused = FORMATS[fmt]
    if fmt == "fp8":   # stored in fp8, computed in float32: sampled as ComfyUI samples it (test_wan_compat)
        size = dict(frames=3, h=64, w=88, steps=1)   # cond + uncond: 2 x 4,224 tokens
        reference = comfy_env.run_sample(base, **size)
    else:
        reference = forward(base)
    patched, report = env.node.apply_patch(base, "Low", NAME, True)
    assert not report.skipped_reasons, report.lines()
    def run():
        return comfy_env.run_sample(patched, **size) if fmt == "fp8" else forward(base, patched)
    run()   # the first call's self-check runs float32 rows of dequantized weights: those may reuse any input
    reuse_runs.clear()
    out = run()
    assert rel_err(out.float(), reference.float()) <= tolerance
    assert bool(reuse_runs) == reused, f"{fmt}: the self-attention {'did not run' if reused else 'ran'} in its input"
