"""Test helper: find and import a real ComfyUI checkout and load node packs (tiny Wan models: `tiny_wan.py`).

Imported by the tests as ``from support import comfy_env`` (pytest puts ``tests/`` on ``sys.path``; tests/ has
no ``__init__.py``). Nothing here is ComfyUI code: it only imports ComfyUI from a checkout found at run time.

Where ComfyUI is looked for (``find_comfyui``; one pytest process imports one ComfyUI):
  1. ``$COMFYUI_PATH`` (with several roots separated by ``os.pathsep``, ``:``, the first one);
  2. the ComfyUI root above this repository when the repository is installed as
     ``ComfyUI/custom_nodes/<pack>`` (the grandparent of the repo root has ``comfy/`` and ``nodes.py``);
  3. ``~/ComfyUI``.
Tests call ``require_comfyui()``, which skips the test with a reason when ComfyUI is missing or fails to import.

Which roots ``scripts/test`` runs pytest against, one process each (``comfyui_roots``; printed by
``python3 tests/support/comfy_env.py roots``, one per line):
  * ``$COMFYUI_PATH`` set: its entries, in order (duplicates dropped);
  * otherwise the root ``find_comfyui`` finds (2. or 3. above), then the extra roots: ``$QKV_EXTRA_COMFYUI``
    (``os.pathsep``-separated; set it empty for none) or, when that is unset, ``~/ComfyUI-0.8.0`` if it is a
    checkout (``DEFAULT_EXTRA_COMFYUI``).
The first root gets the whole suite, each further one only the tests marked ``comfyui``.
``python3 tests/support/comfy_env.py missing FILE`` prints the requirements of FILE that the running interpreter does
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

import contextlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Unresolved too: a pack installed as a symlink ComfyUI/custom_nodes/<pack> -> checkout resolves elsewhere.
_REPO_ROOT_AS_SEEN = Path(os.path.abspath(__file__)).parents[2]
TESTS = Path(__file__).resolve().parents[1]

if __name__ == "__main__" and str(TESTS) not in sys.path:   # run as a script: the `support` imports below
    sys.path.insert(0, str(TESTS))

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

# Stubs of packages ComfyUI imports that may be missing here: tests/support/import_stubs.py
from support.import_stubs import STUBBABLE, StubUsed, install_stub, install_torchvision_stub  # noqa: E402,F401


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


def run_interpreted(script: str, timeout: int = 600) -> str:
    """`script` (Python source; `{tests}` in it becomes tests/, the folder above this one) run in a child process
    under Triton's CPU interpreter (TRITON_INTERPRET must be set before Triton is imported): its standard output.
    Skips without Triton or ComfyUI; fails with the end of the child's error output when it fails."""
    import subprocess
    import pytest
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    require_comfyui()
    done = subprocess.run([sys.executable, "-c", script.format(tests=str(TESTS))],
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def load_on_cuda():
    """ComfyUI loaded on CUDA the way the benchmark loads it (`benchmarks.bench.load_comfyui_workload`: no
    `comfy.sample` (torchsde) and no `comfy_api` (pydantic, av) needed, so a bare GPU machine runs it), or a skip
    saying why. Returns its root."""
    import pytest
    import torch
    root = find_comfyui()
    if root is None:
        pytest.skip("no ComfyUI checkout found ($COMFYUI_PATH, the ComfyUI above the pack, ~/ComfyUI)")
    from benchmarks import bench
    try:
        bench.load_comfyui_workload(str(root), torch.device("cuda"))
    except (ImportError, SystemExit) as e:
        pytest.skip(f"ComfyUI at {root} does not load: {e}")
    return root


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
def split_floor_tokens(modules, tokens: int):
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



# Loading node packs and running prompts through ComfyUI's executor: tests/support/prompt_runs.py
from support.prompt_runs import (StubServer, execution_error, load_custom_node, make_executor,  # noqa: E402,F401
                                 run_prompt)


# --------------------------------------------------------------------------------------------------
# Tiny Wan models, forwards and comparisons: tests/support/tiny_wan.py (reachable here, as the tests call them)
# --------------------------------------------------------------------------------------------------

from support.tiny_wan import (FP8_LAYOUTS, WAN_KINDS, fill_random_, first_call, fp8_cast_per_call_,  # noqa: E402,F401
                              fresh, latent_channels, lines_of_kind, logged_of_kind, make_conds, make_fp8_scaled_wan,
                              make_inputs, make_wan, model_forward, n_tokens, rel_err, run_sample, stock_fallbacks,
                              weights_forward, _as_scaled_fp8_file, _wan_config)


# --------------------------------------------------------------------------------------------------
# Command line (scripts/test): `python3 tests/support/comfy_env.py roots` / `missing FILE`; imports nothing of ComfyUI
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
    print("usage: python3 tests/support/comfy_env.py roots | missing REQUIREMENTS_FILE", file=sys.stderr)
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
