"""`--fast-paths-ab`: the same step timed with every host-time fast path on (`qkv_core.fast_paths`), with none,
and with each one off, in one process. The variants take turns round by round (the order reversed every other
round), so a drift of the GPU's clocks or of the host falls on all of them alike; each variant's time is the
median of its rounds.

Used by `family_blocks.py` (a block call, `--chain` calls back to back, as a model runs its blocks) and
`wan_model.py` (a whole sampling step). A fast path stays where turning it off makes a step of a case users run
at least 2 % slower (docs/design.md §2.5, "Host time").
"""
from __future__ import annotations

import statistics
from typing import Callable

try:
    from ..qkv_core import fast_paths
except ImportError:   # imported as the runner's own `benchmarks.fast_paths_ab` (the pack's qkv_core is the same module)
    from qkv_core import fast_paths

ALL, NONE = "all on", "none"


def variants(spec: str) -> list[tuple[str, frozenset]]:
    """`(label, the fast paths on)` for a comma list of `all`, `none`, `each` (every fast path off in turn) and
    `-name` (that one off); "all on" always comes first (the others are compared with it)."""
    every = frozenset(fast_paths.FAST_PATHS)
    chosen = [(ALL, every)]
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        if entry == "all":
            continue
        if entry == "none":
            chosen.append((NONE, frozenset()))
        elif entry == "each":
            chosen += [(f"-{name}", every - {name}) for name in fast_paths.FAST_PATHS]
        elif entry.startswith("-") and entry[1:] in every:
            chosen.append((entry, every - {entry[1:]}))
        else:
            raise SystemExit(f"--fast-paths: {entry!r} is not all, none, each or -NAME of {', '.join(every)}")
    return list(dict(chosen).items())


def interleaved(time_once: Callable[[], float], chosen: list, rounds: int) -> dict[str, list[float]]:
    """`time_once()` (seconds) under each variant's fast paths, `rounds` times each, in turns."""
    times = {label: [] for label, _ in chosen}
    for number in range(rounds):
        for label, names in (chosen if number % 2 == 0 else chosen[::-1]):
            with fast_paths.only(names):
                times[label].append(time_once())
    return times


def rows(times: dict[str, list[float]]) -> list[dict]:
    """One row a variant: median ms, its ratio to "all on" and the spread of its rounds ((max - min) / median)."""
    base = statistics.median(times[ALL])
    out = []
    for label, values in times.items():
        median = statistics.median(values)
        out.append({"variant": label, "ms": median * 1000, "vs_all_on": median / base,
                    "spread": (max(values) - min(values)) / median if median else 0.0, "rounds": len(values)})
    return out


def table(title: str, result: list[dict]) -> str:
    """`rows` as text: a slower step without a fast path shows as `vs all on` over 1 (+2 % is 1.02)."""
    lines = [title, f"  {'variant':22} {'ms':>10} {'vs all on':>9} {'spread':>7}"]
    for row in result:
        lines.append(f"  {row['variant']:22} {row['ms']:10.2f} {row['vs_all_on']:9.3f} {row['spread']:7.1%}")
    return "\n".join(lines)


def add_arguments(parser, spec: str = "none,each", rounds: int = 3) -> None:
    parser.add_argument("--fast-paths-ab", action="store_true",
                        help="time the pack with every host-time fast path on and with the variants of "
                             "--fast-paths (qkv_core.fast_paths), interleaved in one process, instead of the usual "
                             "table")
    parser.add_argument("--fast-paths", default=spec,
                        help=f"with --fast-paths-ab: the variants beside all on, a comma list of none, each (every "
                             f"fast path off in turn) and -NAME (default {spec})")
    parser.add_argument("--ab-rounds", type=int, default=rounds,
                        help=f"with --fast-paths-ab: rounds of turns (default {rounds})")
