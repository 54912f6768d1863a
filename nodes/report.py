"""What a patch did and why not: logged once when the node runs, and again (with the runtime's fallback
notices and the measured peak) after each sampling run."""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Optional

from ..qkv_core.notices import FALLBACK, SKIPPED, Notice

logger = logging.getLogger("ComfyUI-QKV")


class PatchReport:
    def __init__(self):
        self.patched_counts: Counter = Counter()          # (family, what) -> modules
        self.skips: list[Notice] = []                     # one `SKIPPED` notice a module left as it was
        self.notes: list[str] = []

    def patched(self, family: str, what: str, path: str) -> None:
        self.patched_counts[(family, what)] += 1

    def skipped(self, family: str, path: str, reason: str) -> None:
        self.skips.append(Notice(SKIPPED, path, reason, f"{family}: {path} runs as before: {reason}", family))

    @property
    def skipped_reasons(self) -> "OrderedDict[tuple, list]":
        """(family, reason) -> the paths skipped for it, in the order first seen."""
        grouped: "OrderedDict[tuple, list]" = OrderedDict()
        for skip in self.skips:
            grouped.setdefault((skip.family, skip.reason), []).append(skip.subject)
        return grouped

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


# How much of the pack's saving a run had (`RunReport.saving`; web/qkv_bar.js draws each its own way)
FULL, PARTIAL, NONE = "full", "partial", "none"

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
    (`qkv_core.Tally`), the fallbacks and notes (the runtime's `Notice`s), the reference caches, the peak VRAM beside
    the planner's estimates (`plan`, nodes/planner.py), and how the run ended.

    A run in which a patched module ran ComfyUI's own forward (a failed self-check, gradients on, another
    node's hook: a `FALLBACK` notice) did not have the pack's saving there: the report's first line says so, what ran
    ComfyUI's own and why (`headline`), `saving` tells the browser (no bar drawn as a saving), and the peak is
    not set against a stock estimate (it is stock's, or part of it is)."""

    def __init__(self, family: str, settings: str, patch: PatchReport):
        self.family, self.settings, self.patch = family, settings, patch
        self.kernels: dict = {}
        self.splits: dict = {}
        self.fallbacks: list[Notice] = []   # every notice not by design (a module on ComfyUI's forward, a backend
        self.notes: list[Notice] = []       # passed over...); notes: chosen (short sequences, auto's choices)
        self.caches: list[dict] = []
        self.plan = None          # planner.Plan for the run's shapes, or None
        self.level = None         # the level the run used (a key of the plan's levels)
        self.peak_bytes = None    # CUDA allocator peak during the run (None without CUDA)
        self.ended = "finished"
        self.estimate = None      # (factor, why): the memory estimate the run started with (patching.memory_factor)
        self.estimate_restored = False   # ComfyUI's own estimate put back during the run (a module ran stock)

    @property
    def ran_stock(self) -> list[tuple[str, str]]:
        """(what, why) of each kind of module that ran ComfyUI's own forward in this run, in order, once each."""
        return list(dict.fromkeys((notice.subject, notice.reason) for notice in self.fallbacks
                                  if notice.kind == FALLBACK))

    @property
    def saving(self) -> str:
        """`FULL`: every patched module ran the pack's forward (or was meant not to); `NONE`: some ran ComfyUI's
        own and no attention call went through the pack; `PARTIAL`: some ran ComfyUI's own, others the pack's."""
        if not self.ran_stock:
            return FULL
        return PARTIAL if self.kernels else NONE

    def headline(self) -> Optional[str]:
        """The report's first line when the run lacked some or all of the saving (None otherwise): what ran
        ComfyUI's own forward and why; for a part, how many attention calls still went through the pack."""
        saving = self.saving
        if saving == FULL:
            return None
        what = "; ".join(f"{name} ran as ComfyUI's own ({reason})" for name, reason in self.ran_stock)
        if saving == NONE:
            return f"No saving this run: {what}"
        calls = sum(self.kernels.values())
        return f"Part of the saving this run: {what}; the rest ran the pack's ({calls} attention calls)"

    def _estimate_line(self) -> Optional[str]:
        if self.estimate is None:
            return None
        factor, why = self.estimate
        if self.estimate_restored:
            return (f"memory estimate: x{factor:.2f} at the start ({why}), ComfyUI's own from the first module "
                    f"that ran ComfyUI's forward on")
        if factor == 1.0:
            return f"memory estimate: ComfyUI's own ({why})"
        return f"memory estimate: x{factor:.2f} ({why})"

    @property
    def estimate_bytes(self):
        return None if self.plan is None or self.level is None else self.plan.bytes_at(self.level)

    @property
    def stock_estimate_bytes(self):
        """The peak a stock run would have reached: the measured peak with the pack's estimated working set
        swapped for ComfyUI's (weights, latents and everything else are the same in both). None where modules
        ran ComfyUI's own forward (the peak is then stock's, or partly)."""
        if self.peak_bytes is None or self.plan is None or self.level is None or self.saving != FULL:
            return None
        return max(self.peak_bytes, self.peak_bytes - self.estimate_bytes + self.plan.stock_bytes)

    def lines(self, notices_logged: bool = False) -> list[str]:
        """The report as text; `notices_logged`: the fallbacks and notes were logged as they happened (the log
        block then counts them instead of repeating them)."""
        headline = self.headline()
        out = [] if headline is None else [headline]
        out.append(f"{self.family} ({self.settings}), run {self.ended}")
        if headline is not None and self._estimate_line():
            out.append(self._estimate_line())
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
                       + ("" if stock is None else f"; stock ComfyUI would need about {size(stock)}")
                       + ("" if headline is None else " (with ComfyUI's own forwards where the first line says)"))
        if self.plan is not None and self.level is not None:
            out.append(f"working set of the largest block (estimate): {size(self.estimate_bytes)} at "
                       f"{self.level}, stock {size(self.plan.stock_bytes)}"
                       + ("" if headline is None else " (the pack's forwards; not all of this run's were)"))
        return out

    def as_payload(self) -> dict:
        return {"family": self.family, "settings": self.settings, "ended": self.ended, "lines": self.lines(),
                "saving": self.saving, "headline": self.headline(),
                "ran_stock": [{"what": what, "reason": reason} for what, reason in self.ran_stock],
                "memory_estimate": None if self.estimate is None else
                {"factor": self.estimate[0], "why": self.estimate[1], "restored": self.estimate_restored},
                "backends": self.kernels, "head_groups": {str(k): v for k, v in self.splits.items()},
                "fallbacks": [str(notice) for notice in self.fallbacks],
                "notes": [str(notice) for notice in self.notes],
                "notices": [{"kind": notice.kind, "subject": notice.subject, "reason": notice.reason}
                            for notice in self.fallbacks + self.notes],
                "reference_caches": list(self.caches),
                "peak_bytes": self.peak_bytes, "stock_estimate_bytes": self.stock_estimate_bytes,
                "estimate_bytes": self.estimate_bytes, "level": self.level,
                "plan": None if self.plan is None else self.plan.as_dict()}

    def log(self) -> None:
        logger.info("[QKV] run report:\n%s", "\n".join(f"  {line}" for line in self.lines(notices_logged=True)))
