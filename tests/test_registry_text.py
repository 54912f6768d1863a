"""The texts users read name every family the registry adapts (`nodes/families/__init__.py`, `FAMILIES`):
pyproject.toml's description (ComfyUI Manager shows it), the README's family table and the patch node's
description. A family added to the registry and not to these fails here."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from support import comfy_env

pytestmark = pytest.mark.comfyui

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def families():
    return importlib.import_module(comfy_env.pack_modules().pack.__name__ + ".nodes.families")


def _base_name(display_name: str) -> str:
    """"Flux (1, 2, Chroma)" -> "Flux"; "Lumina 2 / Z-Image" -> "Lumina 2"."""
    return re.split(r" \(| /", display_name)[0]


def test_pyproject_description_names_every_family(families):
    text = (REPO / "pyproject.toml").read_text()
    description = re.search(r'^description = "(.*)"$', text, re.M).group(1)
    missing = [name for name in families.display_names() if name not in description]
    assert not missing, f"pyproject.toml's description lacks {missing}"


def test_readme_family_table_names_every_family(families):
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Families", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    missing = [name for name in families.display_names() if not any(_base_name(name) in row for row in rows)]
    assert not missing, f"the README's family table lacks {missing}"


def test_the_patch_node_describes_every_family(families):
    patch_node = importlib.import_module(families.__name__.rsplit(".", 2)[0] + ".nodes.patch_node")
    text = " ".join(str(v) for v in vars(patch_node).values() if isinstance(v, str))
    text += " ".join(str(getattr(cls, "DESCRIPTION", "")) for cls in vars(patch_node).values() if isinstance(cls, type))
    missing = [name for name in families.display_names() if name not in text]
    assert not missing, f"the patch node's description lacks {missing}"
