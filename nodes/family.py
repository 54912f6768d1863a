"""The contract every model-family adapter meets (`nodes/families/wan.py` is the first), so that `nodes/patching.py`
patches, plans memory for and reports on any family the same way.

An adapter is a module (or any object) with these names; `patching.ADAPTERS` lists them in the order they are
tried, and a model none of them matches gets the kernel-level patch (`nodes/kernel_patch.py`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

from . import compat
from .comfy_ops import not_row_sliceable


@dataclasses.dataclass(frozen=True)
class MemoryFactors:
    """The share of ComfyUI's activation estimate (`memory_usage_factor`) a patched run of the family needs,
    measured on a whole model of it: `split` when the head split runs, `unsplit` when it does not (level Off,
    a short sequence, projections without rows). ComfyUI fills the card with weights up to its estimate, so
    they must hold for the whole model, not a block alone (docs/benchmarks.md, "The memory estimate")."""

    split: float
    unsplit: float
    measured: str   # where the numbers come from


#: What the head groups hold of the q/k/v of every head, in multiples of |x| (divided among the groups): fitted on
#: Wan's block at every level (CPU MemTracker, bf16, 16 heads: Off 4.50, Low 2.78, Medium 2.52, High 2.40 x |x|;
#: with bounded_whole 1.99 the estimates are 4.44, 2.60, 2.30, 2.14, within 15% of every format's measurement:
#: High measured 1.90-1.96 with fp8-scaled weights, 2.40-2.45 with bf16, fp8 and GGUF).
PER_GROUP = 2.45


@dataclasses.dataclass(frozen=True)
class WorkingSet:
    """The peak working set of the family's largest block above its live inputs and weights, in multiples of
    |x| (the block's input activation: batch x tokens x width in the compute dtype), as the planner
    (`nodes/planner.py`) estimates it before a run: ComfyUI's own block (`stock`), and the pack's with block
    bounds, `bounded_whole + per_group / groups` (what stays whole through the attention: the output buffer,
    the modulated input; plus a group's share of q, k and v). Measured with MemTracker on the CPU (bf16, 12,288
    tokens, 16 heads, the family's own proportions: the adapters' memory tests check it within 15%)."""

    stock: float
    bounded_whole: float
    measured: str
    per_group: float = PER_GROUP

    def bounded(self, groups: int) -> float:
        return self.bounded_whole + self.per_group / max(1, groups)


@runtime_checkable
class FamilyAdapter(Protocol):
    FAMILY: str                      # the name the log and the report use ("Wan")
    # The measured constants, the family's row of nodes/families/measured.py (where each was measured is there):
    MEMORY_FACTORS: MemoryFactors
    WORKING_SETS: dict               # block kind -> WorkingSet; the planner takes the largest of the model's
    SPLIT_FLOOR_SCALE: float         # the family's split floor as a multiple of the runtime's (>= 1,
    # `dispatch.family_config`), where its split forwards are bound by the host's launches on shorter sequences
    SHORT_RUNS_STOCK: bool           # calls under that floor run ComfyUI's own forwards (the planner counts stock's)

    def matches(self, diffusion_model) -> bool:
        """True for the family's diffusion models (by structure, not by class name alone)."""

    def patch(self, patcher, config, report) -> None:
        """Object patches on `patcher` (a clone) for `config`; every module patched or skipped goes into
        `report` (skipped: with the reason)."""

    def stock_functions(self, diffusion_model) -> set:
        """ComfyUI's functions the pack's forwards stand in for: the self-check verifies each once per process
        (the memory estimate stays ComfyUI's until they all are)."""

    def tokens_per_item(self, diffusion_model, latent_shape) -> Optional[int]:
        """Tokens of one batch item of the longest attention for a latent of `latent_shape`, or None."""

    def kv_heads(self, diffusion_model) -> Optional[int]:
        """Key/value heads of that attention, or None."""

    def splits_projections(self, diffusion_model) -> Optional[str]:
        """None when its q/k/v can be computed by rows (the head split can run), else why not."""

    def block_kinds(self, diffusion_model) -> Sequence[str]:
        """The keys of `WORKING_SETS` for the blocks this model has."""


def check_adapter(adapter) -> None:
    """A `TypeError` naming what `adapter` lacks of the contract, or a `ValueError` for a measured constant out of
    order (factors, working sets, the split floor's scale, the short-runs flag)."""
    missing = [name for name in ("FAMILY", "MEMORY_FACTORS", "WORKING_SETS", "matches", "patch", "stock_functions",
                                 "tokens_per_item", "kv_heads", "splits_projections", "block_kinds",
                                 "SPLIT_FLOOR_SCALE", "SHORT_RUNS_STOCK")
               if not hasattr(adapter, name)]
    if missing:
        raise TypeError(f"{getattr(adapter, '__name__', adapter)!s} is not a family adapter: it lacks "
                        f"{', '.join(missing)} (see nodes/family.py)")
    factors = adapter.MEMORY_FACTORS
    if not 0 < factors.split <= factors.unsplit <= 1:
        raise ValueError(f"{adapter.FAMILY}: memory factors must be 0 < split <= unsplit <= 1, got {factors}")
    for kind, working_set in adapter.WORKING_SETS.items():
        if not 0 < working_set.bounded(1) <= working_set.stock * 1.5:
            raise ValueError(f"{adapter.FAMILY}: the {kind} block's working set is out of order: {working_set}")
    scale = adapter.SPLIT_FLOOR_SCALE
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 1:
        raise ValueError(f"{adapter.FAMILY}: SPLIT_FLOOR_SCALE must be a number >= 1 (a multiple of the runtime's "
                         f"split floor), got {scale!r}")
    if not isinstance(adapter.SHORT_RUNS_STOCK, bool):
        raise ValueError(f"{adapter.FAMILY}: SHORT_RUNS_STOCK must be True or False, got {adapter.SHORT_RUNS_STOCK!r}")


def unsliceable_projection(module, names: Sequence[str], where: str = "") -> Optional[str]:
    """The adapters' `splits_projections`: why the first of `module`'s projection layers `names` cannot be computed
    by rows (`comfy_ops.not_row_sliceable`), as "<where><name>: <reason>"; None when every one can; "no blocks"
    without a module (a model with no block of the family's)."""
    if module is None:
        return "no blocks"
    for name in names:
        reason = not_row_sliceable(getattr(module, name, None))
        if reason is not None:
            return f"{where}{name}: {reason}"
    return None


def patch_module(patcher, report, family: str, path: str, what: str, make_forward: Callable[[], Callable],
                 probe: Callable[[], Optional[str]], parts=()) -> bool:
    """The patch loop's one step, the same for every family: an object patch of `<path>.forward` on `patcher`
    (a clone) with `make_forward()`, unless another node patched that forward (its patch is kept), or one of
    the module's `parts` the pack's forward computes itself (kept; the module then runs as ComfyUI's and
    calls them), or `probe()` finds the module is not what the pack's forward expects. Every outcome goes
    into `report`; True when patched."""
    def foreign(key: str) -> bool:
        return key in patcher.object_patches and not compat.is_ours(patcher.object_patches[key])

    foreign_parts = [name for name in parts if foreign(f"{path}.{name}.forward")]
    if foreign(f"{path}.forward"):
        reason = "another node patched it (its patch is kept)"
    elif foreign_parts:
        reason = f"another node patched its {', '.join(foreign_parts)} (kept; it runs as ComfyUI's)"
    else:
        reason = probe()
    if reason is not None:
        report.skipped(family, f"{path} ({what})" if what == "block" else path, reason)
        return False
    patcher.add_object_patch(f"{path}.forward", make_forward())
    report.patched(family, what, path)
    return True
