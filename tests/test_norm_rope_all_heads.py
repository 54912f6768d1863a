"""Every head's q normalized and rotated at once, before the head groups run (`GroupLoop.normalize_all_queries`,
`PerHeadNormRope.query_all_heads_`), and two adjacent streams whose norms differ only by their weights in one
fused pass: a few launches a call instead of one per group and stream (the host cost of short split blocks,
Qwen-Image at 1328^2). The same numbers as group by group, and declined (nothing done) where any stream's
fused pass cannot run."""
from __future__ import annotations

import importlib

import pytest
import torch

from qkv_core import joint_qkv_attention

B, HEADS, D = 2, 8, 16
TEXT, IMAGE = 5, 11


class _RmsNorm:
    """A norm over each head's channels, counting the calls that normalize queries."""

    def __init__(self):
        self.query_calls = 0

    def __call__(self, query, key, group):
        for t in (query, key):
            if t is not None:
                t.copy_(t * torch.rsqrt(t.float().square().mean(-1, keepdim=True) + 1e-6).to(t.dtype))
        if query is not None:
            self.query_calls += 1


class _AllHeads(_RmsNorm):
    def __init__(self, takes: bool):
        super().__init__()
        self.takes, self.whole_calls = takes, 0

    def query_all_heads_(self, query, group=None) -> bool:
        self.whole_calls += 1
        if not self.takes:
            return False
        assert query.shape[2] == HEADS   # every head at once
        self(query, None, None)
        self.query_calls -= 1
        return True


def _call(norm):
    g = torch.Generator().manual_seed(0)
    width = HEADS * D
    layers = []
    for _ in range(2):
        stream = []
        for _ in range(3):
            linear = torch.nn.Linear(width, width)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(width, width, generator=g) / width ** 0.5)
                linear.bias.copy_(torch.randn(width, generator=g) * 0.1)
            stream.append(linear)
        layers.append(tuple(stream))
    txt = torch.randn(B, TEXT, width, generator=g)
    img = torch.randn(B, IMAGE, width, generator=g)
    with torch.no_grad():
        return joint_qkv_attention([([txt], layers[0]), ([img], layers[1])], HEADS, D, norm, head_split_level=3,
                                   split_floor_tokens=0)


def test_the_runtime_normalizes_every_query_head_at_once_where_the_norm_offers_it():
    plain, whole, declined = _RmsNorm(), _AllHeads(True), _AllHeads(False)
    want = _call(plain)
    assert plain.query_calls == 8                          # High: 8 groups of one head, q normalized per group
    assert torch.equal(_call(whole), want)
    assert (whole.whole_calls, whole.query_calls) == (1, 0)
    assert torch.equal(_call(declined), want)              # declined: group by group, as before
    assert (declined.whole_calls, declined.query_calls) == (1, 8)


@pytest.mark.comfyui
def test_per_head_norm_rope_all_heads_equals_group_by_group(monkeypatch):
    """`PerHeadNormRope.query_all_heads_` with the fused pass stood in by its PyTorch reference (the kernel's
    own numerics are tested in test_kernels.py): the same as each group's call, and nothing done when one
    stream's pass cannot run."""
    from support import comfy_env
    env = comfy_env.pack_modules()
    norm_rope_module = importlib.import_module(env.pack.__name__ + ".nodes.norm_rope")
    kernels = norm_rope_module.kernels
    ran, worked_out = [], []

    class Pass:   # kernels.NormRopePass with the kernel's PyTorch reference
        def __init__(self, t, inverse_rms=None, weight=None, freqs=None, head_norm_eps=None, weight2=None,
                     split=None):
            worked_out.append(t.shape)
            self.layout = (t.shape, t.stride())
            self.arguments = (inverse_rms, weight, freqs)
            self.options = dict(head_norm_eps=head_norm_eps, weight2=weight2, split=split)

        def fits(self, t):
            return (t.shape, t.stride()) == self.layout

        def run(self, t):
            ran.append((t.shape[1], t.shape[2]))
            t.copy_(kernels.norm_rope_reference(t, *self.arguments, **self.options))
    monkeypatch.setattr(kernels, "can_run", lambda t: True)
    monkeypatch.setattr(kernels, "norm_rope_pass", Pass)
    g = torch.Generator().manual_seed(3)
    tokens = TEXT + IMAGE
    norms = [torch.nn.RMSNorm(D, eps=1e-6) for _ in range(4)]
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
    theta = torch.rand(1, tokens, 1, D // 2, generator=g) * 6
    cos, sin = theta.cos(), theta.sin()
    freqs = torch.stack((cos, -sin, sin, cos), dim=-1).unflatten(-1, (2, 2))
    ranges = [(0, TEXT, norms[0], norms[1]), (TEXT, tokens, norms[2], norms[3])]
    q = torch.randn(B, tokens, HEADS, D, generator=g)
    per_group, whole = q.clone(), q.clone()
    norm_rope = norm_rope_module.PerHeadNormRope(ranges, freqs)
    for start in range(0, HEADS, 2):
        norm_rope(None, per_group[:, :, start:start + 2].clone(), None)   # each group's keys: a tensor of its own
    assert worked_out == [(B, tokens, 2, D)] and len(ran) == HEADS // 2   # worked out once, run for every group
    for start in range(0, HEADS, 2):
        norm_rope(per_group[:, :, start:start + 2], None, None)
    ran.clear()
    assert norm_rope_module.PerHeadNormRope(ranges, freqs).query_all_heads_(whole)
    assert ran == [(tokens, HEADS)]                        # one pass over both streams and every head
    assert torch.equal(whole, per_group)
    # norms with different epsilons: one pass per stream, the same numbers
    norms[2].eps = 1e-5
    per_group, whole = q.clone(), q.clone()
    norm_rope = norm_rope_module.PerHeadNormRope(ranges, freqs)
    for start in range(0, HEADS, 2):
        norm_rope(per_group[:, :, start:start + 2], None, None)
    ran.clear()
    assert norm_rope_module.PerHeadNormRope(ranges, freqs).query_all_heads_(whole)
    assert ran == [(TEXT, HEADS), (IMAGE, HEADS)]
    assert torch.equal(whole, per_group)
    untouched = q.clone()
    other = [(0, TEXT, norms[0], norms[1]), (TEXT, tokens, torch.nn.LayerNorm(D), norms[3])]
    assert not norm_rope_module.PerHeadNormRope(other, freqs).query_all_heads_(untouched)
    assert torch.equal(untouched, q)
