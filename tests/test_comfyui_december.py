"""The ComfyUI of December 2026 (v0.38 on: every attention layer carries a `ComfyAttention`, the kernel its model
file picks, today `comfy_kitchen_int8`; v0.40 on: q/k/v reach every kernel in `AttentionTensorContainer`s).
Skipped on a ComfyUI without `ComfyAttention` (v0.33 and older): run with COMFYUI_PATH at a tree of that era, e.g.
a v0.33.0 checkout with Comfy-Org/ComfyUI's `comfy/ldm/modules/attention.py` at 05080f6022b2 and
`comfy/ldm/wan/model.py` at 0c9a69aefdb1 put over it (the Wan, container and torch.compile tests pass there too).

- A layer whose file picks a kernel gets that kernel in the pack's head groups (backend auto): equal to stock,
  which runs it on all heads, split, no fallback. On CPU the picked kernel is a stand-in (ComfyUI's int8 kernel
  needs CUDA: `comfy_kitchen.int8_attention_is_available`); on CUDA, where it is available, the real one from
  the layer's own state-dict config.
- A forced backend runs its own kernel there and says so once, naming the fix."""
from __future__ import annotations

import importlib
import json
import logging

import pytest

from support import comfy_env

from support.wan_runs import MODEL, SdpaHeads, _fresh_verdicts, env, forward, rel_err  # noqa: F401

pytestmark = pytest.mark.comfyui


@pytest.fixture
def attention(env):
    module = importlib.import_module("comfy.ldm.modules.attention")
    if not hasattr(module, "ComfyAttention"):
        pytest.skip("this ComfyUI has no ComfyAttention (per-layer kernels came in v0.38)")
    return module


def _layers(patcher):
    return [m.comfy_attention for m in patcher.model.diffusion_model.modules() if hasattr(m, "comfy_attention")]


def _stand_in(attention, calls):
    """A kernel a layer can pick, wrapped as ComfyUI wraps its kernels (`wrap_attn`): PyTorch's attention,
    recording the heads of each call."""
    def kernel_stand_in(q, k, v, heads, *args, **kwargs):
        calls.append(heads)
        return attention.attention_pytorch(q, k, v, heads, *args, **kwargs)
    return attention.wrap_attn(kernel_stand_in)


def test_a_kernel_the_file_picks_runs_the_head_groups(env, attention, caplog):
    base = comfy_env.make_wan("t2v", **MODEL)
    calls = []
    kernel = _stand_in(attention, calls)
    layers = _layers(base)
    assert layers, "the Wan model of this ComfyUI has no ComfyAttention"
    for layer in layers:
        layer.function = kernel
    reference = forward(base)
    assert set(calls) == {MODEL["heads"]}                 # stock: the picked kernel, every head at once
    patched, _ = env.node.apply_patch(base, "High", "auto", True)
    calls.clear()
    caplog.set_level(logging.INFO)
    out = forward(base, patched)
    assert rel_err(out, reference) <= 1e-5
    assert 1 in calls, calls                               # High: the picked kernel on one head a group
    kinds = env.core.notices
    notices = env.core.drain_notices()
    assert not comfy_env.lines_of_kind(notices, kinds.FALLBACK, kinds.PASSED_OVER), notices


def test_a_forced_backend_says_it_runs_instead_of_the_files_kernel(env, attention, caplog):
    torch = env.torch
    base = comfy_env.make_wan("t2v", **MODEL)
    calls = []
    for layer in _layers(base):
        layer.function = _stand_in(attention, calls)
    reference = forward(base)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    with SdpaHeads(torch) as spy:
        out = forward(base, patched)
    assert rel_err(out, reference) <= 1e-5
    assert 1 in spy.self_heads
    lines = comfy_env.lines_of_kind(env.core.drain_notices(), env.core.notices.PASSED_OVER)
    assert len(lines) == 1 and "kernel_stand_in" in lines[0] and "pick auto" in lines[0], lines


@pytest.mark.gpu
def test_comfy_kitchen_int8_from_the_file_runs_the_head_groups_on_cuda(env, attention):
    """The real int8 kernel, picked by the layer's state-dict config as a model file picks it, where CUDA and
    comfy-kitchen's int8 attention are available: the pack's head groups run it, close to stock (int8 both)."""
    torch = env.torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import comfy_kitchen
    if not getattr(attention, "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE", False) or \
            not comfy_kitchen.int8_attention_is_available(torch.device("cuda")):
        pytest.skip("comfy-kitchen's int8 attention is not available here")
    base = comfy_env.make_wan("t2v", dtype=torch.bfloat16, device="cuda", **MODEL)
    config = torch.tensor(list(json.dumps({"attention": "comfy_kitchen_int8"}).encode()), dtype=torch.uint8)
    for name, module in base.model.diffusion_model.named_modules():
        if hasattr(module, "comfy_attention"):
            module.comfy_attention.load_state_dict({"config": config}, strict=False)
    assert all(layer.function is attention.attention_comfy_kitchen_int8 for layer in _layers(base))
    reference = forward(base)
    patched, _ = env.node.apply_patch(base, "High", "auto", True)
    out = forward(base, patched)
    assert rel_err(out.float(), reference.float()) <= 5e-2
    assert not comfy_env.stock_fallbacks(env)
