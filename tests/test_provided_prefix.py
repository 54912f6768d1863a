"""Another node pack's step-constant prefix in the reference cache (README: "Your own step-constant keys and
values"): a callable put in `transformer_options["qkv_step_constant_prefix"]` gives each joint attention's keys
and values once per run and conditioning; the cache keeps them (q8 / 16-bit, VRAM / RAM) and every step attends
them before its own keys, on a tiny Flux in a real ComfyUI (skipped without one)."""
from __future__ import annotations

import importlib

import pytest

from support.comfy_env import model_forward as forward, rel_err
import test_reference_cache as reference_tests

pytestmark = pytest.mark.comfyui
env, base, _step = reference_tests.env, reference_tests.base, reference_tests._step   # the pack; a fresh tiny Flux
TOKENS, HEADS, HEAD_DIM = 20, 4, 32


def _inputs(torch):
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(1, 16, 32, 24, generator=g), timestep=torch.tensor([0.6]),
                context=torch.randn(1, 12, 32, generator=g), y=torch.randn(1, 32, generator=g))


@pytest.mark.parametrize("fmt,tolerance", [("16-bit", 1e-5), ("q8", 3e-2)])
def test_a_provided_prefix_is_attended_at_every_step(env, base, fmt, tolerance):
    torch = env.torch
    calls = []

    def provider(position, transformer_options):
        calls.append(position)
        g = torch.Generator().manual_seed(100 + position)
        return (torch.randn(1, TOKENS, HEADS, HEAD_DIM, generator=g), torch.randn(1, TOKENS, HEADS, HEAD_DIM, generator=g))

    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    state = env.cache.ReferenceCache(1, "vram", fmt)
    cached = env.cache.add_reference_cache(patched, state)
    options = dict(_step(torch, 0.6, cached), **{env.cache.PROVIDER_KEY: provider})
    plain = dict(_step(torch, 0.6, patched))
    inputs = _inputs(torch)
    with state.run():
        first = forward(base, inputs, applied=cached, options=options)
        second = forward(base, inputs, applied=cached, options=options)
    assert calls == [0, 1, 2, 3]          # each of the 4 blocks' prefix asked once in the run
    assert state.counts["use"] == 2 and torch.equal(first, second)
    without = forward(base, inputs, applied=patched, options=plain)
    assert rel_err(first, without) > 1e-3   # the prefix is attended: the output moves

    # the definition: each block attends [its prefix, its own keys]: with the pack's own kv_prefix per block
    seen = []
    attention = importlib.import_module(env.pack.__name__ + ".nodes.attention")
    original = attention.joint_qkv_attention

    def with_prefix(*args, **kwargs):
        position = len(seen)
        seen.append(position)
        g = torch.Generator().manual_seed(100 + position)
        k, v = torch.randn(1, TOKENS, HEADS, HEAD_DIM, generator=g), torch.randn(1, TOKENS, HEADS, HEAD_DIM, generator=g)
        return original(*args, kv_prefix=(k, v), **kwargs)
    attention.joint_qkv_attention = with_prefix
    try:
        want = forward(base, inputs, applied=patched, options=plain)
    finally:
        attention.joint_qkv_attention = original
    assert rel_err(first, want) < tolerance


def test_a_provided_prefix_beside_references_is_refused(env, base, caplog):
    torch = env.torch
    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    state = env.cache.ReferenceCache(1, "vram", "q8")
    cached = env.cache.add_reference_cache(patched, state)
    inputs = dict(_inputs(torch), ref_latents=[torch.randn(1, 16, 24, 24)])
    options = dict(_step(torch, 0.6, cached), **{env.cache.PROVIDER_KEY: lambda *a: None})
    with caplog.at_level("INFO"), state.run():
        out = forward(base, inputs, applied=cached, options=options)
    assert state.counts == {"fill": 0, "use": 0, "full": 1}
    assert rel_err(out, forward(base, inputs, applied=patched, options=_step(torch, 0.6, patched))) < 1e-6
    assert any("a step-constant prefix beside reference latents" in r.getMessage() for r in caplog.records)
