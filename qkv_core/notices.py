"""One-time notices: log a line once per distinct reason and keep it for the run report.

The runtime never raises mid-run for a fallback (a missing backend, a projection that cannot be split): it
says so once through here. `drain_notices()` hands the collected lines to whoever reports on a run (the
ComfyUI nodes show them on the node) and forgets them.
"""
from __future__ import annotations

import contextlib
import logging
import threading

logger = logging.getLogger("qkv_core")

_lock = threading.Lock()
_seen: set[str] = set()
_pending: list[str] = []
_muted = threading.local()   # `count` > 0 inside `muted()` on this thread


def notice_once(key: str, message: str) -> bool:
    """Log `message` at INFO the first time `key` is seen; returns True when it was logged now. Inside `muted()`
    nothing is logged nor kept (and the key is not marked seen)."""
    if getattr(_muted, "count", 0):
        return False
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
        _pending.append(message)
    logger.info(message)
    return True


def drain_notices() -> list[str]:
    """The notices logged since the last drain (fallbacks and choices, one line each).

    Returns
    -------
    list of str
        Oldest first. The pending list is cleared; a notice already seen is still not logged again
        (`reset_notices` forgets them).
    """
    with _lock:
        out = list(_pending)
        _pending.clear()
    return out


def reset_notices() -> None:
    """Forget every notice, pending or seen, so that each is logged again once (a new run's report)."""
    with _lock:
        _seen.clear()
        _pending.clear()


@contextlib.contextmanager
def muted():
    """Notices on this thread are dropped inside (a caller's own checks, run in another dtype than the run they
    guard: what they pass over is not something the run did)."""
    _muted.count = getattr(_muted, "count", 0) + 1
    try:
        yield
    finally:
        _muted.count -= 1
