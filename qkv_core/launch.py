"""Repeated Triton launches with less host time, behind one interface (docs/design.md §2.5: a head group's
launches are host-bound at short lengths).

`shared_launch(kernel, grid, meta, args)` gives the launch of a `@triton.jit` kernel for arguments laid out like
`args`; its `launch(args)` runs the kernel. The first launch goes through Triton's public path,
`kernel[grid](*args, **meta)`: it binds every argument, builds the specialization key, looks the compiled kernel
up and calls that kernel's launcher. Every launch takes that path by default: calling the compiled kernel's
launcher directly (the fast path `direct_launch`, off unless `QKV_FAST_PATHS` turns it on) saved no time on a
whole model beyond the runs' spread (docs/benchmarks.md#fast-paths). Turned on, later launches call the
launcher directly only where that is what Triton's own launch does:
- the installed Triton is one of `TESTED_TRITON_VERSIONS` (`triton_problem`, asked once, at the first launch),
  whose `JITFunction.run` calls `kernel.run(grid_0, grid_1, grid_2, stream, kernel.function,
  kernel.packed_metadata, launch_metadata, <enter hook>, <exit hook>, *<values>)`, the values one per entry of the
  compiled kernel's `src.signature` (every parameter), and its driver and compiled kernels have the fields used
  here;
- the kernel's signature starts with the positional arguments and names the rest in `meta`;
- no launch hook is set (a profiler such as proton: Triton calls the hooks);
- the same current CUDA device as the first launch (a compiled kernel belongs to one device's context);
- each tensor argument as aligned (16 bytes or not) as the first launch's: Triton specializes on it.
Anything else takes Triton's path, at every launch. The caller promises the rest: the same non-tensor
arguments and tensors of the same dtypes (part of `shared_launch`'s key).

`shared_launch` keeps each launch across calls (the fast path `kept_launches`), keyed by kernel, grid,
meta-parameters and arguments: a block's next call launches its first norm pass and its first attention
straight away too (through Triton each launch costs the host several times the launcher's own time;
docs/benchmarks.md#families). `kept_across_calls`
keeps, in the same bounded store, a pass worked out from its tensors' layouts (`kernels._PassLayout`,
`inplace_attention.OverQueriesPass`).
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch

from . import fast_paths

try:
    import triton
    from triton.runtime import driver as _driver
except Exception:  # noqa: BLE001 - Triton is optional, and a broken install must not break the pack
    triton = _driver = None

try:
    from triton import knobs as _knobs   # Triton 3.4+: the launch hooks live here
except Exception:  # noqa: BLE001  # pragma: no cover - older Triton
    _knobs = None

# (major, minor) of the Triton releases whose launcher call `CompiledLaunch` reproduces, each checked against
# its `JITFunction.run` and run by tests/test_launch.py: 3.6 with CUDA (docs/benchmarks.md#fast-paths), 3.9 on CPU
TESTED_TRITON_VERSIONS = ((3, 6), (3, 9))
_NOT_YET = object()
_problem: Any = _NOT_YET


def _version(text: str) -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def _layout_problem() -> Optional[str]:
    """Why the installed Triton is not one whose launchers `CompiledLaunch` calls, or None."""
    if triton is None or _driver is None:
        return "Triton is not installed"
    version = getattr(triton, "__version__", "?")
    if _version(version) not in TESTED_TRITON_VERSIONS:
        return f"Triton {version} is not one of the versions its launchers were tested on"
    return None


def _find_problem() -> Optional[str]:
    """`triton_problem`'s answer, worked out."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Triton's interpreter runs the kernels"
    problem = _layout_problem()
    if problem is not None:
        return problem
    try:
        active = _driver.active
        if callable(getattr(active, "get_current_device", None)) and \
                callable(getattr(active, "get_current_stream", None)):
            return None
    except Exception as error:  # noqa: BLE001 - no active driver: Triton's path, which knows what to do
        return f"Triton's driver could not be read ({type(error).__name__}: {error})"
    return "Triton's driver has no get_current_device / get_current_stream"


def triton_problem() -> Optional[str]:
    """Why a launch cannot go straight to the compiled kernel's launcher with the installed Triton, or None;
    worked out once, at the first launch that asks."""
    global _problem
    if _problem is _NOT_YET:
        _problem = _find_problem()
    return _problem


def _hooks() -> tuple:
    """Triton's launch enter and exit hooks (None or an empty chain where nothing is hooked)."""
    if _knobs is not None:
        return _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
    compiled = getattr(getattr(triton, "compiler", None), "CompiledKernel", None)
    return getattr(compiled, "launch_enter_hook", None), getattr(compiled, "launch_exit_hook", None)


def _hooked(hook) -> bool:
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)   # Triton 3.5+: a HookChain, empty unless something is hooked
    return calls is None or len(calls) > 0


def _aligned(arg) -> Optional[bool]:
    return arg.data_ptr() % 16 == 0 if isinstance(arg, torch.Tensor) else None


