"""Benchmark: Ulysses sequence parallelism, one exchange of every head against `qkv_core`'s grouped exchange.

    torchrun --nproc-per-node 2 -m benchmarks.ulysses                  # 2 GPUs (NCCL): Wan 14B, 720p x 81
    python -m benchmarks.ulysses --world 2 --device cpu                # CPU smoke test (gloo, tiny sizes)

Run from the repository root. The layer is a Wan 2.x 14B self-attention (width 5120, 40 heads of 128, q/k/v/o
Linear with bias, RMSNorm over all heads of q and of k with a weight, RoPE by interleaved pairs, random
weights); `--family flux` uses a norm over each head instead. Every rank holds `tokens / world` tokens of
`(1, tokens, 5120)` with every head, as in raylight's Wan forward after `pad_to_world_size`.

- "single exchange": Ulysses as xFuser's `xFuserLongContextAttention` runs it, written here from the algorithm
  (not imported): q, k, v of every head projected, normalized and rotated, each exchanged by one all-to-all
  (each rank gets `heads / world` heads of every token), attended (SDPA), exchanged back, then o.
- "grouped <count>": `qkv_core.ulysses_qkv_attention` with that many head groups, then o (applied by token
  chunks in the attention's storage).

Per rank: the peak working set above the live input and weights (CUDA allocator; on CPU MemTracker) as a
multiple of its local |x| = local tokens x 5120 x bytes, the median time, and (`--check`) the largest error
of each method's output against the single-process result of the whole sequence (`qkv_core.qkv_attention`
unsplit, then o). One JSON line per rank with `--json`.

docs/benchmarks.md#ulysses has the command of the 2-GPU run (not yet measured) and the CPU figures.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import qkv_core as qc
from qkv_core.sequence_parallel import ulysses_qkv_attention, valid_group_counts

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Config:
    """One benchmark run; the defaults are the 2-GPU run (Wan 14B at 720p x 81: 75,600 tokens)."""

    tokens: int = 75600
    heads: int = 40
    head_dim: int = 128
    batch: int = 1
    family: str = "wan"            # wan: RMSNorm over all heads; flux: over each head
    dtype: str = "bf16"
    device: str = "cuda"
    groups: list = field(default_factory=list)   # grouped counts to run (empty: every valid one)
    single: bool = True            # also the single exchange
    repeats: int = 5
    check: bool = False            # errors against the single-process result (needs the whole sequence)
    seed: int = 0
    threads: Optional[int] = None  # CPU threads per rank


# --- the layer ----------------------------------------------------------------------------------------------
class NormRope:
    """A model's `norm_rope(query, key, group)` for one rank's tokens `[offset, offset + n)`: RMSNorm with a
    weight (over all heads' channels, `group.mean_squares` when given, for Wan; over each head's for Flux), then
    RoPE by interleaved pairs at the tokens' global positions. In place, by token chunks (`qkv_core.rows_`)."""

    def __init__(self, heads: int, head_dim: int, tokens: int, offset: int = 0, spans_heads: bool = True,
                 seed: int = 7, eps: float = 1e-6):
        g = torch.Generator().manual_seed(seed)
        width = heads * head_dim if spans_heads else head_dim
        self.q_weight = 1.0 + 0.2 * torch.randn(width, generator=g)
        self.k_weight = 1.0 + 0.2 * torch.randn(width, generator=g)
        pos = torch.arange(tokens, dtype=torch.float64)
        freqs = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = pos[:, None] * freqs[None, :]
        self.cos, self.sin = angles.cos().float(), angles.sin().float()
        self.head_dim, self.offset, self.spans_heads, self.eps = head_dim, offset, spans_heads, eps

    def at(self, offset: int) -> "NormRope":
        """The same norm for the tokens from `offset` on (a rank's shard)."""
        other = object.__new__(NormRope)
        other.__dict__.update(self.__dict__, offset=offset)
        return other

    def to(self, device) -> "NormRope":
        for name in ("q_weight", "k_weight", "cos", "sin"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def _apply(self, t: torch.Tensor, weight: torch.Tensor, heads: range, ms: Optional[torch.Tensor]) -> None:
        d = self.head_dim
        w = weight[heads.start * d:heads.stop * d].view(len(heads), d) if self.spans_heads else weight

        def fn(part, a, b):
            y = part.float()
            if not self.spans_heads:
                scale = y.square().mean(-1, keepdim=True)
            elif ms is None:   # every head handed over: the norm over them
                scale = y.square().mean(dim=(-2, -1), keepdim=True)
            else:
                scale = ms[:, a:b].unsqueeze(-1)
            y = y * torch.rsqrt(scale + self.eps) * w
            del scale
            cos = self.cos[self.offset + a:self.offset + b][None, :, None, :]
            sin = self.sin[self.offset + a:self.offset + b][None, :, None, :]
            pairs = y.unflatten(-1, (-1, 2))
            x0, x1 = pairs[..., 0].clone(), pairs[..., 1].clone()
            pairs[..., 0] = x0 * cos - x1 * sin
            pairs[..., 1] = x1 * cos + x0 * sin
            return y
        qc.rows_(t, fn)

    def __call__(self, query, key, group) -> None:
        ms = group.mean_squares
        if query is not None:
            self._apply(query, self.q_weight, group.q, None if ms is None else ms[0])
        if key is not None:
            self._apply(key, self.k_weight, group.kv, None if ms is None else ms[1])


def make_layer(width: int, heads: int, head_dim: int, seed: int, dtype, device) -> list:
    """q, k, v, o as `torch.nn.Linear` with bias, deterministic weights (the same on every rank)."""
    layers = []
    for i, (n_in, n_out) in enumerate(((width, heads * head_dim),) * 3 + ((heads * head_dim, width),)):
        g = torch.Generator().manual_seed(seed + i)
        lin = torch.nn.Linear(n_in, n_out, bias=True)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in))
            lin.bias.copy_(torch.randn(n_out, generator=g) * 0.1)
        layers.append(lin.to(device=device, dtype=dtype).requires_grad_(False))
    return layers


