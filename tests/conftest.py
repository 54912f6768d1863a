"""pytest set-up shared by the tests.

The repository root has an `__init__.py` (ComfyUI's entry point for the node pack; it imports `comfy_api`),
so pytest would collect the root as a package and import that file before any test, which fails outside
ComfyUI. The plugin below collects the root as a plain directory instead (registered as a plugin, not a
conftest hook, because conftest hooks do not apply to directories above this one).
"""
import os
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent


class _RootAsPlainDirectory:
    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if Path(path).resolve() == _ROOT:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config):
    # tests/test_browser.py (pyproject.toml's markers list the others)
    config.addinivalue_line("markers", "browser: ComfyUI's server and frontend in headless Chromium "
                                       "(skipped without Playwright, Chromium or the frontend package)")
    if not config.pluginmanager.has_plugin("qkv-root-as-plain-directory"):
        config.pluginmanager.register(_RootAsPlainDirectory(), "qkv-root-as-plain-directory")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:   # an xdist worker: its share of the cores (torch's default, every core each, oversubscribes)
        import torch
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(autouse=True)
def _qkv_core_defaults():
    """Every test starts and ends with no notices."""
    import qkv_core as qc
    qc.reset_notices()
    yield
    qc.reset_notices()


@pytest.fixture
def split_everything(env, monkeypatch):
    """The runtime splits from the first token (the tiny models' sequences are short). `env`: the test
    module's fixture (`comfy_env.pack_modules()`)."""
    monkeypatch.setattr(env.core.head_split, "SPLIT_FLOOR_TOKENS", 0)
