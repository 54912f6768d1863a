"""`capture_kv`: a call hands the normalized, rotated keys and values of a range of its key/value tokens to a
`PrefixLayer` (reference images kept across sampler steps, docs/design.md §2.7), and a later call that leaves
those tokens out attends them as its `kv_prefix`: the same attention, to float round-off (16 bits) or to q8's
error."""
from __future__ import annotations

import pytest
import torch

import qkv_core as qc
from support.reference import PerHeadNormRope, make_qkv, max_rel_err, randn

H, D, FEAT = 8, 32, 256
GENERATED, REFERENCE = 4096, 512


@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("quantize", [False, True])
def test_captured_range_serves_as_the_prefix(level, quantize):
    qp, kp, vp = make_qkv(FEAT, H, D, kv_heads=4, seed=1)
    x = randn(2, GENERATED + REFERENCE, FEAT, seed=2)    # generated tokens, then the reference tokens
    norm = PerHeadNormRope(D)
    cache = qc.PrefixCache(1, quantize=quantize, native=False)
    options = dict(kv_heads=4, head_split_level=level, split_floor_tokens=1024, force_attention="sdpa")
    full = qc.qkv_attention([x.clone()], qp, kp, vp, H, D, norm,
                            capture_kv=(cache[0], GENERATED, GENERATED + REFERENCE), **options)
    assert cache[0].populated
    held = cache[0].nbytes()
    assert held == (2 * REFERENCE * 4 * D * (1 + 1 / 16)) * 2 if quantize else 2 * 2 * REFERENCE * 4 * D * 4
    cached = qc.qkv_attention([x[:, :GENERATED].clone()], qp, kp, vp, H, D, norm, kv_prefix=cache[0], **options)
    assert max_rel_err(cached, full[:, :GENERATED]) < (2e-2 if quantize else 1e-5)


def test_capture_from_a_joint_call_and_its_errors():
    """The range indexes the joined key/value tokens ([text, image, references]); a range outside them, or a
    capture beside a prefix, is refused with the fix named."""
    s_txt, s_img = make_qkv(FEAT, H, D, seed=3), make_qkv(FEAT, H, D, seed=4)
    txt, img = randn(1, 77, FEAT, seed=5), randn(1, 2048 + 256, FEAT, seed=6)
    norm = PerHeadNormRope(D)
    cache = qc.PrefixCache(1)
    start = 77 + 2048
    full = qc.joint_qkv_attention([([txt.clone()], s_txt), ([img.clone()], s_img)], H, D, norm,
                                  capture_kv=(cache[0], start, start + 256), head_split_level=3,
                                  split_floor_tokens=512, force_attention="sdpa")
    cached = qc.joint_qkv_attention([([txt.clone()], s_txt), ([img[:, :2048].clone()], s_img)], H, D, norm,
                                    kv_prefix=cache[0], head_split_level=3, split_floor_tokens=512,
                                    force_attention="sdpa")
    assert max_rel_err(cached, full[:, :start]) < 1e-5
    with pytest.raises(ValueError, match=r"capture_kv range \(2000, 3000\) is not inside the 2381 key/value tokens"):
        qc.joint_qkv_attention([([txt.clone()], s_txt), ([img.clone()], s_img)], H, D, norm,
                               capture_kv=(cache[0], 2000, 3000))
    with pytest.raises(ValueError, match="capture_kv and kv_prefix together"):
        qc.joint_qkv_attention([([txt.clone()], s_txt), ([img.clone()], s_img)], H, D, norm,
                               capture_kv=(qc.PrefixCache(1)[0], start, start + 256), kv_prefix=cache[0])
    with pytest.raises(ValueError, match="capture_kv takes \\(layer, start, stop\\)"):
        qc.joint_qkv_attention([([txt.clone()], s_txt), ([img.clone()], s_img)], H, D, norm,
                               capture_kv=(start, start + 256))


def test_capture_with_a_spanning_norm_and_a_staged_fake_keeps_the_16_bit_keys():
    """The keys are captured after the norm and RoPE, before a staged core smooths or quantizes them in place."""
    from support.reference import SpanningNormRope
    from support.fake_backends import FakeBackend, FakeCore

    class SmoothingCore(FakeCore):
        def staged_quantize_k(self, k_list, settings):
            k = k_list[0]
            k -= k.mean(dim=1, keepdim=True)   # smoothed in place, as SageAttention's cores do
            return super().staged_quantize_k(k_list, settings)

    log = []
    backend = FakeBackend(SmoothingCore(log))
    backend.name = "fake-capture"
    qc.backends.register_backend(backend)
    try:
        qp, kp, vp = make_qkv(FEAT, H, D, seed=7)
        x = randn(1, GENERATED + REFERENCE, FEAT, seed=8)
        norm = SpanningNormRope(H, H, D)
        plain, staged = qc.PrefixCache(1), qc.PrefixCache(1)
        options = dict(norm_spans_heads=True, head_split_level=3, split_floor_tokens=1024)
        qc.qkv_attention([x.clone()], qp, kp, vp, H, D, norm, capture_kv=(plain[0], GENERATED, GENERATED + 64),
                         force_attention="sdpa", **options)
        qc.qkv_attention([x.clone()], qp, kp, vp, H, D, norm, capture_kv=(staged[0], GENERATED, GENERATED + 64),
                         force_attention="fake-capture", **options)
        (k1, v1), (k2, v2) = plain[0].get(), staged[0].get()
        assert max_rel_err(k2, k1) < 1e-5 and max_rel_err(v2, v1) < 1e-5
    finally:
        qc.backends.unregister_backend("fake-capture")
