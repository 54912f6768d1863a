"""Benchmark workload: ComfyUI's own Wan 2.x 14B `WanAttentionBlock` (`python -m benchmarks.bench --comfyui`).

Not part of the node pack's runtime (until this change it was `nodes/bench_wan.py`). It imports ComfyUI and
the pack's adapter relatively (`from ..nodes.families import wan`, `from ..qkv_core import ...`, `from .memory import
...`), so it is imported only as `<pack package>.benchmarks.wan_block`: the runner (`benchmarks/bench.py`,
`load_pack_module`) makes that package for the pack without running the pack's `__init__.py` or
`nodes/__init__.py` (they import `comfy_api`, which needs packages a bare benchmark machine lacks), after it
has put ComfyUI on `sys.path` and set its flags, and then calls `make_workload(bench)` with the running
runner module. The tests import it through `comfy_env.load_pack()`'s package instead.

The block: `comfy.ldm.wan.model.WanAttentionBlock("t2v_cross_attn", 5120, 13824, 40, qk_norm=True,
cross_attn_norm=True, eps=1e-6)` with `comfy.ops.disable_weight_init` layers, random bf16 weights. Its inputs
as `WanModel.forward_orig` passes them: x `(1, N, 5120)`, e0 `(1, 1, 6, 5120)` (plain T2V/I2V), freqs from
`EmbedND(128, 10000, [44, 42, 42])` over the (t, h, w) ids in x's dtype, `.movedim(1, 2)`, context
`(1, 512, 5120)`. Methods: "stock" = the block's own forward (ComfyUI's attention); "qkv attention only" =
`self_attn` / `cross_attn` forwards replaced by the adapter's (instance attributes, restored after), block
forward stock; "qkv block" = `wan.bounded_block_forward`.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch

import comfy.ldm.flux.math as flux_math
import comfy.ldm.modules.attention as comfy_attention
import comfy.ldm.wan.model as wan_model
import comfy.model_management
import comfy.ops
from comfy.ldm.flux.layers import EmbedND

import time

from ..nodes import comfy_ops, compat
from ..nodes.families import wan
from ..nodes.dispatch import QKVConfig
from ..qkv_core import LEVEL_NAMES, group_count
from .memory import GiB, measure_peak

WIDTH, HEADS, HEAD_DIM, FFN, TEXT_TOKENS, EPS = 5120, 40, 128, 13824, 512, 1e-6
CHUNK_MIN_TOKENS = 256   # comfy_ops.chunk_tokens' `minimum`: an absolute token count, scaled on scaled runs


def comfyui_version() -> str:
    try:
        import comfyui_version
        return comfyui_version.__version__
    except Exception:  # noqa: BLE001 - a checkout without the file
        return "?"


def kitchen_note() -> str:
    """comfy_kitchen (ComfyUI's kernels, e.g. its RoPE): version and the backends that are on, or absent."""
    try:
        import comfy_kitchen as ck
        from importlib.metadata import version
        backends = [name for name, info in ck.list_backends().items()
                    if info.get("available") and not info.get("disabled")]
        try:
            ck_version = version("comfy-kitchen")
        except Exception:  # noqa: BLE001 - imported from a path without metadata
            ck_version = "?"
        return f"comfy_kitchen {ck_version}, backends on: {', '.join(backends) or 'none'}"
    except Exception as e:  # noqa: BLE001
        return f"comfy_kitchen not importable ({type(e).__name__})"


def random_like(shape, name: str, generator, device) -> torch.Tensor:
    """Values at a trained model's scale for the parameter `name` of `shape`, float32 on `device`: Linear
    weights N(0, 1/fan_in), norm weights 1 + N(0, 0.1^2), modulation N(0, 0.3^2) (gates of about 0.3),
    biases and the rest N(0, 0.02^2)."""
    v = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "weight" and "norm" in name:
        return v.mul_(0.1).add_(1.0)
    if leaf == "weight" and len(shape) >= 2:
        return v.div_(math.sqrt(math.prod(shape[1:])))
    if "modulation" in leaf:
        return v.mul_(0.3)
    return v.mul_(0.02)


def fill_random_(module: torch.nn.Module, seed: int) -> None:
    """ComfyUI's ops leave parameters uninitialised: `random_like` for each, drawn on the parameter's device."""
    generator = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(random_like(tuple(p.shape), name, generator, p.device))


FP8_SCALED = "fp8_scaled"
GGUF_Q8_0 = "gguf_q8_0"
WEIGHT_DTYPES = {"same": None, "fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                 FP8_SCALED: FP8_SCALED, GGUF_Q8_0: GGUF_Q8_0}


def build_block(device, dtype, seed: int, weight_dtype=None, gguf_pack=None) -> torch.nn.Module:
    """The block with `dtype` weights; or `weight_dtype` (fp8) weights cast to `dtype` per call by ComfyUI's
    manual-cast ops (what `weight_dtype fp8_e4m3fn` in the diffusion model loader gives); or, for
    "fp8_scaled", ComfyUI's mixed-precision ops with per-tensor-scaled fp8 `QuantizedTensor` Linear weights
    (what Comfy-Org's `*_fp8_scaled` checkpoints load as; no input scale: quantized per call); or, for
    "gguf_q8_0", city96/ComfyUI-GGUF's ops (from the checkout at `gguf_pack`) with Q8_0 Linear weights."""
    scaled, gguf = weight_dtype == FP8_SCALED, weight_dtype == GGUF_Q8_0
    cast = weight_dtype is not None and not (scaled or gguf)
    operations = comfy.ops.manual_cast if cast else comfy.ops.disable_weight_init
    settings = {"operations": operations, "device": device, "dtype": weight_dtype if cast else dtype}
    block = wan_model.WanAttentionBlock("t2v_cross_attn", WIDTH, FFN, HEADS, qk_norm=True, cross_attn_norm=True,
                                        eps=EPS, operation_settings=settings)
    fill_random_(block, seed)
    if scaled:
        block = _fp8_scaled(block, device, dtype)
    if gguf:
        block = _gguf_q8_0(block, device, dtype, gguf_pack)
    return block.eval().requires_grad_(False)


def import_gguf_ops(path, module: str = "ops"):
    """city96/ComfyUI-GGUF's `ops` module (or another of its modules) from its checkout at `path`, imported
    inside a package made for it without running its `__init__` (which registers its nodes)."""
    import importlib
    import importlib.util
    import os
    import sys
    import types
    if not path or not os.path.isfile(os.path.join(path, "ops.py")):
        raise SystemExit(f"--weight-dtype {GGUF_Q8_0} needs city96/ComfyUI-GGUF: pass its checkout with "
                         f"--gguf-pack PATH (got {path!r}); it also needs the `gguf` package")
    name = "qkv_bench_comfyui_gguf"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [os.path.abspath(path)]
        package.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        package.__spec__.submodule_search_locations = package.__path__
        sys.modules[name] = package
    return importlib.import_module(f"{name}.{module}")


@contextlib.contextmanager
def gguf_under_memory_tracker(ops):
    """Lets ComfyUI-GGUF's layers (`ops`: its ops module) run under the CPU's `MemTracker` (a dispatch mode):
    there a dequantized weight keeps the `GGMLTensor` class (outside it is a plain tensor), and the layer's
    `torch.Tensor(weight)` then calls `GGMLTensor.__init__` without its keyword arguments. Meanwhile such a
    call leaves the view as it is (its shape is its data's). Measurement only: nothing computed changes."""
    cls = ops.GGMLTensor
    original = cls.__init__

    def tolerant_init(self, *args, tensor_type=None, tensor_shape=None, patches=(), **kwargs):
        if tensor_shape is not None:
            original(self, *args, tensor_type=tensor_type, tensor_shape=tensor_shape, patches=list(patches),
                     **kwargs)

    cls.__init__ = tolerant_init
    try:
        yield
    finally:
        cls.__init__ = original


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 blocks of a 2-D weight, as `gguf.quants` writes them: per 32 values of a row, an fp16 scale
    (max |w| / 127) then 32 int8 values; `(rows, in / 32 * 34)` uint8 (each row is whole blocks)."""
    rows, width = weight.shape
    blocks = weight.float().reshape(rows, width // 32, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    values = (blocks * inverse).round().to(torch.int8)
    raw = torch.cat([scale.to(torch.float16).view(torch.uint8), values.view(torch.uint8)], dim=-1)
    return raw.reshape(rows, -1)


def _gguf_q8_0(block, device, dtype, gguf_pack):
    """`block` rebuilt with ComfyUI-GGUF's `GGMLOps`, its Linear weights Q8_0 and everything else F32
    `GGMLTensor`s (what its loader hands over for a Q8_0 file of a Wan model)."""
    ops = import_gguf_ops(gguf_pack)
    types = ops.gguf.GGMLQuantizationType
    linears = {name for name, module in block.named_modules() if isinstance(module, torch.nn.Linear)}
    state = {}
    for key, value in block.state_dict().items():
        if key.rsplit(".", 1)[0] in linears and key.endswith(".weight"):
            state[key] = ops.GGMLTensor(quantize_q8_0(value), tensor_type=types.Q8_0, tensor_shape=value.shape)
        else:
            state[key] = ops.GGMLTensor(value.float(), tensor_type=types.F32, tensor_shape=value.shape)
    del block
    operations = ops.GGMLOps()
    operations.Linear.dequant_dtype = operations.Linear.patch_dtype = None   # the loader's defaults
    settings = {"operations": operations, "device": device, "dtype": dtype}
    gguf_block = wan_model.WanAttentionBlock("t2v_cross_attn", WIDTH, FFN, HEADS, qk_norm=True,
                                             cross_attn_norm=True, eps=EPS, operation_settings=settings)
    gguf_block.load_state_dict(state, strict=False)
    return gguf_block


def _fp8_scaled(block, device, dtype):
    """`block` rebuilt with mixed-precision ops, its Linear weights quantized to fp8 with per-tensor scales
    (the state dict an fp8-scaled checkpoint gives ComfyUI's loader)."""
    import json
    linears = {name for name, module in block.named_modules() if isinstance(module, torch.nn.Linear)}
    state = block.state_dict()
    for name in linears:
        weight = state[f"{name}.weight"].float()
        scale = weight.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
        state[f"{name}.weight"] = (weight / scale).to(torch.float8_e4m3fn)
        state[f"{name}.weight_scale"] = scale.reshape(())
        state[f"{name}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                    dtype=torch.uint8)
    del block
    settings = {"operations": comfy.ops.mixed_precision_ops({}, dtype), "device": device, "dtype": dtype}
    scaled = wan_model.WanAttentionBlock("t2v_cross_attn", WIDTH, FFN, HEADS, qk_norm=True, cross_attn_norm=True,
                                         eps=EPS, operation_settings=settings)
    scaled.load_state_dict(state, strict=False)
    return scaled


def rope_freqs(grid, tokens: int, device, dtype, head_dim: int = HEAD_DIM) -> torch.Tensor:
    """`WanModel.rope_encode` for the first `tokens` positions of the latent grid (t, h, w): ids in x's
    dtype, `EmbedND(...)(ids).movedim(1, 2)` -> float32 `(1, tokens, 1, 64, 2, 2)`."""
    t, h, w = grid
    if tokens > t * h * w:
        t = math.ceil(tokens / (h * w))
    ids = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)
    ids = ids.reshape(1, -1, 3)[:, :tokens].to(device=device, dtype=dtype)
    d = head_dim
    embed = EmbedND(dim=d, theta=10000.0, axes_dim=[d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])
    return embed(ids).movedim(1, 2)


@contextlib.contextmanager
def patched_attention(block, config):
    """The adapter's attention forwards as instance attributes (as ComfyUI's object patches set them)."""
    block.self_attn.forward = wan.self_attention_forward(block.self_attn, config)
    block.cross_attn.forward = wan.cross_attention_forward(block.cross_attn, config)
    try:
        yield
    finally:
        del block.self_attn.forward
        del block.cross_attn.forward


def stock_part_peaks(block, x, e, freqs, context, device, live) -> list:
    """Peaks of the stock block's three parts, each above its own input (and the block's inputs and weights),
    its result included: self-attention of the modulated input, cross-attention of norm3(x), FFN of the
    modulated x."""
    parts = []
    mod = comfy.model_management.cast_to(block.modulation, dtype=x.dtype, device=x.device).unsqueeze(0)
    ee = (mod + e).unbind(2)
    inp = torch.addcmul(ee[0], block.norm1(x), 1 + ee[1])
    peak = measure_peak(block.self_attn, inp, freqs, device=device, live=[live, ee])
    parts.append(("self-attention", peak.peak_bytes))
    x = torch.addcmul(x, peak.result, ee[2])
    del inp, peak
    inp = block.norm3(x)
    peak = measure_peak(block.cross_attn, inp, context, device=device, live=[live, ee, x])
    parts.append(("cross-attention", peak.peak_bytes))
    x = x + peak.result
    del inp, peak
    inp = torch.addcmul(ee[3], block.norm2(x), 1 + ee[4])
    del x
    peak = measure_peak(block.ffn, inp, device=device, live=[live, ee])
    parts.append(("FFN", peak.peak_bytes))
    del inp, peak
    return parts


def self_check_ms(block, x, inputs, config) -> float:
    """What the self-check costs, once per process: the first call of a fresh bounded-block forward (stock and
    the pack's forward on 256 tokens, then the call itself) less a second call."""
    compat.forget_verdicts()
    forward = wan.bounded_block_forward(block, config)
    times = []
    for _ in range(2):
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        forward(x, **inputs)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        times.append(time.perf_counter() - start)
    return (times[0] - times[1]) * 1000


def make_workload(bench):
    """The workload class, built on the running bench module's `Workload` and dataclasses."""

    class ComfyUIWanBlockWorkload(bench.Workload):
        name = "comfyui-wan-block"
        default_levels = "high"
        default_cpu_scale = 32    # a whole block (several times the self-attention's work) in minutes on 2 cores

        def __init__(self):
            self.version = comfyui_version()
            self.label = f"ComfyUI v{self.version} Wan 2.x 14B block"
            self.title = (f"{self.label}: comfy.ldm.wan.model.WanAttentionBlock(t2v, 5120 wide, FFN 13824, 40 "
                          f"heads x 128, qk_norm, cross_attn_norm), random bf16 weights; e0 (1, 1, 6, 5120), "
                          f"context 512 tokens")

        def add_arguments(self, parser):
            parser.add_argument("--qkv-backend", default="sdpa",
                                help="comfyui workload: the attention backend of the qkv methods (default sdpa)")
            parser.add_argument("--no-parts", action="store_true",
                                help="comfyui workload: skip the stock per-part peaks")
            parser.add_argument("--weight-dtype", choices=sorted(WEIGHT_DTYPES), default="same",
                                help="comfyui workload: the block's weight format: fp8_* stored and cast per "
                                     "call by ComfyUI's manual-cast ops, fp8_scaled (mixed-precision "
                                     "QuantizedTensor layers), gguf_q8_0 (city96/ComfyUI-GGUF, see "
                                     "--gguf-pack); default: the compute dtype")
            parser.add_argument("--gguf-pack", default=os.environ.get("COMFYUI_GGUF_PATH"),
                                help="comfyui workload: a city96/ComfyUI-GGUF checkout, for --weight-dtype "
                                     "gguf_q8_0 (default: $COMFYUI_GGUF_PATH)")

        def cases(self, args):
            return bench.WORKLOADS["wan-self-attention"].cases(args)

        @contextlib.contextmanager
        def scaled(self, scale):
            """The pack's chunking has one absolute token count (chunk_tokens' minimum of 256 tokens):
            scaled with the tokens, like the runtime's constants, so a scaled run chunks as at full size."""
            saved = comfy_ops.chunk_tokens.__defaults__
            if scale != 1:
                comfy_ops.chunk_tokens.__defaults__ = (max(1, math.ceil(CHUNK_MIN_TOKENS / scale)),)
            try:
                yield
            finally:
                comfy_ops.chunk_tokens.__defaults__ = saved

        def scaling_notes(self, scale):
            if scale == 1:
                return []
            return [f"The pack's token-chunk minimum (nodes/comfy_ops.chunk_tokens) is scaled alike: "
                    f"{CHUNK_MIN_TOKENS} -> {max(1, math.ceil(CHUNK_MIN_TOKENS / scale))} tokens; and the prompt: "
                    f"{TEXT_TOKENS} -> {max(1, round(TEXT_TOKENS / scale))} text tokens."]

        def setup(self, case, device, dtype, args):
            block = build_block(device, dtype, args.seed, WEIGHT_DTYPES[args.weight_dtype], args.gguf_pack)
            generator = torch.Generator(device="cpu").manual_seed(args.seed + 1)
            x0 = torch.randn(1, case.tokens, WIDTH, generator=generator).to(device=device, dtype=dtype)
            e = (torch.randn(1, 1, 6, WIDTH, generator=generator) * 0.1).to(device=device, dtype=dtype)
            # the prompt is scaled with the video: unscaled, its 512 tokens beside a scaled run's ~1,000 video
            # tokens weighed 30x more than at full size (a CPU run at 480p read 4.51 x |x| at High, the H200 2.41)
            text_tokens = max(1, round(TEXT_TOKENS * case.tokens / case.full_tokens))
            context = torch.randn(1, text_tokens, WIDTH, generator=generator).to(device=device, dtype=dtype)
            freqs = rope_freqs(case.grid, case.tokens, device, dtype)
            inputs = dict(e=e, freqs=freqs, context=context)
            live = [block, x0, e, freqs, context]

            def tracked():   # GGUF layers under the CPU's MemTracker need a measurement-only patch
                if args.weight_dtype == GGUF_Q8_0 and device.type == "cpu":
                    return gguf_under_memory_tracker(import_gguf_ops(args.gguf_pack))
                return contextlib.nullcontext()

            def stock(xl):
                with tracked():
                    return block(xl[0], **inputs)

            methods = [bench.Method(f"stock (ComfyUI v{self.version})", stock, 1)]
            for level in args.levels:
                config = QKVConfig(level, args.qkv_backend, True)
                level_name = LEVEL_NAMES[level].capitalize()
                groups = group_count(HEADS, case.tokens, level)

                def attention_only(xl, config=config):
                    with patched_attention(block, config), tracked():
                        return block(xl[0], **inputs)

                def bounded(xl, forward=wan.bounded_block_forward(block, config)):
                    with tracked():
                        return forward(xl[0], **inputs)

                methods.append(bench.Method(f"qkv attention only {level_name}", attention_only, groups))
                methods.append(bench.Method(f"qkv block {level_name}", bounded, groups))

            weights = sum(p.untyped_storage().nbytes() for p in block.parameters())
            rope = flux_math.apply_rope1
            notes = [f"ComfyUI {self.version}; attention: comfy.ldm.modules.attention.optimized_attention = "
                     f"{getattr(comfy_attention.optimized_attention, '__name__', '?')}; apply_rope1: "
                     f"{getattr(rope, '__module__', '?')}.{getattr(rope, '__name__', '?')} ({kitchen_note()}); qkv backend "
                     f"{args.qkv_backend}; block weights {weights / GiB:.2f} GiB ({args.weight_dtype}"
                     f"{', manual cast' if args.weight_dtype.startswith('fp8_e') else ''})"]
            if args.levels:
                cost = self_check_ms(block, x0, inputs, QKVConfig(max(args.levels), args.qkv_backend, True))
                notes.append(f"self-check of the bounded block (once per process): {cost:.1f} ms")
            def extras():
                return stock_part_peaks(block, x0, e, freqs, context, device, live)
            return bench.Prepared(live=live, make_input=lambda: [x0], unit_bytes=x0.numel() * x0.element_size(),
                                  methods=methods, notes=notes, extras=None if args.no_parts else extras)

    return ComfyUIWanBlockWorkload()
