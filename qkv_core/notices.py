"""One-time notices: a typed record of each fallback or choice, logged once per distinct reason and kept for
the run report.

The runtime never raises mid-run for a fallback (a missing backend, a projection that cannot be split): it
says so once through here, as a `Notice` (its `kind`, what it is about, why). `drain_notices()` hands the
collected notices to whoever reports on a run (the ComfyUI nodes show them on the node) and forgets them;
readers select by `kind`, never by the text, which is only what the log shows.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass

logger = logging.getLogger("qkv_core")

# What a notice says happened (`Notice.kind`)
FALLBACK = "fallback"        # a module ran ComfyUI's own forward instead of the pack's (a failed check, a hook)
SHORT_CALL = "short-call"    # a module ran ComfyUI's own forward by design (a family's short sequences)
PASSED_OVER = "passed-over"  # a backend, kernel or core asked for did not run; the pack's next choice did
AUTO_CHOICE = "auto-choice"  # `auto` measured or declined a backend: a choice, not a fallback
UNSPLIT = "unsplit"          # the head split was not applied to a call
SKIPPED = "skipped"          # a module the patch left as it was (another node's patch, a module it does not know)
KINDS = (FALLBACK, SHORT_CALL, PASSED_OVER, AUTO_CHOICE, UNSPLIT, SKIPPED)
BY_DESIGN = frozenset({SHORT_CALL, AUTO_CHOICE})   # chosen, so the run report lists them as notes


@dataclass(frozen=True)
class Notice:
    """One fallback or choice. `subject`: what it is about (a module such as "Wan block", a backend name, a
    module path); `family`: the model family where the subject does not name it; `text`: the log line
    (`str(notice)`)."""
    kind: str
    subject: str
    reason: str
    text: str
    family: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown notice kind {self.kind!r} (one of {', '.join(KINDS)})")

    def __str__(self) -> str:
        return self.text

    @property
    def by_design(self) -> bool:
        return self.kind in BY_DESIGN


_lock = threading.Lock()
_seen: set[str] = set()
_pending: list[Notice] = []
_muted = threading.local()   # `count` > 0 inside `muted()` on this thread


def notice_once(key: str, notice: Notice) -> bool:
    """Log `notice` at INFO (its text; the record's `notice` attribute is the object) the first time `key` is
    seen; returns True when it was logged now. Inside `muted()` nothing is logged nor kept (and the key is not
    marked seen)."""
    if not isinstance(notice, Notice):
        raise TypeError(f"notice_once takes a Notice, not {type(notice).__name__}")
    if getattr(_muted, "count", 0):
        return False
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
        _pending.append(notice)
    logger.info(notice.text, extra={"notice": notice})
    return True


def drain_notices() -> list[Notice]:
    """The notices logged since the last drain (fallbacks and choices).

    Returns
    -------
    list of Notice
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
