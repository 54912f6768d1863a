"""The units a call is made of (docs/dev/runtime-structure.md), on their own: their error paths and the small
helpers the group loop relies on. The calls themselves are tested through the public API elsewhere."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv_core as qc
from qkv_core import group_loop, prefix_join, statistics, validation
from qkv_core.head_split import HeadGroup
from qkv_core.options import AttentionOptions
from qkv_core.streams import CallStreams, TokenStream
from support.reference import make_qkv, randn

H, D = 4, 32
W = H * D


def call_streams(kv_heads=H, batch=1, tokens=8, dtype=torch.float32, layers=None):
    q, k, v = layers or make_qkv(W, H, D, kv_heads=kv_heads)
    stream = TokenStream(randn(batch, tokens, W, seed=1, dtype=dtype), q=q, k=k, v=v)
    return CallStreams([stream], [stream], H, kv_heads, D)


def test_no_unit_imports_comfy():
    code = ("import sys, qkv_core, qkv_core.validation, qkv_core.streams, qkv_core.statistics, "
            "qkv_core.prefix_join, qkv_core.group_loop\n"
            "bad = [m for m in sys.modules if m == 'comfy' or m.startswith('comfy.')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_take_activation():
    with pytest.raises(ValueError, match=r"pass \[x\]"):
        validation.take_activation(torch.zeros(2, 3), "x_list")
    x_list = [torch.zeros(5, 3)]
    assert validation.take_activation(x_list, "x_list").shape == (1, 5, 3) and x_list == []
    with pytest.raises(ValueError, match="expected"):
        validation.take_activation([torch.zeros(1, 1, 5, 3)], "x_list")


def test_unpack_stream_and_extras():
    with pytest.raises(ValueError, match="stream 2 must be"):
        validation.unpack_stream(2, ([torch.zeros(1, 2, 3)],))
    with pytest.raises(ValueError, match="at most 4"):
        validation.unpack_stream(0, ([], (1, 2, 3, 4, 5)))
    assert validation.unpack_stream(0, ("x", (1, 2, 3)))[1] == (1, 2, 3, None)
    q, k, v = make_qkv(W, H, D)
    streams = [TokenStream(randn(1, 4, W, seed=1), q=q, k=k, v=v, extra=q), TokenStream(randn(1, 4, W, seed=2),
                                                                                        q=q, k=k, v=v)]
    with pytest.raises(ValueError, match="every stream"):
        validation.validate_extras(streams)


def test_validate_kv_first_leaves_the_list():
    bad = [torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8)]
    with pytest.raises(ValueError, match="multiple of their heads"):
        validation.validate_kv_first(bad)
    assert len(bad) == 3


def test_validate_call_and_widths():
    with pytest.raises(ValueError, match="kv_heads=2"):
        validation.validate_call(AttentionOptions(), call_streams(kv_heads=H, layers=make_qkv(W, H, D, kv_heads=2)))
    with pytest.raises(ValueError, match="norm_spans_heads=True"):
        validation.validate_call(AttentionOptions(keep_keys=0.5), call_streams())
    validation.validate_call(AttentionOptions(keep_keys=0.5, norm_spans_heads=True), call_streams())


def test_validate_prefix():
    o = AttentionOptions(kv_prefix=(torch.zeros(3, 4, H, D), torch.zeros(3, 4, H, D)))
    with pytest.raises(ValueError, match="must be 1 or the call's batch 2"):
        validation.validate_prefix(o, H, D, batch=2)
    validation.validate_prefix(o, H, D, batch=3)
    o = AttentionOptions(kv_prefix=[torch.zeros(1, 4, H, D)])
    with pytest.raises(ValueError, match="a .key, value. pair"):
        validation.validate_prefix(o, H, D, batch=1)


def test_validate_mask_chooses_no_backend_for_a_tensor_mask():
    asked = []

    def staged_core():
        asked.append(1)
        return None

    validation.validate_mask(torch.zeros(1, 1, 2, 2), staged_core)
    validation.validate_mask(None, staged_core)
    assert asked == []
    with pytest.raises(ValueError, match="staged SageAttention core"):
        validation.validate_mask(lambda q, k, group: None, staged_core)
    assert asked == [1]


def test_native_prefix_needs_a_core():
    native = qc.KVPrefix(torch.zeros(1), None, torch.zeros(1), None, None, None)
    with pytest.raises(ValueError, match="native=False"):
        validation.validate_native_prefix_core(native, None)
    validation.validate_native_prefix_core(native, object())
    validation.validate_native_prefix_core(None, None)


def test_join_prefix_pair_and_q8():
    pk, pv = randn(1, 3, H, D, seed=3), randn(1, 3, H, D, seed=4)
    k = randn(2, 5, 2, D, seed=5)
    kv = range(1, 3)
    joined = prefix_join.join_prefix((pk, pv), "k", k, kv, batch=2)
    assert joined.shape == (2, 8, 2, D)
    assert torch.equal(joined[:, :3], pk[:, :, 1:3].expand(2, -1, -1, -1)) and torch.equal(joined[:, 3:], k)
    assert prefix_join.join_prefix(None, "v", k, kv, batch=2) is k
    q8 = qc.cache_prefix([pk.clone(), pv.clone()], native=False)
    v16 = qc.dequantize_prefix(q8, torch.float32)[1]
    joined = prefix_join.join_prefix(q8, "v", k[:1], kv, batch=1)
    assert torch.equal(joined[:, :3], v16[:, :, 1:3]) and torch.equal(joined[:, 3:], k[:1])
    assert prefix_join.prefix_tokens(q8) == 3 and prefix_join.prefix_tokens(None) == 0


def test_group_mask():
    group = HeadGroup(range(2, 4), range(1, 2))
    mask = torch.arange(4.).view(1, 4, 1, 1).expand(1, 4, 2, 2)
    assert torch.equal(group_loop.group_mask(mask, 4, group), mask[:, 2:4])
    assert group_loop.group_mask(torch.zeros(1, 2, 2), 4, group).shape == (1, 1, 2, 2)
    assert group_loop.group_mask(print, 4, group) is print


def test_kept_key_groups_and_sum_squares():
    groups = qc.head_split.head_groups(H, H, 4)
    streams = call_streams()
    assert statistics.kept_key_groups(0.5, streams, groups) == 2
    assert statistics.kept_key_groups(None, streams, groups) == 0
    q, k, _ = make_qkv(W, H, D)
    shared = TokenStream(randn(1, 8, W, seed=1), q=q, k=k, v=k)
    assert statistics.kept_key_groups(1.0, CallStreams([shared], [shared], H, H, D), groups) == 0
    t = randn(2, 3, H, D, seed=6, dtype=torch.bfloat16)
    acc = torch.zeros(2, 3)
    statistics.sum_squares_(t, acc)
    torch.testing.assert_close(acc, t.float().square().sum((-2, -1)))


def test_auto_measures_a_backend_once_per_gpu_and_takes_the_faster(monkeypatch):
    """A backend with `measured_in_auto` (SageAttention 1) goes into `auto` only where a one-time micro-benchmark
    on that GPU finds it faster than SDPA; the measurement is kept per (GPU, backend, head dim, dtype) and said in
    the log once."""
    from types import SimpleNamespace
    from qkv_core import backends

    class Measured(backends.AttentionBackend):
        name = "measured-test"
        measured_in_auto = True

        def attend(self, q, k, v, mask=None, softmax_scale=None):   # pragma: no cover - never run here
            raise AssertionError

    times = {"measured-test": 0.010, "sdpa": 0.020}
    calls = []

    def measure(backend, shape, dtype, device):
        calls.append((backend.name, shape))
        return times[backend.name]
    monkeypatch.setattr(backends, "_measure_seconds", measure)
    monkeypatch.setattr(backends.torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.setattr(backends, "_MEASURED", {})
    monkeypatch.setattr(backends, "_FALLBACK_ORDER", ["sdpa"])   # the installed backends out of the way
    backends.register_backend(Measured(), before="sdpa")
    try:
        qc.reset_notices()
        spec = SimpleNamespace(shape=(1, 100, 4, 64), dtype=torch.float16, device=torch.device("cuda"))
        assert backends.resolve_backend(spec, spec, spec).name == "measured-test"
        assert backends.resolve_backend(spec, spec, spec).name == "measured-test"
        assert [name for name, _ in calls] == ["measured-test", "sdpa"]   # once
        assert calls[0][1] == (1, backends.MEASURE_TOKENS, backends.MEASURE_HEADS, 64)
        lines = [str(notice) for notice in qc.drain_notices()]
        assert any("measured on Test GPU, head dim 64" in line and "measured-test is used" in line for line in lines)
        times["measured-test"] = 0.030                                   # another head dim: measured again
        slower = SimpleNamespace(shape=(1, 100, 4, 128), dtype=torch.float16, device=torch.device("cuda"))
        assert backends.resolve_backend(slower, slower, slower).name == "sdpa"
        assert len(calls) == 4
        assert any("sdpa is used" in str(notice) for notice in qc.drain_notices())
        # asked for by name, it is used without measuring; on CPU, auto never measures
        assert backends.resolve_backend(slower, slower, slower, force_attention="measured-test").name == \
            "measured-test"
        cpu = SimpleNamespace(shape=(1, 100, 4, 32), dtype=torch.float16, device=torch.device("cpu"))
        assert backends.resolve_backend(cpu, cpu, cpu).name == "sdpa" and len(calls) == 4
    finally:
        backends.unregister_backend("measured-test")


def test_auto_leaves_short_and_hopper_masked_calls_of_sageattention2_to_sdpa(monkeypatch):
    """With SageAttention 2, `auto` runs its staged core on long calls only (at least SAGE2_AUTO_MIN_TOKENS tokens),
    and on Hopper not for masked calls (its Triton kernel is slower than cuDNN there); forced, it takes them all.
    Each decline is said once in the log."""
    from types import SimpleNamespace
    from qkv_core import backends

    sage = backends.SageBackend()
    monkeypatch.setattr(sage, "_major", 2)
    monkeypatch.setattr(sage, "unavailable_reason", lambda: None)
    monkeypatch.setattr(backends, "_cuda_half", lambda q: None)
    monkeypatch.setattr(backends.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY, sage=sage))
    monkeypatch.setattr(backends, "_FALLBACK_ORDER", ["sage", "sdpa"])
    cuda = torch.device("cuda")

    def spec(tokens):
        return SimpleNamespace(shape=(1, tokens, 8, 128), dtype=torch.bfloat16, device=cuda)

    qc.reset_notices()
    long_, short = spec(backends.SAGE2_AUTO_MIN_TOKENS), spec(backends.SAGE2_AUTO_MIN_TOKENS - 1)
    assert backends.resolve_backend(long_, long_, long_).name == "sage"
    assert backends.resolve_backend(short, short, short).name == "sdpa"
    assert backends.resolve_backend(short, long_, long_).name == "sage"     # a long key/value sequence counts
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    assert backends.resolve_backend(long_, long_, long_, mask=mask).name == "sdpa"
    assert backends.resolve_backend(short, short, short, force_attention="sage").name == "sage"
    assert backends.resolve_backend(long_, long_, long_, mask=mask, force_attention="sage").name == "sage"
    notices = qc.drain_notices()
    assert {notice.kind for notice in notices} == {qc.notices.AUTO_CHOICE}
    lines = [str(notice) for notice in notices]
    assert sum("auto: sage is not used for calls under" in line for line in lines) == 1
    assert sum("auto: sage is not used for masked calls on Hopper" in line for line in lines) == 1
    monkeypatch.setattr(backends.torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert backends.resolve_backend(long_, long_, long_, mask=mask).name == "sage"   # Ada: its Triton kernel


def test_tally_counts_backends_and_groups_for_the_run_report():
    """Each runtime call counts its head groups and each kernel call its backend; `not_counted` leaves a
    caller's own checks out; draining clears the counts."""
    from qkv_core import tally
    qc.drain_tally()
    q, k, v = make_qkv(64, 8, 8)
    x = torch.randn(1, 96, 64)
    qc.qkv_attention([x.clone()], q, k, v, 8, 8, head_split_level=3, split_floor_tokens=0, force_attention="sdpa")
    qc.qkv_attention([x.clone()], q, k, v, 8, 8, head_split_level=0, force_attention="sdpa")
    with tally.not_counted():
        qc.qkv_attention([x.clone()], q, k, v, 8, 8, head_split_level=3, split_floor_tokens=0)
    counts = qc.drain_tally()
    assert counts.splits == {8: 1, 1: 1} and counts.kernels == {"sdpa": 9} and counts.largest_call == 96
    assert qc.drain_tally().empty


