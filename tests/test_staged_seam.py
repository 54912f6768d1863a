"""The staged-core seam (docs/design.md §2.4, §2.5): a fake StagedCore behind a fake backend.

The fake quantizers are the identity (they keep the 16-bit tensors they are handed) and log their calls;
the fake projections log when rows are computed, so the order "v, then k, then q, each quantized as soon as
it is projected" is observable. `staged_attention` writes SDPA into `out`.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv_core as qc
from support.fake_backends import FakeBackend, FakeCore
from support.reference import PerHeadNormRope, SpanningNormRope, ValueNorm, make_qkv, max_rel_err, randn

NAME = FakeBackend.name

H, D, FEAT = 8, 32, 64
TOL = 1e-6
ITEM_FLOOR = 512   # the split floor these tests run with: batches of 16 x 512 tokens split (runtime: 8,192 an item)


@pytest.fixture(autouse=True)
def item_floor(monkeypatch):
    monkeypatch.setattr(qc.head_split, "SPLIT_FLOOR_TOKENS", ITEM_FLOOR)


@pytest.fixture
def fake(request):
    log = []
    core = FakeCore(log)
    backend = FakeBackend(core)
    qc.backends.register_backend(backend)
    request.addfinalizer(lambda: qc.backends.unregister_backend(NAME))
    assert NAME in qc.backend_names() and qc.backend_names()[-1] == "sdpa"
    return core


class LoggedRows(qc.RowProjection):
    """A Linear by rows that logs each rows() call as 'project <name>'."""

    def __init__(self, linear, name, log):
        self.linear, self.name, self.log = linear, name, log
        self.out_features = linear.out_features

    def prepare(self, x):
        inner = qc.WeightRows(x, self.linear.weight, self.linear.bias)
        log, name = self.log, self.name

        class Prepared(qc.PreparedProjection):
            def rows(self, start, stop):
                log.append(f"project {name}")
                return inner.rows(start, stop)

            def full(self):
                log.append(f"project {name}")
                return inner.full()

            def release(self):
                inner.release()
        return Prepared()


class LoggedNorm:
    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __call__(self, query, key, group):
        if key is not None:
            self.log.append("norm k")
        if query is not None:
            self.log.append("norm q")
        self.inner(query, key, group)


def squeeze(events):
    out = []
    for e in events:
        if not out or out[-1] != e:
            out.append(e)
    return out


def per_group(log, groups):
    """The log cut after each 'attention' (one group each)."""
    cuts, current = [], []
    for e in log:
        current.append(e)
        if e == "attention":
            cuts.append(squeeze(current))
            current = []
    assert len(cuts) == groups and not current
    return cuts


def logged_layers(log, kv_heads=H, seed=1, shared=False):
    qp, kp, vp = make_qkv(FEAT, H, D, kv_heads, seed=seed)
    q = LoggedRows(qp, "q", log)
    k = LoggedRows(kp, "k", log)
    v = k if shared else LoggedRows(vp, "v", log)
    return (q, k, v), (qp, kp, kp if shared else vp)


ORDER = ["project v", "quantize v", "project k", "norm k", "quantize k", "project q", "norm q", "quantize q",
         "attention"]
# split: every group's q is projected first, into the output buffer, each quantized there before its attention
ORDER_Q_IN_OUT = [e for e in ORDER if e != "project q"]


def expected_order(groups):
    return [ORDER] if groups == 1 else [["project q"] + ORDER_Q_IN_OUT] + [ORDER_Q_IN_OUT] * (groups - 1)


@pytest.mark.parametrize("kv_heads,level", [(8, 0), (8, 3), (4, 2), (2, 1)])
def test_staged_order_and_results(fake, kv_heads, level):
    log = fake.log
    logged, plain = logged_layers(log, kv_heads)
    x = randn(16, 512, FEAT, seed=2)
    norm = PerHeadNormRope(D)
    want = qc.qkv_attention([x], *plain, H, D, norm, kv_heads=kv_heads, head_split_level=level,
                            force_attention="sdpa")
    got = qc.qkv_attention([x], *logged, H, D, LoggedNorm(norm, log), kv_heads=kv_heads, head_split_level=level,
                           force_attention=NAME)
    groups = qc.group_count(kv_heads, 8192, level)
    assert per_group(log, groups) == expected_order(groups)
    assert len(fake.lists) == 3 * groups and all(lst == [] for lst in fake.lists)
    assert max_rel_err(got, want) < TOL
    assert fake.settings_calls[0][:2] == ((16, 512, H // groups, D), (16, 512, kv_heads // groups, D))


def test_staged_with_norm_v_and_span_norm(fake):
    qp, kp, vp = make_qkv(FEAT, H, D, 4, seed=3)
    x = randn(16, 512, FEAT, seed=4)
    norm, vnorm = SpanningNormRope(H, 4, D), ValueNorm(4)
    got = qc.qkv_attention([x], qp, kp, vp, H, D, norm, kv_heads=4, norm_spans_heads=True, norm_v=vnorm,
                           force_attention=NAME)
    assert fake.log.count("attention") == 4
    want = qc.qkv_attention([x], qp, kp, vp, H, D, norm, kv_heads=4, norm_spans_heads=True, norm_v=vnorm,
                            force_attention="sdpa")
    assert fake.log.count("attention") == 4  # sdpa forced: the fake is not used
    assert max_rel_err(got, want) < TOL


@pytest.mark.parametrize("prefix_kind", ["16bit", "q8"])
def test_staged_with_prefix_and_per_head_mask(fake, prefix_kind):
    qp, kp, vp = make_qkv(FEAT, H, D, 4, seed=5)
    x = randn(16, 512, FEAT, seed=6)
    k, v = randn(1, 32, 4, D, seed=7), randn(1, 32, 4, D, seed=8)
    prefix = (k, v) if prefix_kind == "16bit" else qc.cache_prefix([k, v], native=False)
    g = torch.Generator().manual_seed(9)
    mask = torch.rand(16, H, 512, 32 + 512, generator=g) * -3
    norm = PerHeadNormRope(D)
    opts = dict(kv_heads=4, kv_prefix=prefix, attention_mask=mask, head_split_level=3)
    want = qc.qkv_attention([x], qp, kp, vp, H, D, norm, force_attention="sdpa", **opts)
    got = qc.qkv_attention([x], qp, kp, vp, H, D, norm, force_attention=NAME, **opts)
    assert max_rel_err(got, want) < TOL
    assert len(fake.masks) == 4
    for i, m in enumerate(fake.masks):  # each group got its own heads' rows of the mask
        assert torch.equal(m, mask[:, 2 * i:2 * i + 2])
    assert fake.settings_calls[0][1] == (16, 32 + 512, 1, D)  # the keys' shape counts the prefix


def test_callable_mask(fake):
    log = fake.log
    logged, plain = logged_layers(log, 4, seed=10)
    x = randn(16, 512, FEAT, seed=11)
    g = torch.Generator().manual_seed(12)
    full = torch.rand(16, H, 512, 512, generator=g) < 0.8
    full[..., 0] = True
    norm = PerHeadNormRope(D)
    calls = []

    def mask(query, key, group):
        if query is None:
            assert key is not None and key.shape[2] == len(group.kv)
            calls.append(("key", group.q))
            log.append("mask k")
            return None
        assert key is None and query.shape[2] == len(group.q)
        calls.append(("query", group.q))
        log.append("mask q")
        return full[:, group.q.start:group.q.stop]

    fused_calls = []
    got = qc.qkv_attention([x], *logged, H, D, LoggedNorm(norm, log), kv_heads=4, attention_mask=mask,
                           fused_quant=lambda *a: fused_calls.append(a), head_split_level=3,
                           force_attention=NAME)
    want = qc.qkv_attention([x], *plain, H, D, norm, kv_heads=4, attention_mask=full, head_split_level=3,
                            force_attention="sdpa")
    assert max_rel_err(got, want) < TOL
    assert not fused_calls  # fused quantization is off with a callable mask
    assert calls == [(kind, range(2 * i, 2 * i + 2)) for i in range(4) for kind in ("key", "query")]
    order = ["project v", "quantize v", "project k", "norm k", "mask k", "quantize k", "norm q", "mask q",
             "quantize q", "attention"]
    assert per_group(log, 4) == [["project q"] + order] + [order] * 3   # q: projected first, into the output
    for i, m in enumerate(fake.masks):
        assert torch.equal(m, full[:, 2 * i:2 * i + 2])


@pytest.mark.parametrize("returns", ["none", "quantized"])
@pytest.mark.parametrize("with_prefix", [False, True])
def test_fused_quant(fake, returns, with_prefix):
    log = fake.log
    logged, plain = logged_layers(log, H, seed=13)
    x = randn(16, 512, FEAT, seed=14)
    norm = PerHeadNormRope(D)
    prefix = (randn(16, 16, H, D, seed=15), randn(1, 16, H, D, seed=16).expand(16, -1, -1, -1)) \
        if with_prefix else None
    seen = []

    def fused(query, key, group, core, settings):
        assert core is fake and (query is None) != (key is None)
        which = "q" if key is None else "k"
        seen.append((which, group.q))
        log.append(f"fused {which}")
        if returns == "none":
            return None
        t = query if key is None else key
        norm(query, key, group)  # a fused kernel normalizes, rotates and quantizes in one pass
        return ("quantized", which, t)

    got = qc.qkv_attention([x], *logged, H, D, LoggedNorm(norm, log), kv_prefix=prefix, fused_quant=fused,
                           head_split_level=3, force_attention=NAME)
    want = qc.qkv_attention([x], *plain, H, D, norm, kv_prefix=prefix, head_split_level=3, force_attention="sdpa")
    assert max_rel_err(got, want) < TOL
    groups = 8
    if with_prefix:  # only q is fused: the prefix joins the normalized 16-bit k
        assert seen == [("q", range(i, i + 1)) for i in range(groups)]
        k_part = ["project k", "norm k", "quantize k"]
    else:
        assert seen == [(w, range(i, i + 1)) for i in range(groups) for w in ("k", "q")]
        k_part = ["project k", "fused k"] + (["norm k", "quantize k"] if returns == "none" else [])
    q_part = ["fused q"] + (["norm q", "quantize q"] if returns == "none" else [])
    order = ["project v", "quantize v"] + k_part + q_part + ["attention"]
    assert per_group(log, groups) == [["project q"] + order] + [order] * (groups - 1)  # q projected first


def test_shared_kv_joint_and_cross_staged(fake):
    log = fake.log
    logged, plain = logged_layers(log, 4, seed=17, shared=True)
    x = randn(16, 512, FEAT, seed=18)
    norm = SpanningNormRope(H, 4, D)
    got = qc.qkv_attention([x], *logged, H, D, norm, kv_heads=4, norm_spans_heads=True, head_split_level=3,
                           force_attention=NAME)
    want = qc.qkv_attention([x], *plain, H, D, norm, kv_heads=4, norm_spans_heads=True, head_split_level=3,
                            force_attention="sdpa")
    assert max_rel_err(got, want) < TOL
    # the shared module is projected once per group; its copy (v) is quantized first, then k, then q (in the output)
    order = ["project k", "quantize v", "quantize k", "quantize q", "attention"]   # q: in the output already
    cuts = per_group(log, 4)
    assert cuts[1:] == [order] * 3
    assert cuts[0][-len(order) + 1:] == order[1:]  # (group 1 follows the mean-squares pass's projections)

    s1, s2 = make_qkv(FEAT, H, D, seed=19), make_qkv(FEAT, H, D, seed=22)
    x1, x2 = randn(16, 32, FEAT, seed=25), randn(16, 480, FEAT, seed=26)
    jnorm = SpanningNormRope(H, H, D)
    got = qc.joint_qkv_attention([([x1], s1), ([x2], s2)], H, D, jnorm, norm_spans_heads=True,
                                 norm_stats=jnorm.norm_stats, force_attention=NAME)
    want = qc.joint_qkv_attention([([x1], s1), ([x2], s2)], H, D, jnorm, norm_spans_heads=True,
                                  force_attention="sdpa")
    assert max_rel_err(got, want) < 1e-5  # statistics by norm_stats vs by the runtime: float32 round-off

    qp, kp, vp = make_qkv(FEAT, H, D, 2, seed=27)
    xq, ctx = randn(1, 8192, FEAT, seed=28), randn(1, 77, FEAT, seed=29)
    pnorm = PerHeadNormRope(D)
    got = qc.cross_qkv_attention([xq], [ctx], qp, kp, vp, H, D, pnorm, kv_heads=2, force_attention=NAME)
    want = qc.cross_qkv_attention([xq], [ctx], qp, kp, vp, H, D, pnorm, kv_heads=2, force_attention="sdpa")
    assert max_rel_err(got, want) < TOL


def test_kv_first_attention_staged(fake):
    q, k, v = (randn(1, 500, H, D, seed=s) for s in (30, 31, 32))
    want = qc.kv_first_attention([q, k, v], force_attention="sdpa")
    assert fake.log == []
    qkv = [q, k, v]
    got = qc.kv_first_attention(qkv, force_attention=NAME)
    assert qkv == []
    assert fake.log == ["quantize k", "quantize v", "quantize q", "attention"]  # k before v
    assert all(lst == [] for lst in fake.lists)
    assert fake.settings_calls == [((1, 500, H, D), (1, 500, H, D), torch.float32)]
    assert max_rel_err(got, want) < TOL


class NativeFakeCore(FakeCore):
    """A core whose "native" prefix is the 16-bit keys/values in a `KVPrefix` (`k_mean` set to mark it native):
    it attends them joined before the group's own keys, so the seam's result must equal a 16-bit prefix's."""
    name = "fake-native-core"

    def settings(self, q_shape, k_shape, dtype, device, softmax_scale=None, masked=False, native_prefix=None):
        self.settings_calls.append((tuple(q_shape), tuple(k_shape), native_prefix))
        return {"scale": softmax_scale, "prefix": native_prefix}

    def prefix_heads(self, prefix, heads):
        h = slice(heads.start, heads.stop)
        return qc.KVPrefix(prefix.k[:, :, h], None, prefix.k_mean[:, :, h], prefix.v[:, :, h], None, None)

    def staged_attention(self, out, quantized, settings, mask=None):
        (_, _, q), (_, _, k), (_, _, v) = quantized
        prefix = settings["prefix"]
        k, v = torch.cat([prefix.k.expand(k.shape[0], -1, -1, -1), k], 1), \
            torch.cat([prefix.v.expand(v.shape[0], -1, -1, -1), v], 1)
        self.log.append("attention")
        out.copy_(F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 scale=settings["scale"]).transpose(1, 2))


