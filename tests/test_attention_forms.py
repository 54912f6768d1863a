"""Unit tests of the shared attention pieces in `nodes/attention.py`: the RoPE kinds (each against a rotation
written out with complex numbers, and each head group's slice of the tables against the whole), and the norm
spanning all heads (`SpanningNormRope`: a head group normalized from the statistics of all heads equals the
module's own norm over the full width, per stream of a joined sequence). Skipped without ComfyUI (the module
imports ComfyUI's attention dispatcher)."""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env

pytestmark = pytest.mark.comfyui

B, N, H, D = 2, 10, 4, 8


@pytest.fixture(scope="module")
def env():
    return comfy_env.pack_modules()


@pytest.fixture(scope="module")
def attention(env):
    return importlib.import_module(env.pack.__name__ + ".nodes.attention")


def _angles(torch, per_head: bool):
    g = torch.Generator().manual_seed(0)
    return torch.rand(B, N, H if per_head else 1, D // 2, generator=g, dtype=torch.float64) * 6.0


def _matrices(torch, theta):
    """Rotation matrices `(..., D/2, 2, 2)` as ComfyUI builds them: [[cos, -sin], [sin, cos]]."""
    cos, sin = theta.cos(), theta.sin()
    return torch.stack((cos, -sin, sin, cos), dim=-1).unflatten(-1, (2, 2))


def _complex_rotation(torch, t, theta, split_half: bool):
    """The reference: each pair (a, b) as a + ib times e^(i theta); pairs (2i, 2i+1), or (i, i + D/2)."""
    if split_half:
        a, b = t[..., :D // 2], t[..., D // 2:]
    else:
        a, b = t[..., 0::2], t[..., 1::2]
    z = torch.complex(a, b) * torch.polar(torch.ones_like(theta), theta)
    if split_half:
        return torch.cat((z.real, z.imag), dim=-1)
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


@pytest.mark.parametrize("kind, per_head", [("pairs", False), ("pairs", True), ("split_half", False),
                                            ("split_half", True), ("cos_sin", True), ("cos_sin_halves", True)])
def test_rope_kinds_rotate_each_head_group_as_the_whole(env, attention, kind, per_head):
    """`per_head`: a rotation per head (the tables' heads dimension), else one shared by all heads."""
    torch = env.torch
    theta = _angles(torch, per_head)
    t = torch.randn(B, N, H, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    split_half = kind in ("split_half", "cos_sin_halves")
    if kind in ("pairs", "split_half"):
        freqs = _matrices(torch, theta)                                      # (B, N, 1 or H, D/2, 2, 2)
    elif kind == "cos_sin":
        freqs = tuple(f.repeat_interleave(2, dim=-1).flatten(2) for f in (theta.cos(), theta.sin()))  # (B, N, H*D)
    else:
        freqs = tuple(f.transpose(1, 2).contiguous() for f in (theta.cos(), theta.sin()))            # (B, H, N, D/2)
    expected = _complex_rotation(torch, t, theta, split_half)
    whole = attention.rotate_rows(kind, freqs, t, 0, N, range(H))
    assert torch.allclose(whole, expected, atol=1e-12)
    heads, a, b = range(1, 3), 3, 8   # one group's heads, one chunk's tokens
    part = attention.rotate_rows(kind, freqs, t[:, a:b, heads.start:heads.stop].clone(), a, b, heads)
    assert torch.allclose(part, expected[:, a:b, heads.start:heads.stop], atol=1e-12)


def test_forms_take_the_spanning_norm_and_refuse_per_head_norms_with_other_ropes(attention):
    stream = attention.StreamProjections(q="to_q", k="to_k", v="to_v", norm_q="q_norm", norm_k="k_norm")
    form = attention.AttentionForm(streams=(stream,), norm=attention.NORM_SPANS_HEADS, rope=attention.ROPE_SPLIT_HALF)
    assert form.norm == attention.NORM_SPANS_HEADS
    with pytest.raises(ValueError, match="per-head norm takes one of the RoPE kinds"):
        attention.AttentionForm(streams=(stream,), norm=attention.NORM_PER_HEAD, rope=attention.ROPE_COS_SIN)
    with pytest.raises(ValueError, match="comes with norm='per_head'"):
        attention.AttentionForm(streams=(stream,), norm=attention.NORM_SPANS_HEADS,
                                rope=attention.ROPE_COS_SIN_PAIRS)


@pytest.mark.parametrize("kind", ["pairs", "split_half"])
def test_spanning_norm_per_head_group_equals_the_norm_over_all_heads(env, attention, kind):
    """Two streams joined along tokens, each with its own RMSNorm over all heads (other eps and weights), then
    RoPE with a rotation per head: every head group, normalized from the statistics of all heads, equals the
    modules' own norm of the whole width, then rotated."""
    torch = env.torch
    g = torch.Generator().manual_seed(2)
    split = 4   # stream 1: tokens [0, 4), stream 2: [4, N)
    norms = []
    for eps in (1e-5, 1e-3):
        norm = torch.nn.RMSNorm(H * D, eps=eps)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(H * D, generator=g))
        norms.append(norm)
    q, k = (torch.randn(B, N, H, D, generator=g) for _ in range(2))
    freqs = _matrices(torch, _angles(torch, per_head=True)).float()
    expected = []
    for t in (q, k):
        normed = torch.cat([norm(t[:, a:b].flatten(2)) for norm, (a, b) in zip(norms, ((0, split), (split, N)))],
                           dim=1).unflatten(-1, (H, D))
        expected.append(attention.rotate_rows(kind, freqs, normed, 0, N, range(H)))
    ranges = [(0, split, norms[0], norms[0]), (split, N, norms[1], norms[1])]
    mean_squares = tuple(t.float().square().mean(dim=(-2, -1)).unsqueeze(-1) for t in (q, k))
    norm_rope = attention.SpanningNormRope(ranges, H, D, freqs, rope=kind)
    assert norm_rope.spans_heads
    for heads in (range(0, 1), range(1, 3), range(3, 4)):
        group = env.core.head_split.HeadGroup(heads, heads, mean_squares)
        q_group, k_group = (t[:, :, heads.start:heads.stop].clone() for t in (q, k))
        norm_rope(q_group, k_group, group)
        for got, want in zip((q_group, k_group), expected):
            assert torch.allclose(got, want[:, :, heads.start:heads.stop], atol=1e-5), heads
    # unsplit (one group of every head, no statistics): the modules' own norm
    whole = env.core.head_split.HeadGroup(range(H), range(H))
    q_all, k_all = q.clone(), k.clone()
    attention.SpanningNormRope(ranges, H, D, freqs, rope=kind)(q_all, k_all, whole)
    assert torch.allclose(q_all, expected[0], atol=1e-5) and torch.allclose(k_all, expected[1], atol=1e-5)


def test_a_chunk_of_tokens_takes_its_own_rows_of_the_rope_table(env, attention):
    """A call that reuses its input normalizes token chunks of every head (`HeadGroup.tokens`): each chunk, the
    first one too, is handed the table rows of its own tokens (a table of every token does not fit the fused
    pass, which then fell back to the unfused one), and the chunks together equal the whole."""
    torch = env.torch
    g = torch.Generator().manual_seed(3)
    norm = torch.nn.RMSNorm(H * D, eps=1e-6)
    freqs = _matrices(torch, _angles(torch, per_head=False)).float()
    k = torch.randn(B, N, H, D, generator=g)
    whole = k.clone()
    every = range(H)
    HeadGroup = env.core.head_split.HeadGroup
    attention.SpanningNormRope([(0, None, norm, norm)], H, D, freqs)(None, whole, HeadGroup(every, every))
    norm_rope = attention.SpanningNormRope([(0, None, norm, norm)], H, D, freqs)
    for a, b in ((0, 4), (4, N)):
        group = HeadGroup(every, every, None, tokens=range(a, b))
        first, table = norm_rope._tokens(1, k[:, a:b], group)
        assert first == a and table.shape[1] == b - a and torch.equal(table, freqs[:, a:b])
        chunk = k[:, a:b].clone()
        norm_rope(None, chunk, group)
        assert torch.allclose(chunk, whole[:, a:b], atol=1e-6), (a, b)
    # the fused pass into another tensor (`norm_key_into`) runs on CUDA only: elsewhere it declines, untouched
    dest = torch.zeros_like(k[:, :4])
    group = HeadGroup(every, every, None, tokens=range(0, 4))
    assert norm_rope.key_into(k[:, :4], dest, group) is False and not dest.any()


def test_the_wan_cross_attention_chunks_are_larger_only_where_the_norm_runs_fused(env):
    """Wan's bounded block chunks its cross-attention by |x| / 8 on CPU (there the chunk's norm holds a float32
    scratch and the attention a score matrix: |x| / 4 measured 2.83 x |x| on CPU, over the 2.5 bound) and by
    |x| / 4 on CUDA with Triton (H200: the same 2.20 x |x| peak, half the launches)."""
    torch = env.torch
    wan = importlib.import_module(env.pack.__name__ + ".nodes.families.wan")
    assert wan.cross_chunk_fraction(torch.zeros(1, 4, 8)) == wan.CROSS_CHUNK_FRACTION == 8
    assert wan.CUDA_CROSS_CHUNK_FRACTION == 4


JOINED_PASS_CHECK = """
import sys
sys.path.insert(0, {tests!r})
import importlib
import torch
from support import comfy_env
env = comfy_env.pack_modules()
attention = importlib.import_module(env.pack.__name__ + ".nodes.attention")
kernels = env.core.kernels
assert kernels.INTERPRET and kernels.triton is not None
launches = []
real = kernels.norm_rope_launch
def spy(*args, **kwargs):
    launches.append(kwargs.get("weight2") is not None)
    return real(*args, **kwargs)
kernels.norm_rope_launch = spy
B, N, H, D, split = 2, 12, 4, 16, 8
g = torch.Generator().manual_seed(4)
norms = []
for _ in range(2):   # one epsilon, other weights: HiDream's image and text norms
    norm = torch.nn.RMSNorm(H * D, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(H * D, generator=g))
    norms.append(norm)
theta = torch.rand(1, N, 1, D // 2, generator=g, dtype=torch.float64) * 6.0
cos, sin = theta.cos(), theta.sin()
freqs = torch.stack((cos, -sin, sin, cos), dim=-1).unflatten(-1, (2, 2)).float()
q, k = (torch.randn(B, N, H, D, generator=g) for _ in range(2))
with torch.no_grad():
    expected = [attention.rotate_rows("pairs", freqs, torch.cat(
        [norm(t[:, a:b].flatten(2)) for norm, (a, b) in zip(norms, ((0, split), (split, N)))],
        dim=1).unflatten(-1, (H, D)), 0, N, range(H)) for t in (q, k)]
mean_squares = tuple(t.float().square().mean(dim=(-2, -1)).unsqueeze(-1) for t in (q, k))
norm_rope = attention.SpanningNormRope([(0, split, norms[0], norms[0]), (split, None, norms[1], norms[1])], H, D,
                                       freqs)
error = 0.0
for heads in (range(0, 2), range(2, 4)):
    group = env.core.head_split.HeadGroup(heads, heads, mean_squares)
    q_group, k_group = (t[:, :, heads.start:heads.stop].clone() for t in (q, k))
    norm_rope(q_group, k_group, group)
    for got, want in zip((q_group, k_group), expected):
        error = max(error, float((got - want[:, :, heads.start:heads.stop]).abs().max()))
every = env.core.head_split.HeadGroup(range(H), range(H), mean_squares)
q_all = q.clone()   # every head's q at once, before the groups (the runtime's normalize_all_queries)
assert norm_rope.query_all_heads_(q_all, every)
error = max(error, float((q_all - expected[0]).abs().max()))
one = attention.SpanningNormRope([(0, None, norms[0], norms[0])], H, D, freqs)   # one stream (Wan, LTX)
with torch.no_grad():
    want = attention.rotate_rows("pairs", freqs, norms[0](q.flatten(2)).unflatten(-1, (H, D)), 0, N, range(H))
q_all = q.clone()
assert one.query_all_heads_(q_all, every) and not one.query_all_heads_(q.clone(), None)
error = max(error, float((q_all - want).abs().max()))
print("launches", launches, "error", error)
"""


def test_two_streams_spanning_norms_in_one_fused_pass():
    """HiDream's image and text streams, each with its RMSNorm over all heads (one epsilon, other weights): a
    head group's q and k are each normalized and rotated in one fused pass over both streams (the text tokens
    taking their norm's weight; CUDA, here Triton's interpreter in a child process), and so is every head's q
    at once from the statistics pass (`query_all_heads_`, one stream too), equal to the modules' own norms of
    the whole width, then rotated."""
    import re
    stdout = comfy_env.run_interpreted(JOINED_PASS_CHECK)
    found = re.search(r"launches \[(.*)\] error (\S+)", stdout)
    assert found, stdout[-2000:]
    # one pass a tensor a group, both streams in it; every head's q in one pass, two streams or one
    assert found.group(1) == ", ".join(["True"] * 5 + ["False"])
    assert float(found.group(2)) <= 1e-5
