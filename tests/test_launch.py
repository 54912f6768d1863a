"""`launch.CompiledLaunch` without a GPU: a stand-in kernel records whether each launch went through Triton's
`kernel[grid](...)` or straight to the compiled kernel's launcher, and with which arguments; the first-use check
of the installed Triton (`launch.triton_problem`) with parts of Triton taken away. (On a GPU, `tests/test_gpu.py`
checks the real launcher's numbers against Triton's own launch; `tests/test_fast_paths.py` runs the check and the
fallback against other Triton versions.)"""
from __future__ import annotations

import types

import pytest
import torch

from qkv_core import fast_paths, launch


@pytest.fixture(autouse=True)
def every_fast_path_on():
    """`direct_launch` is off by default (`fast_paths.OFF_BY_DEFAULT`): these tests are about that path."""
    with fast_paths.only(set(fast_paths.FAST_PATHS)):
        yield


class Compiled:
    """A compiled kernel as Triton 3.3+ returns it: its launcher's signature names every parameter."""

    def __init__(self, names, log):
        self.src = types.SimpleNamespace(signature={name: "i32" for name in names})
        self.function, self.packed_metadata, self.log = "function", "metadata", log

    def run(self, x, y, z, stream, function, metadata, launch_metadata, enter, exit_, *args):
        assert (function, metadata, launch_metadata) == ("function", "metadata", None)
        self.log.append(("direct", (x, y, z), stream, args))


class Kernel:
    """A `@triton.jit` kernel `(x_ptr, n, BLOCK: constexpr)`."""
    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self, signature=None):
        self.log = []
        self.compiled = Compiled(signature or self.arg_names, self.log)

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("triton", grid, args, meta))
            return self.compiled
        return run


class Driver:
    def __init__(self):
        self.device = 0
        self.active = self

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


@pytest.fixture
def driver(monkeypatch):
    """A stand-in driver, and the first-use check passed (as on a GPU with a Triton this module knows)."""
    fake = Driver()
    monkeypatch.setattr(launch, "_driver", fake)
    monkeypatch.setattr(launch, "_hooks", lambda: (None, None))
    monkeypatch.setattr(launch, "_problem", None)
    return fake


def test_later_launches_call_the_launcher_with_every_parameter_in_order(driver):
    kernel = Kernel()
    planned = launch.CompiledLaunch(kernel, (4,), dict(BLOCK=64, num_warps=4))
    a, b = torch.zeros(8), torch.zeros(8)
    planned.launch((a, 8))
    planned.launch((b, 8))
    assert kernel.log[0] == ("triton", (4, 1, 1), (a, 8), dict(BLOCK=64, num_warps=4))
    kind, grid, stream, args = kernel.log[1]
    assert (kind, grid, stream, args[1:]) == ("direct", (4, 1, 1), 1000, (8, 64)) and args[0] is b
    assert planned.direct == 1


def test_a_launcher_of_the_parameters_that_are_not_constexprs_takes_the_positional_arguments(driver):
    """Triton 3.2 lays its launcher out as the kernel's parameters that are not constexprs (`src.signature`
    names them): the later launches pass the positional arguments alone."""
    kernel = Kernel(signature=["x_ptr", "n"])
    planned = launch.CompiledLaunch(kernel, (4,), dict(BLOCK=64))
    b = torch.zeros(8)
    planned.launch((torch.zeros(8), 8))
    planned.launch((b, 8))
    kind, _, _, args = kernel.log[1]
    assert kind == "direct" and args[1:] == (8,) and args[0] is b and planned.direct == 1


