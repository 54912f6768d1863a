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


UI_EVENT = "comfyui_qkv.report"   # web/qkv_report.js listens for it
GiB, MiB = 2 ** 30, 2 ** 20


def size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


def send_to_ui(event: str, payload: dict) -> bool:
    """Send `payload` to the browser through ComfyUI's prompt server (its message API); False without one
    (scripts, tests without a server: the log still has the report)."""
    import sys
    server = sys.modules.get("server")   # ComfyUI's own module, imported by main.py; never imported here
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None:
        return False
    instance.send_sync(event, payload)
    return True


class RunReport:
    """What one sampling run of a patched model did, for the log (one compact block) and the node in the
    browser (`as_payload`): the patch (`patch`, a PatchReport), the backends that ran and the head groups
    (`qkv_core.Tally`), the fallbacks (the runtime's notices), the reference caches, the peak VRAM beside
    the planner's estimates (`plan`, nodes/planner.py), and how the run ended."""

    def __init__(self, family: str, settings: str, patch: PatchReport):
        self.family, self.settings, self.patch = family, settings, patch
        self.kernels: dict = {}
        self.splits: dict = {}
        self.fallbacks: list[str] = []
        self.notes: list[str] = []   # what ran ComfyUI's own by design (short sequences of some families)
        self.caches: list[dict] = []
        self.plan = None          # planner.Plan for the run's shapes, or None
        self.level = None         # the level the run used (a key of the plan's levels)
        self.peak_bytes = None    # CUDA allocator peak during the run (None without CUDA)
        self.ended = "finished"

    @property
    def estimate_bytes(self):
        return None if self.plan is None or self.level is None else self.plan.bytes_at(self.level)

    @property
    def stock_estimate_bytes(self):
        """The peak a stock run would have reached: the measured peak with the pack's estimated working set
        swapped for ComfyUI's (weights, latents and everything else are the same in both)."""
        if self.peak_bytes is None or self.plan is None or self.level is None:
            return None
        return max(self.peak_bytes, self.peak_bytes - self.estimate_bytes + self.plan.stock_bytes)

    def lines(self, notices_logged: bool = False) -> list[str]:
        """The report as text; `notices_logged`: the fallbacks and notes were logged as they happened (the log
        block then counts them instead of repeating them)."""
        out = [f"{self.family} ({self.settings}), run {self.ended}"]
        out += self.patch.lines()   # "Wan: 40 self_attn patched", "...: <path> runs as before: <reason>"
        if self.kernels:
            out.append("attention: " + ", ".join(f"{name} x{calls}" for name, calls in self.kernels.items()))
        else:
            out.append("attention: no call went through the pack")
        if self.splits:
            out.append("head groups: " + ", ".join(f"{groups} (x{calls})" for groups, calls in self.splits.items()))
        if notices_logged:
            out.append(f"fallbacks: {len(self.fallbacks) or 'none'}, notes: {len(self.notes) or 'none'} "
                       f"(each logged above when it happened)")
        else:
            out += [f"fallback: {line}" for line in self.fallbacks] or ["fallbacks: none"]
            out += [f"note: {line}" for line in self.notes]
        for cache in self.caches:
            out.append(f"reference cache: {size(cache['bytes'])} {cache['format']} in {cache['storage']}"
                       f" ({cache['entries']} conditioning(s))"
                       + (f"; not used: {'; '.join(cache['refused'])}" if cache["refused"] else ""))
        if self.peak_bytes is None:
            out.append("peak VRAM: not measured (no CUDA device)")
        else:
            stock = self.stock_estimate_bytes
            out.append(f"peak VRAM {size(self.peak_bytes)}"
                       + ("" if stock is None else f"; stock ComfyUI would need about {size(stock)}"))
        if self.plan is not None and self.level is not None:
            out.append(f"working set of the largest block (estimate): {size(self.estimate_bytes)} at "
                       f"{self.level}, stock {size(self.plan.stock_bytes)}")
        return out

    def as_payload(self) -> dict:
        return {"family": self.family, "settings": self.settings, "ended": self.ended, "lines": self.lines(),
                "backends": self.kernels, "head_groups": {str(k): v for k, v in self.splits.items()},
                "fallbacks": list(self.fallbacks), "notes": list(self.notes), "reference_caches": list(self.caches),
                "peak_bytes": self.peak_bytes, "stock_estimate_bytes": self.stock_estimate_bytes,
                "estimate_bytes": self.estimate_bytes, "level": self.level,
                "plan": None if self.plan is None else self.plan.as_dict()}

    def log(self) -> None:
        logger.info("[QKV] run report:\n%s", "\n".join(f"  {line}" for line in self.lines(notices_logged=True)))
