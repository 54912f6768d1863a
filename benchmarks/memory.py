"""Measurement helpers: peak working set of a call, and its time (used by the benchmark and tests; not part of
the node pack's runtime: until this change it was `qkv_core/memory.py`). Needs only torch.

Units: bytes for memory, seconds for time.

Peak working set = the most memory the call held at once *above what was live when it started* (its inputs,
the weights, anything else already allocated), its own result included. Memory the call frees (an input it
was handed off and releases) lowers the working set, so the peak can be less than the sum of what it
allocated and even less than zero is never reported (floored at 0).

- CUDA: the caching allocator's counters: `torch.cuda.reset_peak_memory_stats` then `max_memory_allocated`
  minus the `memory_allocated` before the call (the allocator's 512-byte rounding included; its reserved
  but unallocated cache and workspace of libraries that bypass it, e.g. cuBLAS, are not).
- CPU: `torch.distributed._tools.mem_tracker.MemTracker`, a dispatch mode that adds up the storages that
  tensor operations return and subtracts them when they are freed. It sees every tensor a PyTorch op creates;
  it does not see scratch memory inside one kernel (e.g. the per-thread blocks of the CPU flash attention) or
  tensors that bypass the dispatcher. Used as shipped it miscounts memory that existed before it started:
  a view, an in-place result or a module's parameters of a tensor it was not told about are added as if the
  call had allocated them. `PeakMemory` therefore (a) registers what the caller says is live (`live=`:
  tensors, modules, or lists/tuples/dicts of them) with `track_external` before it starts, so that their
  frees count and their views do not, (b) ignores op results that alias a storage that existed before and
  was not registered (reported as `untracked_alias_bytes`), and (c) turns off MemTracker's per-module
  statistics, which would add a module's parameters at its first call.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, NamedTuple, Optional

import torch

__all__ = ["PeakMemory", "PeakResult", "measure_peak", "Timing", "time_call", "check_cpu_tracker",
           "GiB", "MiB"]

GiB = float(1 << 30)
MiB = float(1 << 20)


def _device_of(device) -> torch.device:
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _flatten_live(live) -> list:
    """Tensors and modules found in `live` (nested lists, tuples, dicts), in order."""
    out, stack = [], [live]
    while stack:
        item = stack.pop()
        if item is None:
            continue
        if torch.is_tensor(item) or isinstance(item, torch.nn.Module):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return out


def _make_cpu_tracker():
    """A MemTracker that counts only storages created inside it (see the module docs)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.common_utils import get_untyped_storages

    class _NewStorageTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self._untracked_inputs: set = set()
            self.untracked_alias_bytes = 0

        # MemTracker's per-module statistics add a module's parameters and buffers at its first call,
        # as if the call had allocated them: off (what is live is registered by `live=` instead).
        def _pre_fw_hook(self, module, inputs):
            return None

        def _post_fw_hook(self, module, inputs, outputs):
            return None

        def _pre_bw_hook(self, module, args):
            return None

        def _post_bw_hook(self, module, args):
            return None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            untracked = set()
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if torch.is_tensor(t):
                    for st in get_untyped_storages(t):
                        if st not in self._WINFO:
                            untracked.add(id(st))
            saved, self._untracked_inputs = self._untracked_inputs, untracked
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._untracked_inputs = saved

        def _track(self, reftype, t):
            if self._untracked_inputs:
                for st in get_untyped_storages(t):
                    if id(st) in self._untracked_inputs and st not in self._WINFO:
                        # a view or in-place result of memory that was live before and not registered
                        self.untracked_alias_bytes += st.nbytes()
                        return
            super()._track(reftype, t)

    return _NewStorageTracker()


def _snapshot_total(snapshot: dict, device: torch.device) -> int:
    total = 0
    for dev, snap in snapshot.items():
        if torch.device(dev).type == device.type:
            total += snap.get("Total", 0)
    return total


class PeakMemory:
    """Context manager: `with PeakMemory(device, live=[module, x_list]) as pm: ...` then `pm.peak_bytes`
    (bytes above what was live at entry, floored at 0), `pm.breakdown` (CPU: bytes per MemTracker category
    at the peak, the registered live memory included; CUDA: {}), `pm.untracked_alias_bytes` (CPU: bytes of
    pre-existing storages that ops aliased but `live` did not name; 0 means everything was accounted for).

    `live`: on CPU, the tensors and modules that exist before the block and that it may use or free
    (nested lists/tuples/dicts are searched). Only weak references are kept. Ignored on CUDA.
    """

    def __init__(self, device=None, live=None):
        self.device = _device_of(device)
        self._live = live
        self.peak_bytes = 0
        self.breakdown: dict = {}
        self.untracked_alias_bytes = 0
        self._tracker = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            tracker = _make_cpu_tracker()
            objects = _flatten_live(self._live)
            if objects:
                tracker.track_external(*objects)
            del objects
            self._live = None  # keep no strong reference: the block may free them
            self._before = _snapshot_total(tracker.get_tracker_snapshot("current"), self.device)
            self._tracker = tracker
            tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._before)
            return
        tracker, self._tracker = self._tracker, None
        tracker.__exit__(*exc)
        peak = tracker.get_tracker_snapshot("peak")
        self.peak_bytes = max(0, _snapshot_total(peak, self.device) - self._before)
        self.breakdown = {str(getattr(k, "value", k)): v
                          for dev, snap in peak.items() if torch.device(dev).type == self.device.type
                          for k, v in snap.items() if v}
        self.untracked_alias_bytes = tracker.untracked_alias_bytes


