"""Every check of a `qkv_core` entry point comes before the hand-off (docs/design.md §2.1): a refused call leaves the
caller's lists as they were (the activation is still there: the list held its only reference), and each wrong input
is a ValueError that names the argument and the fix, never torch's own error from inside the run. `layers`:
16 -> 4 heads x 32, float32 on CPU (tests/test_handoff_and_errors.py's helpers)."""
from __future__ import annotations

import pytest
import torch

import qkv_core as qc
from support.reference import make_qkv

from test_handoff_and_errors import layers, x16  # noqa: F401


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
