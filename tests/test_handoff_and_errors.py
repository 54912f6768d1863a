"""Hand-off of the inputs (docs/design.md §2.1), every error the runtime raises, and backend fallbacks
(docs/design.md §2.4)."""
from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

import qkv_core as qc
from support.reference import PerHeadNormRope, SpanningNormRope, make_qkv, max_rel_err, randn

H, D, FEAT = 8, 32, 64



class Watch:
    """Weak references to everything the runtime hands to the model's hooks."""

    def __init__(self):
        self.refs = []

    def add(self, *tensors):
        for t in tensors:
            if t is not None:
                self.refs.append(weakref.ref(t))

    def alive(self, result=None):
        """What is still alive, other than `result` (an unsplit call returns its attention's own result)."""
        gc.collect()
        own = set() if result is None else {id(result), id(result._base)}
        return [r for r in self.refs if r() is not None and id(r()) not in own and id(r()._base) not in own]


def hooks(watch, inputs, norm=None, heads=H):
    """norm_rope / norm_v / attention_fn that record weak references, and check in the last group, once q, k
    and v are projected, that the inputs (weak references in `inputs`) are already freed: the projections no
    longer need them."""
    seen_last = []

    def check(group):
        if group.q.stop == heads:
            gc.collect()
            seen_last.append([r() is None for r in inputs])

    def norm_rope(q, k, group):
        watch.add(q, k)
        if norm is not None:
            norm(q, k, group)

    def norm_v(v, group):
        watch.add(v)
        check(group)  # v is the last of the three the plain path projects

    def attention_fn(qkv, group):
        check(group)
        watch.add(*qkv)
        q, k, v = qkv[:3]
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2)).transpose(1, 2)
        watch.add(out)
        return out

    return norm_rope, norm_v, attention_fn, seen_last


@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("use_fn", [False, True])
def test_handoff_qkv_attention(level, use_fn):
    qp, kp, vp = make_qkv(FEAT, H, D, seed=1)
    x = randn(8, 1024, FEAT, seed=2)
    wx = weakref.ref(x)
    x_list = [x]
    del x
    watch = Watch()
    norm = SpanningNormRope(H, H, D)
    norm_rope, norm_v, attention_fn, seen_last = hooks(watch, [wx], norm)
    prefix = (randn(1, 16, H, D, seed=3), randn(1, 16, H, D, seed=4))
    out = qc.qkv_attention(x_list, qp, kp, vp, H, D, norm_rope, kv_heads=H, norm_spans_heads=True,
                           norm_v=norm_v, kv_prefix=prefix, head_split_level=level,
                           attention_fn=attention_fn if use_fn else None)
    assert x_list == []
    assert seen_last == [[True]] * (2 if use_fn else 1)  # x was freed once the last group was projected
    gc.collect()
    assert wx() is None
    assert watch.refs and not watch.alive(out)  # the runtime kept nothing of what it handed out
    assert out.shape == (8, 1024, H, D)


def test_handoff_joint_and_norm_stats():
    s1, s2 = make_qkv(FEAT, H, D, seed=5), make_qkv(FEAT, H, D, seed=8)
    x1, x2 = randn(2, 100, FEAT, seed=11), randn(2, 4000, FEAT, seed=12)
    refs = [weakref.ref(x1), weakref.ref(x2)]
    l1, l2 = [x1], [x2]
    del x1, x2
    watch = Watch()
    norm = SpanningNormRope(H, H, D)
    norm_rope, norm_v, _, seen_last = hooks(watch, refs, norm)

    def norm_stats(project):
        def watched(which, heads):
            t = project(which, heads)
            watch.add(t)
            return t
        q_ms, k_ms = norm.norm_stats(watched)
        watch.add(q_ms, k_ms)
        return q_ms, k_ms

    out = qc.joint_qkv_attention([(l1, s1), (l2, s2)], H, D, norm_rope, norm_spans_heads=True,
                                 norm_stats=norm_stats, norm_v=norm_v, head_split_level=3)
    assert l1 == [] and l2 == []
    assert seen_last == [[True, True]]
    norm.groups.clear()  # the test's norm records the groups (and their mean squares)
    gc.collect()
    assert all(r() is None for r in refs)
    assert watch.refs and not watch.alive(out)
    assert out.shape == (2, 4100, H, D)