def test_sageattention_version_is_read_from_the_module_that_imports(monkeypatch):
    """SageAttention 2 used from its source folder (an in-place build on PYTHONPATH: no installed metadata) or
    shadowing an older install's metadata is still SageAttention 2, so its staged core runs (before, such a
    build fell back to `sageattn` per head group: on an H200 a Wan block at Low held 3.63 x|x| instead of 2.20);
    1.x and unknown modules as their metadata, or their API, say."""
    import importlib.metadata
    from types import SimpleNamespace
    from qkv_core import backends

    def metadata(version):
        def read(name):
            assert name == "sageattention"
            if version is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return version
        return read

    v2 = SimpleNamespace(sageattn=lambda *a, **k: None, sageattn_qk_int8_pv_fp16_triton=lambda *a, **k: None)
    v1 = SimpleNamespace(sageattn=lambda *a, **k: None)
    for version, module, major in ((None, v2, 2), ("1.0.6", v2, 2), ("2.2.0", v2, 2), (None, v1, 1),
                                   ("1.0.6", v1, 1), ("2.2.0", v1, 2), (None, SimpleNamespace(), 0),
                                   ("garbled", v1, 1)):
        monkeypatch.setattr(backends.importlib.metadata, "version", metadata(version))
        assert backends.sage_major_version(module) == major, (version, module)

    sage = backends.SageBackend()   # a module that does not import has no version
    monkeypatch.setattr(sage, "unavailable_reason", lambda: "sageattention is not importable (ImportError)")
    assert sage.major_version() == 0 and sage.staged_core is None


