"""The pack inside raylight's sequence-parallel run (nodes/sequence_parallel.py, docs/design.md §3.7), on CPU:
2 and 4 processes on gloo (`gloo_ranks`), ComfyUI's own Wan blocks.

raylight binds its Ulysses forwards to every Wan block's `self_attn` and `cross_attn` when it loads a model
(after ComfyUI's object patches: the pack's block patch stays) and shards the tokens over its group. Here each rank
holds its shard of the tokens of a tiny Wan 2.1 block's input (captured from the whole model's own call), and the
block's attention modules carry a stand-in of raylight's forwards written from its algorithm (q, k, v of every
head exchanged by one all-to-all each, as xFuser's Ulysses does: `_usp_self_attention`) and registered with
`sequence_parallel.register_ulysses_forward`, as raylight's own are recognised by their module. Checked, float32:
- the stand-in itself equals the single-process block (within 1e-5): it computes what raylight does;
- the pack's bounded block over it equals the single-process block within 1e-5, its self-check passes on every
  rank, the head groups were exchanged one at a time (the run's tally), nothing ran stock;
- its peak per rank (MemTracker, above the live inputs and weights, x its local |x|) is under the stand-in's;
- a self-check that fails on one rank runs ComfyUI's block on every rank (no rank waits on an exchange the
  other does not make); a group with a ring degree and an unknown forward keep ComfyUI's block.

raylight's own code (`test_through_raylights_own_wan_path`): where a raylight checkout (RAYLIGHT_PATH, else
~/raylight) and xFuser (`pip install xfuser==0.4.5 yunchang`: raylight's bootstrap loads its distributed modules
on a CPU) are there, the whole tiny Wan through raylight's `USPInjectRegistry` and `usp_dit_forward`, with and
without the pack; skipped elsewhere, with the reason.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from support import comfy_env
from support import gloo_ranks

pytestmark = [pytest.mark.comfyui, pytest.mark.sequence_parallel]

DIM, HEADS, FRAMES, SIDE = 256, 8, 2, 16      # head dim 32; 2 x 8 x 8 = 128 tokens (a multiple of 2 and 4)
TOLERANCE = 1e-5


def _err(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# --- a stand-in of raylight's Wan forwards (written from its algorithm, not its code) ----------------------------
_GROUP: list = []   # this process's sequence-parallel group (a rank's)


def _ulysses_sdpa(q, k, v):
    """Ulysses' single exchange over the stand-in's group: q, k, v `(B, n, H, D)` of the rank's tokens, each sent
    by one all-to-all (rank p gets heads [p H/P, (p+1) H/P) of every token), SDPA, and the result sent back."""
    import torch
    import torch.distributed as dist
    group = _GROUP[0]
    world = dist.get_world_size(group)
    b, n, h, d = q.shape

    def exchange(t):   # (B, n, H, D) -> (B, P n, H / P, D)
        send = t.reshape(b, n, world, h // world, d).permute(2, 1, 0, 3, 4).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        return received.reshape(world * n, b, h // world, d).transpose(0, 1)

    out = torch.nn.functional.scaled_dot_product_attention(*(exchange(t).transpose(1, 2) for t in (q, k, v)))
    out = out.transpose(1, 2).reshape(b, world, n, h // world, d).permute(1, 2, 0, 3, 4).contiguous()
    back = torch.empty_like(out)
    dist.all_to_all_single(back, out, group=group)   # (P, n, B, H / P, D): rank p's heads of this rank's tokens
    return back.permute(2, 1, 0, 3, 4).reshape(b, n, h, d)


def _usp_self_attention(self, x, freqs, transformer_options={}, **kwargs):
    """raylight's `usp_self_attn_forward`: norm and RoPE of every head on the rank's tokens, one exchange."""
    from comfy.ldm.wan.model import apply_rope1
    b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
    q = apply_rope1(self.norm_q(self.q(x)).view(b, s, n, d), freqs)
    k = apply_rope1(self.norm_k(self.k(x)).view(b, s, n, d), freqs)
    return self.o(_ulysses_sdpa(q, k, self.v(x).view(b, s, n, d)).flatten(2))


def _usp_cross_attention(self, *args, **kwargs):
    """raylight's `usp_t2v_cross_attn_forward` / `usp_i2v_cross_attn_forward`: the rank's queries over the whole
    context, which every rank holds (xFuser's exchange of it gives ComfyUI's own numbers): ComfyUI's forward,
    bound as raylight binds its own."""
    return type(self).forward(self, *args, **kwargs)


def _unknown_forward(self, x, freqs, transformer_options={}, **kwargs):
    """Another node's self-attention forward the pack does not know (ComfyUI's own, bound)."""
    return type(self).forward(self, x, freqs, transformer_options=transformer_options)


# --- one rank -------------------------------------------------------------------------------------------------
def _block_inputs(torch, patcher, frames=FRAMES, side=SIDE, text_tokens=16, zero_context=False, kind="t2v"):
    """The first block's own call arguments in the `kind` model's forward (x, e, freqs, context, and for i2v the
    CLIP image tokens before the text with `context_img_len`); `zero_context`: the text embeddings all zeros, as
    ConditioningZeroOut hands a negative over."""
    seen = {}
    block = patcher.model.diffusion_model.blocks[0]

    def capture(module, args, kwargs):
        seen.update(kwargs, x=args[0] if args else kwargs["x"])
        raise StopIteration
    handle = block.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            inputs = comfy_env.make_inputs(patcher, kind, frames=frames, h=side, w=side, text_tokens=text_tokens)
            if zero_context:
                inputs["context"].zero_()
            patcher.model.diffusion_model(**inputs)
    except StopIteration:
        pass
    finally:
        handle.remove()
    seen.pop("transformer_options", None)
    return seen


def _fresh(arguments: dict) -> dict:
    """A block call's arguments again, tensors cloned (the bounded block hands off and writes its inputs)."""
    return {name: comfy_env.fresh(value) for name, value in arguments.items()}