@pytest.mark.parametrize("fail", [False, True], ids=["returned", "raised"])
def test_kept_keys_are_freed(fail):
    """Keys kept by the statistics pass (keep_keys) live until their group's attention: none outlives the
    call, whether it returns or a hook raises midway."""
    layers = make_qkv(FEAT, H, D, seed=41)
    norm = SpanningNormRope(H, H, D, seed=3)
    watch, products = Watch(), []
    k_rows = qc.projections.LinearRows(layers[1])

    class WatchedK(qc.RowProjection):
        out_features = k_rows.out_features

        def prepare(self, x):
            prepared = k_rows.prepare(x)
            rows = prepared.rows

            def watched_rows(start, stop):
                out = rows(start, stop)
                products.append(out)  # moved to the watch below (no strong reference kept here)
                watch.add(products.pop())
                return out
            prepared.rows = watched_rows
            return prepared

    def norm_rope(q, k, group):
        if fail and k is not None and group.kv.start == 1:  # groups 2 and 3 still hold their kept keys
            raise RuntimeError("stop here")
        norm(q, k, group)

    x = randn(1, 8192, FEAT, seed=42)
    if fail:
        with pytest.raises(RuntimeError, match="stop here"):
            qc.qkv_attention([x], layers[0], WatchedK(), layers[2], H, D, norm_rope, norm_spans_heads=True,
                             head_split_level=3, keep_keys=0.5)
    else:
        out = qc.qkv_attention([x], layers[0], WatchedK(), layers[2], H, D, norm_rope, norm_spans_heads=True,
                               head_split_level=3, keep_keys=0.5)
        assert out.shape == (1, 8192, H, D)
    # one product per group: half kept from the statistics pass, half projected (none after the raise)
    assert len(watch.refs) == (H // 2 if fail else H)
    assert watch.alive() == []


@pytest.mark.parametrize("ctx_tokens", [77, 8192])
def test_handoff_cross(ctx_tokens):
    qp, kp, vp = make_qkv(FEAT, H, D, seed=13)
    x, ctx = randn(1, 8192 if ctx_tokens == 77 else 64, FEAT, seed=14), randn(1, ctx_tokens, FEAT, seed=15)
    refs = [weakref.ref(x), weakref.ref(ctx)]
    x_list, ctx_list = [x], [ctx]
    del x, ctx
    watch = Watch()
    norm_rope, norm_v, attention_fn, seen_last = hooks(watch, refs, PerHeadNormRope(D))
    out = qc.cross_qkv_attention(x_list, ctx_list, qp, kp, vp, H, D, norm_rope, norm_v=norm_v,
                                 attention_fn=attention_fn, head_split_level=3)
    assert x_list == [] and ctx_list == []
    assert seen_last == [[True, True]] * 2
    gc.collect()
    assert all(r() is None for r in refs)
    assert not watch.alive(out)
    assert out.shape[1] == (8192 if ctx_tokens == 77 else 64)


def test_handoff_kv_first_and_cache_prefix():
    q, k, v = (randn(1, 300, H, D, seed=s) for s in (16, 17, 18))
    refs = [weakref.ref(t) for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                            v.transpose(1, 2)).transpose(1, 2)
    qkv = [q, k, v]
    del q, k, v
    out = qc.kv_first_attention(qkv)
    assert qkv == []
    gc.collect()
    assert all(r() is None for r in refs)
    assert max_rel_err(out, want) < 1e-6

    k, v = randn(1, 40, 2, 32, seed=19), randn(1, 40, 2, 32, seed=20)
    refs = [weakref.ref(k), weakref.ref(v)]
    kv = [k, v]
    del k, v
    prefix = qc.cache_prefix(kv, native=False)
    assert kv == []
    gc.collect()
    assert all(r() is None for r in refs)
    assert prefix.k.dtype == torch.int8

    # a quantized PrefixLayer keeps only the quantized form
    cache = qc.PrefixCache(1, quantize=True, native=False)
    k, v = randn(1, 40, 2, 32, seed=21), randn(1, 40, 2, 32, seed=22)
    refs = [weakref.ref(k), weakref.ref(v)]
    cache[0].store(k, v)
    del k, v
    gc.collect()
    assert all(r() is None for r in refs)


# --- errors --------------------------------------------------------------------------------------------
@pytest.fixture
def layers():
    return make_qkv(16, 4, 32, seed=30)


def x16(*shape):
    return torch.randn(*shape, 16)


@pytest.mark.parametrize("bad", ["tensor", "tuple", "empty", "two", "not_tensor"])
def test_bad_x_list_forms(layers, bad):
    x = x16(1, 8)
    arg = {"tensor": x, "tuple": (x,), "empty": [], "two": [x, x], "not_tensor": [[1.0]]}[bad]
    with pytest.raises(ValueError, match=r"x_list must be a one-element list holding the tensor"):
        qc.qkv_attention(arg, *layers, 4, 32)
    with pytest.raises(ValueError, match=r"context_list must be a one-element list"):
        qc.cross_qkv_attention([x16(1, 8)], arg, *layers, 4, 32)
    with pytest.raises(ValueError, match=r"stream 0 x_list must be a one-element list"):
        qc.joint_qkv_attention([(arg, layers)], 4, 32)


@pytest.mark.parametrize("shape", [(8,), (1, 1, 8, 16)])
def test_bad_x_shapes(layers, shape):
    with pytest.raises(ValueError, match=r"x_list: expected \(batch, tokens, features\) or \(tokens, features\)"):
        qc.qkv_attention([torch.randn(*shape)], *layers, 4, 32)


def test_bad_joint_streams(layers):
    with pytest.raises(ValueError, match="joint_qkv_attention needs at least one stream"):
        qc.joint_qkv_attention([], 4, 32)
    with pytest.raises(ValueError, match=r"stream 0 must be \(x_list, \(q_proj, k_proj, v_proj\[, extra_proj\]\)\)"):
        qc.joint_qkv_attention([([x16(1, 8)], layers[:2])], 4, 32)
    with pytest.raises(ValueError, match=r"stream 1 must be"):
        qc.joint_qkv_attention([([x16(1, 8)], layers), [x16(1, 8)]], 4, 32)
    with pytest.raises(ValueError, match="stream 0 has 5 projections; at most 4"):
        qc.joint_qkv_attention([([x16(1, 8)], (*layers, layers[0], layers[0]))], 4, 32)
    with pytest.raises(ValueError, match="either every stream carries a fourth projection or none does"):
        qc.joint_qkv_attention([([x16(1, 8)], layers), ([x16(1, 8)], (*layers, layers[0]))], 4, 32)


def test_bad_heads(layers):
    with pytest.raises(ValueError, match=r"heads \(4\) must be a multiple of kv_heads \(3\)"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, kv_heads=3)
    with pytest.raises(ValueError, match=r"heads \(4\) must be a multiple of kv_heads \(0\)"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, kv_heads=0)
    with pytest.raises(ValueError, match=r"heads \(0\) and head_dim \(32\) must be positive"):
        qc.qkv_attention([x16(1, 8)], *layers, 0, 32)


@pytest.mark.parametrize("level", [4, -1, "max", True, 1.0])
def test_bad_head_split_level(layers, level):
    with pytest.raises(ValueError, match=r"head_split_level must be 0-3 or one of \('off', 'low', 'medium', 'high'\)"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, head_split_level=level)
    with pytest.raises(ValueError, match=r"head_split_level must be 0-3"):
        qc.SplitPolicy.of_call(level, None)
    with pytest.raises(ValueError, match=r"head_split_level must be 0-3"):
        qc.parse_level(level)


def test_softmax_scale_rules(layers):
    msg = r"softmax_scale is only honoured by the SDPA path: pass force_attention='sdpa' and no attention_fn"
    with pytest.raises(ValueError, match=msg):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, softmax_scale=0.1)
    with pytest.raises(ValueError, match=msg):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, softmax_scale=0.1, force_attention="flash")
    with pytest.raises(ValueError, match=msg):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, softmax_scale=0.1, force_attention="sdpa",
                         attention_fn=lambda qkv, g: qkv[0])
    out = qc.qkv_attention([x16(1, 8)], *layers, 4, 32, softmax_scale=0.1, force_attention="sdpa")
    assert out.shape == (1, 8, 4, 32)