def test_native_prefix_goes_to_the_core_by_groups():
    """A native prefix is never joined by the runtime: each group's settings carry the core's slice of its heads,
    the keys' shape counts only the call's own tokens, and the core's pass gives the prefix's attention."""
    log = []
    core = NativeFakeCore(log)
    backend = FakeBackend(core)
    backend.name = "fake-native"
    qc.backends.register_backend(backend)
    try:
        qp, kp, vp = make_qkv(FEAT, H, D, seed=33)
        x = randn(2, 4096, FEAT, seed=34)
        pk, pv = randn(1, 40, H, D, seed=35), randn(1, 40, H, D, seed=36)
        prefix = qc.KVPrefix(pk, None, torch.zeros(1, 1, H, D), pv, None, None)
        got = qc.qkv_attention([x.clone()], qp, kp, vp, H, D, kv_prefix=prefix, force_attention="fake-native",
                               head_split_level=3)
        want = qc.qkv_attention([x.clone()], qp, kp, vp, H, D, kv_prefix=(pk, pv), force_attention="sdpa")
        assert max_rel_err(got, want) < TOL
        assert len(core.settings_calls) > 1   # split: one slice of the prefix per group
        heads_seen = 0
        for q_shape, k_shape, native in core.settings_calls:
            assert k_shape[1] == 4096 and native.k.shape[2] == q_shape[2]
            heads_seen += native.k.shape[2]
        assert heads_seen == H
        # a core without native prefixes says how to cache one it can read
        with pytest.raises(ValueError, match="keeps no native prefixes: cache the prefix with native=False"):
            qc.StagedCore().prefix_heads(prefix, range(0, 1))
    finally:
        qc.backends.unregister_backend("fake-native")

@pytest.mark.parametrize("capability,modules,masked,mode", [
    ((9, 0), {"sm90_compile"}, False, "sm90"),
    ((9, 0), set(), False, "sageattn"),          # a build without the Hopper kernel: its own sageattn
    ((8, 0), {"sm80_compile"}, False, "sm80"),
    ((8, 0), set(), False, "sageattn"),
    ((8, 6), set(), False, "triton"),            # what sageattn runs on sm86
    ((8, 9), {"sm89_compile"}, False, "sageattn"),  # Ada: not staged (its kernel could not be checked)
    ((12, 0), {"sm89_compile"}, False, "sageattn"),
    ((9, 0), {"sm90_compile"}, True, "triton"),   # masks: the Triton kernel on every GPU
])
def test_sage2_kernel_mode_by_gpu(monkeypatch, capability, modules, masked, mode):
    """SageAttention 2's staged core picks each GPU's kernel as `sageattn` does, where the installed build has it
    (no GPU needed: the capability and the build's modules are given)."""
    from qkv_core import sage2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(sage2, "_has_module", lambda name: name in modules)
    assert sage2.kernel_mode(torch.device("cuda", 0), masked) == mode
