"""The device's own peak during a run, beside the allocator's: `torch.cuda.max_memory_allocated` counts only what
PyTorch's caching allocator hands out, not its cache, the CUDA context, or memory another library takes itself
(comfy-aimdo, ComfyUI's Dynamic VRAM, holds the weights it streams outside PyTorch's allocator). A real card must
hold all of it. `DevicePeak` samples `torch.cuda.mem_get_info` (the whole device: total less free) from a thread
while the run goes on; the benchmarks report it beside the allocator's peak. Not part of the node pack."""
from __future__ import annotations

import threading
from typing import Optional

import torch

GiB = float(1 << 30)


class DevicePeak:
    """`with DevicePeak(device) as peak:` ... `peak.gib`: the most device memory in use (GiB) seen while inside,
    sampled every `interval` seconds and once at each end; `peak.reserved_gib`: the allocator's own peak
    (`max_memory_reserved`, which the caller resets). None without CUDA. Short spikes between two samples can
    be missed: the allocator keeps what it reserved cached, so the device's use rises and stays."""

    def __init__(self, device: Optional[torch.device] = None, interval: float = 0.002):
        self.device = device if device is not None else (torch.device("cuda", torch.cuda.current_device())
                                                         if torch.cuda.is_available() else None)
        self.interval, self.gib, self.reserved_gib = interval, None, None
        self._most, self._stop, self._thread = 0, threading.Event(), None

    def _sample(self) -> None:
        free, total = torch.cuda.mem_get_info(self.device)
        self._most = max(self._most, total - free)

    def _watch(self) -> None:
        torch.cuda.set_device(self.device)
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self):
        if self.device is None:
            return self
        self._sample()
        self._thread = threading.Thread(target=self._watch, name="device-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is None:
            return False
        self._stop.set()
        self._thread.join()
        self._sample()
        self.gib = self._most / GiB
        self.reserved_gib = torch.cuda.max_memory_reserved(self.device) / GiB
        return False
