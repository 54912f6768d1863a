"""The model families the pack adapts: one module each (`nodes/families/<module>.py`, the adapter contract of
`family.py`), and THE registry of them: `FAMILIES`, their `Family` objects (each module's `SPEC`: its name, the
models it adapts as the node names them, its measured row). The registry feeds the patch loop (`nodes/patching.py`
tries the adapters in its order: the first that matches a model patches it), the patch node's description
(`nodes/patch_node.py`), the texts `tests/test_registry_text.py` holds to it and the contract test's cases
(`tests/support/family_cases.py` has one case per registered family; `tests/test_family_contract.py` checks that
it does).

Adding a family: its module here, one line below and its measured row in `measured.py` (docs/design.md §3.2 lists every file it takes)."""
from __future__ import annotations

from . import cogvideox, cosmos, flux, hidream, kandinsky5, ltx, lumina, minimax, mochi, qwen_image, sd3, wan
from .family import Family

# In the order the patch loop tries them.
FAMILIES = (
    wan.SPEC,
    flux.SPEC,
    lumina.SPEC,
    qwen_image.SPEC,
    kandinsky5.SPEC,
    ltx.SPEC,
    sd3.SPEC,
    cosmos.SPEC,
    hidream.SPEC,
    minimax.SPEC,
    cogvideox.SPEC,
    mochi.SPEC,
)

ADAPTERS = tuple(family.adapter for family in FAMILIES)
MODULES = tuple(family.module for family in FAMILIES)


def display_names() -> list:
    """Every adapted model as the patch node's description names it, in the registry's order."""
    return [name for family in FAMILIES for name in family.names]


__all__ = ["FAMILIES", "ADAPTERS", "MODULES", "Family", "display_names"]
