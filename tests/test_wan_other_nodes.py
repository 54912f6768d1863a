"""The other nodes of a workflow against a real ComfyUI (tiny Wan models): their hooks (`attn1_patch`,
`attn2_patch`, `double_block`) and object patches (on a block's self_attn, cross_attn or the block itself) in both
orders equal stock with the same patches; the node applied twice replaces its own patch; a forced backend says
an override is unused; gradients run stock; a notice is logged once a run. The helpers and fixtures are
tests/support/wan_runs.py's."""
from __future__ import annotations

import logging

import pytest

from support import comfy_env

from support.wan_runs import (MODEL, SMALL, _fresh_verdicts, env, forward, inputs,  # noqa: F401
                              other_node_hooks, rel_err)

pytestmark = pytest.mark.comfyui


# --- other nodes' hooks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("hooks", [("attn1_patch",), ("attn2_patch",), ("double_block",),
                                   ("attn1_patch", "attn2_patch", "double_block")],
                         ids=["attn1", "attn2", "double_block", "all"])
@pytest.mark.parametrize("block", [False, True], ids=["attention", "block"])
def test_other_nodes_hooks_are_honoured(env, hooks, block):
    torch = env.torch
    base = comfy_env.make_wan("t2v", **MODEL)
    stock_calls, ours_calls = [], []
    stock = base.clone()
    for name in hooks:
        stock.set_model_patch(other_node_hooks(torch, stock_calls)[name], name)
    reference = forward(base, stock, **SMALL)
    hooked = base.clone()
    for name in hooks:
        hooked.set_model_patch(other_node_hooks(torch, ours_calls)[name], name)
    patched, _ = env.node.apply_patch(hooked, "High", "sdpa", block)
    out = forward(base, patched, **SMALL)
    assert rel_err(out, reference) <= 1e-5
    assert ours_calls == stock_calls   # each hook ran as often as stock runs it, never on check inputs
    if comfy_env.version_tuple() >= (0, 33):
        assert stock_calls   # this ComfyUI calls these hooks: the comparison is not vacuous


@pytest.mark.parametrize("block", [False, True], ids=["attention", "block"])
def test_a_dit_block_replacement_wraps_the_pack_block(env, block):
    """`patches_replace["dit"]` (what block-swap / caching nodes set): the replacement calls the original block,
    which is the pack's, and the result equals stock with the same replacement."""
    calls = []

    def replace(args, extra):
        calls.append(args["img"].shape[1])
        out = extra["original_block"](args)
        return {"img": out["img"] * 0.9}
    base = comfy_env.make_wan("t2v", **MODEL)
    hooked = base.clone()
    hooked.set_model_patch_replace(replace, "dit", "double_block", 0)
    reference = forward(base, hooked, **SMALL)
    if not calls:
        pytest.skip("this ComfyUI's Wan does not call dit block replacements")
    del calls[:]
    patched, _ = env.node.apply_patch(hooked, "High", "sdpa", block)
    assert rel_err(forward(base, patched, **SMALL), reference) <= 1e-5
    assert calls


# --- other nodes' object patches, both orders ------------------------------------------------------------
def _foreign(module):
    """What KJNodes-style nodes install: a forward of their own on the module (here: stock, scaled)."""
    def forward(*args, **kwargs):
        out = type(module).forward(module, *args, **kwargs)
        return out * 0.5
    return forward


@pytest.mark.parametrize("target", ["self_attn", "cross_attn", "block"])
@pytest.mark.parametrize("order", ["theirs-first", "ours-first"])
@pytest.mark.parametrize("block", [False, True], ids=["attention", "block"])
def test_other_nodes_object_patches_are_kept(env, target, order, block):
    base = comfy_env.make_wan("t2v", **MODEL)
    module = base.model.diffusion_model.blocks[0]
    module = module if target == "block" else getattr(module, target)
    key = "diffusion_model.blocks.0." + ("forward" if target == "block" else f"{target}.forward")
    theirs = base.clone()
    theirs.add_object_patch(key, _foreign(module))
    reference = forward(base, theirs, **SMALL)
    if order == "theirs-first":
        patched, report = env.node.apply_patch(theirs, "High", "sdpa", block)
        if target != "block" or block:
            assert any("another node patched" in line for line in report.lines())
    else:
        patched, _ = env.node.apply_patch(base, "High", "sdpa", block)
        patched.add_object_patch(key, _foreign(module))
    assert rel_err(forward(base, patched, **SMALL), reference) <= 1e-5


