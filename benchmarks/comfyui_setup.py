"""ComfyUI for the benchmarks (`benchmarks/bench.py` and the workloads it loads): a ComfyUI checkout found and set up
on a bare machine (stubs for packages its unused nodes import), and the pack's workload modules imported inside a
package made for the whole pack, so that their relative imports of `nodes/` resolve without the pack's
`__init__.py` files. Not part of the node pack."""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Optional

import torch

#: the repository root = the node pack's folder (benchmarks/ sits next to nodes/ and qkv_core/)
PACK_ROOT = Path(__file__).resolve().parent.parent
#: the package name the pack is loaded under for the benchmark (never ComfyUI's top-level `nodes`)
PACK_PACKAGE = "comfyui_qkv_bench"
#: top-level packages of this process that the pack package shares (same module objects): see `load_pack_module`
SHARED_PACKAGES = ("qkv_core", "benchmarks")


def _is_comfyui_root(path: Path) -> bool:
    return (path / "comfy").is_dir() and (path / "comfyui_version.py").is_file()


def find_comfyui(path: Optional[str] = None) -> Path:
    """ComfyUI's root: `path`, else $COMFYUI_PATH, else the ComfyUI this repository is installed in
    (ComfyUI/custom_nodes/<pack>), else ~/ComfyUI. SystemExit with the places looked at when none is."""
    if path or os.environ.get("COMFYUI_PATH"):
        given = Path(path or os.environ["COMFYUI_PATH"]).expanduser().resolve()
        if not _is_comfyui_root(given):
            raise SystemExit(f"--comfyui: {given} is not a ComfyUI checkout (needs comfy/ and comfyui_version.py)")
        return given
    # custom_nodes/<pack>/benchmarks/bench.py -> ComfyUI, as given (a symlinked pack) and resolved
    given_root = Path(os.path.abspath(__file__)).parent.parent
    candidates = [given_root.parent.parent, PACK_ROOT.parent.parent, Path.home() / "ComfyUI"]
    for candidate in candidates:
        if _is_comfyui_root(candidate):
            return candidate.resolve()
    raise SystemExit("--comfyui: no ComfyUI found (give its path: --comfyui PATH, or set COMFYUI_PATH); looked at "
                     + ", ".join(str(c) for c in candidates))


# Packages ComfyUI imports unguarded at module level for models and nodes the benchmarks never run: a bare
# machine (a CPU-only torch, a GPU image without PyAV) may have none that imports
STUBBED = ("torchvision", "torchaudio", "av")


