"""Test helper: find and import a real ComfyUI checkout, load node packs, build tiny Wan models.

Imported by the tests as ``import comfy_env`` (pytest puts ``tests/`` on ``sys.path``; tests/ has no
``__init__.py``). Nothing here is ComfyUI code: it only imports ComfyUI from a checkout found at run time.

Where ComfyUI is looked for (``find_comfyui``; one pytest process imports one ComfyUI):
  1. ``$COMFYUI_PATH`` (with several roots separated by ``os.pathsep``, ``:``, the first one);
  2. the ComfyUI root above this repository when the repository is installed as
     ``ComfyUI/custom_nodes/<pack>`` (the grandparent of the repo root has ``comfy/`` and ``nodes.py``);
  3. ``~/ComfyUI``.
Tests call ``require_comfyui()``, which skips the test with a reason when ComfyUI is missing or fails to import.

Which roots ``scripts/test`` runs pytest against, one process each (``comfyui_roots``; printed by
``python3 tests/comfy_env.py roots``, one per line):
  * ``$COMFYUI_PATH`` set: its entries, in order (duplicates dropped);
  * otherwise the root ``find_comfyui`` finds (2. or 3. above), then the extra roots: ``$QKV_EXTRA_COMFYUI``
    (``os.pathsep``-separated; set it empty for none) or, when that is unset, ``~/ComfyUI-0.8.0`` if it is a
    checkout (``DEFAULT_EXTRA_COMFYUI``).
The first root gets the whole suite, each further one only the tests marked ``comfyui``.
``python3 tests/comfy_env.py missing FILE`` prints the requirements of FILE that the running interpreter does
not satisfy (scripts/test skips pip when there are none).

Import set-up (``setup()``, idempotent, run by ``require_comfyui``):
  * ComfyUI's root goes to the front of ``sys.path`` (see the note on ``nodes`` below);
  * torchvision and torchaudio stubs are installed only when ``import torchvision`` / ``import torchaudio``
    fail (ComfyUI imports them unguarded in model families and extra nodes; v0.33 imports
    ``torchvision.ops`` and ``torchaudio`` on the way to ``import nodes``; the CPU torch wheels here come
    without them). Every ``torchvision.*`` / ``torchaudio.*`` submodule and attribute exists; using one raises
    ``StubUsed``;
  * ``comfy.cli_args.args.cpu = True`` before ``comfy.model_management`` is imported (that module reads the
    flags at import time and fails on a CPU-only torch without it). Set ``COMFY_ENV_GPU=1`` to leave the
    flag alone (GPU test runs). DynamicVRAM (v0.33, comfy-aimdo) stays off: only ComfyUI's main.py turns it
    on (``comfy.memory_management.aimdo_enabled``), never an import, and ``--cpu`` disables it there too;
    comfy_aimdo itself imports on a CPU-only machine (its modules are imported unconditionally).

Model helpers: ``make_wan(kind, ...)`` builds a tiny random-weight Wan (float32, CPU) from
``comfy.supported_models`` configs and returns a ``ModelPatcher``; ``make_inputs`` builds the keyword
arguments of a direct ``diffusion_model(...)`` call; ``run_sample`` runs ``comfy.sample.sample``.
Prompt helpers: ``load_custom_node`` (ComfyUI's own loader) and ``run_prompt`` (ComfyUI's own
``execution.PromptExecutor``, with a stub server: no web server is started).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.machinery
import importlib.util
import inspect
import math
import os
import sys
import types
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Unresolved too: a pack installed as a symlink ComfyUI/custom_nodes/<pack> -> checkout resolves elsewhere.
_REPO_ROOT_AS_SEEN = Path(os.path.abspath(__file__)).parents[1]

# Kinds accepted by make_wan / make_inputs / run_sample.
WAN_KINDS = ("t2v", "i2v", "wan22_5b", "vace", "camera")

_state = {"root": None, "error": None, "done": False}


# --------------------------------------------------------------------------------------------------
# Finding ComfyUI
# --------------------------------------------------------------------------------------------------

def _is_comfy_root(path) -> bool:
    p = Path(path)
    return (p / "comfy").is_dir() and (p / "nodes.py").is_file() and (p / "execution.py").is_file()


# Further roots scripts/test runs the ComfyUI tests against when neither COMFYUI_PATH nor QKV_EXTRA_COMFYUI is
# set (only those that are checkouts).
DEFAULT_EXTRA_COMFYUI = ("~/ComfyUI-0.8.0",)


def split_roots(value):
    """Entries of an ``os.pathsep``-separated list of paths (``COMFYUI_PATH``, ``QKV_EXTRA_COMFYUI``), in order,
    empty entries dropped, ``~`` expanded, made absolute (not resolved: a missing path stays as given)."""
    return [Path(os.path.abspath(os.path.expanduser(e.strip())))
            for e in (value or "").split(os.pathsep) if e.strip()]


def _resolved(p: Path) -> Path:
    try:
        return p.resolve()
    except OSError:
        return p


def find_comfyui(repo_root=None, environ=None):
    """Path of a ComfyUI checkout, or None. Order: $COMFYUI_PATH (its first entry when it lists several),
    ComfyUI above this repo, ~/ComfyUI."""
    environ = os.environ if environ is None else environ
    roots = [Path(repo_root)] if repo_root is not None else [_REPO_ROOT_AS_SEEN, REPO_ROOT]
    listed = split_roots(environ.get("COMFYUI_PATH"))
    if listed:
        p = _resolved(listed[0])
        return p if _is_comfy_root(p) else None   # an explicit path that is wrong is not silently replaced
    for r in roots:
        above = Path(os.path.abspath(r)).parent.parent   # ComfyUI/custom_nodes/<pack> -> ComfyUI
        if _is_comfy_root(above):
            return above.resolve()
    home = Path.home() / "ComfyUI"
    if _is_comfy_root(home):
        return home.resolve()
    return None


def comfyui_roots(repo_root=None, environ=None):
    """The ComfyUI roots to run the tests against, one pytest process each, in order (list of Paths).

    ``COMFYUI_PATH`` set: its entries (wrong ones kept: their run skips the ComfyUI tests and says why).
    Otherwise ``find_comfyui()``'s root (if any) followed by ``QKV_EXTRA_COMFYUI``'s entries, or, when that
    variable is unset, by the ``DEFAULT_EXTRA_COMFYUI`` that are checkouts. Duplicates (same resolved path)
    are dropped. Empty when there is no ComfyUI at all."""
    environ = os.environ if environ is None else environ
    listed = split_roots(environ.get("COMFYUI_PATH"))
    if listed:
        roots = listed
    else:
        primary = find_comfyui(repo_root, environ={})
        roots = [primary] if primary is not None else []
        if "QKV_EXTRA_COMFYUI" in environ:
            roots += split_roots(environ["QKV_EXTRA_COMFYUI"])
        else:
            roots += [p for p in split_roots(os.pathsep.join(DEFAULT_EXTRA_COMFYUI)) if _is_comfy_root(p)]
    out, seen = [], set()
    for p in roots:
        r = _resolved(p) if p.exists() else p
        if r not in seen:
            seen.add(r)
            out.append(r)
    return out


def unsatisfied_requirements(path):
    """The requirement lines of a pip requirements file that the running interpreter does not satisfy
    (missing distribution or a version outside the specifier; lines whose marker is false are skipped).

    A quick check (importlib.metadata, no pip) so scripts/test calls pip only when something is missing.
    Without the ``packaging`` module every requirement is reported (pip then decides)."""
    import importlib.metadata as md
    lines = []
    for raw in Path(path).read_text().splitlines():
        line = raw.split(" #", 1)[0].split("\t#", 1)[0].strip()
        if line and not line.startswith(("#", "-")):
            lines.append(line)
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return lines
    missing = []
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            version = md.version(req.name)
        except md.PackageNotFoundError:
            missing.append(line)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            missing.append(line)
    return missing


def _not_found_reason():
    listed = split_roots(os.environ.get("COMFYUI_PATH"))
    if listed:
        return (f"COMFYUI_PATH entry {str(listed[0])!r} is not a ComfyUI checkout "
                "(needs comfy/, nodes.py, execution.py)")
    return ("no ComfyUI checkout found (set COMFYUI_PATH, install this repo under ComfyUI/custom_nodes/, "
            "or put ComfyUI at ~/ComfyUI)")


# --------------------------------------------------------------------------------------------------
# Import set-up
# --------------------------------------------------------------------------------------------------

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


def _module_root(mod):
    f = getattr(mod, "__file__", None)
    if f:
        return Path(f).resolve().parent
    locs = getattr(getattr(mod, "__spec__", None), "submodule_search_locations", None) or []
    return Path(list(locs)[0]).resolve().parent if locs else None


def _put_comfy_first(root: Path):
    # Name clash: ComfyUI's top-level module is `nodes` (nodes.py); this repository also has a `nodes/`
    # package folder (imported only relatively inside the pack: `from .nodes import ...`). The repo root can
    # be on sys.path (pytest `pythonpath = ["."]`), so a bare `import nodes` could pick up our folder. We
    # therefore (1) move ComfyUI's root to sys.path[0] and (2) evict a `nodes` module (and its submodules)
    # that was already imported from anywhere else, so the next `import nodes` finds ComfyUI's nodes.py.
    # ComfyUI's other top-level names (execution, server, folder_paths, utils, app, ...) get the same
    # treatment. Once ComfyUI's `nodes` is in sys.modules, later sys.path changes cannot shadow it.
    rs = str(root)
    sys.path[:] = [p for p in sys.path if not (p and _same_path(p, root))]
    sys.path.insert(0, rs)
    names = ["nodes", "execution", "server", "folder_paths", "latent_preview", "node_helpers", "utils", "app",
             "comfy_execution", "comfy_api", "comfy_extras", "comfy_config", "comfyui_version"]
    for name in names:
        mod = sys.modules.get(name)
        if mod is not None and not _inside(_module_root(mod), root):
            for k in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[k]
    comfy = sys.modules.get("comfy")
    if comfy is not None and not _inside(_module_root(comfy), root):
        raise ImportError(f"`comfy` is already imported from {_module_root(comfy)}, not from {root}; "
                          "run the tests in a fresh process")


def _inside(path, root) -> bool:
    # nodes.py itself puts ComfyUI/comfy on sys.path[0], so ComfyUI modules may live one level down.
    return path is not None and (path == root or root in path.parents)


def _same_path(a, b) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def setup():
    """Make ComfyUI importable (CPU mode, torchvision stub, sys.path). Idempotent.

    Returns the ComfyUI root Path. Raises ImportError (with the reason) if ComfyUI is missing or broken."""
    if _state["done"]:
        if _state["error"] is not None:
            raise ImportError(_state["error"])
        _put_comfy_first(_state["root"])   # cheap; keeps the order right if something re-ordered sys.path
        return _state["root"]
    root = find_comfyui()
    if root is None:
        _state.update(done=True, error=_not_found_reason())
        raise ImportError(_state["error"])
    try:
        _put_comfy_first(root)
        install_torchvision_stub()
        install_stub("torchaudio")
        install_stub("av")   # PyAV: comfy_api's video types import it (a GPU machine may lack it)
        import comfy.cli_args
        if os.environ.get("COMFY_ENV_GPU") != "1":
            if "comfy.model_management" in sys.modules and not comfy.cli_args.args.cpu:
                raise ImportError("comfy.model_management was imported before comfy_env could set "
                                  "comfy.cli_args.args.cpu = True")
            comfy.cli_args.args.cpu = True
            # ComfyUI's SDPA path (what CUDA users run) instead of CPU's default sub-quadratic attention:
            # the stock reference is then the same kernel family, and tests run several times faster
            comfy.cli_args.args.use_pytorch_cross_attention = True
        import comfy.model_management  # noqa: F401
        import comfy.model_patcher  # noqa: F401
        import comfy.supported_models  # noqa: F401
        import comfy.sample  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the reason is reported to the skip
        _state.update(done=True, root=root, error=f"importing ComfyUI from {root} failed: {type(e).__name__}: {e}")
        raise ImportError(_state["error"]) from e
    _state.update(done=True, root=root, error=None)
    return root


def try_setup():
    """``setup()`` that never raises; returns the root or None (the reason is in ``skip_reason()``)."""
    try:
        return setup()
    except ImportError:
        return None


def skip_reason():
    return _state["error"]


def require_comfyui():
    """ComfyUI root Path, or pytest.skip(reason) when ComfyUI is missing or does not import."""
    import pytest
    try:
        return setup()
    except ImportError as e:
        pytest.skip(str(e))


def comfyui_version():
    """ComfyUI's version string (comfyui_version.py), e.g. "0.8.0"; None if unknown."""
    root = setup()
    ns = {}
    try:
        exec((root / "comfyui_version.py").read_text(), ns)
    except OSError:
        return None
    return ns.get("__version__")


