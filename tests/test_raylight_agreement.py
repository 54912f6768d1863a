"""A failure on one rank of raylight's sequence-parallel group only (issue 46, item 5): every rank still takes the
same path (docs/design.md §3.7). 2 and 4 CPU processes on gloo (`gloo_ranks`, under a timeout: ranks that wait
on each other's exchanges fail the test instead of hanging it), the tiny Wan block of tests/test_raylight.py with
its stand-in of raylight's Ulysses forwards.

Each reason to run ComfyUI's own is planted on the last rank alone, and every rank must end on ComfyUI's block
(raylight's forwards: the pack's head groups not exchanged, the fallback logged) with the single process's numbers:
- a refusal there: gradients enabled, or another node's forward on the block's feed-forward;
- its verdicts forgotten while the others keep a pass: every rank checks again (a pass: every rank on the pack's
  block; a planted error there: every rank on ComfyUI's);
- its check failing: an error planted in the pack's block on that rank only (the feed-forward's update 1 % off);
- its float32 reference raising (`compat.exact_reference` planted to raise there).
"""
from __future__ import annotations

import pytest

from support import comfy_env
from support import gloo_ranks
import test_raylight as raylight

pytestmark = [pytest.mark.comfyui, pytest.mark.sequence_parallel]

TIMEOUT = 240   # seconds for a world's ranks together (2 ranks: ~35 s, 4: ~55 s on 2 CPU cores, mostly start-up)
STOCK = "Wan block runs as ComfyUI's own"
PLANTED = ("gradients on one rank", "another node's feed-forward on one rank", "one rank forgot, its check fails",
           "one rank's check fails", "one rank's reference raises")
REASONS = {"gradients on one rank": "gradients are enabled",
           "another node's feed-forward on one rank": "another node patched its ffn",
           "one rank forgot, its check fails": "the outputs differ",
           "one rank's check fails": "the outputs differ",
           "one rank's reference raises": "a float32 reference planted to fail"}
# what the other ranks say (a refusal there: "another rank of the sequence-parallel group runs ComfyUI's own")
OTHER_RANKS = {"one rank forgot, its check fails": "the check failed on another rank",
               "one rank's check fails": "the check failed on another rank",
               "one rank's reference raises": "float32 forward cannot run on another rank"}


def _one_rank_fails(rank: int, world: int) -> dict:
    """Each case's error against the single process, fallback lines and the pack's head groups, on this rank."""
    import importlib
    import types
    import torch
    import torch.distributed as dist
    env = comfy_env.pack_modules()
    sp = importlib.import_module(env.pack.__name__ + ".nodes.sequence_parallel")
    env.core.head_split.SPLIT_FLOOR_TOKENS = 16
    patcher = comfy_env.make_wan("t2v", dim=raylight.DIM, heads=raylight.HEADS, layers=1, text_dim=32)
    inputs = raylight._block_inputs(torch, patcher)
    block = patcher.model.diffusion_model.blocks[0]
    n = inputs["x"].shape[1] // world
    local = slice(rank * n, (rank + 1) * n)
    sharded = {k: (v[:, local].contiguous() if k in ("x", "freqs") else v) for k, v in inputs.items()}
    with torch.no_grad():
        want = block(**raylight._fresh(inputs))[:, local]
    patched, _ = env.node.apply_patch(patcher, "High", "sdpa", True)
    patched.patch_model(load_weights=False)
    raylight._GROUP.append(dist.new_group(list(range(world))))
    sp.register_ulysses_forward(raylight._usp_self_attention, sp.SELF_ATTENTION, group=lambda: raylight._GROUP[-1])
    sp.register_ulysses_forward(raylight._usp_cross_attention, sp.CROSS_ATTENTION)
    planted = rank == world - 1
    out = {}

    def call(label, grad=False):
        env.core.drain_tally()
        env.core.reset_notices()
        with torch.set_grad_enabled(grad and planted):
            got = block(**raylight._fresh(sharded))
        out[label] = {"error": raylight._err(got.detach(), want), "fallbacks": comfy_env.stock_fallbacks(env),
                      "splits": {str(k): v for k, v in env.core.drain_tally().splits.items()}}

    ffn_phase_, exact_reference = env.wan.ffn_phase_, env.compat.exact_reference

    def wrong_ffn_(block, residual, mod):   # the pack's block: its feed-forward's update 1 % larger
        before = residual.clone()
        ffn_phase_(block, residual, mod)
        residual.sub_(before).mul_(1.01).add_(before)

    def raising_reference(*args, **kwargs):
        raise RuntimeError("a float32 reference planted to fail on this rank")

    def plant(wrong_ffn=False, raising=False):
        if planted:
            env.wan.ffn_phase_ = wrong_ffn_ if wrong_ffn else ffn_phase_
            env.compat.exact_reference = raising_reference if raising else exact_reference

    raylight._bind(block, raylight._usp_self_attention)
    try:
        env.compat.forget_verdicts()
        call("first call (self-check)")
        call("a cached pass")
        call("gradients on one rank", grad=True)
        if planted:   # what another node binds: ComfyUI's own feed-forward, as a forward of its own
            block.ffn.forward = types.MethodType(lambda self, x: type(self).forward(self, x), block.ffn)
        call("another node's feed-forward on one rank")
        block.ffn.__dict__.pop("forward", None)
        if planted:
            env.compat.forget_verdicts()
        call("one rank forgot, its check passes")
        if planted:
            env.compat.forget_verdicts()
        plant(wrong_ffn=True)
        call("one rank forgot, its check fails")
        env.compat.forget_verdicts()
        call("one rank's check fails")
        plant(raising=True)
        env.compat.forget_verdicts()
        call("one rank's reference raises")
    finally:
        plant()
        sp.unregister_ulysses_forward(raylight._usp_self_attention)
        sp.unregister_ulysses_forward(raylight._usp_cross_attention)
        raylight._unbind(block)
        patched.unpatch_model(unpatch_weights=False)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_failure_on_one_rank_runs_comfyuis_block_on_every_rank(world):
    comfy_env.require_comfyui()
    results = gloo_ranks.spawn(_one_rank_fails, world, timeout=TIMEOUT)
    groups = str(raylight.HEADS // world)   # High: a head a rank in each exchanged group
    for rank, result in enumerate(results):
        print(f"\nworld {world} rank {rank}: " + ", ".join(f"{k} {v['error']:.1e} {v['splits']}"
                                                        for k, v in result.items()))
        for label, row in result.items():
            assert row["error"] <= raylight.TOLERANCE, (rank, label, row)
        for label in ("first call (self-check)", "a cached pass", "one rank forgot, its check passes"):
            row = result[label]
            assert not row["fallbacks"], (rank, label, row)
            assert row["splits"].get(groups, 0) >= 1, (rank, label, row)   # the pack's grouped exchange ran
        for label in PLANTED:
            row = result[label]
            assert row["splits"] == {}, (rank, label, row)   # ComfyUI's block: raylight's forwards, no head groups
            reason = REASONS[label] if rank == world - 1 else OTHER_RANKS.get(label, "another rank of the sequence"
                                                                                         "-parallel group runs")
            assert any(STOCK in line and reason in line for line in row["fallbacks"]), (rank, label, row["fallbacks"])
