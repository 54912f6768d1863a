"""What the runtime did, counted for a run report: which backend ran each attention kernel call, and into how
many head groups each call was split.

The runtime counts as it goes (`count_attention`, `count_split`); whoever reports on a run (the ComfyUI node's
run report) takes the counts with `drain_tally()`, which clears them. Counting is a dictionary increment per
kernel call: nothing is kept but the counts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter

_lock = threading.Lock()
_kernels: Counter = Counter()   # backend label -> kernel calls
_splits: Counter = Counter()    # head groups -> runtime calls
_largest = 0                    # tokens of the longest runtime call, all batch items together
_paused = 0                     # > 0 inside `not_counted()`


@dataclasses.dataclass(frozen=True)
class Tally:
    """What the runtime did since the last `drain_tally`.

    Attributes
    ----------
    kernels : dict
        Backend label ("sdpa", "sage (staged)", "comfy: attention_sage", ...) -> attention kernel calls, most
        first.
    splits : dict
        Head groups -> runtime calls split into that many (1: not split), most groups first.
    largest_call : int
        Tokens of the longest runtime call, all batch items together (0 without one).
    empty : bool
        Nothing was counted.
    """

    kernels: dict
    splits: dict
    largest_call: int = 0

    @property
    def empty(self) -> bool:
        return not self.kernels and not self.splits


@contextlib.contextmanager
def not_counted():
    """Calls inside are not counted (a caller's own checks, which are not part of the work it reports on)."""
    global _paused
    with _lock:
        _paused += 1
    try:
        yield
    finally:
        with _lock:
            _paused -= 1


def count_attention(backend: str, calls: int = 1) -> None:
    """`calls` attention kernel calls ran on `backend` (a label the report prints as it is)."""
    with _lock:
        if not _paused:
            _kernels[backend] += calls


def count_split(groups: int, tokens: int = 0) -> None:
    """One runtime call of `tokens` tokens (all batch items) ran in `groups` head groups."""
    global _largest
    with _lock:
        if not _paused:
            _splits[groups] += 1
            _largest = max(_largest, tokens)


def drain_tally() -> Tally:
    """The counts since the last drain; clears them.

    Returns
    -------
    Tally
    """
    global _largest
    with _lock:
        out = Tally(dict(_kernels.most_common()), dict(sorted(_splits.items(), reverse=True)), _largest)
        _kernels.clear()
        _splits.clear()
        _largest = 0
    return out