def _bind(block, self_forward, cross_forward=_usp_cross_attention) -> None:
    """What raylight's USP patch does to a block at load time: its forwards bound to the attention modules."""
    import types
    block.self_attn.forward = types.MethodType(self_forward, block.self_attn)
    block.cross_attn.forward = types.MethodType(cross_forward, block.cross_attn)


def _unbind(block) -> None:
    for module in (block.self_attn, block.cross_attn):
        module.__dict__.pop("forward", None)


def _block_checks(rank: int, world: int) -> dict:
    """One rank's errors, fallback lines, head groups and peaks (`test_the_bounded_block_over_raylights_ulysses`)."""
    import importlib
    import torch
    import torch.distributed as dist
    env = comfy_env.pack_modules()
    sp = importlib.import_module(env.pack.__name__ + ".nodes.sequence_parallel")
    memory = importlib.import_module(env.pack.__name__ + ".benchmarks.memory")
    env.core.head_split.SPLIT_FLOOR_TOKENS = 16   # the tiny block's 128 tokens split as real lengths do
    patcher = comfy_env.make_wan("t2v", dim=DIM, heads=HEADS, layers=1, text_dim=32)
    inputs = _block_inputs(torch, patcher)
    block = patcher.model.diffusion_model.blocks[0]
    n = inputs["x"].shape[1] // world
    local = slice(rank * n, (rank + 1) * n)

    def shard(name, value):
        if name == "x":
            return value[:, local].contiguous()   # raylight: padded (a new tensor), then its chunk
        if name == "freqs":
            return value[:, local]
        return value
    sharded = {name: shard(name, value) for name, value in inputs.items()}
    with torch.no_grad():
        want = block(**_fresh(inputs))[:, local]
    patched, _ = env.node.apply_patch(patcher, "High", "sdpa", True)
    patched.patch_model(load_weights=False)   # the pack's object patches, then raylight's binding, as at a load
    _GROUP.append(dist.new_group(list(range(world))))   # the stand-in's sequence-parallel group
    sp.register_ulysses_forward(_usp_self_attention, sp.SELF_ATTENTION, group=lambda: _GROUP[0])
    sp.register_ulysses_forward(_usp_cross_attention, sp.CROSS_ATTENTION)
    out = {"errors": {}, "fallbacks": {}}

    def call(label):
        env.core.drain_tally()
        env.core.reset_notices()
        with torch.no_grad():
            got = block(**_fresh(sharded))
        out["errors"][label] = _err(got, want)
        out["fallbacks"][label] = comfy_env.stock_fallbacks(env)
        return env.core.drain_tally()

    try:
        _bind(block, _usp_self_attention)
        with torch.no_grad():   # the stand-in alone: ComfyUI's block, raylight's forwards
            stock = type(block).forward(block, **_fresh(sharded))
        out["errors"]["stand-in vs single process"] = _err(stock, want)
        call("pack, first call (self-check)")
        tally = call("pack")
        out["splits"] = {str(k): v for k, v in tally.splits.items()}
        x_bytes = sharded["x"].numel() * sharded["x"].element_size()
        for name, fn in (("peak_pack", block), ("peak_stand_in", lambda **kw: type(block).forward(block, **kw))):
            fresh = _fresh(sharded)
            with torch.no_grad():
                out[name] = memory.measure_peak(fn, **fresh, live=[block, list(fresh.values())]).peak_bytes / x_bytes
        # a check that fails on the last rank only: every rank runs ComfyUI's block (raylight's forwards)
        env.compat.forget_verdicts()
        compare = env.compat.compare
        if rank == world - 1:
            env.compat.compare = lambda *a, **k: "a difference planted on this rank"
        try:
            call("one rank's check fails")
        finally:
            env.compat.compare = compare
        # raylight's ring attention (a ring degree): ComfyUI's block, said why
        env.compat.forget_verdicts()
        sp.unregister_ulysses_forward(_usp_self_attention)
        from types import SimpleNamespace
        sp.register_ulysses_forward(_usp_self_attention, sp.SELF_ATTENTION,
                                    group=lambda: SimpleNamespace(ring_world_size=2, ulysses_group=None))
        call("ring degree")
        # a forward the pack does not know: ComfyUI's block
        _unbind(block)
        _bind(block, _unknown_forward, _usp_cross_attention)
        env.compat.forget_verdicts()
        with torch.no_grad():
            block(**_fresh(sharded))
        out["fallbacks"]["unknown forward"] = comfy_env.stock_fallbacks(env)
    finally:
        sp.unregister_ulysses_forward(_usp_self_attention)
        sp.unregister_ulysses_forward(_usp_cross_attention)
        _unbind(block)
        patched.unpatch_model(unpatch_weights=False)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_the_bounded_block_over_raylights_ulysses(world):
    comfy_env.require_comfyui()
    results = gloo_ranks.spawn(_block_checks, world)
    for rank, result in enumerate(results):
        errors, fallbacks = result["errors"], result["fallbacks"]
        print(f"\nworld {world} rank {rank}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
              + f"; peak {result['peak_pack']:.2f} x|x| (stand-in {result['peak_stand_in']:.2f}); "
              f"groups {result['splits']}")
        assert errors["stand-in vs single process"] <= TOLERANCE, errors
        for label in ("pack, first call (self-check)", "pack"):
            assert errors[label] <= TOLERANCE, (label, errors)
            assert not fallbacks[label], fallbacks[label]
        # High: 8 heads over the world's ranks in groups of a head a rank (world 2: 4 groups, world 4: 2)
        assert result["splits"].get(str(HEADS // world)) == 1, result["splits"]   # (1: cross-attention)
        assert result["peak_pack"] < result["peak_stand_in"], result
        failed = fallbacks["one rank's check fails"]
        assert errors["one rank's check fails"] <= TOLERANCE
        reason = "a difference planted" if rank == world - 1 else "failed on another rank"
        assert any("Wan block runs as ComfyUI's own" in line and reason in line for line in failed), failed
        assert any("ring_degree to 1" in line for line in fallbacks["ring degree"]), fallbacks["ring degree"]
        assert errors["ring degree"] <= TOLERANCE
        assert any("another node patched its self_attn" in line for line in fallbacks["unknown forward"]), \
            fallbacks["unknown forward"]


def _user_inputs_checks(rank: int, world: int) -> dict:
    """Over the stand-in's group, with weights and inputs users feed: fp8-scaled weights in both file layouts
    (ComfyUI's mixed-precision layers) with a zeroed negative, and an I2V model's CLIP image tokens beside the
    text. The pack's block against ComfyUI's block with raylight's forwards (the same layers, the same exchange
    of the whole sequence) and the latter against the single process; the pack's fallbacks and head groups."""
    import importlib
    import torch
    import torch.distributed as dist
    env = comfy_env.pack_modules()
    sp = importlib.import_module(env.pack.__name__ + ".nodes.sequence_parallel")
    env.core.head_split.SPLIT_FLOOR_TOKENS = 16
    _GROUP.append(dist.new_group(list(range(world))))
    sp.register_ulysses_forward(_usp_self_attention, sp.SELF_ATTENTION, group=lambda: _GROUP[-1])
    sp.register_ulysses_forward(_usp_cross_attention, sp.CROSS_ATTENTION)
    import comfy.ops
    layouts = comfy_env.FP8_LAYOUTS if hasattr(comfy.ops, "mixed_precision_ops") else ()
    cases = {layout: (lambda layout=layout: comfy_env.make_fp8_scaled_wan("t2v", dim=DIM, heads=HEADS, layers=1,
                                                                          text_dim=32, layout=layout), "t2v")
             for layout in layouts}
    cases["i2v"] = (lambda: comfy_env.make_wan("i2v", dim=DIM, heads=HEADS, layers=1, text_dim=32), "i2v")
    out = {}
    try:
        for name, (make, kind) in cases.items():
            patcher = make()
            inputs = _block_inputs(torch, patcher, zero_context=kind == "t2v", kind=kind)
            block = patcher.model.diffusion_model.blocks[0]
            n = inputs["x"].shape[1] // world
            local = slice(rank * n, (rank + 1) * n)
            sharded = {k: (v[:, local].contiguous() if k in ("x", "freqs") else v) for k, v in inputs.items()}
            with torch.no_grad():
                whole = block(**_fresh(inputs))[:, local]
            patched, _ = env.node.apply_patch(patcher, "High", "sdpa", True)
            patched.patch_model(load_weights=False)
            _bind(block, _usp_self_attention)
            try:
                with torch.no_grad():
                    stand_in = type(block).forward(block, **_fresh(sharded))
                    env.core.reset_notices()
                    block(**_fresh(sharded))   # the self-check
                    env.core.drain_tally()
                    ours = block(**_fresh(sharded))
                out[name] = {"vs stand-in": _err(ours, stand_in), "stand-in vs single process": _err(stand_in, whole),
                             "fallbacks": comfy_env.stock_fallbacks(env), "clip tokens": inputs.get("context_img_len"),
                             "splits": {str(k): v for k, v in env.core.drain_tally().splits.items()}}
            finally:
                _unbind(block)
                patched.unpatch_model(unpatch_weights=False)
    finally:
        sp.unregister_ulysses_forward(_usp_self_attention)
        sp.unregister_ulysses_forward(_usp_cross_attention)
    return out


def test_weights_and_inputs_users_feed_over_raylights_ulysses():
    """fp8-scaled weights (both file layouts) with a zeroed negative, and I2V's CLIP image tokens, over 2 ranks:
    the self-check passes on every rank (no block runs ComfyUI's), the heads are exchanged in groups, and the
    pack's block equals ComfyUI's block with raylight's forwards (float32 on the CPU, within 1e-3: the same layers,
    in another order). A ComfyUI without mixed-precision ops runs the I2V case alone."""
    comfy_env.require_comfyui()
    import comfy.ops
    fp8 = hasattr(comfy.ops, "mixed_precision_ops")
    # layers without row slices (v0.8.0's fp8-scaled) keep every head in one exchange, as on one GPU they keep one
    rows = hasattr(comfy.ops, "CastBiasWeightContext")
    for rank, result in enumerate(gloo_ranks.spawn(_user_inputs_checks, 2)):
        assert set(result) == set(comfy_env.FP8_LAYOUTS) | {"i2v"} if fp8 else "i2v" in result, result
        assert result["i2v"]["clip tokens"] == 257
        for name, row in result.items():
            groups = str(HEADS // 2) if rows or name == "i2v" else "1"
            print(f"\nrank {rank} {name}: pack vs raylight's forwards {row['vs stand-in']:.1e}, raylight's vs the "
                  f"single process {row['stand-in vs single process']:.1e}; groups {row['splits']}")
            assert not row["fallbacks"], row["fallbacks"]
            assert row["splits"].get(groups, 0) >= 1, row["splits"]
            assert row["stand-in vs single process"] <= 1e-5, row
            assert row["vs stand-in"] <= 1e-3, row   # float32 on the CPU: the layers dequantize their weights


def _block_peaks(rank: int, world: int) -> dict:
    """Per-rank peaks of a Wan block of the memory tests' proportions (width 512, 16 heads, feed-forward 2.7x,
    512 text tokens; bf16), 8,192 tokens sharded: the pack's bounded block over the stand-in's group and the
    stand-in's own (ComfyUI's block with raylight's forwards), x the rank's |x|."""
    import importlib
    import torch
    import torch.distributed as dist
    env = comfy_env.pack_modules()
    sp = importlib.import_module(env.pack.__name__ + ".nodes.sequence_parallel")
    memory = importlib.import_module(env.pack.__name__ + ".benchmarks.memory")
    env.core.head_split.SPLIT_FLOOR_TOKENS = 1024
    patcher = comfy_env.make_wan("t2v", dim=512, heads=16, layers=1, ffn_dim=1376, text_dim=32,
                                 dtype=torch.bfloat16)
    seen = _block_inputs(torch, patcher, frames=8, side=64, text_tokens=512)
    block = patcher.model.diffusion_model.blocks[0]
    n = seen["x"].shape[1] // world
    local = slice(rank * n, (rank + 1) * n)
    # raylight pads the tokens to a multiple of the world (a new, contiguous tensor) and takes its chunk
    sharded = {k: (v[:, local].contiguous() if k in ("x", "freqs") else v) for k, v in seen.items()}
    patched, _ = env.node.apply_patch(patcher, "High", "sdpa", True)
    patched.patch_model(load_weights=False)
    _GROUP.append(dist.new_group(list(range(world))))
    sp.register_ulysses_forward(_usp_self_attention, sp.SELF_ATTENTION, group=lambda: _GROUP[0])
    sp.register_ulysses_forward(_usp_cross_attention, sp.CROSS_ATTENTION)
    _bind(block, _usp_self_attention)
    x_bytes = sharded["x"].numel() * sharded["x"].element_size()
    peaks = {}
    with torch.no_grad():
        block(**_fresh(sharded))   # the self-check
        env.core.drain_notices()
        for name, fn in (("pack", block), ("stand-in", lambda **kw: type(block).forward(block, **kw))):
            fresh = _fresh(sharded)
            peaks[name] = memory.measure_peak(fn, **fresh, live=[block, list(fresh.values())]).peak_bytes / \
                x_bytes
        peaks["fallbacks"] = comfy_env.stock_fallbacks(env)
        env.core.drain_tally()
        _unbind(block)   # the same block on the rank's tokens alone (no exchange): what the exchange adds
        block(**_fresh(sharded))
        fresh = _fresh(sharded)
        peaks["alone"] = memory.measure_peak(block, **fresh, live=[block, list(fresh.values())]).peak_bytes / \
            x_bytes
    return peaks


def test_the_per_rank_peak_of_the_bounded_block():
    """Over 2 ranks, a Wan block of real proportions: the pack's block holds under a third of the stand-in's
    (ComfyUI's block with raylight's forwards: 9.0 x the rank's |x|), and the exchange adds at most a quarter of
    |x| to the same block run on the rank's tokens alone (its 16 heads exchange in 8 groups of a head a rank:
    each group's buffers 1/8 |x|; Wan 14B's 40 heads in 20)."""
    comfy_env.require_comfyui()
    for rank, peaks in enumerate(gloo_ranks.spawn(_block_peaks, 2)):
        print(f"\nrank {rank}: pack {peaks['pack']:.2f} x|x| (its block on the rank's tokens alone "
              f"{peaks['alone']:.2f}), raylight's forwards in ComfyUI's block {peaks['stand-in']:.2f}")
        assert not peaks["fallbacks"], peaks["fallbacks"]
        assert peaks["pack"] < peaks["stand-in"] / 3, peaks
        assert peaks["pack"] <= peaks["alone"] + 0.25, peaks


# --- raylight's own Wan path ------------------------------------------------------------------------------------
def _raylight_src():
    root = Path(os.environ.get("RAYLIGHT_PATH") or Path.home() / "raylight")
    return root / "src" if (root / "src" / "raylight" / "distributed_modules" / "usp.py").is_file() else None


def _raylight_skip_reason():
    if _raylight_src() is None:
        return "no raylight checkout (RAYLIGHT_PATH or ~/raylight: komikndr/raylight)"
    import importlib.util
    for name in ("xfuser", "yunchang"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed (pip install xfuser==0.4.5 yunchang)"
    return None


def _load_raylight(torch):
    """raylight's bootstrap of xFuser's distributed modules on this machine (its `install_minimal_xfuser`);
    xFuser's attention layer takes yunchang's only where it sees CUDA, so it is told so while it loads."""
    sys.path.insert(0, str(_raylight_src()))
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        import raylight.xfuser_compat as compat
        compat.install_minimal_xfuser()
        import xfuser.core.long_ctx_attention  # noqa: F401
    finally:
        torch.cuda.is_available = available


def _through_raylight(rank: int, world: int) -> dict:
    """One rank's errors, fallback lines and head groups of the tiny Wan through raylight's own path, alone and with
    the pack."""
    import torch
    comfy_env.setup()
    _load_raylight(torch)
    import raylight.distributed_modules.attention as xfuser_attention
    xfuser_attention.set_attn_type("TORCH_MATH")
    xfuser_attention.set_sync_ulysses(False)
    from xfuser.core.distributed import init_distributed_environment, initialize_model_parallel
    init_distributed_environment(rank=rank, world_size=world)
    initialize_model_parallel(sequence_parallel_degree=world, ulysses_degree=world)
    from raylight.distributed_modules.usp import USPInjectRegistry
    import comfy.patcher_extension
    env = comfy_env.pack_modules()
    env.core.head_split.SPLIT_FLOOR_TOKENS = 16
    patcher = comfy_env.make_wan("t2v", dim=DIM, heads=HEADS, layers=2, text_dim=32)
    inputs = comfy_env.make_inputs(patcher, "t2v", frames=FRAMES, h=SIDE, w=SIDE)
    inputs.pop("transformer_options")
    want = comfy_env.model_forward(patcher, inputs)
    result = {"errors": {}, "fallbacks": {}}
    for label, level in (("raylight", None), ("raylight + pack", "High")):
        model = patcher.clone() if level is None else env.node.apply_patch(patcher, level, "sdpa", True)[0]
        model.add_callback(comfy.patcher_extension.CallbacksMP.ON_LOAD, USPInjectRegistry.inject)
        model.patch_model(device_to=torch.device("cpu"))   # object patches, then raylight's injection
        try:
            env.core.reset_notices()
            env.core.drain_tally()
            for call in ("first", "second"):
                with torch.no_grad():
                    got = model.model.diffusion_model(**{k: comfy_env.fresh(v) for k, v in inputs.items()},
                                                      transformer_options={})
                result["errors"][f"{label}, {call} call"] = _err(got, want)
            result["fallbacks"][label] = comfy_env.stock_fallbacks(env)
            result.setdefault("splits", {})[label] = {str(k): v for k, v in env.core.drain_tally().splits.items()}
        finally:
            model.unpatch_model()
            for block in model.model.diffusion_model.blocks:   # raylight's binding goes with its model
                _unbind(block)
    return result


def test_through_raylights_own_wan_path():
    comfy_env.require_comfyui()
    reason = _raylight_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    results = gloo_ranks.spawn(_through_raylight, 2)
    for rank, result in enumerate(results):
        print(f"\nraylight rank {rank}: " + ", ".join(f"{k} {v:.1e}" for k, v in result["errors"].items())
              + f"; groups {result['splits']}")
        assert all(err <= TOLERANCE for err in result["errors"].values()), result["errors"]
        assert not result["fallbacks"]["raylight + pack"]
        assert result["splits"]["raylight + pack"].get(str(HEADS // 2), 0) >= 2, result["splits"]
        assert result["splits"]["raylight"] == {}, result["splits"]


def test_the_raylight_benchmark_runs_on_the_cpu(tmp_path):
    """`--raylight-model --tiny` (benchmarks/raylight_model.py) under torchrun on 2 CPU processes: raylight alone
    and with the pack sample the same latent, through raylight's own code."""
    import subprocess
    root = comfy_env.require_comfyui()
    reason = _raylight_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "benchmarks.bench", "--comfyui", str(root), "--raylight-model", "--raylight-root",
                           str(_raylight_src().parent), "--device", "cpu", "--tiny", "--format", "bf16",
                           "--frames", "5", "--size", "128x128", "--steps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=str(comfy_env.REPO_ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [row["method"] for row in report["rows"]] == ["raylight", "raylight + pack"]
    assert all(row["fits"] for row in report["rows"]) and report["difference"] < 1e-3, report
