"""What the guard reads of a module at every call (`nodes/compat.py`): whether a forward is this pack's (`mark_ours`)
or another node's (`foreign_forward`), and one walk of a module's tree (`module_tree`) that gives both the layer
signature of the self-check and the foreign-part check of a bounded block (`block_parts.foreign_part`)."""
from __future__ import annotations

import threading
from typing import Callable, NamedTuple, Optional

_OURS = "_qkv_patch"
# Per thread: `trees`, the module trees walked within one guarded call's checks (`compat.guarded` sets it);
# `reference`, how deep ComfyUI's forward computing a check's reference runs (`compat._Reference`).
_local = threading.local()


def mark_ours(fn: Callable) -> Callable:
    """Tag a forward as this pack's (so a re-applied node finds and replaces it, and it is never taken for
    another node's patch)."""
    setattr(fn, _OURS, True)
    return fn


def is_ours(obj) -> bool:
    return bool(getattr(obj, _OURS, False))


def stock_forward(module) -> Callable:
    """ComfyUI's own forward of `module`: its class's, bound (whatever instance patch is installed)."""
    return type(module).forward.__get__(module)


def foreign_forward(module) -> bool:
    """Does `module` carry a forward installed by another node (an object patch that is not ours and not
    ComfyUI's restored bound method)?"""
    patched = getattr(module, "__dict__", {}).get("forward")
    if patched is None or is_ours(patched):
        return False
    return getattr(patched, "__func__", None) is not type(module).forward


class ModuleTree(NamedTuple):
    """What the guard reads of a module's tree at every call, from one walk (`module_tree`): `layers`, the
    layer classes and weight dtypes (`layers_signature`), and `foreign`, why a part below the module carries
    another node's forward or module hook (`block_parts.foreign_part`), or None; `bound`, (part, module) of every
    module below whose forward another node bound (the part: the block's child it is in), and `hooked`, why a part
    carries another node's module hook, or None (a block that runs some bound forwards itself asks them:
    `block_parts.foreign_part`)."""

    layers: tuple
    foreign: Optional[str]
    bound: tuple = ()
    hooked: Optional[str] = None


def module_tree(module) -> ModuleTree:
    """`ModuleTree` of `module`: each module once, in `named_modules()`' order, through the modules' own dicts
    (`named_modules()`' nested generators and `hasattr` cost every block call host time). Within
    one guarded call's checks it is walked once (`layers_signature` and `foreign_part` both ask)."""
    walked = getattr(_local, "trees", None)
    if walked is not None:
        tree = walked.get(id(module))
        if tree is not None:
            return tree
    layers, foreign, bound, hooked, seen, stack = [], None, [], None, set(), [("", module, None)]
    while stack:
        name, child, part = stack.pop()
        key = id(child)
        if key in seen:
            continue
        seen.add(key)
        own = child.__dict__
        if part is not None:
            if own.get("forward") is not None and foreign_forward(child):
                bound.append((part, child))
                foreign = foreign or f"another node patched its {part}"
            elif (own.get("_forward_hooks") or own.get("_forward_pre_hooks")) and hooked is None:
                hooked = f"another node hooks its {part}"
                foreign = foreign or hooked
        weight = _weight_of(child, own)
        if weight is not _NO_WEIGHT:
            layers.append((name, type(child).__qualname__, _dtype_name(getattr(weight, "dtype", None))))
        below = own.get("_modules")
        if below:
            prefix = name + "." if name else ""
            for sub_name, sub in reversed(below.items()):
                if sub is not None:
                    stack.append((prefix + sub_name, sub, sub_name if part is None else part))
    tree = ModuleTree(tuple(layers), foreign, tuple(bound), hooked)
    if walked is not None:
        walked[id(module)] = tree
    return tree


_NO_WEIGHT = object()
_DTYPE_NAMES: dict = {}


def _weight_of(module, own: dict):
    """`getattr(module, "weight", None)` where the module has a weight (its class, its own attributes, parameters,
    buffers or submodules name one), else `_NO_WEIGHT`: read from the module's own dicts in `getattr`'s order,
    `getattr` itself only where its class has a `weight`."""
    if hasattr(type(module), "weight"):
        return getattr(module, "weight", None)
    if "weight" in own:
        return own["weight"]
    for store in ("_parameters", "_buffers", "_modules"):
        values = own.get(store)
        if values and "weight" in values:
            return values["weight"]
    return _NO_WEIGHT


def _dtype_name(dtype) -> str:
    """`str(dtype)`, kept (the signature is built at every call)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def layers_signature(module) -> tuple:
    """Layer classes and weight dtypes under `module` (each module once, in `named_modules()`'s order): a
    different weight format is checked on its own. Part of every guarded call's signature (`module_tree`)."""
    return module_tree(module).layers


__all__ = ["mark_ours", "is_ours", "stock_forward", "foreign_forward", "ModuleTree", "module_tree", "layers_signature"]