@pytest.mark.parametrize("part", ["self_attn", "ffn"])
def test_module_hooks_on_a_block_part_are_kept(env, part):
    """A torch forward hook another node put on a part the bounded block computes itself: the block runs as
    ComfyUI's (which calls the part, so the hook fires) and the result equals stock with the hook."""
    base = comfy_env.make_wan("t2v", **MODEL)
    module = getattr(base.model.diffusion_model.blocks[0], part)
    calls = []

    def hook(mod, args, output):
        calls.append(1)
        return output * 0.5
    handle = module.register_forward_hook(hook)
    try:
        reference = forward(base, **SMALL)
        stock_calls = len(calls)
        patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
        del calls[:]
        assert rel_err(forward(base, patched, **SMALL), reference) <= 1e-5
        assert len(calls) == stock_calls > 0
    finally:
        handle.remove()


# --- the node in a chain ----------------------------------------------------------------------------------
def test_a_reapplied_node_replaces_its_own_patch(env):
    import comfy.patcher_extension
    outer = comfy.patcher_extension.WrappersMP.OUTER_SAMPLE
    base = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
    once, _ = env.node.apply_patch(base, "High", "auto", True)
    twice, report = env.node.apply_patch(once, "Low", "auto", True)
    assert set(twice.object_patches) == set(once.object_patches)
    assert len(twice.get_wrappers(outer, env.node.WRAPPER_KEY)) == 1
    assert any("already patched by this node" in line for line in report.lines())
    stock_factor = base.model.memory_usage_factor
    seen = []

    def probe(executor, *args, **kwargs):
        seen.append(executor.class_obj.model_patcher.model.memory_usage_factor / stock_factor)
        return executor(*args, **kwargs)
    twice.add_wrapper_with_key(outer, "zz_probe", probe)
    for _ in range(2):
        comfy_env.run_sample(twice, frames=3, h=8, w=8, steps=1)
    assert seen == [pytest.approx(1.0), pytest.approx(env.wan.SPEC.measured.memory_factors.unsplit)]  # scaled once


def test_a_forced_backend_says_the_override_is_unused(env, caplog):
    """Another node's `optimized_attention_override`: `auto` chains it (every head group goes through it);
    a forced backend runs its own kernel and says so in the log."""
    base = comfy_env.make_wan("t2v", **MODEL)
    size = dict(frames=2, h=32, w=24, steps=1)    # 384 tokens (the self-check runs on 256)
    calls = []

    def override(func, *args, **kwargs):
        if args[0].shape[1] == 384:
            calls.append(func.__name__)
        return func(*args, **kwargs)
    with_override = base.clone()
    with_override.model_options["transformer_options"]["optimized_attention_override"] = override
    reference = comfy_env.run_sample(with_override, **size)
    stock_calls = len(calls)
    assert stock_calls > 0
    caplog.set_level(logging.INFO)
    forced, _ = env.node.apply_patch(with_override, "High", "sdpa", True)
    del calls[:]
    assert rel_err(comfy_env.run_sample(forced, **size), reference) <= 1e-4
    assert not calls
    assert "attention_backend=sdpa runs its own kernel: the attention override another node set is not used" \
        in caplog.text
    auto, _ = env.node.apply_patch(with_override, "High", "auto", True)
    assert rel_err(comfy_env.run_sample(auto, **size), reference) <= 1e-5
    assert calls    # chained through ComfyUI's dispatcher


def test_gradients_run_stock(env, caplog):
    """A training node downstream: with grad enabled the patched model runs ComfyUI's forwards."""
    torch = env.torch
    base = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
    size = dict(frames=2, h=8, w=8, batch=1)
    patched, _ = env.node.apply_patch(base, "High", "auto", True)
    caplog.set_level(logging.INFO)
    for applied in (base, patched):
        applied.patch_model(load_weights=False)
        try:
            with torch.enable_grad():
                kwargs = inputs(base, **size)
                kwargs["x"].requires_grad_(True)
                out = base.model.diffusion_model(**kwargs)
                if applied is base:
                    reference = out
        finally:
            applied.unpatch_model(unpatch_weights=False)
    assert out.requires_grad and torch.equal(out.detach(), reference.detach())
    assert "runs as ComfyUI's own: gradients are enabled" in caplog.text


def test_a_notice_is_logged_once_per_run(env, caplog):
    """A projection the runtime cannot split says so once a run (not once by the runtime and again by the
    run report)."""
    base = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
    patched, _ = env.node.apply_patch(base, "High", "auto", True)
    ops = env.pack.nodes.comfy_ops
    original = ops.ComfyLinearRows.__init__

    def refuse(self, linear):
        original(self, linear)
        self._reason = "test: a weight without rows"
    caplog.set_level(logging.INFO)
    ops.ComfyLinearRows.__init__ = refuse
    try:
        for _ in range(2):
            comfy_env.run_sample(patched, frames=3, h=64, w=88, steps=2)
    finally:
        ops.ComfyLinearRows.__init__ = original
    assert caplog.text.count("Head Split is not applied") == 2   # once in each of the two runs