class CompiledLaunch:
    """Launches of one `@triton.jit` kernel over one grid with one set of meta-parameters (`meta`: its
    constexprs by name, and `num_warps` / `num_stages`). `launch(args)`: the kernel's positional arguments,
    tensors included; every launch passes the same non-tensor values and tensors of the same dtypes. The first
    launch goes through Triton (compiling if needed); later ones call the compiled kernel's launcher where the
    module docstring says that is Triton's own launch, else Triton again. Holds no tensor of a launch (only the
    non-tensor values and the tensor slots' alignment)."""

    __slots__ = ("_kernel", "_grid", "_meta", "_learned", "_compiled", "_tail", "_device", "_alignment", "_count",
                 "direct")

    def __init__(self, kernel, grid: Sequence[int], meta: dict):
        self._kernel, self._meta = kernel, meta
        self._grid = (tuple(grid) + (1, 1))[:3]
        self._learned = False
        self._compiled = self._tail = self._device = self._alignment = self._count = None
        self.direct = 0   # launches that went straight to the launcher (the tests read it)

    def launch(self, args: Sequence[Any]) -> None:
        if self._compiled is not None and fast_paths.on("direct_launch") and self._direct_launch(args):
            return
        compiled = self._kernel[self._grid](*args, **self._meta)
        if not self._learned:
            self._learned = True
            self._learn(compiled, args)

    def _learn(self, compiled, args: Sequence[Any]) -> None:
        """Keep `compiled` (what the first launch returned) and the launcher's values after `args`, where the
        module docstring's conditions hold; else every launch stays on Triton's path."""
        if triton_problem() is not None:
            return
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        names = getattr(self._kernel, "arg_names", None)
        if not isinstance(signature, dict) or names is None or \
                not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            return
        order, count = list(signature), len(args)
        if order[:count] != list(names[:count]) or any(name not in self._meta for name in order[count:]):
            return   # the launcher's values are not the positional arguments, then `meta`'s, in its order
        try:
            self._device = _driver.active.get_current_device()
        except Exception:  # noqa: BLE001 - no active driver: Triton's path, which knows what to do
            return
        self._tail, self._count = tuple(self._meta[name] for name in order[count:]), count
        # (position, 16-byte aligned) of each tensor argument: Triton specializes on the alignment
        self._alignment = tuple((index, _aligned(arg)) for index, arg in enumerate(args)
                                if _aligned(arg) is not None)
        self._compiled = compiled

    def _direct_launch(self, args: Sequence[Any]) -> bool:
        enter, exit_ = _hooks()
        if _hooked(enter) or _hooked(exit_):
            return False
        active = _driver.active
        device = active.get_current_device()
        if device != self._device or len(args) != self._count:
            return False
        for index, aligned in self._alignment:
            if (args[index].data_ptr() % 16 == 0) != aligned:
                return False
        compiled, (x, y, z) = self._compiled, self._grid
        compiled.run(x, y, z, active.get_current_stream(device), compiled.function, compiled.packed_metadata, None,
                     enter, exit_, *args, *self._tail)
        self.direct += 1
        return True


# launches and worked-out passes kept across calls: a few per model and size; the least recently used goes first
SHARED_LAUNCHES = 64
_shared: "OrderedDict[tuple, Any]" = OrderedDict()


def shared_launch(kernel, grid: Sequence[int], meta: dict, args: Sequence[Any]) -> CompiledLaunch:
    """The `CompiledLaunch` of `kernel` over `grid` with `meta` for arguments like `args` (the same non-tensor
    values, tensors of the same dtypes, devices and 16-byte alignment): the one an earlier call made where
    there is one and the fast path `kept_launches` is on, else a new one. Holds no tensor."""
    if not fast_paths.on("kept_launches"):
        return CompiledLaunch(kernel, grid, meta)
    key = [id(kernel), tuple(grid), tuple(meta.items()), len(args)]
    for arg in args:   # (a flat key: this runs once per pass a call, on the host's critical path)
        if isinstance(arg, torch.Tensor):
            key += (arg.dtype, arg.is_cuda, arg.get_device(), arg.data_ptr() % 16 == 0)
        else:   # Triton specializes on an integer's value (1, multiples of 16) and on the type
            key += (arg.__class__, arg)
    key = tuple(key)
    found = _shared.get(key)
    if found is not None and found._kernel is kernel:   # (the id of a kernel still held: the same kernel)
        _shared.move_to_end(key)
        return found
    return _keep(key, CompiledLaunch(kernel, grid, meta))


def kept_across_calls(key: tuple, make: Callable[[], Any]) -> Any:
    """What `make()` returns for `key`, made once and kept beside the shared launches (their bound; dropped by
    `forget_shared_launches`). `key` starts with the kept object's class; what is kept holds no tensor (None is kept
    too). The caller asks its own fast path first (`pass_layouts`, `over_queries_pass`)."""
    found = _shared.get(key, _NOT_YET)
    if found is not _NOT_YET:
        _shared.move_to_end(key)
        return found
    return _keep(key, make())


def _keep(key: tuple, value: Any) -> Any:
    _shared[key] = value
    while len(_shared) > SHARED_LAUNCHES:
        _shared.popitem(last=False)
    return value


def forget_shared_launches() -> None:
    """Drop every launch `shared_launch` keeps, and what `kept_across_calls` keeps (tests; a changed Triton
    setup)."""
    _shared.clear()


__all__ = ["CompiledLaunch", "shared_launch", "kept_across_calls", "forget_shared_launches", "triton_problem",
           "SHARED_LAUNCHES", "TESTED_TRITON_VERSIONS"]
