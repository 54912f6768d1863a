"""Host-time fast paths, each with a switch (docs/design.md §2.5, "Host time").

A fast path saves host time on a call's critical path (at short lengths a head group's launches, not the GPU, set
the time) and changes no result: with it off, the plain path runs and gives the same numbers. Each is kept only
where it saves a measured share of a whole step (`python -m benchmarks.bench --comfyui --families
--fast-paths-ab`, and `--whole-model --fast-paths-ab`, time a step with each one off, in one process;
docs/benchmarks.md#fast-paths).

`QKV_FAST_PATHS`, read once at import, says which are on: a comma list applied left to right from the defaults
(every path on but those of `OFF_BY_DEFAULT`), of `all`, `none`, a name (on) and `-name` (off); e.g.
`none,direct_launch` or `-kept_launches`. `only(names)` sets them for a block of code (the benchmarks).
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

#: paths off unless `QKV_FAST_PATHS` names them: their whole-model gain is within the runs' spread and they use
#: another project's internals (docs/benchmarks.md#fast-paths)
OFF_BY_DEFAULT = frozenset({"direct_launch"})

_on: dict[str, bool] = {}
_spec = os.environ.get("QKV_FAST_PATHS", "")


def _apply(spec: str, names: Iterable[str], warn: bool) -> None:
    """Sets `_on` for `names` from a `QKV_FAST_PATHS` value (the defaults first)."""
    names = list(names)
    for name in names:
        _on[name] = name not in OFF_BY_DEFAULT
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        if entry in ("all", "none"):
            for name in names:
                _on[name] = entry == "all"
            continue
        name, value = (entry[1:], False) if entry.startswith("-") else (entry, True)
        if name in names:
            _on[name] = value
        elif warn:
            logging.getLogger("qkv_core").info("[QKV] QKV_FAST_PATHS: %r is not a fast path (yet): %s", name,
                                              ", ".join(FAST_PATHS))


_apply(_spec, FAST_PATHS, warn=True)


def on(name: str) -> bool:
    """Is the fast path `name` on (a dict lookup: it is asked on the hot path)?"""
    return _on[name]


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


__all__ = ["FAST_PATHS", "OFF_BY_DEFAULT", "on", "only"]
