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


# --- every check before the hand-off (issue 46, item 4) ---------------------------------------------------------
# A refused call leaves the caller's lists as they were: the activation is still there (the list held its only
# reference), and each wrong input is a ValueError that names the argument and the fix, never torch's own error
# from inside the run. `layers`: 16 -> 4 heads x 32, float32 on CPU.
def refused(match, call, *lists):
    """`call()` raises a ValueError matching `match`; each of `lists` (`(list, its tensors)`) still holds the very
    tensors it held."""
    with pytest.raises(ValueError, match=match):
        call()
    for held, tensors in lists:
        assert len(held) == len(tensors) and all(a is b for a, b in zip(held, tensors)), "a list was touched"


def _meta(layer):
    return torch.nn.Linear(layer.in_features, layer.out_features, device="meta").requires_grad_(False)


SELF_REFUSALS = {   # id: (regex of the message, arguments changed from a good call of 8 tokens x 16 features)
    "bogus level": (r"head_split_level must be 0-3 or one of .*not 'bogus'", dict(head_split_level="bogus")),
    "heads as str": (r"heads must be a positive int \(got '4' of type str\): pass heads=4", dict(heads="4")),
    "heads as float": (r"heads must be a positive int \(got 4\.0 of type float\): pass heads=4", dict(heads=4.0)),
    "heads zero": (r"heads \(0\) and head_dim \(32\) must be positive: pass the model's", dict(heads=0)),
    "head_dim as str": (r"head_dim must be a positive int \(got 'x' of type str\): pass head_dim as an int",
                        dict(head_dim="x")),
    "kv_heads as str": (r"kv_heads must be a positive int \(got '2' of type str\): pass kv_heads=2",
                        dict(kv_heads="2")),
    "kv_heads not dividing heads": (r"heads \(4\) must be a multiple of kv_heads \(3\).*pass kv_heads=heads",
                                    dict(kv_heads=3)),
    "wrong width": (r"^x has 24 features but the q projection takes 16 \(its in_features\): pass the activation",
                    dict(x=torch.randn(1, 8, 24))),
    "integer x": (r"^x \(in x_list\) must be a floating-point tensor .*got torch.int64: cast it .*x\.to\(",
                  dict(x=torch.ones(1, 8, 16, dtype=torch.long))),
    "x of 4 dims": (r"^x_list: expected \(batch, tokens, features\) or \(tokens, features\), got \(1, 1, 8, 16\): "
                    r"pass \[x\] with x of 2 or 3 dims", dict(x=torch.randn(1, 1, 8, 16))),
    "x of 1 dim": (r"^x_list: expected .* got \(16,\)", dict(x=torch.randn(16))),
    "x dtype not the layers'": (r"^x is torch.bfloat16 but the q projection's weight is torch.float32 \(a "
                                r"torch.nn.Linear is not cast\): cast the layer \(layer.to\(torch.bfloat16\)\)",
                                dict(x=torch.randn(1, 8, 16).bfloat16())),
    "layers on another device": (r"^x is on cpu but the q projection's weight is on meta: move the layer",
                                 dict(meta_layers=True)),
    "mask shape": (r"attention_mask of shape \(1, 1, 8, 9\) does not broadcast to \(batch, heads, q tokens, kv "
                   r"tokens\) = \(1, 4, 8, 8\).*give each dim that size or 1",
                   dict(attention_mask=torch.zeros(1, 1, 8, 9))),
    "mask heads": (r"attention_mask of shape \(1, 3, 8, 8\) does not broadcast",
                   dict(attention_mask=torch.zeros(1, 3, 8, 8))),
    "mask of 5 dims": (r"attention_mask of shape \(1, 1, 1, 8, 8\) does not broadcast",
                       dict(attention_mask=torch.zeros(1, 1, 1, 8, 8))),
    "mask of 1 dim": (r"attention_mask of shape \(8,\) does not broadcast", dict(attention_mask=torch.zeros(8))),
    "mask counts the prefix": (r"attention_mask of shape \(1, 1, 8, 8\) does not broadcast to .* = \(1, 4, 8, 13\) "
                               r"\(kv tokens count a kv_prefix's first",
                               dict(attention_mask=torch.zeros(1, 1, 8, 8),
                                    kv_prefix=(torch.randn(1, 5, 4, 32), torch.randn(1, 5, 4, 32)))),
    "integer mask": (r"attention_mask must be boolean \(True attends\) or an additive float mask, got torch.int64: "
                     r"pass mask.bool\(\)", dict(attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.long))),
    "float16 mask beside float32": (r"attention_mask is torch.float16 but the inputs are torch.float32: .*pass "
                                    r"mask.to\(torch.float32\)", dict(attention_mask=torch.zeros(1, 1, 8, 8).half())),
    "mask on another device": (r"attention_mask is on meta but the inputs are on cpu: pass mask.to\('cpu'\)",
                               dict(attention_mask=torch.zeros(1, 1, 8, 8, device="meta"))),
    "mask as a list": (r"attention_mask must be a tensor .* not list: pass torch.as_tensor\(mask\)",
                       dict(attention_mask=[[0.0] * 8] * 8)),
    "callable mask without a staged core": (r"a callable attention_mask needs a staged SageAttention core",
                                            dict(attention_mask=lambda q, k, g: None)),
    "native prefix without a staged core": (r"a native prefix needs a staged SageAttention core",
                                            dict(kv_prefix="native")),
    "prefix shape": (r"kv_prefix keys must be \(batch, tokens, kv_heads=4, head_dim=32\), got \(1, 5, 4, 16\)",
                     dict(kv_prefix=(torch.randn(1, 5, 4, 16), torch.randn(1, 5, 4, 16)))),
    "unknown backend": (r"^force_attention: unknown attention backend 'nope': use one of \['auto', ",
                        dict(force_attention="nope")),
    "backend not a name": (r"^force_attention: unknown attention backend 3", dict(force_attention=3)),
    "softmax_scale as str": (r"^softmax_scale is a number .* not '0.1' of type str", dict(force_attention="sdpa",
                                                                                          softmax_scale="0.1")),
    "split_heads not a switch": (r"^split_heads is a switch, True or False, not 'no' of type str: pass split_heads=",
                                 dict(split_heads="no")),
    "norm_spans_heads not a switch": (r"^norm_spans_heads is a switch", dict(norm_spans_heads="yes")),
    "reuse_input not a switch": (r"^reuse_input is a switch", dict(reuse_input=2)),
    "split_floor_tokens as str": (r"^split_floor_tokens is the fewest tokens .* not '0'", dict(split_floor_tokens="0")),
    "group scale zero": (r"^head_split_group_scale multiplies the level's head groups, a number > 0, not 0",
                         dict(head_split_group_scale=0)),
    "keep_keys out of range": (r"^keep_keys is the fraction", dict(norm_spans_heads=True, keep_keys=2)),
    "norm_rope not callable": (r"^norm_rope must be a callable .* not int", dict(norm_rope=3)),
    "attention_fn not callable": (r"^attention_fn must be a callable .* not str", dict(attention_fn="sdpa")),
    "norm_v not callable": (r"^norm_v must be a callable", dict(norm_v=1.0)),
    "norm_stats not callable": (r"^norm_stats must be a callable", dict(norm_spans_heads=True, norm_stats=[])),
    "fused_quant not callable": (r"^fused_quant must be a callable", dict(fused_quant=True)),
    "capture_kv form": (r"^capture_kv takes \(layer, start, stop\)", dict(capture_kv=(None, 0, 4))),
    "projection not callable": (r"a projection must be a torch.nn.Linear, a RowProjection or a callable, not int",
                                dict(k_proj=3)),
}


