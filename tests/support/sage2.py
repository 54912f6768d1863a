"""Test helper: whether SageAttention 2's GPU tests can run here (tests/test_sage2_gpu.py, test_wan_gpu.py,
test_reference_cache_gpu.py)."""
from __future__ import annotations

import torch

import qkv_core as qc


def sage2_reason():
    """Why SageAttention 2's GPU tests cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs CUDA (a GPU machine)"
    try:
        import sageattention
    except Exception as error:  # noqa: BLE001 - not installed, or a build that does not load
        return f"SageAttention is not importable ({type(error).__name__})"
    major = qc.backends.sage_major_version(sageattention)   # as the pack reads it (a source-folder build too)
    return None if major == 2 else f"SageAttention {major or '?'}.x is not 2.x"
