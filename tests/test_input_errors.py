"""Backend fallbacks (docs/design.md §2.4), inputs that once gave silently wrong results or obscure errors, and
tensors that require grad (refused up front with the fix named). The helpers are tests/test_handoff_and_errors.py's."""
from __future__ import annotations

import logging

import pytest
import torch

import qkv_core as qc
from support.reference import PerHeadNormRope, make_qkv, max_rel_err, randn

from test_handoff_and_errors import D, FEAT, H, layers, x16  # noqa: F401


# --- backend fallback -----------------------------------------------------------------------------------
def test_available_backends():
    available = qc.backends.available_backends()
    assert available["sdpa"] is None
    assert set(available) == set(qc.backend_names()) >= {"sdpa", "flash", "sage"}
    assert qc.backend_names()[-1] == "sdpa"
    for name, reason in available.items():
        assert reason is None or isinstance(reason, str)
    assert qc.backends.resolve_backend(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)).name \
        in qc.backend_names()


@pytest.mark.parametrize("name", ["flash", "sage"])
def test_forced_backend_falls_back_to_sdpa_on_cpu(caplog, name):
    caplog.set_level(logging.INFO, logger="qkv_core")
    qp, kp, vp = make_qkv(FEAT, H, D, seed=40)
    x = randn(1, 300, FEAT, seed=41)
    norm = PerHeadNormRope(D)
    want = qc.qkv_attention([x], qp, kp, vp, H, D, norm, force_attention="sdpa")
    assert not caplog.records
    for _ in range(2):
        got = qc.qkv_attention([x], qp, kp, vp, H, D, norm, force_attention=name)
        assert torch.equal(got, want)
    q, k, v = (randn(1, 50, H, D, seed=s) for s in (42, 43, 44))
    plain = qc.pay_attention(q, k, v, force_attention="sdpa")
    assert torch.equal(qc.pay_attention(q, k, v, force_attention=name), plain)
    assert torch.equal(qc.kv_first_attention([q, k, v], force_attention=name), plain)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"[Attention] {name} backend not used: ") and "falling back" in lines[0]
    notices = qc.drain_notices()
    assert [str(notice) for notice in notices] == lines and qc.drain_notices() == []
    assert [(notice.kind, notice.subject) for notice in notices] == [(qc.notices.PASSED_OVER, name)]


# --- inputs that gave silently wrong results or obscure errors ------------------------------------------
def test_projection_width_must_be_heads_times_head_dim(layers):
    q, k, v = layers                                         # 4 heads x 32 = 128 features each
    with pytest.raises(ValueError, match=r"the q projection has 128 output features, not heads x head_dim = "
                                         r"8 x 32 = 256"):
        qc.qkv_attention([x16(1, 8)], q, k, v, 8, 32)
    gqa_k, gqa_v = make_qkv(16, 2, 32, seed=31)[1:]          # 2 heads of keys/values
    with pytest.raises(ValueError, match=r"the k projection has 64 output features.*pass kv_heads=2"):
        qc.qkv_attention([x16(1, 8)], q, gqa_k, gqa_v, 4, 32)
    out = qc.qkv_attention([x16(1, 8)], q, gqa_k, gqa_v, 4, 32, kv_heads=2)   # the fix it names works
    assert out.shape == (1, 8, 4, 32)


def test_a_fused_qkv_layer_is_passed_by_its_parts():
    fused = torch.nn.Linear(16, 3 * 4 * 32).requires_grad_(False)
    x = x16(2, 8)
    with pytest.raises(ValueError, match=r"passed as q and k: a fused qkv layer must be passed as its parts, "
                                         r"qkv_core.FusedRows"):
        qc.qkv_attention([x.clone()], fused, fused, fused, 4, 32)
    with pytest.raises(ValueError, match=r"the q projection has 384 output features.*FusedRows\(layer, index, 3\)"):
        qc.qkv_attention([x.clone()], fused, torch.nn.Linear(16, 128).requires_grad_(False),
                         torch.nn.Linear(16, 128).requires_grad_(False), 4, 32)
    parts = [qc.FusedRows(fused, i, 3) for i in range(3)]
    out = qc.qkv_attention([x.clone()], *parts, 4, 32, head_split_level=3, split_floor_tokens=0)
    with torch.no_grad():
        q, k, v = fused(x).unflatten(-1, (3, 4, 32)).unbind(2)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    assert max_rel_err(out, expected) < 1e-5
    with pytest.raises(ValueError, match=r"do not split into 5 equal parts; pass sizes"):
        qc.FusedRows(fused, 0, 5)
    with pytest.raises(ValueError, match=r"sizes \(128, 128\) add up to 256, the layer has 384 outputs"):
        qc.FusedRows(fused, 0, sizes=(128, 128))
    with pytest.raises(ValueError, match=r"index 3 is not one of the 3 parts"):
        qc.FusedRows(fused, 3, 3)


