"""q/k/v in ComfyUI's `AttentionTensorContainer`s, as ComfyUI v0.40 passes them to every attention backend (v0.33
has the class and MiniMax H3 uses it already): emulated on v0.33 for every family by handing each model's
`optimized_attention` calls containers (every `comfy.ldm` module's name bound to it), as the newer models write
them. Each family's patched model still equals ComfyUI's own (the containers' forward is its self-check's stock)
without a fallback, and the head split runs; the kernel-level override peeks at containers it hands on and takes
the ones it runs. Skipped without ComfyUI, or where ComfyUI has no AttentionTensorContainer."""
from __future__ import annotations

import importlib
import sys

import pytest

from support import comfy_env
from support import family_cases
from support.family_runs import _family_floor, case_forward, env, family_groups, rel_err  # noqa: F401

pytestmark = pytest.mark.comfyui


@pytest.fixture
def containers(monkeypatch):
    """Every `comfy.ldm` module's `optimized_attention` and `optimized_attention_masked` hand q/k/v on in containers
    (those they get as tensors). Returns the list of calls that went through containers."""
    attention = importlib.import_module("comfy.ldm.modules.attention")
    container = getattr(attention, "AttentionTensorContainer", None)
    if container is None:
        pytest.skip("this ComfyUI has no AttentionTensorContainer")
    handed = []

    def in_containers(original):
        def call(q, k, v, *args, **kwargs):
            if not isinstance(q, container):
                q, k, v = container(q), container(k), container(v)
            handed.append(original.__name__)
            return original(q, k, v, *args, **kwargs)
        return call

    for attribute in ("optimized_attention", "optimized_attention_masked"):
        original = getattr(attention, attribute)
        wrapped = in_containers(original)
        for name, module in list(sys.modules.items()):
            if name.startswith("comfy.ldm.") and getattr(module, attribute, None) is original:
                monkeypatch.setattr(module, attribute, wrapped)
    return handed


@pytest.mark.parametrize("family", sorted(family_cases.CASES))
def test_every_family_with_containers(env, containers, family):
    case = family_cases.case(family)
    reference = case_forward(case)
    assert containers, f"{family}: no attention call went through the containers"
    patched, report = env.node.apply_patch(case.patcher, "High", "sdpa", True)
    assert report.any_patched and not report.skipped_reasons, report.lines()
    env.compat.forget_verdicts()   # the self-check runs against the containers' forward
    env.core.reset_notices()
    with comfy_env.SdpaHeads(env.torch) as spy:
        out = case_forward(case, applied=patched)
    assert not comfy_env.stock_fallbacks(env), family
    assert rel_err(out, reference) <= 1e-5, (family, rel_err(out, reference))
    groups = family_groups(env, family, case.kv_heads, 3)
    assert (case.heads or case.kv_heads) // groups in spy.self_heads, (family, spy.self_heads)


def test_the_kernel_override_takes_only_the_containers_it_runs(env):
    """The kernel-level override with containers: a call it runs takes them (empty after) and equals SDPA; a call it
    hands on (an argument it does not know) gets them untouched."""
    torch = env.torch
    attention = importlib.import_module("comfy.ldm.modules.attention")
    container = getattr(attention, "AttentionTensorContainer", None)
    if container is None:
        pytest.skip("this ComfyUI has no AttentionTensorContainer")
    kernel_patch = importlib.import_module(env.pack.__name__ + ".nodes.kernel_patch")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 4 * 16, generator=g) for _ in range(3))
    override = kernel_patch.make_override("sdpa")
    boxes = [container(t) for t in (q, k, v)]
    out = override(None, *boxes, 4)
    assert all(box.tensor is None for box in boxes)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.unflatten(-1, (4, 16)).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).flatten(2)
    assert torch.allclose(out, expected, atol=1e-5)
    seen = []
    boxes = [container(t) for t in (q, k, v)]
    override(lambda *args, **kwargs: seen.append(args), *boxes, 4, something_new=True)
    assert seen and all(box.tensor is not None for box in boxes) and seen[0][0] is boxes[0]


def test_comfyuis_wrapper_hands_the_kernel_override_its_containers(env, monkeypatch):
    """Through ComfyUI's own `optimized_attention` (its `wrap_attn`) with the kernel-level override set: the
    override's container path gets the containers themselves, and the pack's backend takes them (ComfyUI's wrapper
    holds no q/k/v while the kernel runs); a call it hands on reaches ComfyUI's kernel with them untouched; an
    override chained behind it gets ComfyUI's `func` and tensors, as it would alone."""
    torch = env.torch
    attention = importlib.import_module("comfy.ldm.modules.attention")
    container = getattr(attention, "AttentionTensorContainer", None)
    if container is None:
        pytest.skip("this ComfyUI has no AttentionTensorContainer")
    kernel_patch = importlib.import_module(env.pack.__name__ + ".nodes.kernel_patch")
    takers = []
    take = container.take

    def recorded_take(self):
        frame = sys._getframe(1)
        while frame.f_code.co_name.startswith("<"):   # a generator expression: its function is the taker
            frame = frame.f_back
        takers.append(frame.f_code.co_name)
        return take(self)
    monkeypatch.setattr(container, "take", recorded_take)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 4 * 16, generator=g) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.unflatten(-1, (4, 16)).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).flatten(2)

    def call(override, **extra):
        takers.clear()
        boxes = [container(t) for t in (q, k, v)]
        out = attention.optimized_attention(*boxes, 4, transformer_options={"optimized_attention_override": override},
                                            **extra)
        assert all(box.tensor is None for box in boxes)
        return out

    ours = kernel_patch.make_override("sdpa")
    assert torch.allclose(call(ours), expected, atol=1e-5)
    assert takers == ["_take"] * 3, takers                       # the pack's backend took them, not ComfyUI
    assert torch.allclose(call(ours, something_new=True), expected, atol=1e-5)
    assert takers == ["wrapper"] * 3, takers                     # handed on: ComfyUI's kernel took them

    seen = []

    def previous(func, *args, **kwargs):
        seen.append((func, args[:3]))
        return func(*args, **kwargs)
    assert torch.allclose(call(kernel_patch.make_override("sdpa", previous)), expected, atol=1e-5)
    assert seen and callable(seen[0][0]) and all(torch.is_tensor(t) for t in seen[0][1])