def _self_call(layers, x=None, heads=4, head_dim=32, norm_rope=None, k_proj=None, meta_layers=False, **options):
    """A call of `qkv_attention` (its list and x) with the arguments of one `SELF_REFUSALS` case."""
    q, k, v = (_meta(layer) for layer in layers) if meta_layers else layers
    if options.get("kv_prefix") == "native":
        options["kv_prefix"] = qc.KVPrefix(torch.zeros(1, 8, 4, 32, dtype=torch.int8), torch.ones(1, 8, 4, 1),
                                           torch.zeros(1, 1, 4, 32), torch.zeros(1, 8, 4, 32, dtype=torch.int8),
                                           torch.ones(1, 8, 4, 1), None)
    x = x16(1, 8) if x is None else x
    x_list = [x]
    return x_list, x, lambda: qc.qkv_attention(x_list, q, k if k_proj is None else k_proj, v, heads, head_dim,
                                               norm_rope, **options)


@pytest.mark.parametrize("case", list(SELF_REFUSALS))
def test_qkv_attention_refuses_before_the_hand_off(layers, case):
    match, arguments = SELF_REFUSALS[case]
    x_list, x, call = _self_call(layers, **arguments)
    refused(match, call, (x_list, [x]))
    assert x_list[0] is x


def test_an_unknown_option_leaves_the_list(layers):
    x = x16(1, 8)
    x_list = [x]
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['mask'\]"):
        qc.qkv_attention(x_list, *layers, 4, 32, mask=None)
    assert x_list[0] is x