def version_tuple():
    v = comfyui_version() or "0"
    return tuple(int(p) if p.isdigit() else 0 for p in v.split(".")[:3])


# --------------------------------------------------------------------------------------------------
# Node packs
# --------------------------------------------------------------------------------------------------

def load_pack(repo_root=REPO_ROOT, name="comfyui_qkv_under_test", reload=False, require=True):
    """Import a pack's root ``__init__.py`` as package ``name`` so its relative imports work.

    ``from .nodes import X`` inside the pack resolves to ``<name>.nodes`` (the pack's folder), never to
    ComfyUI's top-level ``nodes``. Without an ``__init__.py`` an empty package is created so its
    submodules can still be imported (``importlib.import_module(name + ".qkv_core")``).
    ``require=True`` first calls ``require_comfyui()`` (skips without ComfyUI)."""
    if require:
        require_comfyui()
    root = Path(repo_root).resolve()
    cached = sys.modules.get(name)
    if cached is not None and not reload:
        if _pack_dir(cached) == root:
            return cached
        reload = True
    if reload:
        for k in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[k]
    init = root / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(root)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
    else:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__spec__.submodule_search_locations = [str(root)]
        module.__path__ = [str(root)]
        module.__package__ = name
        sys.modules[name] = module
    return module


@contextlib.contextmanager
def split_floor(modules, tokens: int):
    """The runtime's split floor set to `tokens` (of one batch item) inside, restored after: tests whose tiny
    models run cond + uncond of ~4k tokens each split as real sizes (8,192+ tokens an item) do."""
    saved = modules.core.head_split.SPLIT_FLOOR_TOKENS
    modules.core.head_split.SPLIT_FLOOR_TOKENS = tokens
    try:
        yield modules
    finally:
        modules.core.head_split.SPLIT_FLOOR_TOKENS = saved