def test_a_missing_projection_is_named(layers):
    q, k, v = layers
    with pytest.raises(ValueError, match=r"k_proj is None: q, k and v projections are all needed"):
        qc.qkv_attention([x16(1, 8)], q, None, v, 4, 32)
    with pytest.raises(ValueError, match=r"v_proj is None"):
        qc.cross_qkv_attention([x16(1, 8)], [x16(1, 4)], q, k, None, 4, 32)


def test_prefix_keys_and_values_must_pair(layers):
    k = torch.randn(1, 5, 4, 32)
    with pytest.raises(ValueError, match=r"kv_prefix keys \(1, 5, 4, 32\) and values \(1, 6, 4, 32\) must have the "
                                         r"same batch and tokens"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, kv_prefix=(k, torch.randn(1, 6, 4, 32)))
    with pytest.raises(ValueError, match=r"kv_prefix values must be \(batch, tokens, kv_heads=4, head_dim=32\), "
                                         r"got \(1, 5, 4, 16\)"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, kv_prefix=(k, torch.randn(1, 5, 4, 16)))
    with pytest.raises(ValueError, match=r"cache_prefix takes a key and a value of one shape"):
        qc.cache_prefix([k, torch.randn(1, 6, 4, 32)], native=False)
    with pytest.raises(ValueError, match=r"cache_prefix takes a key and a value of one shape"):
        qc.cache_prefix([torch.randn(5, 4, 32), torch.randn(5, 4, 32)], native=False)


def test_kv_first_attention_wants_heads_split_out():
    q = torch.randn(1, 8, 128)
    with pytest.raises(ValueError, match=r"takes q, k, v as \(batch, tokens, heads, head_dim\).*unflatten"):
        qc.kv_first_attention([q, q.clone(), q.clone()])
    q4, k4 = torch.randn(1, 8, 4, 32), torch.randn(1, 8, 4, 32)
    with pytest.raises(ValueError, match=r"k and v must match"):
        qc.kv_first_attention([q4, k4, torch.randn(1, 9, 4, 32)])
    with pytest.raises(ValueError, match=r"a multiple of their heads"):
        qc.kv_first_attention([torch.randn(1, 8, 5, 32), k4, k4.clone()])


def test_merge_lse_names_the_layout():
    out, other = torch.randn(1, 6, 4, 32), torch.randn(1, 6, 4, 32)
    good = torch.randn(1, 4, 6)
    with pytest.raises(ValueError,
                       match=r"lse must be \(batch, heads, tokens\) = \(1, 4, 6\).*pass \.transpose\(1, 2\)"):
        qc.q8.merge_lse_(out, torch.randn(1, 6, 4), other, good)
    with pytest.raises(ValueError, match=r"out and other must be one shape"):
        qc.q8.merge_lse_(out, good, torch.randn(1, 6, 4, 16), good.clone())


def test_split_plan_says_why_it_does_not_split():
    """One decision for the runtime and for the node's memory estimate (`qkv_core.split_plan`)."""
    assert qc.split_plan(40, 75600, "high") == qc.SplitPlan(20)
    assert qc.split_plan(40, 75600, "low") == qc.SplitPlan(4)
    assert qc.split_plan(40, 75600, "off") == qc.SplitPlan(1, "head split Off")
    assert qc.split_plan(40, 100, "high") == qc.SplitPlan(1, "100 tokens, under 8192")
    assert qc.split_plan(40, 100, "high", split_floor_tokens=64).groups == 20
    assert qc.split_plan(1, 75600, "high") == qc.SplitPlan(1, "one key/value head")
    assert qc.split_plan(40, 75600, "high", split_heads=False) == qc.SplitPlan(1, "split_heads=False")
    assert qc.split_plan(40, 75600, "high", unsliceable="GGUF patch") == qc.SplitPlan(1, "GGUF patch")
    assert qc.split_plan(40, 100, "high", unsliceable="GGUF patch").reason == "100 tokens, under 8192"
    assert qc.group_count(40, 75600, 3) == 20