def test_option_combinations(layers):
    with pytest.raises(ValueError, match="norm_stats is only used with norm_spans_heads=True: pass both, or neither"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, norm_stats=lambda project: None)
    for bad in (1.5, -0.1, True, "all"):
        with pytest.raises(ValueError, match="keep_keys is the fraction"):
            qc.qkv_attention([x16(1, 8)], *layers, 4, 32, norm_spans_heads=True, keep_keys=bad)
    with pytest.raises(ValueError, match="keep_keys only applies to the statistics pass of a norm that spans heads: "
                                         "pass norm_spans_heads=True, or drop keep_keys"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, keep_keys=0.5)
    with pytest.raises(ValueError, match="fused_quant needs the staged quantizers, which attention_fn turns off"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, fused_quant=lambda *a: None,
                         attention_fn=lambda qkv, g: qkv[0])
    with pytest.raises(ValueError, match="a callable attention_mask needs a staged SageAttention core"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, attention_mask=lambda q, k, g: None)
    with pytest.raises(ValueError, match=r"norm_key_into is a callable \(key, dest, group\) -> bool .* not bool"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, norm_key_into=True)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['kv_head', 'mask'\]; the options are"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, kv_head=2, mask=None)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['scale'\]"):
        qc.cross_qkv_attention([x16(1, 8)], [x16(1, 4)], *layers, 4, 32, scale=1.0)
    with pytest.raises(ValueError, match="a projection must be a torch.nn.Linear, a RowProjection or a callable, not int"):
        qc.qkv_attention([x16(1, 8)], layers[0], 3, layers[2], 4, 32)