@pytest.mark.parametrize("prompt_tokens, whole", [(256, False), (60, True)])
def test_a_short_key_value_stream_is_projected_whole_only_under_a_64th_of_the_keys(prompt_tokens, whole):
    """Split, a key/value stream of at most 1/64 of the call's keys beside a long one projects its k and v whole
    once (each group copies its columns); a longer one (Qwen-Image 1328²'s prompt: 256 of 7,145 keys) projects
    each group's own columns, so its whole k and v are not held through the groups. Either way each group's keys
    and values are the layers' outputs, joined in stream order."""
    from qkv_core.projections import WholeThenSlice
    image_tokens = 4096 - prompt_tokens
    text, image = make_qkv(W, H, D, seed=3), make_qkv(W, H, D, seed=4)
    x_text, x_image = randn(1, prompt_tokens, W, seed=5), randn(1, image_tokens, W, seed=6)
    streams = [TokenStream(x_text, q=text[0], k=text[1], v=text[2]),
               TokenStream(x_image, q=image[0], k=image[1], v=image[2])]
    call = CallStreams(streams, streams, H, H, D)
    call.prepare(groups=4)
    try:
        assert isinstance(streams[0].prepared["k"], WholeThenSlice) is whole
        assert isinstance(streams[0].prepared["v"], WholeThenSlice) is whole
        assert not isinstance(streams[1].prepared["k"], WholeThenSlice)
        group = HeadGroup(range(1, 2), range(1, 2))
        k = call.project_k(group, last=False, v_later=True)
        _, v = call.project_v(group, last=False, k_later=False)
        with torch.no_grad():
            for got, layers in ((k, (text[1], image[1])), (v, (text[2], image[2]))):
                expected = torch.cat((layers[0](x_text), layers[1](x_image)), 1)[..., D:2 * D]
                assert torch.allclose(got.flatten(2), expected, rtol=1e-5, atol=1e-5)
    finally:
        call.release()