@pytest.mark.parametrize("mask", ["(q, kv)", "(batch, q, kv)", "(batch, heads, q, kv)", "(1, 1, 1, kv)", "bool",
                                  "float32 beside bfloat16"])
def test_the_masks_the_runtime_takes_still_run(layers, mask):
    """The mask check refuses only what fails inside the run: each form the runtime and SDPA take still runs and
    the list is cleared as before."""
    bf16 = mask == "float32 beside bfloat16"
    x = x16(2, 8).bfloat16() if bf16 else x16(2, 8)
    q, k, v = (torch.nn.Linear(16, 128, dtype=torch.bfloat16).requires_grad_(False) for _ in range(3)) if bf16 \
        else layers
    tensor = {"(q, kv)": torch.zeros(8, 13), "(batch, q, kv)": torch.zeros(2, 8, 13),
              "(batch, heads, q, kv)": torch.zeros(2, 4, 8, 13), "(1, 1, 1, kv)": torch.zeros(1, 1, 1, 13),
              "bool": torch.ones(2, 1, 8, 13, dtype=torch.bool),
              "float32 beside bfloat16": torch.zeros(2, 1, 8, 13)}[mask]
    prefix = (torch.randn(1, 5, 4, 32, dtype=x.dtype), torch.randn(1, 5, 4, 32, dtype=x.dtype))
    x_list = [x]
    out = qc.qkv_attention(x_list, q, k, v, 4, 32, attention_mask=tensor, kv_prefix=prefix, head_split_level=3,
                           split_floor_tokens=0)
    assert x_list == [] and out.shape == (2, 8, 4, 32) and torch.isfinite(out).all()


JOINT_REFUSALS = {
    "bogus level": (r"head_split_level must be 0-3", dict(head_split_level="bogus")),
    "heads as str": (r"heads must be a positive int \(got '4' of type str\): pass heads=4", dict(heads="4")),
    "integer stream": (r"^stream 1 x \(in stream 1 x_list\) must be a floating-point tensor",
                       dict(x1=torch.ones(1, 4, 16, dtype=torch.int32))),
    "stream of 4 dims": (r"^stream 1 x_list: expected", dict(x1=torch.randn(1, 1, 4, 16))),
    "stream width": (r"^stream 1 x has 20 features but the q projection takes 16", dict(x1=torch.randn(1, 4, 20))),
    "stream dtype": (r"all token streams must have one dtype", dict(x1=torch.randn(1, 4, 16).half())),
    "stream device": (r"all token streams must be on one device, got \['cpu', 'meta'\]",
                      dict(x1=torch.randn(1, 4, 16, device="meta"))),
    "mask shape": (r"attention_mask of shape \(1, 1, 12, 8\) does not broadcast to .* = \(1, 4, 12, 12\)",
                   dict(attention_mask=torch.zeros(1, 1, 12, 8))),
    "unknown backend": (r"^force_attention: unknown attention backend 'nope'", dict(force_attention="nope")),
}


