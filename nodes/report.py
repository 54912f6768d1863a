"""What a patch did and why not: logged once when the node runs, and again (with the runtime's fallback
notices and the measured peak) after each sampling run."""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict

logger = logging.getLogger("ComfyUI-QKV")


class PatchReport:
    def __init__(self):
        self.patched_counts: Counter = Counter()          # (family, what) -> modules
        self.skipped_reasons: "OrderedDict[tuple, list]" = OrderedDict()  # (family, reason) -> paths
        self.notes: list[str] = []

    def patched(self, family: str, what: str, path: str) -> None:
        self.patched_counts[(family, what)] += 1

    def skipped(self, family: str, path: str, reason: str) -> None:
        self.skipped_reasons.setdefault((family, reason), []).append(path)

    def note(self, line: str) -> None:
        self.notes.append(line)

    @property
    def any_patched(self) -> bool:
        return bool(self.patched_counts)

    def lines(self) -> list[str]:
        out = []
        for (family, what), count in self.patched_counts.items():
            out.append(f"{family}: {count} {what} patched")
        for (family, reason), paths in self.skipped_reasons.items():
            where = paths[0] if len(paths) == 1 else f"{paths[0]} and {len(paths) - 1} more"
            out.append(f"{family}: {where} runs as before: {reason}")
        return out + self.notes

    def log(self) -> None:
        for line in self.lines():
            logger.info("[QKV] %s", line)