class _StubSubmodules:
    """`<stubbed>.<anything>` as an empty stub package while that package is a stub below: `comfy.model_base`
    (v0.33) imports `torchvision.ops.roi_align` (SAM3), comfy_api's video types `av.container`. Attributes of
    the stub modules are placeholders that raise when called; no workload calls them. A real package is never
    shadowed."""

    STUB_VERSION = "0.0.0+qkv_bench_stub"

    @classmethod
    def active(cls, name: str) -> bool:
        top = sys.modules.get(name)
        return top is not None and getattr(top, "__version__", "") == cls.STUB_VERSION

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        top, dot, _ = fullname.partition(".")
        if not dot or top not in STUBBED or not cls.active(top):
            return None
        return importlib.machinery.ModuleSpec(fullname, cls, is_package=True)

    @classmethod
    def create_module(cls, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    @classmethod
    def exec_module(cls, module):
        pass


class _StubClass(type):
    """A stub module's placeholder class: its attributes (enum members such as `av`'s `ColorTrc.ARIB_STD_B67`,
    read in tables at import time) are placeholders too."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(cls.__module__, f"{cls.__name__}.{name}")


def _placeholder(module: str, name: str) -> type:
    top = module.split(".")[0]

    def unavailable(*args, **kwargs):
        raise ImportError(f"{module}.{name}: {top} is not installed (bench.py's stub)")
    return _StubClass(name.rpartition(".")[2], (), {"__init__": unavailable, "__module__": module})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(self.__name__, name)


def _stubs_if_missing() -> list:
    """A bare stub package for each of `STUBBED` that does not import (missing, or built for another torch);
    the names stubbed."""
    stubbed = []
    for top in STUBBED:
        try:
            importlib.import_module(top)
            continue
        except Exception:  # noqa: BLE001 - missing, or built for another torch
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]
        module = _StubModule(top)
        # a real spec: transformers calls importlib.util.find_spec("torchvision"), which needs one
        module.__spec__ = importlib.machinery.ModuleSpec(top, None, is_package=True)
        module.__path__ = []
        module.__version__ = _StubSubmodules.STUB_VERSION
        sys.modules[top] = module
        stubbed.append(top)
    if stubbed and _StubSubmodules not in sys.meta_path:
        sys.meta_path.append(_StubSubmodules)
    if "torchvision" in stubbed:   # imported with the package, as the real one does
        sys.modules["torchvision"].transforms = importlib.import_module("torchvision.transforms")
    return stubbed


def setup_comfyui(root: Path, device: torch.device, flags=()) -> list:
    """Makes ComfyUI at `root` importable and imports `comfy.model_management`. Without CUDA (or with a CPU
    `--device`) ComfyUI runs in its CPU mode with its PyTorch (SDPA) attention, flags set before
    `comfy.model_management` reads them; on CUDA its own defaults stay (SDPA on NVIDIA). Returns notes."""
    notes = []
    sys.path[:] = [p for p in sys.path if not (p and os.path.abspath(p) == str(root))]
    sys.path.insert(0, str(root))
    comfy = sys.modules.get("comfy")
    if comfy is not None and not str(Path(comfy.__path__[0]).resolve()).startswith(str(root)):
        raise SystemExit(f"--comfyui: `comfy` is already imported from {comfy.__path__[0]}, not from {root}")
    for name in _stubs_if_missing():
        notes.append(f"{name}: not importable, a stub stands in")
    import comfy.cli_args
    if device.type != "cuda":
        if "comfy.model_management" in sys.modules and not comfy.cli_args.args.cpu:
            raise SystemExit("--comfyui: comfy.model_management was imported before its CPU flag could be set")
        comfy.cli_args.args.cpu = True
        comfy.cli_args.args.use_pytorch_cross_attention = True
        notes.append("ComfyUI flags: --cpu --use-pytorch-cross-attention")
    for flag in flags:   # ComfyUI's command-line flags, e.g. use_ck_attention for --use-ck-attention
        name = flag.lstrip("?-").replace("-", "_")
        if not hasattr(comfy.cli_args.args, name):
            if flag.startswith("?"):   # wanted where this ComfyUI has it
                continue
            raise SystemExit(f"--comfy-flag: this ComfyUI has no flag {flag!r}")
        setattr(comfy.cli_args.args, name, True)
        notes.append(f"ComfyUI flag: --{name.replace('_', '-')}")
    importlib.import_module("comfy.model_management")
    return notes


def _package(name: str, path: Path) -> types.ModuleType:
    """An empty package `name` whose submodules are found in `path` (its __init__.py is not run)."""
    spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    spec.submodule_search_locations = [str(path)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    return module


def load_pack_module(name: str, path: Optional[str], device: torch.device, flags=()):
    """ComfyUI set up (`setup_comfyui`), then `benchmarks/<name>.py` imported as `<PACK_PACKAGE>.benchmarks.<name>`:
    returns (module, ComfyUI root, notes).

    The workloads import the pack's adapter relatively (`from ..nodes.families import wan`, `from ..qkv_core import
    ...`, `from .memory import ...`), so they are imported inside a package made for the whole pack: `PACK_PACKAGE`
    and `<PACK_PACKAGE>.nodes` are empty package objects over the repository root and `nodes/` (neither
    `__init__.py` runs: they import comfy_api, i.e. pydantic, av, ... that a bare benchmark machine lacks),
    so the relative imports of `nodes/families/wan.py` (`from ...qkv_core import ...`, `from ..comfy_ops import
    ...`) resolve inside it. `<PACK_PACKAGE>.qkv_core` and `<PACK_PACKAGE>.benchmarks` are this process's
    `qkv_core` and `benchmarks` (`SHARED_PACKAGES`: the same module objects), so `scaled_runtime` and the
    notices reach the code the adapter calls and the workloads measure with this runner's `memory`. Nothing
    in `qkv_core/` or `nodes/` imports `benchmarks`."""
    if not (PACK_ROOT / "nodes" / "families" / "wan.py").is_file() or \
            not (PACK_ROOT / "benchmarks" / f"{name}.py").is_file():
        raise SystemExit(f"--comfyui needs the repository checkout (nodes/families/wan.py and benchmarks/{name}.py "
                         f"under {PACK_ROOT})")
    root = find_comfyui(path)
    notes = setup_comfyui(root, device, flags)
    if PACK_PACKAGE not in sys.modules:
        pack = _package(PACK_PACKAGE, PACK_ROOT)
        pack.nodes = _package(PACK_PACKAGE + ".nodes", PACK_ROOT / "nodes")
        for module_name, module in list(sys.modules.items()):
            if module_name.split(".", 1)[0] in SHARED_PACKAGES:
                sys.modules[f"{PACK_PACKAGE}.{module_name}"] = module
        for package in SHARED_PACKAGES:
            setattr(pack, package, sys.modules[package])
    return importlib.import_module(f"{PACK_PACKAGE}.benchmarks.{name}"), root, notes


__all__ = ["PACK_ROOT", "PACK_PACKAGE", "SHARED_PACKAGES", "STUBBED", "find_comfyui", "setup_comfyui",
           "load_pack_module"]