def native_prefix(batch=1, tokens=8, kv_heads=4, d=32):
    k = torch.zeros(batch, tokens, kv_heads, d, dtype=torch.int8)
    scale = torch.ones(batch, tokens, kv_heads, 1)
    return qc.KVPrefix(k, scale, torch.zeros(batch, 1, kv_heads, d), k.clone(), scale.clone(), None)


def test_native_prefix_rules(layers):
    prefix = native_prefix()
    assert prefix.is_native
    msg = "a native prefix is attended in a pass of its own, unmasked: drop attention_mask/attention_fn"
    with pytest.raises(ValueError, match=msg):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, kv_prefix=prefix, attention_mask=torch.zeros(1, 1, 8, 16))
    with pytest.raises(ValueError, match=msg):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, kv_prefix=prefix, attention_fn=lambda qkv, g: qkv[0])
    with pytest.raises(ValueError, match="a native prefix needs a staged SageAttention core: use a staged backend"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, kv_prefix=prefix)
    with pytest.raises(ValueError, match="dequantize_prefix takes a q8 prefix; a native prefix is read by its staged"):
        qc.dequantize_prefix(prefix)


@pytest.mark.parametrize("bad", ["tensor", "triple", "non_tensor", "dict"])
def test_bad_kv_prefix_forms(layers, bad):
    k = torch.randn(1, 8, 4, 32)
    arg = {"tensor": k, "triple": (k, k, k), "non_tensor": (k, 1.0), "dict": {"k": k, "v": k}}[bad]
    with pytest.raises(ValueError, match="kv_prefix must be a \\(key, value\\) pair of tensors, a KVPrefix or a PrefixLayer"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, kv_prefix=arg)


@pytest.mark.parametrize("shape", [(1, 8, 2, 32), (1, 8, 4, 16), (8, 4, 32), (1, 1, 8, 4, 32)])
def test_bad_kv_prefix_shapes(layers, shape):
    k = torch.randn(*shape)
    with pytest.raises(ValueError, match=r"kv_prefix keys must be \(batch, tokens, kv_heads=4, head_dim=32\)"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, kv_prefix=(k, k))


def test_kv_prefix_batch_mismatch(layers):
    k = torch.randn(3, 8, 4, 32)
    with pytest.raises(ValueError, match=r"kv_prefix batch 3 must be 1 or the call's batch 2"):
        qc.qkv_attention([x16(2, 8)], *layers, 4, 32, kv_prefix=(k, k))
    prefix = qc.cache_prefix([k.clone(), k.clone()], native=False)
    with pytest.raises(ValueError, match=r"kv_prefix batch 3 must be 1 or the call's batch 2"):
        qc.cross_qkv_attention([x16(2, 8)], [x16(2, 4)], *layers, 4, 32, kv_prefix=prefix)


def test_mismatched_streams(layers):
    with pytest.raises(ValueError, match=r"all token streams must have the same batch size, got \[1, 2\]"):
        qc.joint_qkv_attention([([x16(1, 8)], layers), ([x16(2, 8)], layers)], 4, 32)
    with pytest.raises(ValueError, match=r"all token streams must have the same batch size, got \[2, 3\]"):
        qc.cross_qkv_attention([x16(2, 8)], [x16(3, 4)], *layers, 4, 32)
    with pytest.raises(ValueError, match=r"all token streams must have one dtype, got \['torch.bfloat16', "
                                         r"'torch.float32'\]: cast them"):
        qc.joint_qkv_attention([([x16(1, 8)], layers), ([x16(1, 8).bfloat16()], layers)], 4, 32)
    with pytest.raises(ValueError, match=r"all token streams must have one dtype"):
        qc.cross_qkv_attention([x16(1, 8)], [x16(1, 4).half()], *layers, 4, 32)