def pack_modules():
    """The pack loaded as ComfyUI loads it (skips without ComfyUI), with the modules the tests reach into:
    `torch`, `pack`, `node` (nodes.patching: apply_patch and the memory factors), `wan`, `compat`,
    `ops` (nodes.comfy_ops), `core` (qkv_core)."""
    require_comfyui()
    import importlib
    import torch
    pack = load_pack()
    return types.SimpleNamespace(torch=torch, pack=pack,
                                 node=importlib.import_module(pack.__name__ + ".nodes.patching"),
                                 wan=importlib.import_module(pack.__name__ + ".nodes.families.wan"),
                                 compat=importlib.import_module(pack.__name__ + ".nodes.compat"),
                                 ops=importlib.import_module(pack.__name__ + ".nodes.comfy_ops"),
                                 core=importlib.import_module(pack.__name__ + ".qkv_core"))


class SdpaHeads:
    """Records the head count of every SDPA call (the group size actually attended); `self_heads`: those
    of self-attention calls (as many keys as queries) longer than the self-check's few tokens, i.e. the
    calls of the real run; `self_tokens`: their token counts (of one batch item)."""

    def __init__(self, torch, check_tokens=256):
        self.torch, self.check_tokens, self.heads, self.self_heads, self.self_tokens = torch, check_tokens, [], [], []

    def __enter__(self):
        torch, recorder = self.torch, self

        class Mode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types=(), args=(), kwargs=None):
                if func is torch.nn.functional.scaled_dot_product_attention:
                    q, k = args[0], args[1]
                    recorder.heads.append(q.shape[1])
                    if q.shape[2] == k.shape[2] and q.shape[2] > recorder.check_tokens:
                        recorder.self_heads.append(q.shape[1])
                        recorder.self_tokens.append(q.shape[2])
                return func(*args, **(kwargs or {}))
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