def test_kept_buffers_are_reused_by_the_groups_and_dropped_with_the_last():
    """`CallStreams.buffers` (set by the group loop): every group's joined k is written into one buffer through
    each stream's writer (the layers' outputs, joined in stream order); the last group releases the projections
    and drops the kept entry, so no writer keeps an input alive after it."""
    import weakref
    text, image = make_qkv(W, H, D, seed=7), make_qkv(W, H, D, seed=8)
    x_text, x_image = randn(1, 300, W, seed=9), randn(1, 700, W, seed=10)
    expected = torch.cat((text[1](x_text), image[1](x_image)), 1).detach()
    streams = [TokenStream(x_text, q=text[0], k=text[1], v=text[2]),
               TokenStream(x_image, q=image[0], k=image[1], v=image[2])]
    image_input = weakref.ref(x_image)
    del x_text, x_image
    call = CallStreams(streams, streams, H, H, D)
    call.prepare(groups=2)
    call.buffers = {}
    try:
        storages = set()
        for index, heads in enumerate((range(0, 2), range(2, 4))):
            k = call.project_k(HeadGroup(heads, heads), last=index == 1, v_later=False)
            assert torch.allclose(k.flatten(2), expected[..., heads.start * D:heads.stop * D], rtol=1e-5, atol=1e-5)
            storages.add(k.untyped_storage().data_ptr())
            del k
        assert len(storages) == 1   # one buffer for both groups
        assert not any(names == ("k", "k") for names, _ in call.buffers)   # dropped with the last group
        assert "k" not in streams[1].prepared and image_input() is not None   # v still holds the input
    finally:
        call.release()
    assert image_input() is None and call.buffers is None
