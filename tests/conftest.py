"""pytest set-up shared by the tests.

The repository root has an `__init__.py` (ComfyUI's entry point for the node pack; it imports `comfy_api`),
so pytest would collect the root as a package and import that file before any test, which fails outside
ComfyUI. The plugin below collects the root as a plain directory instead (registered as a plugin, not a
conftest hook, because conftest hooks do not apply to directories above this one).
"""
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
