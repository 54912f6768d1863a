"""ComfyUI's Dynamic VRAM (comfy-aimdo) turned on as ComfyUI's `main.py` turns it on, for the benchmarks and GPU
tests: `start()` loads comfy-aimdo's library before torch is imported (its allocator takes over CUDA's only when
it is loaded before torch's CUDA libraries: started after, ComfyUI's own weight load fails with "CUDA error:
invalid argument"), `enable()` then starts its devices and makes `ModelPatcherDynamic` ComfyUI's core patcher,
after ComfyUI's `comfy.model_management` is imported. This module imports no torch at its top.
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional

_started: dict = {}


def start(headroom_gib: Optional[float] = None) -> Optional[str]:
    """comfy-aimdo's library loaded (`comfy_aimdo.control.init`, in each protocol its versions have). None when it
    loaded, else why not. Must run before `import torch` (a process that imported torch already is refused)."""
    if "started" in _started:
        return _started["started"]
    if "torch" in sys.modules:
        return ("torch was imported before comfy-aimdo could start (start Dynamic VRAM first thing in the "
                "process, as ComfyUI's main.py does)")
    try:
        control = importlib.import_module("comfy_aimdo.control")
    except ImportError as error:
        _started["started"] = f"comfy-aimdo is not installed ({error})"
        return _started["started"]
    headroom = None if headroom_gib is None else int(headroom_gib * 1024 ** 3)
    try:
        control.init(simple_vram_headroom=headroom, nvml_pressure=True)
    except TypeError:   # comfy-aimdo 0.4.10, then 0.4.9
        try:
            control.init(simple_vram_headroom=headroom)
        except TypeError:
            control.init()
    _started["started"] = None if getattr(control, "lib", None) is not None else \
        "comfy-aimdo's library does not load here"
    return _started["started"]


def enable() -> Optional[str]:
    """Dynamic VRAM on, after `start()` and ComfyUI's import: comfy-aimdo's devices, `ModelPatcherDynamic` as the
    core patcher, `aimdo_enabled`. None when on, else why not (not started, this ComfyUI has none, ComfyUI runs
    on the CPU here, the GPU refuses it)."""
    if _started.get("started", "comfy-aimdo was not started (dynamic_vram.start)") is not None:
        return _started.get("started", "comfy-aimdo was not started before torch (dynamic_vram.start)")
    import torch
    import comfy.cli_args
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher
    control = importlib.import_module("comfy_aimdo.control")
    if not hasattr(comfy.model_patcher, "ModelPatcherDynamic"):
        return "this ComfyUI has no Dynamic VRAM"
    devices = [d for d in comfy.model_management.get_all_torch_devices() if d.type == "cuda"]
    if not devices:
        return "ComfyUI runs on the CPU in this process"
    devices = [d if d.index is not None else torch.device("cuda", torch.cuda.current_device()) for d in devices]
    headroom = getattr(comfy.cli_args.args, "vram_headroom", 0) or 0
    try:
        ready = control.init_devices((d.index, int(headroom * 1024 ** 3)) for d in devices)
    except TypeError:   # comfy-aimdo 0.4.9
        ready = control.init_devices(d.index for d in devices)
    if not ready:
        return "comfy-aimdo could not start on this GPU"
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    return None
