"""Every family's measured constants, in one table: the memory factors ComfyUI's estimate is scaled by, the
working sets the planner estimates with, the split floor's scale and whether calls under that floor run
ComfyUI's own forwards. Each row says where its numbers were measured (a section of docs/benchmarks.md); each
family's `Family` holds its row (`Family.measured`; `Family.configure` puts the split policy's fields in a call's
configuration), and `family.py`'s `check_measured` checks every field.

Adding a family: its row here, keyed by its module's name under `nodes/families/` (the registry's `module`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

BENCHMARKS = "docs/benchmarks.md"


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
#: Wan's block at every level, within 15% of every weight format's measurement (docs/benchmarks.md#planner).
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
    # Older ComfyUI releases whose own block peaks elsewhere: ((the first release measured at `stock`, the peak
    # before it), ...), oldest first (v0.3.64 rotated q and k in float32 copies, so its blocks peak higher)
    stock_before: tuple = ()

    def stock_on(self, release: Optional[tuple] = None) -> float:
        """ComfyUI's own block's peak on ComfyUI `release` (a tuple of ints, `comfy_release()`; None: the
        newest)."""
        for first, peak in self.stock_before:
            if release is not None and tuple(release) < tuple(first):
                return peak
        return self.stock

    def bounded(self, groups: int, share: float = 1.0) -> float:
        """The pack's block in `groups` head groups, each holding `share` of a plain SDPA group's transients
        (`SplitPlan.share`)."""
        return self.bounded_whole + self.per_group * share / max(1, groups)


# The working sets' common ground (each row adds its family's own proportions and the test that holds it).
CPU_BLOCK = "CPU MemTracker, bf16, 12,288 tokens x width 512, 16 heads"
# How the factors of every family but Wan were found (docs/benchmarks.md#family-models): A, P the allocator's
# peaks above weights and inputs (stock, pack), E ComfyUI's estimate; a factor >= 1 - (A - P) / E never plans for
# less than the patched run uses.
WHOLE_MODEL = ("whole model, one call of cond + uncond on an H200 (ComfyUI v0.33.0, benchmarks/family_models.py): "
               "factor >= 1 - (A - P) / E; ")


@dataclasses.dataclass(frozen=True)
class Measured:
    """One family's measured constants, each with where it was measured (`docs/benchmarks.md#<anchor>`).

    `memory_factors`: the share of ComfyUI's activation estimate a patched run needs (`MemoryFactors`, from
    whole models: `memory_where`). `working_sets`: block kind -> `WorkingSet`, the planner's estimate of a block's
    peak (CPU MemTracker: `working_sets_where`). `split_floor_scale`: the family's split floor as a multiple of the
    runtime's (`Family.configure`), where its split forwards are bound by the host's launches on shorter
    sequences; `short_runs_stock`: calls whose sequences are all under that floor run ComfyUI's own forwards
    (`compat.guard_module`; the planner then counts stock's peak there): both measured where `floor_where` says.
    `group_scale`: the level's target count of head groups times this (`SplitPolicy.group_scale`): above 1 for a
    family whose attention is wider than its hidden state (the output buffer of every head then takes more of the
    level's peak, each group must hold less), under 1 for one whose split calls are bound by the host's launches
    and whose fewer groups still hold the level's peak (measured where `working_sets_where` says)."""

    memory_factors: MemoryFactors
    working_sets: dict
    split_floor_scale: float = 1
    short_runs_stock: bool = False
    group_scale: float = 1
    memory_where: str = f"{BENCHMARKS}#family-models"
    working_sets_where: str = f"{BENCHMARKS}#planner"
    floor_where: str = f"{BENCHMARKS}#split-floors"

    def anchors(self) -> tuple:
        """Every `docs/benchmarks.md#anchor` the row cites."""
        return self.memory_where, self.working_sets_where, self.floor_where


def whole_model(split: float, unsplit: float, found: str) -> MemoryFactors:
    """Factors set from whole models (`WHOLE_MODEL`): `found`, the factors each one needed."""
    return MemoryFactors(split=split, unsplit=unsplit, measured=WHOLE_MODEL + found)


def cpu_block(stock: float, bounded_whole: float, where: str, setup: str = CPU_BLOCK,
              stock_before: tuple = ()) -> WorkingSet:
    """A working set measured on the CPU (`CPU_BLOCK`), held by the test `where` names; `stock_before`, ComfyUI's
    own block's peak on older releases (`WorkingSet.stock_before`)."""
    return WorkingSet(stock=stock, bounded_whole=bounded_whole, measured=f"{setup}; {where}",
                      stock_before=stock_before)


# The releases the working sets were measured on: ComfyUI v0.33.0 and v0.8.0 for `stock`; v0.3.64 for the peaks of
# `stock_before`, taken for every release before v0.8.0 (none between was measured)
V0_8 = (0, 8, 0)


TABLE = {
    # Factors from whole Wan 14B runs through ComfyUI's model management (docs/benchmarks.md#memory-estimate):
    # ComfyUI fills the card with weights up to its estimate, so a patched run peaks no higher than stock only if
    # factor >= 1 - (1 - r) * A / E, r the pack's share of stock's real activation memory (the whole model's, not a
    # block's), A / E stock's real use over ComfyUI's estimate.
    # Split only from 2x the runtime's floor (16,384 tokens an item): a split Wan 14B block costs the host about the
    # same whatever the length, and its GPU work takes longer than that only from about there
    # (docs/benchmarks.md#split-floors).
    "wan": Measured(
        MemoryFactors(split=0.6, unsplit=0.9, measured="whole Wan 14B, H200, ComfyUI v0.8.0 and v0.33.0"),
        {"block": cpu_block(9.0, 1.99, "tests/test_wan_memory.py (bf16, fp8, fp8-scaled, GGUF: 9.0-9.7 -> 1.96-2.45)")},
        split_floor_scale=2, memory_where=f"{BENCHMARKS}#memory-estimate"),
    # Split only from 1.5x the runtime's floor (12,288 tokens an item): under it the split blocks are bound by the
    # host's launches, for little memory saved (docs/benchmarks.md#split-floors); whole, the pack's blocks still
    # hold well under half of stock's peak (docs/benchmarks.md#families).
    "flux": Measured(
        whole_model(0.8, 0.85, "Flux-dev 2048^2 0.74 and HunyuanVideo 720p x 129 0.56 split, Flux-dev 1024^2 0.78 "
                               "unsplit"),
        {"double": cpu_block(10.06, 2.11, "tests/test_flux_blocks.py", stock_before=((V0_8, 17.36),)),
         "single": cpu_block(14.06, 2.04, "tests/test_flux_blocks.py", stock_before=((V0_8, 19.0),))},
        split_floor_scale=1.5),
    # Split only from 2x the runtime's floor (16,384 tokens an item): a split Lumina 2 is bound by the host's
    # launches below it (docs/benchmarks.md#split-floors); under it ComfyUI's own forwards run.
    "lumina": Measured(
        whole_model(0.7, 1.0, "Lumina 2 2048^2 0.38 split (Z-Image not measured: 0.7 leaves it room); unsplit: "
                              "ComfyUI's own blocks run"),
        {"lumina2": cpu_block(18.0, 1.95, "tests/test_lumina_memory.py", stock_before=((V0_8, 66.0),)),
         "zimage": cpu_block(14.0, 2.04, "tests/test_lumina_memory.py")},
        split_floor_scale=2, short_runs_stock=True),
    # Split only from 1.5x the runtime's floor (12,288 tokens an item), as Flux: shorter calls (a 1 MP image with a
    # 1 MP reference) run slower split than whole (docs/benchmarks.md#split-floors).
    "qwen_image": Measured(
        whole_model(0.8, 0.8, "Qwen-Image 1328^2 0.76 unsplit; the split runs take the unsplit factor (no split run "
                              "measured)"),
        {"block": cpu_block(10.15, 2.11, "tests/test_qwen_image_memory.py", stock_before=((V0_8, 14.08),))},
        split_floor_scale=1.5),
    # The runtime's own floor: a whole Kandinsky 5 Video Lite split just above it is not slower than stock
    # (docs/benchmarks.md#split-floors).
    "kandinsky5": Measured(
        whole_model(0.9, 1.0, "Kandinsky 5 lite 768x512 x 61 0.88 split (unsplit not measured)"),
        {"block": cpu_block(9.10, 2.04, "tests/test_kandinsky5_adapter.py")}),
    # Split only from 3x the runtime's floor (24,576 tokens an item): LTX's split attention (an RMSNorm over all
    # heads, so a statistics pass; the RoPE table sliced per group) launches enough small kernels that the host
    # bounds it on shorter sequences: its launches cost the same at any length (docs/benchmarks.md#split-floors).
    # Under the floor ComfyUI's own forwards run.
    "ltx": Measured(
        whole_model(0.8, 1.0, "LTX-Video 2B 1216x704 x 121 0.72 split; unsplit: ComfyUI's own blocks run (short "
                              "sequences)"),
        {"block": cpu_block(10.5, 2.24, "tests/test_ltx_memory.py (stock 11.0 on v0.33, 10.0 on v0.8.0)")},
        split_floor_scale=3, short_runs_stock=True),
    # Split only from 2x the runtime's floor (16,384 tokens an item): a split SD3.5 Large costs the host about the
    # same a model call whatever the length (docs/benchmarks.md#split-floors); under it ComfyUI's own forwards run.
    "sd3": Measured(
        whole_model(0.6, 1.0, "SD3.5 Large 2048^2 0.39 split (Medium not measured); unsplit: ComfyUI's own blocks "
                              "run"),
        {"joint": cpu_block(19.21, 2.11, "tests/test_sd3_memory.py (SD3.5 Large)"),
         "joint_self_attention": cpu_block(27.21, 3.06, "tests/test_sd3_memory.py (SD3.5 Medium: x's second "
                                                        "attention)")},
        split_floor_scale=2, short_runs_stock=True),
    # Split only from 3.5x the runtime's floor (28,672 tokens an item): a split Cosmos predict2 2B costs the host
    # about the same a model call whatever the length (docs/benchmarks.md#split-floors).
    "cosmos": Measured(
        whole_model(0.65, 0.7, "Cosmos predict2 2B 1280x704 x 93 0.55 split, x 9 and x 21 (10,560 and 21,120 "
                               "tokens) 0.64 unsplit"),
        {"block": cpu_block(12.3, 2.04, "tests/test_cosmos_memory.py (stock 11.08 on v0.33, 14.00 on v0.8.0)")},
        split_floor_scale=3.5),
    # ComfyUI's own estimate: the whole model needed nearly all of it, not enough saved to plan with less
    # (docs/benchmarks.md#family-models). Half the level's head groups (High: 10 of its 20 heads' groups): its split
    # blocks are bound by the host's launches, and with a tenth of the groups' keys kept by the statistics pass
    # (`hidream.BLOCK_KEPT_KEYS`) 10 groups still hold the level's peak (docs/benchmarks.md#families).
    "hidream": Measured(
        whole_model(1.0, 1.0, "HiDream-I1 1024^2 0.97 unsplit (split not measured)"),
        {"block": cpu_block(15.35, 2.15, "tests/test_hidream_adapter.py (double block: 2.46 x |x| at 8 groups, the "
                                         "split attention's peak; its bounded mixture of experts 2.25 x |x| with "
                                         "the output)", setup=f"{CPU_BLOCK}, 4 experts")},
        group_scale=0.5),
    # Twice the level's head groups: its attention (56 heads of 128) is 1.33x its hidden width (5376), so the
    # output buffer of every head and the modulated input held beside it take 2.33 |x|, and High's own groups put
    # the block over the level's peak (docs/benchmarks.md#families). ComfyUI's own estimate: it is already under
    # what the pack's run uses, so less would plan for less than the run needs (docs/benchmarks.md#minimax-model).
    "minimax": Measured(
        whole_model(1.0, 1.0, "H3 (4 of its 50 blocks) 1344x768 x 124 / 260 / 362: ComfyUI's estimate 0.66 / 1.38 / "
                              "1.92 GiB, stock's call 4.59 / 9.53 / 13.23, the pack's 1.91 / 3.98 / 5.52: the estimate "
                              "is under the pack's use already"),
        {"block": cpu_block(10.0, 2.04, "tests/test_minimax_adapter.py (16 groups: 2.19 x |x|)")},
        group_scale=2),
    # The runtime's own floor. Not measured on a whole model: ComfyUI's own estimate.
    "mochi": Measured(
        whole_model(1.0, 1.0, "Mochi: not measured on a whole model; ComfyUI's own estimate"),
        {"block": cpu_block(15.0, 2.10, "tests/test_mochi_adapter.py (16 groups: 2.25 x |x|; its feed-forward 4x "
                                        "the width, as Mochi 1's)")}),
    # The runtime's own floor. Not measured on a whole model: ComfyUI's own estimate.
    "cogvideox": Measured(
        whole_model(1.0, 1.0, "CogVideoX: not measured on a whole model; ComfyUI's own estimate"),
        {"block": cpu_block(18.3, 2.34, "tests/test_cogvideox_adapter.py (16 groups: 2.48-2.49 x |x| at 12,288 and "
                                        "16,384 tokens, with RoPE)")}),
}


__all__ = ["MemoryFactors", "WorkingSet", "PER_GROUP", "Measured", "TABLE", "BENCHMARKS", "V0_8"]
