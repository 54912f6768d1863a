"""Run a ComfyUI checkout's main.py (the real server) with tests/support/comfy_env.py's import stubs.

    python3 tests/browser/launch_comfyui.py COMFYUI_ROOT [main.py arguments ...]

The CPU torch wheels here come without torchvision / torchaudio, which ComfyUI imports unguarded on the way
to `import nodes`; comfy_env's stubs (installed only when the real package does not import) make those
imports succeed. Nothing else changes: main.py parses its own arguments and starts the server as usual.
Used by tests/test_browser.py; nothing is written into the checkout (the test passes --base-directory, a
temporary --database-url, and PYTHONDONTWRITEBYTECODE=1).
"""
import os
import runpy
import sys
from pathlib import Path


def main(argv):
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0]).resolve()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # tests/: support.comfy_env
    # comfy_env sets ComfyUI up for import when it is imported (the tests' in-process use); that would import
    # comfy.cli_args before main.py enables argument parsing. Point it at no checkout while importing it, so
    # its set-up does nothing, and use only its stubs.
    saved = os.environ.get("COMFYUI_PATH")
    os.environ["COMFYUI_PATH"] = os.devnull
    try:
        from support import comfy_env
    finally:
        if saved is None:
            del os.environ["COMFYUI_PATH"]
        else:
            os.environ["COMFYUI_PATH"] = saved
    assert "comfy" not in sys.modules, "comfy_env imported ComfyUI before main.py"
    comfy_env.install_torchvision_stub()
    comfy_env.install_stub("torchaudio")
    sys.path[:] = [p for p in sys.path if p not in ("", ".")]
    sys.path.insert(0, str(root))
    os.chdir(root)
    sys.argv = [str(root / "main.py"), *argv[1:]]
    runpy.run_path(str(root / "main.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
