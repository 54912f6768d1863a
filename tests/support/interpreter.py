"""Test helper: a script in a child Python under Triton's CPU interpreter (TRITON_INTERPRET=1; Triton reads it when
the kernels are defined), with the repository root on its path. ComfyUI-backed scripts: `comfy_env.run_interpreted`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_in_interpreter(script: str, timeout: int = 600) -> str:
    """`script` in a child Python with TRITON_INTERPRET=1: its stdout, after checking that it succeeded. Skips
    without Triton."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
