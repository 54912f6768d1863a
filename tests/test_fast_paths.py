"""The host-time fast paths (`qkv_core.fast_paths`): the switch, the same numbers with each one off, and the launch
check and fallback (`qkv_core.launch`) on other Triton versions.

Runs on CPU through Triton's interpreter in a child process (TRITON_INTERPRET=1: Triton reads it when the kernels
are defined). `QKV_OTHER_TRITONS`: Triton installs made with `pip install --no-deps --target DIR triton==X`,
separated by the path separator, each checked in a child process of its own (Triton 3.2 and 3.6 beside the
installed one, say); without it that test is skipped.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qkv_core import fast_paths

ROOT = Path(__file__).resolve().parent.parent


def run_child(script: str, env: dict, path: str = "") -> str:
    """`script` in a child Python with `env` added and `path` before the repository on its module path: its
    stdout, after checking that it succeeded."""
    env = dict(os.environ, **env, PYTHONPATH=os.pathsep.join(p for p in (path, str(ROOT)) if p))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


SWITCH = textwrap.dedent("""
    from qkv_core import fast_paths
    print(sorted(name for name in fast_paths.FAST_PATHS if fast_paths.on(name)))
""")
DEFAULTS = set(fast_paths.FAST_PATHS) - fast_paths.OFF_BY_DEFAULT


@pytest.mark.parametrize("value, on", [
    ("", DEFAULTS),
    ("all", set(fast_paths.FAST_PATHS)),
    ("none", set()),
    ("none,direct_launch", {"direct_launch"}),
    ("-kept_launches", DEFAULTS - {"kept_launches"}),
    ("direct_launch,not_a_fast_path", set(fast_paths.FAST_PATHS)),
])
def test_QKV_FAST_PATHS_is_read_once_at_import(value, on):
    """A comma list from the defaults (all on but `OFF_BY_DEFAULT`: direct_launch), left to right: all, none, a
    name on, -name off; an unknown name is said and left."""
    lines = run_child(SWITCH, {"QKV_FAST_PATHS": value}).splitlines()
    assert lines == [str(sorted(on))]


def test_only_sets_the_fast_paths_of_a_block():
    before = {name: fast_paths.on(name) for name in fast_paths.FAST_PATHS}
    with fast_paths.only({"direct_launch"}):
        assert [name for name in fast_paths.FAST_PATHS if fast_paths.on(name)] == ["direct_launch"]
    assert {name: fast_paths.on(name) for name in fast_paths.FAST_PATHS} == before
    with pytest.raises(ValueError, match="not fast paths"):
        with fast_paths.only({"direct_launch", "no_such_path"}):
            pass


SAME_NUMBERS = textwrap.dedent("""
    import torch
    import qkv_core as qc
    from qkv_core import fast_paths, kernels, launch, runtime, tally
    assert kernels.INTERPRET and kernels.triton is not None
    runtime.OVER_QUERIES_MAX_TOKENS = 100   # these tiny calls stand for the short calls that attend over queries
    g = torch.Generator().manual_seed(0)
    heads, dim, width = 6, 128, 32   # High: 16 x 2/3 groups aimed at, 6 of one head each
    streams = [(torch.randn(1, 5, width, generator=g).to(torch.bfloat16),
                [torch.nn.Linear(width, heads * dim, dtype=torch.bfloat16) for _ in range(3)]),
               (torch.randn(1, 12, width, generator=g).to(torch.bfloat16),
                [torch.nn.Linear(width, heads * dim, dtype=torch.bfloat16) for _ in range(3)])]
    weight = (torch.randn(dim, generator=g) * 0.2 + 1).to(torch.bfloat16)
    freqs = torch.randn(1, 17, 1, dim // 2, 2, 2, generator=g)

    class KernelNorm:
        # a per-head RMSNorm and RoPE through the kernel's in-place passes, every head's q at once, as the nodes'
        def __call__(self, query, key, group):
            for t in (query, key):
                if t is not None:
                    kernels.norm_rope_pass(t, None, weight, freqs, 1e-6).run(t)

        def query_all_heads_(self, query, group=None):
            self(query, None, None)
            return True

    def call():
        tally.drain_tally()
        with torch.no_grad():
            out = qc.joint_qkv_attention([([x.clone()], tuple(p)) for x, p in streams], heads, dim, KernelNorm(),
                                         head_split_level="high", force_attention="sdpa", split_floor_tokens=0)
        counted = tally.drain_tally()
        assert counted.kernels == {"sdpa (Triton, over the queries)": 6}, counted
        return out

    every = set(fast_paths.FAST_PATHS)
    want = call()
    # every one off, and each of the caches whose layers meet (a kept pass holds a kept launch) off alone
    variants = [("none", set())] + [("-" + name, every - {name})
                                    for name in ("kept_launches", "pass_layouts", "over_queries_pass")]
    for label, names in variants:
        with fast_paths.only(names):
            assert torch.equal(call(), want), label
    launch._problem = "simulated: the installed Triton's launchers are not known here"   # the fallback
    assert torch.equal(call(), want)
    kept = [value for value in launch._shared.values() if isinstance(value, launch.CompiledLaunch)]
    assert kept and all(value.direct == 0 for value in kept)   # the interpreter: Triton's path at every launch
    print("same", len(variants) + 1)
""")


def test_every_fast_path_off_gives_the_same_numbers_in_the_interpreter():
    """A split joint call that attends over its queries and normalizes through the kernel's passes: bitwise
    the same with every fast path off, each kept layer off alone, and every launch on Triton's own path."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    assert "same 5" in run_child(SAME_NUMBERS, {"TRITON_INTERPRET": "1"})


OTHER_TRITON = textwrap.dedent("""
    import triton
    from qkv_core import launch
    print(triton.__version__, triton.__file__)
    assert launch._layout_problem() is None, launch._layout_problem()
""")


@pytest.mark.skipif(not os.environ.get("QKV_OTHER_TRITONS"), reason="QKV_OTHER_TRITONS names no other Triton")
@pytest.mark.parametrize("target", [p for p in os.environ.get("QKV_OTHER_TRITONS", "").split(os.pathsep) if p])
def test_another_triton_version(target):
    """With the Triton installed at `target`: its launcher layout is the one `CompiledLaunch` calls, the launch
    tests pass, and in its interpreter every fast path off (and the fallback) gives the same numbers."""
    version = run_child(OTHER_TRITON, {}, target).split()
    assert version[1].startswith(str(Path(target).resolve())) or version[1].startswith(target), version
    assert "same 5" in run_child(SAME_NUMBERS, {"TRITON_INTERPRET": "1"}, target)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((target, str(ROOT))))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_launch.py"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]