class PeakResult(NamedTuple):
    result: Any
    peak_bytes: int           # bytes above what was live before the call
    breakdown: dict           # CPU: bytes per category at the peak; CUDA: {}
    untracked_alias_bytes: int


def measure_peak(fn: Callable, *args, device=None, live=None, **kwargs) -> PeakResult:
    """Runs `fn(*args, **kwargs)` and returns its result and peak working set in bytes above what was live
    before it started. On CPU, name in `live` what exists before the call and is used or freed by it (the
    modules, the input list it is handed); tensors found in `args` are added automatically."""
    device = _device_of(device)
    with PeakMemory(device, live=[live, list(args), kwargs]) as pm:
        result = fn(*args, **kwargs)
    return PeakResult(result, pm.peak_bytes, pm.breakdown, pm.untracked_alias_bytes)


class Timing(NamedTuple):
    median_s: float                  # seconds, wall clock (CUDA: between CUDA events)
    times_s: list                    # seconds, one per timed run
    cpu_median_s: Optional[float] = None  # CPU runs: seconds of this process's CPU time (all threads), median


def time_call(fn: Callable, setup: Optional[Callable[[], tuple]] = None, warmup: int = 1, repeats: int = 5,
              device=None) -> Timing:
    """Median time in seconds of `fn(*setup())` over `repeats` runs after `warmup` untimed runs.
    `setup` (not timed) makes fresh arguments for each run (e.g. an input list the call clears). CUDA:
    CUDA events around the call (the queue is drained before each run); CPU: perf_counter, and also the
    process's CPU time (`time.process_time`, summed over threads), which a busy shared machine distorts
    far less than the wall clock."""
    device = _device_of(device)
    times, cpu_times = [], []
    for index in range(warmup + repeats):
        args = setup() if setup is not None else ()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn(*args)
            end.record()
            torch.cuda.synchronize(device)
            elapsed, cpu = start.elapsed_time(end) / 1000.0, None
        else:
            cpu_start, start_s = time.process_time(), time.perf_counter()
            result = fn(*args)
            elapsed, cpu = time.perf_counter() - start_s, time.process_time() - cpu_start
        del result, args
        if index >= warmup:
            times.append(elapsed)
            if cpu is not None:
                cpu_times.append(cpu)
    return Timing(statistics.median(times) if times else float("nan"), times,
                  statistics.median(cpu_times) if cpu_times else None)


def check_cpu_tracker(megabytes: int = 8) -> Optional[str]:
    """Checks the CPU measurement with known patterns; None if right, else what is wrong. Two buffers of
    `megabytes` MiB allocated one after the other must peak at one, together at two; a view and an in-place
    change of a live tensor, or a module's parameters, must count nothing (named in `live` or not); a
    handed-off input freed before an allocation of its size must peak at zero."""
    n = megabytes << 20

    def sequential():
        a = torch.ones(n, dtype=torch.uint8)
        del a
        b = torch.ones(n, dtype=torch.uint8)
        del b

    def together():
        a = torch.ones(n, dtype=torch.uint8)
        b = torch.ones(n, dtype=torch.uint8)
        del a, b

    live = torch.zeros(n, dtype=torch.uint8)
    linear = torch.nn.Linear(256, n // 1024, bias=False)

    def views():
        live.view(-1)[: n // 2].add_(1)
        linear(torch.zeros(1, 256))  # its parameters were live before: only the tiny output counts

    def handoff(x_list):
        x = x_list.pop()
        x.add_(1)
        del x
        torch.ones(n, dtype=torch.uint8)

    checks = [("sequential", lambda: measure_peak(sequential), n),
              ("together", lambda: measure_peak(together), 2 * n),
              ("views", lambda: measure_peak(views, live=[live]), 0),
              ("views of unnamed live memory", lambda: measure_peak(views), 0),
              ("handoff", lambda: measure_peak(handoff, [torch.zeros(n, dtype=torch.uint8)]), 0)]
    problems = []
    with torch.no_grad():
        for name, run, expected in checks:
            got = run().peak_bytes
            if abs(got - expected) > 64 * 1024:
                problems.append(f"{name}: {got} bytes, expected {expected}")
    return "; ".join(problems) or None