class TorchCalls:
    """Records the calls of the torch function `func` (e.g. `torch.nn.functional.layer_norm`) made inside the
    `with` block, through a TorchFunctionMode: `calls`, the `(args, kwargs)` of each that `keep(args, kwargs)`
    accepts (every call by default)."""

    def __init__(self, torch, func, keep=None):
        self.torch, self.func, self.keep, self.calls = torch, func, keep, []

    def __enter__(self):
        recorder = self

        class Mode(self.torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types=(), args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is recorder.func and (recorder.keep is None or recorder.keep(args, kwargs)):
                    recorder.calls.append((args, kwargs))
                return func(*args, **kwargs)
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _pack_dir(module):
    locs = getattr(getattr(module, "__spec__", None), "submodule_search_locations", None) or []
    return Path(list(locs)[0]).resolve() if locs else None


def load_custom_node(path, ignore=()):
    """Register a custom node folder (or file) through ComfyUI's own ``nodes.load_custom_node``.

    Returns ComfyUI's bool (False when the pack failed to import; ComfyUI only logs the error)."""
    setup()
    import nodes
    fn = nodes.load_custom_node
    res = fn(str(path), ignore=set(ignore))
    if inspect.isawaitable(res):
        res = asyncio.run(res)
    return res


class StubServer:
    """The part of ``server.PromptServer`` that ``execution.PromptExecutor`` uses; records messages."""

    def __init__(self):
        self.client_id = None
        self.last_node_id = None
        self.last_prompt_id = None
        self.messages = []

    def send_sync(self, event, data, sid=None):
        self.messages.append((event, data))

    def send_progress_text(self, text, node_id, sid=None):
        self.messages.append(("progress_text", {"text": text, "node": node_id}))

    def queue_updated(self):
        pass


def make_executor(server=None):
    """``execution.PromptExecutor`` with a stub server and the classic cache (v0.8.0 and v0.33 take
    ``cache_args``, v0.3.64 ``cache_size``; v0.33 also reads ``cache_args["ram_inactive"]``, which v0.8.0
    ignores)."""
    setup()
    import execution
    server = server or StubServer()
    params = inspect.signature(execution.PromptExecutor.__init__).parameters
    if "cache_args" in params:
        return execution.PromptExecutor(server, cache_type=execution.CacheType.CLASSIC,
                                        cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})
    return execution.PromptExecutor(server, cache_type=execution.CacheType.CLASSIC, cache_size=0)


def run_prompt(prompt, executor=None, prompt_id=None, extra_data=None):
    """Validate and execute an API-format prompt with ComfyUI's own engine, no web server.

    Returns the executor; check ``executor.success``, ``executor.history_result["outputs"]`` (ui outputs per
    node id), ``executor.status_messages`` and ``executor.server.messages``. Raises ``AssertionError`` with
    ComfyUI's messages if validation fails. Pass the same executor again to exercise its output cache."""
    setup()
    import execution
    executor = executor or make_executor()
    prompt_id = prompt_id or str(uuid.uuid4())
    valid = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
    ok, error, outputs, node_errors = valid[0], valid[1], valid[2], valid[3]
    if not ok:
        raise AssertionError(f"prompt failed validation: {error} {node_errors}")
    executor.execute(prompt, prompt_id, extra_data or {}, outputs)
    return executor


def execution_error(executor):
    """The ``execution_error`` message of a failed run (dict), or None."""
    for event, data in executor.status_messages:
        if event == "execution_error":
            return data
    return None


# --------------------------------------------------------------------------------------------------
# Tiny Wan models
# --------------------------------------------------------------------------------------------------

def n_tokens(frames, h, w, patch=(1, 2, 2)):
    """Self-attention tokens of a latent (frames, h, w) with Wan's patch (1, 2, 2)."""
    return math.ceil(frames / patch[0]) * math.ceil(h / patch[1]) * math.ceil(w / patch[2])