def test_other_launcher_layouts_hooks_devices_and_alignments_go_through_triton(driver, monkeypatch):
    # a launcher whose values are not the positional arguments, then meta's: never called directly
    for signature in (["n", "x_ptr", "BLOCK"], ["x_ptr", "n", "BLOCK", "EXTRA"]):
        kernel = Kernel(signature=signature)
        planned = launch.CompiledLaunch(kernel, (4,), dict(BLOCK=64))
        for _ in range(3):
            planned.launch((torch.zeros(8), 8))
        assert [entry[0] for entry in kernel.log] == ["triton"] * 3 and planned.direct == 0
    # an interpreter (or anything that is not a compiled kernel) returned by the first launch
    kernel = Kernel()
    kernel.compiled = None
    planned = launch.CompiledLaunch(kernel, (4,), dict(BLOCK=64))
    planned.launch((torch.zeros(8), 8))
    planned.launch((torch.zeros(8), 8))
    assert planned.direct == 0
    kernel = Kernel()
    planned = launch.CompiledLaunch(kernel, (4,), dict(BLOCK=64))
    planned.launch((torch.zeros(8), 8))
    # a tensor two bytes off the first one's 16-byte alignment: Triton compiles another specialization
    planned.launch((torch.zeros(9, dtype=torch.bfloat16)[1:], 8))
    # another current device: the compiled kernel belongs to the first one's context
    driver.device = 1
    planned.launch((torch.zeros(8), 8))
    driver.device = 0
    # a launch hook (a profiler): Triton calls it
    monkeypatch.setattr(launch, "_hooks", lambda: (print, None))
    planned.launch((torch.zeros(8), 8))
    assert [entry[0] for entry in kernel.log] == ["triton"] * 4 and planned.direct == 0
    monkeypatch.setattr(launch, "_hooks", lambda: (types.SimpleNamespace(calls=[]), None))   # an empty chain
    planned.launch((torch.zeros(8), 8))
    assert kernel.log[-1][0] == "direct" and planned.direct == 1


def test_the_fast_path_switch_and_the_first_use_check_send_every_launch_through_triton(driver, monkeypatch):
    """`direct_launch` off: Triton's path while it is off, the launcher again after. The installed Triton
    found unlike what this module calls (`triton_problem`) or a compiled kernel without the private fields it
    reads: Triton's path at every launch."""
    kernel = Kernel()
    planned = launch.CompiledLaunch(kernel, (4,), dict(BLOCK=64))
    planned.launch((torch.zeros(8), 8))
    with fast_paths.only(set(fast_paths.FAST_PATHS) - {"direct_launch"}):
        planned.launch((torch.zeros(8), 8))
    planned.launch((torch.zeros(8), 8))
    assert [entry[0] for entry in kernel.log] == ["triton", "triton", "direct"]
    monkeypatch.setattr(launch, "_problem", "Triton 9.0's JITFunction.run calls its launchers in another way")
    kernel = Kernel()
    planned = launch.CompiledLaunch(kernel, (4,), dict(BLOCK=64))
    for _ in range(3):
        planned.launch((torch.zeros(8), 8))
    assert [entry[0] for entry in kernel.log] == ["triton"] * 3
    monkeypatch.setattr(launch, "_problem", None)
    for missing in ("run", "function", "packed_metadata", "src"):
        kernel = Kernel()
        fields = dict(src=kernel.compiled.src, function="function", packed_metadata="metadata",
                      run=kernel.compiled.run)
        del fields[missing]
        kernel.compiled = types.SimpleNamespace(**fields)
        planned = launch.CompiledLaunch(kernel, (4,), dict(BLOCK=64))
        for _ in range(3):
            planned.launch((torch.zeros(8), 8))
        assert [entry[0] for entry in kernel.log] == ["triton"] * 3, missing


