"""Hand-off of the inputs (docs/design.md §2.1), every error the runtime raises, and backend fallbacks
(docs/design.md §2.4)."""
from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

import qkv_core as qc
from reference import PerHeadNormRope, SpanningNormRope, make_qkv, max_rel_err, randn

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
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope': use one of \['auto', "):
        qc.backends.set_attention_backend("nope")
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


# --- backend fallback -----------------------------------------------------------------------------------
def test_available_backends():
    available = qc.backends.available_backends()
    assert available["sdpa"] is None
    assert set(available) == set(qc.backend_names()) >= {"sdpa", "flash", "sage"}
    assert qc.backend_names()[-1] == "sdpa"
    for name, reason in available.items():
        assert reason is None or isinstance(reason, str)
    assert qc.backends.get_attention_backend() == "auto"
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
    qc.backends.set_attention_backend(name)
    assert qc.backends.get_attention_backend() == name
    assert torch.equal(qc.qkv_attention([x], qp, kp, vp, H, D, norm), want)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"[Attention] {name} backend not used: ") and "falling back" in lines[0]
    assert qc.drain_notices() == lines and qc.drain_notices() == []


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
    assert qc.split_plan(40, 100, "high", floor=64).groups == 20
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
