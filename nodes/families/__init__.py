"""The model families the pack adapts: one module each (`nodes/families/<module>.py`, the adapter contract of
`family.py`), and THE registry of them. The registry feeds the patch loop (`nodes/patching.py` tries the
adapters in its order: the first that matches a model patches it), the patch node's description
(`nodes/patch_node.py`) and the contract test's cases (`tests/family_cases.py` has one case per registered
family; `tests/test_family_contract.py` checks that it does).

Adding a family: its module here and one row below (plus its measured constants' row in `measured.py`)."""
from __future__ import annotations

from typing import NamedTuple

from . import cogvideox, cosmos, flux, hidream, kandinsky5, ltx, lumina, minimax, mochi, qwen_image, sd3, wan


class Registered(NamedTuple):
    """One adapted family: `module`, its adapter's module name under `nodes/families/`; `adapter`, that module;
    `names`, the models it adapts as the patch node's description names them."""

    module: str
    adapter: object
    names: tuple


# In the order the patch loop tries them.
FAMILIES = (
    Registered("wan", wan, ("Wan",)),
    Registered("flux", flux, ("Flux (1, 2, Chroma)", "HunyuanVideo")),
    Registered("lumina", lumina, ("Lumina 2 / Z-Image",)),
    Registered("qwen_image", qwen_image, ("Qwen-Image",)),
    Registered("kandinsky5", kandinsky5, ("Kandinsky 5",)),
    Registered("ltx", ltx, ("LTX-Video",)),
    Registered("sd3", sd3, ("SD3.5",)),
    Registered("cosmos", cosmos, ("Cosmos",)),
    Registered("hidream", hidream, ("HiDream",)),
    Registered("minimax", minimax, ("MiniMax H3",)),
    Registered("cogvideox", cogvideox, ("CogVideoX",)),
    Registered("mochi", mochi, ("Mochi",)),
)

ADAPTERS = tuple(family.adapter for family in FAMILIES)
MODULES = tuple(family.module for family in FAMILIES)


def display_names() -> list:
    """Every adapted model as the patch node's description names it, in the registry's order."""
    return [name for family in FAMILIES for name in family.names]


__all__ = ["FAMILIES", "ADAPTERS", "MODULES", "Registered", "display_names"]