def test_the_first_use_check_reads_the_installed_tritons_launch(monkeypatch):
    """`triton_problem` is asked once; it names why the launcher is not called directly: the interpreter, a
    Triton not in `TESTED_TRITON_VERSIONS`, a driver without the calls used here; None where all is as this module
    calls it."""
    triton = pytest.importorskip("triton")
    assert launch._layout_problem() is None, f"Triton {triton.__version__}"   # the Triton installed here
    good = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 0)
    monkeypatch.setattr(launch, "_driver", types.SimpleNamespace(active=good))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert launch._find_problem() is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in launch._find_problem()
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(launch, "_driver", types.SimpleNamespace(active=types.SimpleNamespace()))
    assert "get_current_device" in launch._find_problem()
    monkeypatch.setattr(launch, "_driver", types.SimpleNamespace(active=good))
    for untested in ("3.1.0", "3.7.0", "4.0.0"):
        monkeypatch.setattr(launch.triton, "__version__", untested)
        assert "not one of the versions" in launch._find_problem()
    monkeypatch.setattr(launch, "_problem", launch._NOT_YET)
    monkeypatch.setattr(launch, "_find_problem", lambda: "once")
    assert launch.triton_problem() == "once"
    monkeypatch.setattr(launch, "_find_problem", lambda: pytest.fail("asked twice"))
    assert launch.triton_problem() == "once"


def test_triton_hook_chains():
    assert not launch._hooked(None) and not launch._hooked(types.SimpleNamespace(calls=[]))
    assert launch._hooked(print) and launch._hooked(types.SimpleNamespace(calls=[print]))


def test_a_later_calls_launch_of_the_same_layout_is_the_kept_one(driver, monkeypatch):
    """`shared_launch`: the next call's first launch of a kernel with the same grid, meta-parameters, non-tensor
    arguments and tensor dtypes / devices / alignment goes straight to the launcher; anything else differing
    is another launch (through Triton first); the least recently used layouts are dropped past the bound."""
    launch.forget_shared_launches()
    kernel = Kernel()
    first = launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(8), 8))
    first.launch((torch.zeros(8), 8))
    again = launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.ones(8), 8))   # the next call
    again.launch((torch.ones(8), 8))
    assert again is first and [entry[0] for entry in kernel.log] == ["triton", "direct"]
    others = [launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(8), 9)),          # another value
              launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(8), 8.0)),        # another type
              launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(8, dtype=torch.bfloat16), 8)),
              launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(9, dtype=torch.bfloat16)[1:], 8)),
              launch.shared_launch(kernel, (8,), dict(BLOCK=64), (torch.zeros(8), 8)),          # another grid
              launch.shared_launch(kernel, (4,), dict(BLOCK=32), (torch.zeros(8), 8)),          # another meta
              launch.shared_launch(Kernel(), (4,), dict(BLOCK=64), (torch.zeros(8), 8))]        # another kernel
    assert len({id(planned) for planned in others + [first]}) == len(others) + 1
    monkeypatch.setattr(launch, "SHARED_LAUNCHES", 3)
    launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(8), 8))   # the most recent again
    launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(8), 10))
    assert len(launch._shared) == 3 and launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(8), 8)) is first
    assert launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(8), 9)) is not others[0]   # dropped
    launch.forget_shared_launches()
    assert launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(8), 8)) is not first
    with fast_paths.only(set(fast_paths.FAST_PATHS) - {"kept_launches"}):   # each its own launch
        kept = launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(8), 8))
        assert launch.shared_launch(kernel, (4,), dict(BLOCK=64), (torch.zeros(8), 8)) is not kept
    launch.forget_shared_launches()


def test_a_worked_out_launch_is_kept_for_its_key_beside_the_launches():
    """`kept_across_calls`: made once for a key and given back to the next call; within the launches' bound
    (least recently used first out) and dropped with them."""
    launch.forget_shared_launches()
    made = []

    def make():
        made.append(object())
        return made[-1]
    first = launch.kept_across_calls((Kernel, 1), make)
    assert launch.kept_across_calls((Kernel, 1), make) is first and len(made) == 1
    assert launch.kept_across_calls((Kernel, 2), make) is not first and len(made) == 2
    launch.forget_shared_launches()
    assert launch.kept_across_calls((Kernel, 1), make) is not first and len(made) == 3
    declined = []   # None is kept too: a declined layout is not worked out again
    assert launch.kept_across_calls((Kernel, 3), lambda: declined.append(1)) is None
    assert launch.kept_across_calls((Kernel, 3), lambda: declined.append(1)) is None and declined == [1]
    launch.forget_shared_launches()
