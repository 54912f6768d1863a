"""Host-time fast paths, each with a switch (docs/design.md §2.5, "Host time").

A fast path saves host time on a call's critical path (at short lengths a head group's launches, not the GPU, set
the time) and changes no result: with it off, the plain path runs and gives the same numbers. Each is kept only
where it saves a measured share of a whole step (`python -m benchmarks.bench --comfyui --families
--fast-paths-ab`, and `--whole-model --fast-paths-ab`, time a step with each one off, in one process).

`QKV_FAST_PATHS`, read once at import, says which are on: a comma list applied left to right from "all on", of
`all`, `none`, a name (on) and `-name` (off); e.g. `none,direct_launch` or `-kept_launches`. `only(names)` sets
them for a block of code (the benchmarks). A module outside `qkv_core` with a fast path of its own names it
with `declare` and asks `on` like the runtime does.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterable, Iterator

#: name -> what it does and where; every name is on unless `QKV_FAST_PATHS` or `only` says otherwise
FAST_PATHS: dict[str, str] = {
    "direct_launch": "a repeated Triton launch goes straight to the compiled kernel's launcher (launch.py)",
    "kept_launches": "the launches kept across calls, by kernel, grid and arguments (launch.shared_launch)",
    "pass_layouts": "an in-place norm and RoPE pass worked out once per layout, kept across calls "
                    "(kernels._PassLayout)",
    "over_queries_pass": "the attention over the queries worked out once per layout, kept across calls "
                         "(inplace_attention.over_queries_pass)",
    "sdpa_order": "SDPA's kernel order set once around a call's groups, not per group (backends.held_sdpa_order)",
    "group_buffers": "the joined k and v buffers and the projections' writers made once a call, reused by every "
                     "group (streams.CallStreams.buffers)",
    "weight_views": "a Linear's input and transposed weight viewed once a call (projections.WeightRows)",
    "all_heads_q": "every head's q normalized in one pass per stream before the groups (GroupLoop."
                   "normalize_all_queries)",
    "capability": "a GPU's compute capability asked once (kernels.capability)",
}

_on: dict[str, bool] = {}
_spec = os.environ.get("QKV_FAST_PATHS", "all")


def _apply(spec: str, names: Iterable[str], warn: bool) -> None:
    """Sets `_on` for `names` from a `QKV_FAST_PATHS` value (all on first)."""
    names = list(names)
    for name in names:
        _on[name] = True
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        if entry in ("all", "none"):
            for name in names:
                _on[name] = entry == "all"
            continue
        name, value = (entry[1:], False) if entry.startswith("-") else (entry, True)
        if name in names:
            _on[name] = value
        elif warn:
            # a name declared later (outside qkv_core) takes the value when it is declared
            logging.getLogger("qkv_core").info("[QKV] QKV_FAST_PATHS: %r is not a fast path (yet): %s", name,
                                              ", ".join(FAST_PATHS))


_apply(_spec, FAST_PATHS, warn=True)


def on(name: str) -> bool:
    """Is the fast path `name` on (a dict lookup: it is asked on the hot path)?"""
    return _on[name]


def declare(name: str, what: str) -> None:
    """A fast path outside `qkv_core` (one line of `what` it does and where), switched like the others."""
    FAST_PATHS[name] = what
    if name not in _on:
        _apply(_spec, [name], warn=False)


@contextlib.contextmanager
def only(names: Iterable[str]) -> Iterator[None]:
    """Exactly the fast paths `names` on inside the block (each name known); the previous setting after it."""
    names = set(names)
    unknown = names - FAST_PATHS.keys()
    if unknown:
        raise ValueError(f"not fast paths: {sorted(unknown)}; they are {', '.join(FAST_PATHS)}")
    saved = dict(_on)
    _on.update({name: name in names for name in FAST_PATHS})
    try:
        yield
    finally:
        _on.clear()
        _on.update(saved)


__all__ = ["FAST_PATHS", "on", "declare", "only"]