def latent_channels(kind):
    return 48 if kind == "wan22_5b" else 16


def _wan_config(kind, dim, heads, layers, ffn_dim, text_dim, vace_layers, extra):
    import comfy.supported_models as sm
    cfg = {
        "image_model": "wan2.1", "dim": dim, "num_heads": heads, "num_layers": layers,
        "ffn_dim": ffn_dim or 2 * dim, "text_dim": text_dim, "freq_dim": 256, "text_len": 512,
        "patch_size": (1, 2, 2), "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True,
        "eps": 1e-6, "in_dim": 16, "out_dim": 16,
    }
    if kind == "t2v":
        cls, cfg["model_type"] = sm.WAN21_T2V, "t2v"
    elif kind == "i2v":
        # WAN21_I2V: in_dim 36 = 16 noise + 4 mask + 16 image latent channels (model_base.WAN21.concat_cond
        # fills zeros when no image is given); cross-attention is WanI2VCrossAttention; img_emb is
        # MLPProj(1280 -> dim) over CLIP-H penultimate hidden states (257 tokens in real use).
        cls, cfg["model_type"], cfg["in_dim"] = sm.WAN21_I2V, "i2v", 36
    elif kind == "wan22_5b":
        # WAN22_T2V (Wan 2.2 TI2V 5B): 48-channel latent (Wan22 latent format), model_base.WAN22.
        cls, cfg["model_type"], cfg["in_dim"], cfg["out_dim"] = sm.WAN22_T2V, "t2v", 48, 48
    elif kind == "vace":
        # VaceWanModel: vace_in_dim 96 = 32 (16 inactive + 16 reactive latent channels) + 64 mask channels,
        # what model_base.WAN21_Vace.extra_conds builds by default.
        cls, cfg["model_type"] = sm.WAN21_Vace, "vace"
        cfg["vace_layers"], cfg["vace_in_dim"] = vace_layers, 96
    elif kind == "camera":
        # WAN21_Camera: CameraWanModel with model_type "camera" (-> i2v cross-attention + img_emb),
        # in_dim 32 (16 noise + 16 image), control adapter input 24 channels at 8x the latent size.
        cls, cfg["model_type"], cfg["in_dim"] = sm.WAN21_Camera, "camera", 32
    else:
        raise ValueError(f"unknown Wan kind {kind!r}; one of {WAN_KINDS}")
    cfg.update(extra)
    return cls, cfg