@pytest.mark.parametrize("case", list(JOINT_REFUSALS))
def test_joint_qkv_attention_refuses_before_the_hand_off(layers, case):
    match, arguments = JOINT_REFUSALS[case]
    arguments = dict(arguments)   # a copy: the cases' dict stays as it is
    x0, x1 = x16(1, 8), arguments.pop("x1", x16(1, 4))
    heads = arguments.pop("heads", 4)
    lists = [x0], [x1]
    other = make_qkv(16, 4, 32, seed=31)
    refused(match, lambda: qc.joint_qkv_attention([(lists[0], layers), (lists[1], other)], heads, 32, **arguments),
            (lists[0], [x0]), (lists[1], [x1]))


CROSS_REFUSALS = {
    "bogus level": (r"head_split_level must be 0-3", dict(head_split_level=7)),
    "heads as str": (r"heads must be a positive int \(got 'four' of type str\): pass heads as an int",
                     dict(heads="four")),
    "x width": (r"^x has 12 features but the q projection takes 16", dict(x=torch.randn(1, 8, 12))),
    "context width": (r"^context has 24 features but the k projection takes 16", dict(context=torch.randn(1, 6, 24))),
    "integer x": (r"^x \(in x_list\) must be a floating-point tensor",
                  dict(x=torch.zeros(1, 8, 16, dtype=torch.int16))),
    "integer context": (r"^context \(in context_list\) must be a floating-point tensor .*context\.to\(",
                        dict(context=torch.zeros(1, 6, 16, dtype=torch.uint8))),
    "context of 4 dims": (r"^context_list: expected", dict(context=torch.randn(1, 1, 6, 16))),
    "context dtype": (r"all token streams must have one dtype", dict(context=torch.randn(1, 6, 16).bfloat16())),
    "mask shape": (r"attention_mask of shape \(1, 1, 8, 8\) does not broadcast to .* = \(1, 4, 8, 6\)",
                   dict(attention_mask=torch.zeros(1, 1, 8, 8))),
    "batch": (r"all token streams must have the same batch size, got \[1, 3\]", dict(context=torch.randn(3, 6, 16))),
}


@pytest.mark.parametrize("case", list(CROSS_REFUSALS))
def test_cross_qkv_attention_refuses_before_the_hand_off(layers, case):
    match, arguments = CROSS_REFUSALS[case]
    arguments = dict(arguments)   # a copy: the cases' dict stays as it is
    x, context = arguments.pop("x", x16(1, 8)), arguments.pop("context", x16(1, 6))
    heads = arguments.pop("heads", 4)
    x_list, context_list = [x], [context]
    refused(match, lambda: qc.cross_qkv_attention(x_list, context_list, *layers, heads, 32, **arguments),
            (x_list, [x]), (context_list, [context]))


@pytest.mark.parametrize("case", ["integer", "mixed dtypes", "mixed devices", "unknown backend"])
def test_kv_first_attention_refuses_before_the_hand_off(case):
    q, k, v = (torch.randn(1, 8, 4, 32) for _ in range(3))
    force = None
    if case == "integer":
        q, k, v = (t.long() for t in (q, k, v))
        match = r"^kv_first_attention: q, k and v \(qkv_list\) must be floating point of one dtype, got " \
                r"\['torch.int64', 'torch.int64', 'torch.int64'\]: cast them"
    elif case == "mixed dtypes":
        v = v.half()
        match = r"must be floating point of one dtype, got \['torch.float32', 'torch.float32', 'torch.float16'\]"
    elif case == "mixed devices":
        k = torch.empty(1, 8, 4, 32, device="meta")
        match = r"^kv_first_attention: q, k and v \(qkv_list\) must be on one device, got \['cpu', 'meta', 'cpu'\]"
    else:
        force = "nope"
        match = r"^force_attention: unknown attention backend 'nope'"
    qkv = [q, k, v]
    refused(match, lambda: qc.kv_first_attention(qkv, force_attention=force), (qkv, [q, k, v]))


