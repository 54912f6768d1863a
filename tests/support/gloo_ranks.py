"""Test helper: a test's work on several CPU processes at once (torch.multiprocessing spawn, gloo, a file
rendezvous), each rank's result handed back as JSON. Imported by the sequence-parallel tests as
``from support import gloo_ranks`` (tests/ is on sys.path)."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Optional


def _rank(rank: int, world: int, init_file: str, out_dir: str, body, args: tuple) -> None:
    """One process: the default group on gloo (one torch thread), `body(rank, world, *args)`'s result written
    for the parent, then every rank waits for the others before the group goes."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = body(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(body, world: int, *args, timeout: Optional[float] = None) -> list:
    """`body(rank, world, *args)` (a module-level function returning JSON-able data) on `world` processes:
    the results in rank order. `timeout`: seconds the ranks may take together; past it they are killed and a
    `TimeoutError` says so (ranks that wait on each other's exchanges fail the test instead of hanging it)."""
    import time
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.spawn(_rank, args=(world, os.path.join(tmp, "rendezvous"), tmp, body, args), nprocs=world,
                           join=False)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not context.join(None if deadline is None else max(0.1, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                for process in context.processes:
                    process.join(10)
                raise TimeoutError(f"{body.__name__} on {world} ranks did not end in {timeout:g} s "
                                   f"(ranks waiting on each other's exchanges)")
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    return results