def test_kv_first_bad_list():
    q = torch.randn(1, 4, 2, 8)
    for bad in ((q, q, q), [q, q], [q, q, q, q]):
        with pytest.raises(ValueError, match=r"kv_first_attention takes \[q, k, v\] in a three-element list"):
            qc.kv_first_attention(bad)


def test_q8_errors():
    with pytest.raises(ValueError, match="q8 needs head_dim divisible by 32, got 48: keep this prefix in 16 bits"):
        qc.q8.quantize_q8(torch.randn(1, 4, 2, 48))
    with pytest.raises(ValueError, match="q8 needs head_dim divisible by 32, got 48"):
        qc.q8.dequantize_q8_into(torch.empty(1, 4, 2, 48), torch.zeros(1, 4, 2, 48, dtype=torch.int8),
                              torch.ones(1, 4, 2, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="q8 needs head_dim divisible by 32, got 48"):
        qc.cache_prefix([torch.randn(1, 4, 2, 48), torch.randn(1, 4, 2, 48)], native=False)
    with pytest.raises(ValueError, match="quantize_q8 takes a float tensor, got torch.int32"):
        qc.q8.quantize_q8(torch.zeros(1, 4, 2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="dequantize_q8_into takes int8 values, got torch.float32"):
        qc.q8.dequantize_q8_into(torch.empty(1, 4, 2, 32), torch.zeros(1, 4, 2, 32),
                              torch.ones(1, 4, 2, 1, dtype=torch.float16))
    values, scales = qc.q8.quantize_q8(torch.randn(1, 4, 2, 32))
    with pytest.raises(ValueError, match=r"output \(1, 5, 2, 32\) does not match q8 values \(1, 4, 2, 32\)"):
        qc.q8.dequantize_q8_into(torch.empty(1, 5, 2, 32), values, scales)
    with pytest.raises(ValueError, match=r"output \(1, 4, 3, 32\) does not match q8 values"):
        qc.q8.dequantize_q8_into(torch.empty(1, 4, 3, 32), values, scales)


def test_q8_prefix_errors():
    kq, ks = qc.q8.quantize_q8(torch.randn(1, 6, 2, 64))
    with pytest.raises(ValueError, match="q8_prefix: k must be int8, got torch.float32; quantize it with cache_prefix"):
        qc.q8_prefix(kq.float(), ks, kq, ks)
    with pytest.raises(ValueError, match="q8_prefix: v must be int8, got torch.bfloat16"):
        qc.q8_prefix(kq, ks, kq.bfloat16(), ks)
    with pytest.raises(ValueError, match=r"q8_prefix: k \(1, 6, 2, 64\) and its scales \(1, 6, 2, 1\) are not "
                                         r"\(batch, tokens, kv_heads, head_dim\) and \(\.\.\., head_dim // 32\)"):
        qc.q8_prefix(kq, ks[..., :1], kq, ks)
    with pytest.raises(ValueError, match=r"q8_prefix: v \(6, 2, 64, 1\) and its scales"):
        qc.q8_prefix(kq, ks, kq[0].unsqueeze(-1), ks)
    with pytest.raises(ValueError, match=r"q8_prefix: k \(1, 6, 2, 64\) and v \(1, 5, 2, 64\) differ"):
        qc.q8_prefix(kq, ks, kq[:, :5], ks[:, :5])


def test_cache_prefix_wrong_list():
    k = torch.randn(1, 4, 2, 32)
    for bad in ((k, k), [k], [k, k, k], k):
        with pytest.raises(ValueError, match=r"cache_prefix takes \[key, value\] in a two-element list"):
            qc.cache_prefix(bad)


def test_backend_registry_errors(layers):
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'"):
        qc.qkv_attention([x16(1, 8)], *layers, 4, 32, force_attention="nope")
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'"):
        qc.pay_attention(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8),
                         force_attention="nope")
    with pytest.raises(ValueError, match="the sdpa backend cannot be removed: it is every call's last fallback"):
        qc.backends.unregister_backend("sdpa")
    assert "sdpa" in qc.backend_names()


def test_prefix_cache_errors():
    with pytest.raises(ValueError, match="PrefixCache needs at least one block, got 0"):
        qc.PrefixCache(0)
    with pytest.raises(ValueError, match="PrefixCache needs at least one block, got -2"):
        qc.PrefixCache(-2)
    with pytest.raises(RuntimeError, match="KV cache has not been populated yet."):
        qc.PrefixCache(1)[0].kv_prefix()
