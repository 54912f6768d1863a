"""The autograd refusal of every entry point: a `ValueError` naming the fix when a part of the call requires
grad with gradient mode on (docs/design.md §2.1). The pack writes q, k, v and the attention into buffers it
allocates, which autograd cannot differentiate."""
from __future__ import annotations

import functools
from typing import Any

import torch

GRAD_FIX = ("qkv_core is for inference: its head groups write q, k, v and the attention into buffers it "
            "allocates, which autograd cannot differentiate. Run the call under torch.no_grad() or "
            "torch.inference_mode(), or use the model's own attention for training")
_WALK_DEPTH = 3      # how far into a projection's attributes (a RowProjection's layer, a closure's cells) to look
_WALK_ITEMS = 16     # the most items of one list or tuple looked at


def refuse_autograd(entry: str, parts) -> None:
    """A `ValueError` when one of `parts` (name, value pairs: input tensors or the lists holding them, projections,
    norms, prefixes, masks) requires grad: called by every entry point while grad mode is on (its caller tests
    `torch.is_grad_enabled()` first, so inference pays one call). Tensors, `torch.nn.Module` parameters, and what
    a projection object holds (its attributes, a bound method's module, a function's closure, a partial's
    arguments, a few levels deep) are looked at; an opaque callable is not. Nothing is cleared or touched."""
    for name, value in parts:
        if value is not None and _requires_grad(value, _WALK_DEPTH, set()):
            raise ValueError(f"{entry}: {name} requires grad with gradient mode on. {GRAD_FIX}")


def _requires_grad(obj: Any, depth: int, seen: set) -> bool:
    if torch.is_tensor(obj):
        return obj.requires_grad
    if isinstance(obj, (str, bytes, int, float, bool, type)) or id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        return any(p.requires_grad for p in obj.parameters())
    if depth <= 0:
        return False
    if isinstance(obj, (list, tuple)):
        return any(_requires_grad(item, depth - 1, seen) for item in obj[:_WALK_ITEMS])
    if isinstance(obj, dict):
        return any(_requires_grad(item, depth - 1, seen) for item in list(obj.values())[:_WALK_ITEMS])
    inner = getattr(obj, "__self__", None)   # a bound method: its object (a module's forward)
    if inner is not None and not isinstance(obj, type(len)):
        return _requires_grad(inner, depth - 1, seen)
    if isinstance(obj, functools.partial):
        return _requires_grad([obj.func, *obj.args, *obj.keywords.values()], depth, seen)
    cells = getattr(obj, "__closure__", None)   # a function: what it closes over
    if cells:
        return any(_requires_grad(_cell(cell), depth - 1, seen) for cell in cells[:_WALK_ITEMS])
    if callable(obj) and not hasattr(obj, "__dict__"):
        return False
    own = getattr(obj, "__dict__", None)
    if isinstance(own, dict):
        return any(_requires_grad(value, depth - 1, seen) for value in list(own.values())[:_WALK_ITEMS])
    return False


def _cell(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:   # an empty cell
        return None