# --- Ulysses as xFuser runs it: one exchange of every head -------------------------------------------------
def _to_heads(t: torch.Tensor, world: int, group) -> torch.Tensor:
    """`(B, n, H, D)` of this rank's tokens -> `(B, world * n, H / world, D)`: all tokens of its heads."""
    b, n, h, d = t.shape
    send = t.reshape(b, n, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    del send
    return received.permute(1, 0, 2, 3, 4).reshape(b, world * n, h // world, d)


def _to_tokens(t: torch.Tensor, world: int, group) -> torch.Tensor:
    """`(B, world * n, H / world, D)` -> `(B, n, H, D)`: this rank's tokens, every head."""
    b, total, hp, d = t.shape
    n = total // world
    send = t.reshape(b, world, n, hp, d).permute(1, 0, 2, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    del send
    return received.permute(1, 2, 0, 3, 4).reshape(b, n, world * hp, d)


def single_exchange(x: torch.Tensor, layers: list, heads: int, head_dim: int, norm, group=None) -> torch.Tensor:
    """The self-attention layer of this rank's `x` `(B, n, width)` by Ulysses' one exchange: `(B, n, width)`."""
    q_proj, k_proj, v_proj, o_proj = layers
    world = dist.get_world_size(group)
    b, n = x.shape[:2]
    every = qc.HeadGroup(range(heads), range(heads))
    q = q_proj(x).view(b, n, heads, head_dim)
    k = k_proj(x).view(b, n, heads, head_dim)
    norm(q, k, every)
    v = v_proj(x).view(b, n, heads, head_dim)
    q, k, v = (_to_heads(t, world, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    del q, k, v
    out = _to_tokens(out, world, group)
    return o_proj(out.flatten(2))


def grouped_exchange(x: torch.Tensor, layers: list, heads: int, head_dim: int, norm, groups: int, spans: bool,
                     group=None) -> torch.Tensor:
    """The same layer by `qkv_core.ulysses_qkv_attention` in `groups` head groups, then o."""
    q_proj, k_proj, v_proj, o_proj = layers
    return ulysses_qkv_attention([x], q_proj, k_proj, v_proj, heads, head_dim, norm, group=group, o_proj=o_proj,
                                 norm_spans_heads=spans, groups=groups, force_attention="sdpa")


def single_process(x_full: torch.Tensor, layers: list, heads: int, head_dim: int, norm, spans: bool) -> torch.Tensor:
    """The whole sequence on one process: `qkv_core.qkv_attention` unsplit, then o."""
    q_proj, k_proj, v_proj, o_proj = layers
    attended = qc.qkv_attention([x_full], q_proj, k_proj, v_proj, heads, head_dim, norm, norm_spans_heads=spans,
                                head_split_level=0, force_attention="sdpa")
    return o_proj(attended.flatten(2))


# --- one rank ------------------------------------------------------------------------------------------------
def _peak_and_time(device: torch.device, run, live: list, repeats: int) -> tuple:
    """(peak bytes of one run above `live`, median seconds of `repeats` runs, the last output)."""
    from benchmarks.memory import PeakMemory
    with torch.no_grad(), PeakMemory(device, live=live) as pm:
        out = run()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        del out
        start = time.perf_counter()
        with torch.no_grad():
            out = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return pm.peak_bytes, statistics.median(times) if times else float("nan"), out


def run_rank(config: Config, group=None) -> dict:
    """This rank's part of the benchmark (the process group initialized): per method its peak as a multiple of
    the local |x|, its median time, and with `check` its error against the single-process result."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = torch.device(config.device)
    dtype = _DTYPES[config.dtype]
    heads, d = config.heads, config.head_dim
    width = heads * d
    if config.tokens % world:
        raise ValueError(f"--tokens {config.tokens} is not a multiple of the world size {world}")
    n = config.tokens // world
    spans = config.family == "wan"
    layers = make_layer(width, heads, d, config.seed, dtype, device)
    norm_full = NormRope(heads, d, config.tokens, 0, spans).to(device)
    norm = norm_full.at(rank * n)
    g = torch.Generator().manual_seed(config.seed + 100)
    shape = (config.batch, config.tokens, width)
    if config.check:
        x_full = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        x = x_full[:, rank * n:(rank + 1) * n].clone()
    else:   # only this rank's tokens (the same values as the slice of the whole)
        x_full = None
        gen = torch.Generator(device=device).manual_seed(config.seed + 100 + rank)
        x = torch.randn((config.batch, n, width), generator=gen, device=device, dtype=dtype)
    act = x.numel() * x.element_size()
    reference = None
    if x_full is not None:
        with torch.no_grad():
            reference = single_process(x_full, layers, heads, d, norm_full, spans)[:, rank * n:(rank + 1) * n]
        del x_full
    counts = config.groups or valid_group_counts(heads, world)
    methods = ([("single exchange", None)] if config.single else []) + [(f"grouped {c}", c) for c in counts]
    results = {"rank": rank, "world": world, "tokens": config.tokens, "local_tokens": n, "family": config.family,
               "dtype": config.dtype, "device": str(device), "x_bytes": act, "methods": {}}
    live = [*layers, norm.q_weight, norm.k_weight, norm.cos, norm.sin, x]
    single_out = None
    for name, count in methods:
        if count is None:
            def run():
                return single_exchange(x, layers, heads, d, norm, group)
        else:
            def run(count=count):
                return grouped_exchange(x.clone(), layers, heads, d, norm, count, spans, group)
        # the grouped call frees the clone it is handed: its peak is measured above the clone, as if handed x
        clone_bytes = 0 if count is None else act
        dist.barrier()
        peak, seconds, out = _peak_and_time(device, run, live, config.repeats)
        entry = {"groups": count, "peak_x": round(max(0, peak - clone_bytes) / act, 3),
                 "peak_gib": round(max(0, peak - clone_bytes) / 2 ** 30, 4), "seconds": seconds}
        if reference is not None:
            entry["max_rel_err"] = _rel_err(out, reference)
        if count is None:
            single_out = out
        elif single_out is not None:
            entry["max_rel_err_vs_single"] = _rel_err(out, single_out)
        results["methods"][name] = entry
        del out
    return results


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# --- launching ---------------------------------------------------------------------------------------------
def _spawned_rank(rank: int, world: int, init_file: str, out_dir: str, config: dict) -> None:
    """One CPU rank under `torch.multiprocessing.spawn` (gloo): writes its results to `out_dir/rank<r>.json`."""
    cfg = Config(**config)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = run_rank(cfg)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_cpu(world: int, config: Config) -> list[dict]:
    """Every rank's results of `config` on the CPU: `world` processes, gloo, a file rendezvous."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_spawned_rank, args=(world, init_file, tmp, asdict(config)), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    return results


def _print(results: list[dict], as_json: bool) -> None:
    if as_json:
        for r in results:
            print(json.dumps(r))
        return
    first = results[0]
    print(f"Ulysses, {first['family']} layer, {first['tokens']} tokens over {first['world']} ranks "
          f"({first['local_tokens']} a rank), {first['dtype']} on {first['device']}")
    print(f"{'method':<18} " + " ".join(f"{'rank ' + str(r['rank']) + ' peak':>22}" for r in results) +
          f" {'time (s)':>10} {'max rel err':>12}")
    for name in first["methods"]:
        entries = [r["methods"][name] for r in results]
        peaks = " ".join(f"{e['peak_x']:.3f} x|x| {e['peak_gib']:.3f} GiB".rjust(22) for e in entries)
        err = max((e.get("max_rel_err", float("nan")) for e in entries), default=float("nan"))
        print(f"{name:<18} {peaks} {max(e['seconds'] for e in entries):>10.4f} {err:>12.2e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ulysses", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="CPU ranks to spawn (torchrun sets its own)")
    parser.add_argument("--device", default=None, help="cuda (under torchrun) or cpu (default: cuda if present)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens of the whole sequence "
                        "(default: 75600 on CUDA, 1024 on CPU)")
    parser.add_argument("--heads", type=int, default=None, help="default 40 on CUDA, 8 on CPU")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128 on CUDA, 32 on CPU")
    parser.add_argument("--family", choices=("wan", "flux"), default="wan")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--groups", default="", help="comma-separated grouped counts (default: every valid one)")
    parser.add_argument("--no-single", action="store_true", help="skip the single exchange")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (default: CUDA 5, CPU 1)")
    parser.add_argument("--check", action="store_true", help="errors against the single-process result")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = device == "cpu"
    config = Config(tokens=args.tokens or (1024 if cpu else 75600), heads=args.heads or (8 if cpu else 40),
                    head_dim=args.head_dim or (32 if cpu else 128), family=args.family,
                    dtype=args.dtype or ("fp32" if cpu else "bf16"), device=device,
                    groups=[int(c) for c in args.groups.split(",") if c.strip()], single=not args.no_single,
                    repeats=args.repeats if args.repeats is not None else (1 if cpu else 5), check=args.check,
                    threads=1 if cpu else None)
    if under_torchrun:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if device.startswith("cuda"):
            torch.cuda.set_device(local)
            config.device = f"cuda:{local}"
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        try:
            result = run_rank(config)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
            if dist.get_rank() == 0:
                _print(gathered, args.json)
        finally:
            dist.destroy_process_group()
        return 0
    if not cpu:
        print("a CUDA run needs one process per GPU: torchrun --nproc-per-node N -m benchmarks.ulysses",
              file=sys.stderr)
        return 2
    _print(spawn_cpu(args.world, config), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
