"""Test helper: stubs of packages ComfyUI imports unguarded at module level (torchvision, torchaudio, PyAV) for
when they do not import here, installed by `comfy_env.setup()`. Every submodule and attribute of a stub exists;
using one raises `StubUsed`. Imports nothing of ComfyUI."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

# Packages stubbed when they do not import (see install_stub). ComfyUI imports them unguarded at module level
# in model families and extra nodes the tests never run; the CPU torch wheels here come without them (and
# installing them could replace torch).
STUBBABLE = ("torchvision", "torchaudio", "av")


class StubUsed(ImportError):
    """Raised when stubbed code is actually called (never while importing ComfyUI)."""


class _StubMeta(type):
    # Any attribute of a stub class is another stub class: `InterpolationMode.BICUBIC`,
    # `transforms.Compose`, ... can be evaluated at import time (default arguments, class bodies).
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__qualname__}.{name}", cls.__module__)

    def __repr__(cls):
        return f"<comfy_env stub {cls.__module__}.{cls.__qualname__}>"


def _stub_class(qualname, module):
    def __init__(self, *args, **kwargs):
        top = module.split(".")[0]
        raise StubUsed(f"{module}.{qualname} is a comfy_env stub: {top} is not installed")
    cls = _StubMeta(qualname.rsplit(".", 1)[-1], (), {"__init__": __init__, "__module__": module})
    cls.__qualname__ = qualname
    return cls


class _StubModule(types.ModuleType):
    """A stub (sub)module: a package whose every public attribute exists.

    An attribute that is an imported submodule is that module; any other is a stub class (callable and
    subclassable; calling or instantiating it raises StubUsed), so `from torchvision.ops import
    deform_conv2d`, `from torchvision.transforms.functional import InterpolationMode`,
    `class X(transforms.Compose)` and `torchaudio.functional.resample` all import."""

    __comfy_env_stub__ = True

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        sub = sys.modules.get(f"{self.__name__}.{name}")
        if sub is not None:
            return sub
        value = _stub_class(name, self.__name__)
        setattr(self, name, value)
        return value


class _StubFinder:
    """Meta-path finder + loader: `<stubbed>.<anything>` imports as a stub module while the stub is the
    top-level module in sys.modules (a real package is never shadowed)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        top_name, dot, _ = fullname.partition(".")
        if not dot or top_name not in STUBBABLE:
            return None
        top = sys.modules.get(top_name)
        if top is None or not getattr(top, "__comfy_env_stub__", False):
            return None
        return importlib.machinery.ModuleSpec(fullname, cls, is_package=True)

    @classmethod
    def create_module(cls, spec):
        return _new_stub_module(spec.name, spec)

    @classmethod
    def exec_module(cls, module):
        pass


def _new_stub_module(name, spec=None):
    # A real __spec__ is needed: transformers calls importlib.util.find_spec("torchvision"), which raises
    # "ValueError: torchvision.__spec__ is None" for a bare module object.
    mod = _StubModule(name)
    mod.__spec__ = spec or importlib.machinery.ModuleSpec(name, _StubFinder, is_package=True)
    mod.__loader__ = mod.__spec__.loader
    mod.__path__ = []
    mod.__package__ = name
    return mod


def install_stub(name) -> bool:
    """Install a stub of package ``name`` (one of STUBBABLE) if the real one cannot be imported.

    Returns True if stubbed. The stub is the top-level module plus a meta-path finder that makes every
    ``name.*`` submodule a stub module (see _StubModule); nothing in it works, which is fine as the tests
    never run the models that use it. ComfyUI v0.33 needs it at import time for torchvision
    (`torchvision.ops`, `torchvision.transforms.functional`, `torchvision.models.optical_flow`) and
    torchaudio (`import torchaudio` in comfy.sd's LTX audio VAE, imported by nodes.py)."""
    if name not in STUBBABLE:
        raise ValueError(f"{name!r} is not one of {STUBBABLE}")
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__comfy_env_stub__", False):
        _install_stub_finder()
        return True
    try:
        importlib.import_module(name)
        return False
    except Exception:
        for k in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[k]
    mod = _new_stub_module(name)
    mod.__version__ = "0.0.0+comfy_env_stub"
    sys.modules[name] = mod
    _install_stub_finder()
    return True


def install_torchvision_stub() -> bool:
    """``install_stub("torchvision")`` (with ``torchvision.transforms`` imported, as the real package does)."""
    stubbed = install_stub("torchvision")
    if stubbed:
        import torchvision.transforms  # noqa: F401
    return stubbed


def _install_stub_finder():
    if _StubFinder not in sys.meta_path:
        sys.meta_path.insert(0, _StubFinder)