def fill_random_(module, seed=0, norm_noise=0.1, modulation_std=0.3, bias_std=0.02):
    """Fill every parameter (ComfyUI's ops leave them uninitialised) with seeded, non-degenerate values.

    Linear/Conv weights ~ N(0, 1/fan_in) (activations keep unit scale through the stack); norm weights
    1 + N(0, norm_noise^2) so RMSNorm/LayerNorm stay near identity but not exactly; Wan ``modulation``
    ~ N(0, modulation_std^2) so the gates are O(0.3), i.e. attention visibly changes the output;
    biases and everything else N(0, bias_std^2)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            is_norm = "norm" in name.lower()
            if leaf == "weight" and is_norm:
                v = 1.0 + norm_noise * torch.randn(p.shape, generator=g)
            elif leaf == "weight" and p.ndim >= 2:
                fan_in = math.prod(p.shape[1:])
                v = torch.randn(p.shape, generator=g) / math.sqrt(fan_in)
            elif "modulation" in leaf:
                v = modulation_std * torch.randn(p.shape, generator=g)
            else:
                v = bias_std * torch.randn(p.shape, generator=g)
            p.copy_(v.to(p.dtype))
    return module


def fp8_cast_per_call_(module, storage=None) -> int:
    """`module`'s ComfyUI Linear layers as ComfyUI runs an fp8 checkpoint computed in a wider dtype: each 2-D
    weight stored in `storage` (default float8_e4m3fn) and cast for every call (`comfy_cast_weights`), its bias
    kept. In place; returns how many layers changed."""
    import torch
    import comfy.ops
    storage = storage or torch.float8_e4m3fn
    count = 0
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, comfy.ops.CastWeightBiasOp) and isinstance(layer, torch.nn.Linear) and \
                    layer.weight is not None and layer.weight.dim() == 2:
                layer.weight = torch.nn.Parameter(layer.weight.to(storage), requires_grad=False)
                layer.comfy_cast_weights = True
                count += 1
    return count


def make_wan(kind="t2v", dim=128, heads=4, layers=2, ffn_dim=None, text_dim=32, vace_layers=1,
             dtype=None, seed=0, device="cpu", **extra_config):
    """Tiny random-weight Wan wrapped in a ``ModelPatcher`` (float32 on CPU by default).

    kind: "t2v" (WAN21_T2V), "i2v" (WAN21_I2V), "wan22_5b" (WAN22_T2V), "vace" (WAN21_Vace),
    "camera" (WAN21_Camera). head_dim = dim // heads must be even and split by Wan's RoPE axes
    (d - 4*(d//6), 2*(d//6), 2*(d//6)) into even parts: 32, 64 and 128 work. ``extra_config`` goes into
    the unet config (e.g. ``flf_pos_embed_token_number=514``, ``in_dim_ref_conv=16``).
    The patcher's ``.model`` is the ``comfy.model_base`` model, ``.model.diffusion_model`` the WanModel."""
    setup()
    import torch
    import comfy.model_patcher
    if dim % heads:
        raise ValueError("dim must be a multiple of heads")
    d = dim // heads
    if any(a % 2 for a in (d - 4 * (d // 6), 2 * (d // 6))):
        raise ValueError(f"head_dim {d} does not split into even RoPE axes; use 32, 64 or 128")
    dtype = dtype or torch.float32
    dev = torch.device(device)
    cls, cfg = _wan_config(kind, dim, heads, layers, ffn_dim, text_dim, vace_layers, extra_config)
    model_config = cls(cfg)
    model_config.set_inference_dtype(dtype, None)
    model = model_config.get_model({}, device=dev)
    fill_random_(model.diffusion_model, seed=seed)
    model.eval()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=dev, offload_device=dev)
    patcher.comfy_env_kind = kind
    return patcher


FP8_LAYOUTS = ("comfy_quant", "scaled_fp8")


def make_fp8_scaled_wan(kind="t2v", dim=128, heads=4, layers=1, input_scale=True, fmt="float8_e4m3fn",
                        full_precision_mm=False, seed=0, dtype=None, layout="comfy_quant", **extra_config):
    """Tiny Wan loaded the way ComfyUI loads an fp8-scaled checkpoint (Comfy-Org's `*_fp8_scaled` files):
    ComfyUI's mixed-precision ops (`comfy.ops.mixed_precision_ops`), the blocks' 2-D Linear weights stored as
    fp8 with a per-tensor `weight_scale` (and `input_scale`) and a `comfy_quant` entry, so they load as
    `QuantizedTensor` weights (``fmt="int8_tensorwise"``: int8 with a per-tensor scale, weight-only);
    everything else float32, computed in float32. The weights are those of
    ``make_wan(kind, ...)`` with the same seed, quantized. ``full_precision_mm``: the layers dequantize their
    weight for a full-precision matmul (what ComfyUI makes of old `scaled_fp8` checkpoints that ask for it).
    ``layout``: "comfy_quant" (a per-layer `comfy_quant` entry, as above) or "scaled_fp8" (the layout of
    Comfy-Org's `*_fp8_scaled` files: `scale_weight` / `scale_input` per layer and a `scaled_fp8` marker,
    converted by ComfyUI's own `comfy.utils.convert_old_quants` as its loader does; skipped where this ComfyUI
    has no such converter)."""
    setup()
    import json
    import torch
    import comfy.model_patcher
    import comfy.ops
    storage = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
               "int8_tensorwise": torch.int8}[fmt]
    integer = not storage.is_floating_point
    float_model = make_wan(kind, dim=dim, heads=heads, layers=layers, seed=seed, **extra_config)
    sd = {k: v.clone() for k, v in float_model.model.diffusion_model.state_dict().items()}
    for key in [k for k, v in sd.items() if k.endswith(".weight") and v.dim() == 2 and "blocks." in k
                and "modulation" not in k and "norm" not in k]:
        prefix = key[:-len("weight")]
        weight = sd[key]
        scale = weight.abs().amax() / (torch.iinfo(storage).max if integer else torch.finfo(storage).max)
        sd[key] = (weight / scale).round().to(storage) if integer else (weight / scale).to(storage)
        sd[prefix + "weight_scale"] = scale.reshape(())
        if input_scale and not integer:   # int8_tensorwise is weight-only: no input scale
            sd[prefix + "input_scale"] = torch.tensor(0.02)
        conf = {"format": fmt, **({"full_precision_matrix_mult": True} if full_precision_mm else {})}
        sd[prefix + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    if layout == "scaled_fp8":
        sd = _as_scaled_fp8_file(sd, fmt, full_precision_mm)
    elif layout != "comfy_quant":
        raise ValueError(f"unknown fp8 layout {layout!r}; one of {FP8_LAYOUTS}")
    cls, cfg = _wan_config(kind, dim, heads, layers, None, 32, 1, extra_config)
    model_config = cls(cfg)
    dtype = dtype or torch.float32
    model_config.set_inference_dtype(dtype, None)
    model_config.custom_operations = comfy.ops.mixed_precision_ops({}, dtype)
    model = model_config.get_model({}, device=torch.device("cpu"))
    missing, unexpected = model.diffusion_model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"fp8-scaled Wan: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.eval()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    patcher.comfy_env_kind = kind
    return patcher


def _as_scaled_fp8_file(sd, fmt, full_precision_mm):
    """`sd` (comfy_quant layout) as a Comfy-Org `*_fp8_scaled` file stores it, then converted back by ComfyUI's
    `convert_old_quants` (what its loader does with such a file)."""
    import pytest
    import torch
    import comfy.utils
    if fmt != "float8_e4m3fn":
        raise ValueError("the scaled_fp8 layout stores float8_e4m3fn weights")
    convert = getattr(comfy.utils, "convert_old_quants", None)
    if convert is None:
        pytest.skip("this ComfyUI has no convert_old_quants (scaled_fp8 files load another way)")
    old = {}
    for key, value in sd.items():
        if key.endswith(".comfy_quant"):
            continue
        if key.endswith(".weight_scale"):
            old[key[:-len("weight_scale")] + "scale_weight"] = value
        elif key.endswith(".input_scale"):
            old[key[:-len("input_scale")] + "scale_input"] = value
        else:
            old[key] = value
    # the marker: an fp8 scalar; two elements ask for a full-precision matmul
    old["scaled_fp8"] = torch.zeros(2 if full_precision_mm else 0, dtype=torch.float8_e4m3fn)
    converted, _ = convert(old, "")
    return converted


def _diffusion_model(model):
    if hasattr(model, "model") and hasattr(model.model, "diffusion_model"):   # ModelPatcher
        return model.model.diffusion_model
    if hasattr(model, "diffusion_model"):                                      # BaseModel
        return model.diffusion_model
    return model                                                                # WanModel


def _kind_of(model):
    kind = getattr(model, "comfy_env_kind", None)
    if kind is not None:
        return kind
    dm = _diffusion_model(model)
    name = type(dm).__name__
    if name == "VaceWanModel":
        return "vace"
    if name == "CameraWanModel":
        return "camera"
    if dm.out_dim == 48:
        return "wan22_5b"
    return "i2v" if dm.model_type == "i2v" else "t2v"


def make_inputs(model, kind=None, frames=2, h=8, w=8, batch=1, text_tokens=16, clip_tokens=257,
                vace_contexts=1, per_frame_t=False, timestep=500.0, seed=1, dtype=None):
    """Keyword arguments for a direct ``diffusion_model(**inputs)`` call.

    ``h``, ``w`` are latent sizes; self-attention tokens = ``n_tokens(frames, h, w)`` = frames*(h/2)*(w/2).
    x: (batch, in_dim, frames, h, w) (in_dim includes the i2v/camera concat channels); timestep (batch,)
    in [0, 1000], or (batch, frames) with ``per_frame_t`` (Wan 2.2 5B path -> e0 (B, frames, 6, C));
    context: (batch, text_tokens, text_dim); i2v/camera: clip_fea (batch, clip_tokens, 1280);
    vace: vace_context (batch, vace_contexts, 96, frames, h, w) + vace_strength list;
    camera: camera_conditions (batch, 24, frames, 8h, 8w)."""
    import torch
    dm = _diffusion_model(model)
    kind = kind or _kind_of(model)
    dtype = dtype or next(p.dtype for n, p in dm.named_parameters() if n.startswith("blocks."))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(shape, generator=g).to(dtype)

    in_dim = dm.patch_embedding.weight.shape[1]
    text_dim = dm.text_embedding[0].weight.shape[1]
    out = {
        "x": rnd(batch, in_dim, frames, h, w),
        "timestep": (torch.full((batch, frames), float(timestep)) if per_frame_t
                     else torch.full((batch,), float(timestep))),
        "context": rnd(batch, text_tokens, text_dim),
        "transformer_options": {},
    }
    if per_frame_t:
        # per-frame timesteps, first frame "clean" like Wan 2.2 TI2V with a conditioning image
        out["timestep"][:, 0] = 0.0
    if kind in ("i2v", "camera") and clip_tokens:
        out["clip_fea"] = rnd(batch, clip_tokens, 1280)
    if kind == "vace":
        out["vace_context"] = rnd(batch, vace_contexts, dm.vace_in_dim, frames, h, w)
        out["vace_strength"] = [1.0] * vace_contexts
    if kind == "camera":
        out["camera_conditions"] = rnd(batch, 24, frames, 8 * h, 8 * w)
    return out


class _ClipVisionOutput:
    """What model_base.WAN21.extra_conds reads from a CLIP_VISION_OUTPUT."""

    def __init__(self, penultimate_hidden_states):
        self.penultimate_hidden_states = penultimate_hidden_states


def make_conds(model, kind=None, frames=2, h=8, w=8, batch=1, text_tokens=16, clip_tokens=257, seed=1):
    """(positive, negative) conditioning lists for ``comfy.sample.sample`` matching ``make_wan(kind)``."""
    import torch
    dm = _diffusion_model(model)
    kind = kind or _kind_of(model)
    g = torch.Generator().manual_seed(seed)
    text_dim = dm.text_embedding[0].weight.shape[1]
    pos_ctx = torch.randn((batch, text_tokens, text_dim), generator=g)
    neg_ctx = torch.randn((batch, text_tokens, text_dim), generator=g)
    pos_extra, neg_extra = {}, {}
    if kind in ("i2v", "camera") and clip_tokens:
        clip = _ClipVisionOutput(torch.randn((batch, clip_tokens, 1280), generator=g))
        pos_extra["clip_vision_output"] = clip
        neg_extra["clip_vision_output"] = clip
    if kind == "camera":
        cam = torch.randn((batch, 24, frames, 8 * h, 8 * w), generator=g)
        pos_extra["camera_conditions"] = cam
        neg_extra["camera_conditions"] = cam
    return [[pos_ctx, pos_extra]], [[neg_ctx, neg_extra]]


def run_sample(patcher, kind=None, frames=2, h=8, w=8, batch=1, steps=3, cfg=5.0, seed=0,
               sampler_name="euler", scheduler="simple", positive=None, negative=None, latent=None,
               denoise_mask=None, text_tokens=16, clip_tokens=257, **kwargs):
    """A short ``comfy.sample.sample`` run (3 steps, cond + uncond batched) on a tiny Wan; returns the latent.

    ``denoise_mask`` (batch, 1, frames, h, w) gives Wan 2.2 5B its per-frame timesteps
    (model_base.WAN22.process_timestep). Extra kwargs go to ``comfy.sample.sample``."""
    setup()
    import torch
    import comfy.sample
    kind = kind or _kind_of(patcher)
    if latent is None:
        latent = torch.zeros((batch, latent_channels(kind), frames, h, w))
    if positive is None or negative is None:
        pos, neg = make_conds(patcher, kind, frames, h, w, batch, text_tokens, clip_tokens)
        positive = positive if positive is not None else pos
        negative = negative if negative is not None else neg
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(patcher, noise, steps, cfg, sampler_name, scheduler, positive, negative, latent,
                               noise_mask=denoise_mask, disable_pbar=True, seed=seed, **kwargs)


# --------------------------------------------------------------------------------------------------
# What the family adapters' tests share
# --------------------------------------------------------------------------------------------------

def fresh(value):
    """A copy of a forward argument the model may write: tensors cloned, lists of tensors too."""
    import torch
    if torch.is_tensor(value):
        return value.clone()
    return [v.clone() if torch.is_tensor(v) else v for v in value] if isinstance(value, list) else value


def model_forward(patcher, inputs, applied=None, options=None):
    """`patcher`'s diffusion model on fresh copies of `inputs`, with `applied`'s object patches in place (None:
    as loaded) and its transformer_options (plus `options`)."""
    import torch
    if applied is not None:
        applied.patch_model(load_weights=False)
    try:
        transformer_options = dict((applied or patcher).model_options.get("transformer_options", {}))
        transformer_options.update(options or {})
        with torch.no_grad():
            return patcher.model.diffusion_model(**{k: fresh(v) for k, v in inputs.items()},
                                                 transformer_options=transformer_options)
    finally:
        if applied is not None:
            applied.unpatch_model(unpatch_weights=False)


def weights_forward(patcher, inputs, lowvram=False, layer=None):
    """`patcher`'s diffusion model on fresh copies of `inputs` with its weight patches applied (a LoRA):
    `lowvram=True` loads it as ComfyUI's low-VRAM mode does (`lowvram_model_memory=1`: the patches become each
    layer's weight functions, applied at every call); `layer(diffusion_model)` then names a patched layer, which
    must really take that path. Unpatched afterwards."""
    import torch
    if lowvram:
        patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1)
        if layer is not None:
            patched_layer = layer(patcher.model.diffusion_model)
            assert len(patched_layer.weight_function) > 0 and patched_layer.comfy_cast_weights   # LowVramPatch
    else:
        patcher.patch_model(device_to=torch.device("cpu"))
    try:
        options = dict(patcher.model_options.get("transformer_options", {}))
        with torch.no_grad():
            return patcher.model.diffusion_model(**{k: fresh(v) for k, v in inputs.items()},
                                                 transformer_options=options)
    finally:
        patcher.unpatch_model()


def stock_fallbacks(env) -> list:
    """The pack's forwards that ran ComfyUI's own since the last call (a failed self-check, a refusal)."""
    return [line for line in env.core.drain_notices() if "runs as ComfyUI's own" in line]


def rel_err(a, b) -> float:
    """max |a - b| / max |b| in float64 (the largest over paired outputs for lists and tuples)."""
    if isinstance(b, (list, tuple)):
        return max(rel_err(x, y) for x, y in zip(a, b))
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


# --------------------------------------------------------------------------------------------------
# Command line (scripts/test): `python3 tests/comfy_env.py roots` / `missing FILE`; imports nothing of ComfyUI
# --------------------------------------------------------------------------------------------------

def _main(argv):
    if argv[:1] == ["roots"] and len(argv) == 1:
        for root in comfyui_roots():
            print(root)
        return 0
    if argv[:1] == ["missing"] and len(argv) == 2:
        for line in unsatisfied_requirements(argv[1]):
            print(line)
        return 0
    print("usage: python3 tests/comfy_env.py roots | missing REQUIREMENTS_FILE", file=sys.stderr)
    return 2


# Set-up at import time, on purpose. Test modules import this helper while pytest collects, i.e. before
# anything else can import ComfyUI: pytest >= 8 also imports the repository's root __init__.py (the
# pack's entry point, which imports comfy_api and, through the pack, comfy.model_management) when it sets
# up the root directory as a Package, before the first test of the session runs. By then ComfyUI must be
# on sys.path and comfy.cli_args.args.cpu must be set. Without ComfyUI this does nothing (tests skip).
# Run as a script (the queries above) it imports nothing of ComfyUI.
if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
else:
    try_setup()
