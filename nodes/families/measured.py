"""Every family's measured constants, in one table: the memory factors ComfyUI's estimate is scaled by, the
working sets the planner estimates with, the split floor's scale and whether calls under that floor run
ComfyUI's own forwards. Each row says where its numbers were measured (a section of docs/benchmarks.md); each
adapter reads its row (`constants`), and `nodes/family.py`'s `check_adapter` checks every field.

Adding a family: its row here, keyed by its module's name under `nodes/families/` (the registry's `module`)."""
from __future__ import annotations

import dataclasses

from ..family import MemoryFactors, WorkingSet

BENCHMARKS = "docs/benchmarks.md"
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
    runtime's (`dispatch.family_config`), where its split forwards are bound by the host's launches on shorter
    sequences; `short_runs_stock`: calls whose sequences are all under that floor run ComfyUI's own forwards
    (`compat.guard_module`; the planner then counts stock's peak there): both measured where `floor_where` says."""

    memory_factors: MemoryFactors
    working_sets: dict
    split_floor_scale: float = 1
    short_runs_stock: bool = False
    memory_where: str = f"{BENCHMARKS}#family-models"
    working_sets_where: str = f"{BENCHMARKS}#planner"
    floor_where: str = f"{BENCHMARKS}#split-floors"

    def constants(self) -> tuple:
        """(MEMORY_FACTORS, WORKING_SETS, SPLIT_FLOOR_SCALE, SHORT_RUNS_STOCK): the adapter contract's names."""
        return self.memory_factors, self.working_sets, self.split_floor_scale, self.short_runs_stock

    def anchors(self) -> tuple:
        """Every `docs/benchmarks.md#anchor` the row cites."""
        return self.memory_where, self.working_sets_where, self.floor_where


TABLE = {
    # Measured on an H200 (v0.8.0, a whole Wan 14B at 720p x 81, cfg 5, planned for 16 and 24 GB cards; and on
    # v0.33.0 in every weight format, where each patched run stayed under its card). ComfyUI fills the card with
    # weights up to its estimate, so a patched run peaks no higher than stock only if factor >= 1 - (1 - r) * A / E,
    # r the pack's share of stock's real activation memory, A / E stock's real use over ComfyUI's estimate: A / E =
    # 0.93, r = 0.55 with the head split running (a block alone: 0.30-0.33, the rest is the model around the blocks
    # and ComfyUI's weight streaming), r = 0.84 without it.
    # Split only from 2x the runtime's floor (16,384 tokens an item): a split Wan 14B block costs the host about
    # 33-36 ms whatever the length (20 groups at High, each with its share of the statistics pass), which its GPU
    # work passes near 17,000 tokens on an H200 (10,920 tokens: 33 ms split against stock's 17; 14,040 (480p x 33
    # frames): 35 against 25, 23 whole; 17,160: 36 against 35; 32,760: 77 against 100).
    "wan": Measured(
        memory_factors=MemoryFactors(split=0.6, unsplit=0.9,
                                     measured="whole Wan 14B, H200, ComfyUI v0.8.0 and v0.33.0"),
        working_sets={"block": WorkingSet(stock=9.0, bounded_whole=1.99, measured=f"{CPU_BLOCK}; tests/test_wan_memory.py (bf16, fp8, fp8-scaled, GGUF: 9.0-9.7 -> 1.96-2.45)")},
        split_floor_scale=2, memory_where=f"{BENCHMARKS}#memory-estimate"),
    # Split only from 1.5x the runtime's floor (12,288 tokens an item): under it the split blocks are bound by the
    # host's launches on an H200 (double / single block, 8,704 tokens: 1.21 / 1.39x stock's time split, 0.80 / 0.84x
    # whole; 12,800: 1.11 / 0.94x split; 14,848: 0.88 / 0.82x), for a saving of under 0.2 GiB a call there. Whole,
    # the pack's blocks still hold about 4.2-4.6 x |x| against stock's 10-13.
    "flux": Measured(
        memory_factors=MemoryFactors(split=0.8, unsplit=0.85, measured=f"{WHOLE_MODEL}Flux-dev 2048^2 0.74 and HunyuanVideo 720p x 129 0.56 split, Flux-dev 1024^2 0.78 unsplit"),
        working_sets={"double": WorkingSet(stock=10.06, bounded_whole=2.11, measured=f"{CPU_BLOCK}; tests/test_flux_blocks.py"),
                      "single": WorkingSet(stock=14.06, bounded_whole=2.04, measured=f"{CPU_BLOCK}; tests/test_flux_blocks.py")},
        split_floor_scale=1.5),
    # Split only from 2x the runtime's floor (16,384 tokens an item): a split Lumina 2 is bound by the host's
    # launches below it (whole model on an H200, cond + uncond: 1536^2 (9,472 tokens) 311 ms stock, 596 split;
    # 2048^2 (16,640) 0.98x stock's time); under it ComfyUI's own forwards run.
    "lumina": Measured(
        memory_factors=MemoryFactors(split=0.7, unsplit=1.0, measured=f"{WHOLE_MODEL}Lumina 2 2048^2 0.38 split (Z-Image not measured: 0.7 leaves it room); unsplit: ComfyUI's own blocks run"),
        working_sets={"lumina2": WorkingSet(stock=18.0, bounded_whole=1.95, measured=f"{CPU_BLOCK}; tests/test_lumina_memory.py"),
                      "zimage": WorkingSet(stock=14.0, bounded_whole=2.04, measured=f"{CPU_BLOCK}; tests/test_lumina_memory.py")},
        split_floor_scale=2, short_runs_stock=True),
    # Split only from 1.5x the runtime's floor (12,288 tokens an item), as Flux: a Qwen-Image-Edit call of a 1 MP
    # image and a 1 MP reference (8,537 tokens) took 1.24x stock's time split on an H200 (one item; 1.00x with cond +
    # uncond), 0.85x whole; from 12,100 image tokens on the split is 0.84-0.99x.
    "qwen_image": Measured(
        memory_factors=MemoryFactors(split=0.8, unsplit=0.8, measured=f"{WHOLE_MODEL}Qwen-Image 1328^2 0.76 unsplit; the split runs take the unsplit factor (no split run measured)"),
        working_sets={"block": WorkingSet(stock=10.15, bounded_whole=2.11, measured=f"{CPU_BLOCK}; tests/test_qwen_image_memory.py")},
        split_floor_scale=1.5),
    # The runtime's own floor: a whole Kandinsky 5 Video Lite split at 10,752 tokens an item ran 0.95x stock's time.
    "kandinsky5": Measured(
        memory_factors=MemoryFactors(split=0.9, unsplit=1.0, measured=f"{WHOLE_MODEL}Kandinsky 5 lite 768x512 x 61 0.88 split (unsplit not measured)"),
        working_sets={"block": WorkingSet(stock=9.10, bounded_whole=2.04, measured=f"{CPU_BLOCK}; tests/test_kandinsky5_adapter.py")}),
    # Split only from 3x the runtime's floor (24,576 tokens an item): LTX's split attention (an RMSNorm over all
    # heads, so a statistics pass; the RoPE table sliced per group) launches enough small kernels that the host
    # bounds it on shorter sequences. Whole LTX-Video 2B on an H200, cond + uncond: 13,376 tokens an item 449 ms
    # stock, 1,272 ms split (its launches, ~1.3 s, are the same at any length); 27,588 tokens 1,490 ms stock,
    # 1,500 ms split. Under the floor ComfyUI's own forwards run.
    "ltx": Measured(
        memory_factors=MemoryFactors(split=0.8, unsplit=1.0, measured=f"{WHOLE_MODEL}LTX-Video 2B 1216x704 x 121 0.72 split; unsplit: ComfyUI's own blocks run (short sequences)"),
        working_sets={"block": WorkingSet(stock=10.5, bounded_whole=2.24, measured=f"{CPU_BLOCK}; tests/test_ltx_memory.py (stock 11.0 on v0.33, 10.0 on v0.8.0)")},
        split_floor_scale=3, short_runs_stock=True),
    # Split only from 2x the runtime's floor (16,384 tokens an item): a split SD3.5 Large costs the host about 1.1 s
    # a model call (whole model on an H200, cond + uncond: 1536^2 (9,370 tokens) 495 ms stock, 1,101 split; 1792^2
    # (12,698) 758 / 1,080; 2048^2 (16,538) 0.96x stock's time); under it ComfyUI's own forwards run.
    "sd3": Measured(
        memory_factors=MemoryFactors(split=0.6, unsplit=1.0, measured=f"{WHOLE_MODEL}SD3.5 Large 2048^2 0.39 split (Medium not measured); unsplit: ComfyUI's own blocks run"),
        working_sets={"joint": WorkingSet(stock=19.21, bounded_whole=2.11, measured=f"{CPU_BLOCK}; tests/test_sd3_memory.py (SD3.5 Large)"),
                      "joint_self_attention": WorkingSet(stock=27.21, bounded_whole=3.06, measured=f"{CPU_BLOCK}; tests/test_sd3_memory.py (SD3.5 Medium: x's second attention)")},
        split_floor_scale=2, short_runs_stock=True),
    # Split only from 3.5x the runtime's floor (28,672 tokens an item): a split Cosmos predict2 2B costs the host
    # about 1 s a model call whatever the length (whole model on an H200, cond + uncond: 10,560 tokens an item 318 ms
    # stock, 1,002 split; 21,120: 917 / 1,279; 31,680: 1,808 / 1,592; 42,240: 3,005 / 2,297).
    "cosmos": Measured(
        memory_factors=MemoryFactors(split=0.65, unsplit=0.7, measured=f"{WHOLE_MODEL}Cosmos predict2 2B 1280x704 x 93 0.55 split, x 9 and x 21 (10,560 and 21,120 tokens) 0.64 unsplit"),
        working_sets={"block": WorkingSet(stock=12.3, bounded_whole=2.04, measured=f"{CPU_BLOCK}; tests/test_cosmos_memory.py (stock 11.08 on v0.33, 14.00 on v0.8.0)")},
        split_floor_scale=3.5),
    # ComfyUI's own estimate: the whole model needed 0.97 of it, not enough saved to plan with less.
    "hidream": Measured(
        memory_factors=MemoryFactors(split=1.0, unsplit=1.0, measured=f"{WHOLE_MODEL}HiDream-I1 1024^2 0.97 unsplit (split not measured)"),
        working_sets={"block": WorkingSet(stock=15.35, bounded_whole=2.30, measured=f"{CPU_BLOCK}, 4 experts; tests/test_hidream_adapter.py (double block: 2.45 x |x| at 16 groups, the split attention's peak; its bounded mixture of experts 2.25 x |x| with the output)")}),
}


def constants(module: str) -> tuple:
    """The row of the family whose adapter is `nodes/families/<module>.py`, as its contract names:
    `MEMORY_FACTORS, WORKING_SETS, SPLIT_FLOOR_SCALE, SHORT_RUNS_STOCK = measured.constants("wan")`."""
    return TABLE[module].constants()


__all__ = ["Measured", "TABLE", "constants", "BENCHMARKS"]
