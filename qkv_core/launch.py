"""Repeated Triton launches with less host time (docs/design.md §2.5: a head group's launches are host-bound
at short lengths).

`kernel[grid](*args, **meta)` binds every argument, builds the specialization key, looks the compiled kernel up
and then calls its launcher: about 18 µs of host time on an H200's host, where the launcher alone takes about 6
(measured with microbenchmarks, docs/benchmarks.md#families). A head group's norm pass and attention are
launched once per group with the same arguments but their tensors, so `CompiledLaunch` launches through Triton's
own path once, keeps the compiled kernel it returns, and calls that kernel's launcher directly afterwards.

Only where that is what Triton itself would do:
- the compiled kernel's launcher is built from its `src.signature`, one entry per kernel parameter by name
  (constexprs included, as Triton 3.2+ lays it out): the positional arguments, then the other parameters'
  values from `meta` in the kernel's order, as `JITFunction.run` passes them;
  any other layout (older Triton, the interpreter, an unknown object) keeps Triton's path for every launch;
- no launch hook is set (a profiler such as proton): with one, Triton's path (it calls the hooks);
- the same current CUDA device as the first launch (a compiled kernel belongs to one device's context);
- each tensor argument as aligned (16 bytes or not) as the first launch's: Triton specializes on it.
The caller promises the rest: the same non-tensor arguments, tensors of the same dtypes (both fixed per
`CompiledLaunch`; the callers check their tensors' layout before they launch).

`shared_launch` keeps one `CompiledLaunch` per kernel, grid, meta-parameters and arguments (non-tensor values,
tensors' dtypes, devices and alignment) across calls: a block's next call launches its first norm pass and its
first attention straight away too (through Triton, each was 50–90 µs of host time on the critical path before
the GPU has work: docs/benchmarks.md#families).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch

try:
    import triton
    from triton.runtime import driver as _driver
except Exception:  # noqa: BLE001 - Triton is optional, and a broken install must not break the pack
    triton = _driver = None

try:
    from triton import knobs as _knobs   # Triton 3.4+: the launch hooks live here
except Exception:  # noqa: BLE001  # pragma: no cover - older Triton
    _knobs = None


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
    module docstring says that is safe, else Triton again. Holds no tensor of a launch (its arguments are
    only kept as the non-tensor values and the tensor slots' alignment)."""

    __slots__ = ("_kernel", "_grid", "_meta", "_compiled", "_tail", "_device", "_alignment", "_count",
                 "direct")

    def __init__(self, kernel, grid: Sequence[int], meta: dict):
        self._kernel, self._meta = kernel, meta
        self._grid = (tuple(grid) + (1, 1))[:3]
        self._compiled = self._tail = self._device = self._alignment = self._count = None
        self.direct = 0   # launches that went straight to the launcher (the tests read it)

    def launch(self, args: Sequence[Any]) -> None:
        if self._compiled is not None and self._direct_launch(args):
            return
        compiled = self._kernel[self._grid](*args, **self._meta)
        if self._compiled is None:
            self._learn(compiled, args)

    def _learn(self, compiled, args: Sequence[Any]) -> None:
        """Keep `compiled` (what the first launch returned) and the launcher's argument order, where the module
        docstring's conditions hold; else every launch stays on Triton's path."""
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        names = getattr(self._kernel, "arg_names", None)
        if _driver is None or not isinstance(signature, dict) or names is None or \
                not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            return
        tail = names[len(args):]   # the parameters after the positional ones: passed by name in `meta`
        if list(signature) != list(names) or len(args) > len(names) or any(name not in self._meta for name in tail):
            return   # the launcher's arguments are not one per parameter, in the kernel's order
        try:
            self._device = _driver.active.get_current_device()
        except Exception:  # noqa: BLE001 - no active driver: Triton's path, which knows what to do
            return
        self._tail, self._count = tuple(self._meta[name] for name in tail), len(args)
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


# launches kept across calls (`shared_launch`): a few per model and size; the least recently used goes first
SHARED_LAUNCHES = 64
_shared: "OrderedDict[tuple, CompiledLaunch]" = OrderedDict()


def shared_launch(kernel, grid: Sequence[int], meta: dict, args: Sequence[Any]) -> CompiledLaunch:
    """The `CompiledLaunch` of `kernel` over `grid` with `meta` for arguments like `args` (the same non-tensor
    values, tensors of the same dtypes, devices and 16-byte alignment), the one an earlier call made where
    there is one: what `CompiledLaunch` asks its caller to keep the same is part of the key. Holds no tensor."""
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
    found = _shared[key] = CompiledLaunch(kernel, grid, meta)
    while len(_shared) > SHARED_LAUNCHES:
        _shared.popitem(last=False)
    return found


def kept_across_calls(key: tuple, make: Callable[[], Any]) -> Any:
    """What `make()` returns for `key`, made once and kept beside the shared launches (the same bound of the
    most recently used, dropped with them by `forget_shared_launches`): a launch's worked-out arguments that
    the next call of the same layout would work out again (`inplace_attention.OverQueriesPass`,
    `kernels._PassLayout`). `key` starts with the kept object's class (no clash with `shared_launch`'s keys,
    which start with an int); what is kept must hold no tensor."""
    found = _shared.get(key)
    if found is not None:
        _shared.move_to_end(key)
        return found
    found = _shared[key] = make()
    while len(_shared) > SHARED_LAUNCHES:
        _shared.popitem(last=False)
    return found


def forget_shared_launches() -> None:
    """Drop every launch `shared_launch` keeps, and what `kept_across_calls` keeps (tests; a changed Triton
    setup)."""
    _shared.clear()


__all__ = ["CompiledLaunch", "shared_launch", "kept_across_calls", "forget_shared_launches", "SHARED_LAUNCHES"]