# --- autograd: refused up front (issue 34, item 8) -------------------------------------------------------------
def _grad_calls(trainable: bool, x_grad: bool, wrap=lambda layer: layer):
    """One call of each entry point (name, a function making and running it): layers whose weights require grad
    when `trainable`, inputs that require grad when `x_grad`; `wrap(layer)` is what each projection is passed as.
    Split from the first token (a split call is what fails deep inside without the refusal)."""
    def layer(seed):
        return make_qkv(16, 4, 32, seed=seed)

    def trained(layers):
        return tuple(wrap(lin.requires_grad_(trainable)) for lin in layers)

    def x(tokens=24):
        return x16(1, tokens).requires_grad_(x_grad)
    split = dict(head_split_level="high", split_floor_tokens=0)

    def kv_first():
        q, k, v = (torch.randn(1, 24, 4, 32).requires_grad_(x_grad or trainable) for _ in range(3))
        return qc.kv_first_attention([q, k, v])
    return {
        "qkv_attention": lambda: qc.qkv_attention([x()], *trained(layer(40)), 4, 32, **split),
        "joint_qkv_attention": lambda: qc.joint_qkv_attention([([x()], trained(layer(41))),
                                                               ([x(8)], trained(layer(42)))], 4, 32, **split),
        "cross_qkv_attention": lambda: qc.cross_qkv_attention([x()], [x(12)], *trained(layer(43)), 4, 32, **split),
        "kv_first_attention": kv_first,
    }


ENTRY_POINTS = ("qkv_attention", "joint_qkv_attention", "cross_qkv_attention", "kv_first_attention")


@pytest.mark.parametrize("entry,trainable,x_grad", [
    *((entry, False, True) for entry in ENTRY_POINTS),
    *((entry, True, False) for entry in ENTRY_POINTS if entry != "kv_first_attention")])   # it has no weights
def test_tensors_that_require_grad_are_refused_up_front(entry, trainable, x_grad):
    """A model author's training code calling an entry point under grad mode with an input or a projection that
    requires grad: a `ValueError` naming the fix, before anything is cleared or computed (no `addmm(): functions
    with out=... arguments` from deep inside); under `torch.no_grad()` / `torch.inference_mode()` the same call
    runs."""
    call = _grad_calls(trainable, x_grad)[entry]
    with pytest.raises(ValueError, match=rf"^{entry}: .* requires grad with gradient mode on\. .*torch\.no_grad\(\) "
                                         r"or torch\.inference_mode\(\), or use the model's own attention"):
        call()
    with torch.no_grad():
        out = call()
    assert out.shape[-2:] == (4, 32) and torch.isfinite(out).all() and not out.requires_grad
    with torch.inference_mode():
        assert torch.isfinite(call()).all()


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_grad_mode_with_nothing_to_differentiate_runs(entry):
    """Grad mode on but no input and no weight requires grad: nothing for autograd to do, the call runs."""
    out = _grad_calls(False, False)[entry]()
    assert torch.isfinite(out).all() and not out.requires_grad


@pytest.mark.parametrize("form", ["RowProjection", "bound forward", "closure", "module"])
def test_weights_behind_a_projection_object_are_seen(form):
    """A trainable layer passed as a `RowProjection`, a module's bound forward, a closure over it, or inside a
    module of the model's own: each is looked through, and named."""
    class Wrapper(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            self.linear = linear

        def forward(self, x):
            return self.linear(x)

    wrap = {"RowProjection": qc.projections.LinearRows, "bound forward": lambda lin: Wrapper(lin).forward,
            "closure": lambda lin: (lambda x: lin(x)), "module": Wrapper}[form]
    with pytest.raises(ValueError, match=r"^qkv_attention: the q projection requires grad .*torch\.no_grad\(\)"):
        _grad_calls(True, False, wrap)["qkv_attention"]()
    with torch.no_grad():
        assert torch.isfinite(_grad_calls(True, False, wrap)["qkv_attention"]()).all()


def test_a_refused_call_leaves_its_lists_alone(layers):
    """The refusal comes before the hand-off: the caller's lists still hold their tensors (retry under no_grad)."""
    x = x16(1, 8).requires_grad_(True)
    x_list = [x]
    with pytest.raises(ValueError, match="qkv_attention: x requires grad"):
        qc.qkv_attention(x_list, *layers, 4, 32)
    assert x_list == [x]
    qkv = [torch.randn(1, 8, 4, 32, requires_grad=True) for _ in range(3)]
    with pytest.raises(ValueError, match="kv_first_attention: q requires grad"):
        qc.kv_first_attention(qkv)
    assert len(qkv) == 3