@pytest.mark.parametrize("case", ["integer", "q8 head dim", "native on a CPU"])
def test_cache_prefix_refuses_before_the_hand_off(case):
    key, value = torch.randn(1, 4, 2, 32), torch.randn(1, 4, 2, 32)
    kit = None
    if case == "integer":
        key, value = key.long(), value.long()
        match = r"^cache_prefix takes float keys and values \(kv_list\), got torch.int64 and torch.int64"
    elif case == "q8 head dim":
        key, value = torch.randn(1, 4, 2, 48), torch.randn(1, 4, 2, 48)
        match = r"^cache_prefix \(kv_list\) keeps it as q8 here: q8 needs head_dim divisible by 32, got 48"
    else:
        from qkv_core.sage2 import Sage2Core
        kit = Sage2Core()
        match = r"a native SageAttention 2 prefix needs an sm90 GPU"
    kv = [key, value]
    refused(match, lambda: qc.cache_prefix(kv, native=True, kit=kit) if kit is not None else
            qc.cache_prefix(kv, native=False), (kv, [key, value]))


# ulysses_qkv_attention on a gloo group of one process (its exchange hands the buffer back)
@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


ULYSSES_REFUSALS = {
    "bogus level": (r"head_split_level must be 0-3 or one of .*not 'bogus'", dict(head_split_level="bogus")),
    "split floor": (r"^split_floor_tokens is the fewest tokens", dict(split_floor_tokens=-1)),
    "heads as str": (r"heads must be a positive int \(got '4' of type str\): pass heads=4", dict(heads="4")),
    "wrong width": (r"^x has 24 features but the q projection takes 16", dict(x=torch.randn(1, 8, 24))),
    "integer x": (r"^x \(in x_list\) must be a floating-point tensor", dict(x=torch.ones(1, 8, 16, dtype=torch.long))),
    "x of 4 dims": (r"^x_list: expected", dict(x=torch.randn(1, 1, 8, 16))),
    "no tokens": (r"^x: expected tokens and features, got \(1, 0, 16\)", dict(x=torch.randn(1, 0, 16))),
    "x dtype not the layers'": (r"^x is torch.float16 but the q projection's weight is torch.float32",
                                dict(x=torch.randn(1, 8, 16).half())),
    "o_proj width": (r"^the attention has 128 features but the o projection takes 64",
                     dict(o_proj=torch.nn.Linear(64, 16).requires_grad_(False))),
    "o_proj dtype": (r"^the attention is torch.float32 but the o projection's weight is torch.float16",
                     dict(o_proj=torch.nn.Linear(128, 16, dtype=torch.float16).requires_grad_(False))),
    "group count not an int": (r"^groups is a count of head groups, an int, not 2.0", dict(groups=2.0)),
    "unknown backend": (r"^force_attention: unknown attention backend 'nope'", dict(force_attention="nope")),
    "softmax_scale as str": (r"^softmax_scale is a number", dict(softmax_scale="1", force_attention="sdpa")),
    "norm_rope not callable": (r"^norm_rope must be a callable", dict(norm_rope="rms")),
    "split_heads not a switch": (r"^split_heads is a switch", dict(split_heads="no")),
}


@pytest.mark.parametrize("case", list(ULYSSES_REFUSALS))
def test_ulysses_qkv_attention_refuses_before_the_hand_off(layers, one_rank, case):
    match, arguments = ULYSSES_REFUSALS[case]
    arguments = dict(arguments)   # a copy: the cases' dict stays as it is
    x, heads = arguments.pop("x", x16(1, 8)), arguments.pop("heads", 4)
    norm_rope = arguments.pop("norm_rope", None)
    x_list = [x]
    refused(match, lambda: qc.ulysses_qkv_attention(x_list, *layers, heads, 32, norm_rope, **arguments),
            (x_list, [x]))
    out = qc.ulysses_qkv_attention([x16(1, 8)], *layers, 4, 32, groups=2)   # the group runs
    assert out.shape == (1, 8, 4, 32)
