"""The grouped Ulysses exchange (`qkv_core.ulysses_qkv_attention`, docs/design.md §2.9) on CPU: 2 and 4 processes
on gloo (`gloo_ranks`: torch.multiprocessing spawn, a file rendezvous), run alone with `-m sequence_parallel`.

Every rank builds the same layer and the whole sequence, keeps its shard, and checks in float32:
- the grouped exchange at every valid group count equals Ulysses' single exchange of every head
  (`benchmarks.ulysses.single_exchange`, xFuser's algorithm written out) and the single-process result
  (`qkv_attention` unsplit over the whole sequence, then o) within 1e-5, for a Wan-like norm spanning all
  heads and a Flux-like norm over each head; also with a batch of two, `o_columns` and no `o_proj`;
- its peak working set (MemTracker, above the live input and weights, as a multiple of the local |x|) falls
  with the group count and stays under the single exchange's;
- the refusals (`ValueError`s naming the fix) come before any communication.
One spawn per world size (results handed back as JSON); yunchang's all-to-all is compared where installed.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from support import gloo_ranks

from qkv_core.sequence_parallel import (exchange_group_count, process_group_of, ulysses_qkv_attention,
                                        valid_group_counts)

pytestmark = pytest.mark.sequence_parallel

HEADS, HEAD_DIM = 8, 16
TOKENS = 96            # the whole sequence (a multiple of 2 and 4)
MEMORY = dict(heads=8, head_dim=32, tokens=2048)
TOLERANCE = 1e-5


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _yunchang_single(x, layers, norm) -> torch.Tensor:
    """Ulysses' single exchange through yunchang's own all-to-all (the one xFuser's attention calls)."""
    import torch.nn.functional as F
    from yunchang.comm.all_to_all import all_to_all_4D
    from qkv_core import HeadGroup
    q_proj, k_proj, v_proj, o_proj = layers
    b, n = x.shape[:2]
    q, k = q_proj(x).view(b, n, HEADS, HEAD_DIM), k_proj(x).view(b, n, HEADS, HEAD_DIM)
    norm(q, k, HeadGroup(range(HEADS), range(HEADS)))
    q, k, v = (all_to_all_4D(t, 2, 1) for t in (q, k, v_proj(x).view(b, n, HEADS, HEAD_DIM)))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    return o_proj(all_to_all_4D(out.contiguous(), 1, 2).flatten(2))


def _has_yunchang() -> bool:
    try:
        import yunchang.comm.all_to_all  # noqa: F401
        return True
    except Exception:
        return False


def _numerics(rank: int, world: int) -> dict:
    """Errors of every variant on this rank, by name."""
    from benchmarks.ulysses import NormRope, make_layer, single_exchange, single_process
    errors = {}
    n = TOKENS // world
    for family, spans in (("wan", True), ("flux", False)):
        layers = make_layer(HEADS * HEAD_DIM, HEADS, HEAD_DIM, seed=3, dtype=torch.float32, device="cpu")
        norm_full = NormRope(HEADS, HEAD_DIM, TOKENS, 0, spans, seed=11)
        norm = norm_full.at(rank * n)
        for batch in (1, 2):
            g = torch.Generator().manual_seed(5 + batch)
            x_full = torch.randn(batch, TOKENS, HEADS * HEAD_DIM, generator=g)
            local = slice(rank * n, (rank + 1) * n)
            with torch.no_grad():
                want = single_process(x_full.clone(), layers, HEADS, HEAD_DIM, norm_full, spans)[:, local]
                x = x_full[:, local].clone()
                single = single_exchange(x, layers, HEADS, HEAD_DIM, norm)
                errors[f"{family} b{batch} single exchange vs single process"] = _err(single, want)
                if _has_yunchang():
                    errors[f"{family} b{batch} yunchang single exchange vs single process"] = \
                        _err(_yunchang_single(x, layers, norm), want)
                for count in valid_group_counts(HEADS, world):
                    for o_columns in (False, True):
                        got = ulysses_qkv_attention([x.clone()], *layers[:3], HEADS, HEAD_DIM, norm, o_proj=layers[3],
                                                    o_columns=o_columns, norm_spans_heads=spans, groups=count)
                        name = f"{family} b{batch} grouped {count}{' columns' if o_columns else ''}"
                        errors[f"{name} vs single process"] = _err(got, want)
                        errors[f"{name} vs single exchange"] = _err(got, single)
                attended = ulysses_qkv_attention([x.clone()], *layers[:3], HEADS, HEAD_DIM, norm,
                                                 norm_spans_heads=spans, head_split_level="high",
                                                 split_floor_tokens=0)
                errors[f"{family} b{batch} level high, o applied after, vs single process"] = \
                    _err(layers[3](attended.flatten(2)), want)
    return errors


def _peaks(rank: int, world: int) -> dict:
    """Peak working set per method on this rank, as a multiple of its local |x| (float32 Wan layer)."""
    from benchmarks.ulysses import Config, run_rank
    config = Config(tokens=MEMORY["tokens"], heads=MEMORY["heads"], head_dim=MEMORY["head_dim"], dtype="fp32",
                    device="cpu", repeats=0)
    result = run_rank(config)
    return {name: entry["peak_x"] for name, entry in result["methods"].items()}


def _refusals(world: int) -> dict:
    """The message of each refused call (None where nothing was raised)."""
    from benchmarks.ulysses import make_layer
    layers = make_layer(HEADS * HEAD_DIM, HEADS, HEAD_DIM, seed=3, dtype=torch.float32, device="cpu")
    x = torch.randn(1, 8, HEADS * HEAD_DIM)
    cases = {
        "bad group count": dict(groups=3),
        "heads per group not a multiple of the world": dict(groups=HEADS // world * 2),
        "grouped-query heads": dict(kv_heads=HEADS // 2),
        "o_columns without a weight": dict(o_proj=lambda t: t, o_columns=True),
        "group scale not above 0": dict(head_split_group_scale=0),
    }
    out = {}
    for name, kwargs in cases.items():
        try:
            ulysses_qkv_attention([x.clone()], *layers[:3], HEADS, HEAD_DIM, **kwargs)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    try:   # heads that do not split over the world: 6 heads over 4 ranks
        odd = make_layer(6 * HEAD_DIM, 6, HEAD_DIM, seed=3, dtype=torch.float32, device="cpu")
        ulysses_qkv_attention([torch.randn(1, 8, 6 * HEAD_DIM)], *odd[:3], 6, HEAD_DIM)
        out["heads over the world"] = None
    except ValueError as e:
        out["heads over the world"] = str(e)
    return out


def _case_rank(rank: int, world: int) -> dict:
    import sys
    result = {"rank": rank, "comfy": [m for m in sys.modules if m == "comfy" or m.startswith("comfy.")]}
    result["refusals"] = _refusals(world)   # first: a refusal that communicated would hang the next step
    result["errors"] = _numerics(rank, world)
    result["peaks"] = _peaks(rank, world)
    return result


# One test a world size, so that each spawns once (under pytest-xdist too); its parts are checked in turn.
@pytest.mark.parametrize("world", [2, 4])
def test_grouped_exchange_on_gloo(world):
    results = gloo_ranks.spawn(_case_rank, world)
    _check_errors(world, results)
    _check_peaks(world, results)
    _check_refusals(world, results)


def _check_errors(world: int, results: list[dict]) -> None:
    """The grouped exchange equals Ulysses' single exchange (also yunchang's, where installed) and the single
    process, float32, within 1e-5, on every rank."""
    worst = {}
    for result in results:
        for name, err in result["errors"].items():
            worst[name] = max(worst.get(name, 0.0), err)
    print(f"\nworld {world}: largest error {max(worst.values()):.2e} ({max(worst, key=worst.get)}); "
          f"yunchang {'compared' if any('yunchang' in k for k in worst) else 'not installed'}")
    assert any("wan" in k for k in worst) and any("flux" in k for k in worst)
    assert len([k for k in worst if "grouped" in k]) >= 8 * len(valid_group_counts(HEADS, world))
    bad = {k: v for k, v in worst.items() if not v <= TOLERANCE}
    assert not bad, bad


def _check_peaks(world: int, results: list[dict]) -> None:
    """Per rank, the peak falls with the group count and stays under the single exchange's."""
    for result in results:
        peaks = result["peaks"]
        counts = sorted(int(k.split()[1]) for k in peaks if k.startswith("grouped"))
        grouped = [peaks[f"grouped {c}"] for c in counts]
        print(f"world {world} rank {result['rank']}: single exchange {peaks['single exchange']:.3f} x|x|, grouped "
              + ", ".join(f"{c}: {p:.3f}" for c, p in zip(counts, grouped)))
        assert counts == valid_group_counts(MEMORY["heads"], world)
        assert all(later < earlier for earlier, later in zip(grouped, grouped[1:])), grouped
        assert grouped[0] <= peaks["single exchange"]
        assert grouped[-1] <= 0.6 * peaks["single exchange"], (grouped, peaks["single exchange"])
        assert grouped[-1] >= 1.0   # at least the result: the measurement saw the call


def _check_refusals(world: int, results: list[dict]) -> None:
    assert results[0]["comfy"] == []   # qkv_core never imports ComfyUI
    refusals = results[0]["refusals"]
    assert "use one of" in refusals["bad group count"]
    assert "multiple of the world size" in refusals["heads per group not a multiple of the world"]
    assert "key/value heads" in refusals["grouped-query heads"]
    assert "o_columns=False" in refusals["o_columns without a weight"]
    assert "a number > 0" in refusals["group scale not above 0"]
    if world == 4:
        assert "ulysses_degree" in refusals["heads over the world"]


def test_xfuser_coordinator_and_group_counts():
    ring = SimpleNamespace(ring_world_size=2, ulysses_group=None)
    with pytest.raises(ValueError, match="ring_degree to 1"):
        process_group_of(ring)
    with pytest.raises(ValueError, match="ProcessGroup"):
        process_group_of(SimpleNamespace(ring_world_size=1))
    assert process_group_of(None) is None
    assert valid_group_counts(40, 2) == [1, 2, 4, 5, 10, 20]
    assert valid_group_counts(40, 4) == [1, 2, 5, 10]
    assert valid_group_counts(40, 3) == []
    # Wan 14B, 720p x 81 over 2 ranks: High aims at 16 groups -> 20 (2 heads a group, 1 a rank)
    assert exchange_group_count(40, 2, 75600, "high") == 20
    assert exchange_group_count(40, 4, 75600, "high") == 10
    assert exchange_group_count(40, 2, 75600, "off") == 1
    assert exchange_group_count(40, 2, 4096, "high") == 1   # under the split floor
    assert exchange_group_count(40, 2, 75600, "high", group_scale=0.5) == 10   # a family's multiple of the level's
