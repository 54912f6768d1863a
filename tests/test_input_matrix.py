"""The inputs users feed, in a matrix (issue 34 item 3): for every patched family, weight formats x conditioning,
at a length just above the family's split floor (lowered, as tests/test_family_contract.py lowers it).

A row (family, weight format, conditioning) runs the family's tiny model (tests/family_cases.py; Kandinsky 5 and
Wan I2V from their adapter tests' helpers), rebuilt in that format the way ComfyUI's loaders build it
(tests/formats.py), once as ComfyUI runs it and once patched (High, block bounds, SDPA) on the same inputs: cond
and uncond in one batch of two (HunyuanVideo: one item, its forward takes one text mask for the batch) with the
odd conditioning in the FIRST item (the one the self-check took alone before it took every distinct
conditioning). It asserts:
  * no "runs as ComfyUI's own" fallback: every self-check passed (verdicts are forgotten before each row, so each
    row's own conditionings are checked);
  * the head split ran: the longest self-attention calls (the real run's; the checks take at most 256 image
    tokens) attend one head group;
  * the output is as close to the float32 reference as ComfyUI's own: the same model in float32 with its weights
    dequantized, on the same (rounded) inputs in float32 (`compat.exact_reference` over the whole diffusion
    model); |ours - ref| <= 1.25 |stock - ref| + round-off x |ref| (float32 1e-4, bf16 4e-3, fp16 2e-3); where
    the compute is float32 and no input is quantized (GGUF) ours also equals stock within 1e-5.

Formats (tests/formats.py): bf16, fp16, fp8 cast per call (bf16 compute), fp8-scaled in both file layouts
(comfy_quant with per-call input scales, Comfy-Org's scaled_fp8 with a stored input scale; bf16 compute),
int8_tensorwise (bf16 compute), GGUF Q8_0 and Q4_K (float32 compute; Q4_K with llama.cpp's Q5_0 fallback for
the layers whose input is not a multiple of 256, as K-quant files hold them).
Conditioning: random text; zeros (ConditioningZeroOut: context and pooled output zeroed, text masks and HiDream's
llama3 states as they were); a short prompt padded to the text length (3 random tokens, then zeros; the text mask
marks the padding where the forward takes one: HunyuanVideo, LTX-Video); a long context (8x the text length).
Where the family has them: Wan I2V's CLIP vision features (its own model, in every one of its rows) and
reference latents (Flux Kontext, Qwen-Image-Edit: the "reference" conditioning).

The full product (10 families x 8 formats x 4-5 conditionings, three whole-model forwards and the self-checks a
row) is too slow for the suite's budget on 2 cores (this file: <= 3 minutes on v0.33.0). The CPU rows cover every
format for every family with the zeroed negative (item 0 zeros, item 1 random text), and every conditioning for
every family in bf16 and in fp8-scaled (comfy_quant); Wan I2V in those two formats with zeros and random text.
The GPU rows (`pytest -m gpu`, with COMFY_ENV_GPU=1; skipped without CUDA) run fp8-scaled in both layouts in bf16
on CUDA with 4x the tokens, every conditioning of every family; there the layers quantize their inputs for real
fp8 matmuls (a scaled-mm kernel must run in ComfyUI's own forward). Skipped without ComfyUI; formats a ComfyUI
lacks skip with the reason (v0.8.0: the mixed-precision formats, fp8-scaled and int8_tensorwise).

A GGUF F16 file (every Linear weight a torch-compatible F16 GGML tensor, as city96 publishes them beside the
quantized ones) splits too: its layers compute ComfyUI's own cast-then-linear (`comfy_ops.gguf_layer_without_quants`).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable, NamedTuple, Optional

import pytest

from support import comfy_env
from support import family_cases
from support import formats

pytestmark = pytest.mark.comfyui

# The matrix's split floor (tokens of one item, after each family's split_floor_scale): the rows' images are 288
# tokens an item, just above it and above the self-check's 256 (so the real run's attention is the longest the
# spy sees). The GPU rows: sides twice as long (1,152 image tokens an item) above a floor of 1,024.
MATRIX_FLOOR = 256
GPU_SIZE, GPU_FLOOR = 2, 1024
TEXT = 12              # text tokens of a prompt
PROMPT = 3             # real tokens of the short prompt (the rest padding)
LONG = 8               # the long context: LONG x TEXT tokens
ROUND_OFF = {"float32": 1e-4, "bfloat16": 4e-3, "float16": 2e-3}
MARGIN = 1.25
CONDS = ("random", "zeros", "padded", "long")


# ----------------------------------------------------------------------------------------------- inputs

class Text(NamedTuple):
    """The text inputs of a batch for one conditioning, float32: context (batch, tokens, dim), a pooled vector
    (or None), a mask of real tokens (batch, tokens) long."""
    context: object
    pooled: object
    mask: object


def text(torch, cond, batch, dim, pooled_dim=None, tokens=TEXT, seed=2, extra_dims=()):
    """`cond`'s text for a batch: item 0 carries the odd conditioning, the others random text. Returns
    (Text, extras): `extras` are further text tensors of shape (batch, *lead, tokens, d) for each (lead, d) in
    `extra_dims` (HiDream's llama3 states), padded like the context, never zeroed (ConditioningZeroOut keeps
    them)."""
    g = torch.Generator().manual_seed(seed)
    length = tokens * LONG if cond == "long" else tokens
    context = torch.randn(batch, length, dim, generator=g)
    pooled = torch.randn(batch, pooled_dim, generator=g) if pooled_dim else None
    mask = torch.ones(batch, length, dtype=torch.long)
    extras = [torch.randn(batch, *lead, length, d, generator=g) for lead, d in extra_dims]
    if cond == "zeros":
        context[0] = 0
        if pooled is not None:
            pooled[0] = 0
    elif cond == "padded":
        context[0, PROMPT:] = 0
        mask[0, PROMPT:] = 0
        for e in extras:
            e[0, ..., PROMPT:, :] = 0
    return Text(context, pooled, mask), extras


def _latent(torch, *shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def wan_inputs(torch, cond, model, size=1):
    dm = model.diffusion_model
    t, _ = text(torch, cond, 2, dm.text_embedding[0].weight.shape[1], tokens=16)
    out = dict(x=_latent(torch, 2, dm.patch_embedding.weight.shape[1], 2, 24 * size, 24 * size),
               timestep=torch.tensor([500.0, 500.0]), context=t.context)
    if getattr(dm, "img_emb", None) is not None:   # I2V: CLIP vision features of the start image
        out["clip_fea"] = _latent(torch, 2, 257, 1280, seed=3)
    return out


def flux_inputs(torch, cond, model, size=1):
    t, _ = text(torch, cond, 2, 32, pooled_dim=32)
    out = dict(x=_latent(torch, 2, 16, 32 * size, 36 * size), timestep=torch.tensor([0.7, 0.7]), context=t.context,
               y=t.pooled)
    if cond == "reference":   # Flux Kontext: a reference image's latent joined to the image tokens
        out["ref_latents"] = [_latent(torch, 2, 16, 16 * size, 16 * size, seed=4)]
    return out


def hunyuan_inputs(torch, cond, model, size=1):
    import inspect
    import comfy.ldm.hunyuan_video.model as hunyuan_model
    t, _ = text(torch, cond, 1, 32, pooled_dim=32, tokens=16)
    out = dict(x=_latent(torch, 1, 16, 2, 24 * size, 24 * size), timestep=torch.tensor([700.0]), context=t.context, y=t.pooled)
    if "attention_mask" in inspect.signature(hunyuan_model.HunyuanVideo.forward).parameters:
        mask = t.mask.float()
        if cond != "padded":
            mask[:, -4:] = 0   # the case's text padding
        out["attention_mask"] = mask
    return out


def qwen_inputs(torch, cond, model, size=1):
    t, _ = text(torch, cond, 2, 48)
    out = dict(x=_latent(torch, 2, 16, 1, 32 * size, 36 * size), timestep=torch.tensor([0.5, 0.5]), context=t.context)
    if cond == "reference":   # Qwen-Image-Edit: the reference image's latent joined to the image tokens
        out["ref_latents"] = [_latent(torch, 2, 16, 1, 16 * size, 16 * size, seed=4)]
    return out


def lumina_inputs(torch, cond, model, size=1):
    from test_lumina_adapter import CAPTION_DIM
    t, _ = text(torch, cond, 2, CAPTION_DIM)
    # no text mask: ComfyUI passes one only for a batch of prompts of unequal lengths, v0.33's forward ignores it
    # and v0.8.0's context refiner cannot take it in 16 bits (a long mask in its SDPA)
    return dict(x=_latent(torch, 2, 16, 32 * size, 36 * size), timesteps=torch.tensor([0.6, 0.6]), context=t.context,
                num_tokens=t.context.shape[1])


def ltx_inputs(torch, cond, model, size=1):
    from test_ltx_adapter import CAPTION
    t, _ = text(torch, cond, 2, CAPTION)
    mask = t.mask
    if cond != "padded":
        mask[:, -3:] = 0   # the case's text padding
    return dict(x=_latent(torch, 2, 16, 2, 12 * size, 12 * size), timestep=torch.tensor([0.5, 0.5]), context=t.context,
                attention_mask=mask, frame_rate=25)


def sd3_inputs(torch, cond, model, size=1):
    from test_sd3_adapter import CONTEXT
    t, _ = text(torch, cond, 2, CONTEXT, pooled_dim=32)
    return dict(x=_latent(torch, 2, 16, 32 * size, 36 * size), timesteps=torch.tensor([700.0, 700.0]), context=t.context,
                y=t.pooled)


def cosmos_inputs(torch, cond, model, size=1):
    from test_cosmos_adapter import TEXT_DIM
    t, _ = text(torch, cond, 2, TEXT_DIM)
    return dict(x=_latent(torch, 2, 16, 1, 32 * size, 36 * size), timesteps=torch.tensor([0.5, 0.5]), context=t.context)


def hidream_inputs(torch, cond, model, size=1):
    t, (llama,) = text(torch, cond, 2, 32, pooled_dim=32, tokens=8, extra_dims=[((2,), 32)])
    return dict(x=_latent(torch, 2, 16, 32 * size, 36 * size), t=torch.tensor([0.5, 0.5]), y=t.pooled, context=t.context,
                encoder_hidden_states_llama3=llama)


def kandinsky5_inputs(torch, cond, model, size=1):
    from test_kandinsky5_adapter import POOLED_DIM, TEXT_DIM
    t, _ = text(torch, cond, 2, TEXT_DIM, pooled_dim=POOLED_DIM, tokens=10)
    return dict(x=_latent(torch, 2, 33, 2, 24 * size, 24 * size), timestep=torch.tensor([0.6, 0.6]), context=t.context,
                y=t.pooled)


def minimax_inputs(torch, cond, model, size=1):
    from test_minimax_adapter import TEXT_DIM
    t, _ = text(torch, cond, 1, TEXT_DIM)   # batch 1: ComfyUI runs H3's cond and uncond apart
    return dict(x=[_latent(torch, 1, 24, 2, 24 * size, 24 * size), _latent(torch, 1, 32, 2, 8, seed=3)],
                timestep=torch.tensor([600.0]), context=t.context)


def cogvideox_inputs(torch, cond, model, size=1):
    from test_cogvideox_adapter import TEXT_DIM
    t, _ = text(torch, cond, 2, TEXT_DIM)
    return dict(x=_latent(torch, 2, 16, 2, 24 * size, 24 * size), timestep=torch.tensor([500.0, 500.0]),
                context=t.context)


def mochi_inputs(torch, cond, model, size=1):
    from test_mochi_adapter import TEXT_DIM
    t, _ = text(torch, cond, 2, TEXT_DIM)
    mask = t.mask.bool()
    return dict(x=_latent(torch, 2, 12, 2, 24 * size, 24 * size), timestep=torch.tensor([0.6, 0.6]),
                context=t.context, attention_mask=mask, num_tokens=int(mask.sum(1).max()))


# ----------------------------------------------------------------------------------------------- families

def _case_model(name):
    return lambda: family_cases.case(name).patcher


def _wan_i2v():
    return comfy_env.make_wan("i2v", dim=128, heads=4, layers=1)


def _kandinsky5():
    if importlib.util.find_spec("comfy.ldm.kandinsky5") is None:
        pytest.skip("this ComfyUI has no Kandinsky 5")
    from test_kandinsky5_adapter import VIDEO, kandinsky_model
    return kandinsky_model(dict(VIDEO, num_visual_blocks=1))


def _minimax():
    from test_minimax_adapter import has_minimax, minimax_model
    if not has_minimax():
        pytest.skip("this ComfyUI has no MiniMax H3")
    return minimax_model()


def _cogvideox():
    from test_cogvideox_adapter import CONFIG, cogvideox_model, has_cogvideox
    if not has_cogvideox():
        pytest.skip("this ComfyUI has no CogVideoX")
    return cogvideox_model(dict(CONFIG, num_layers=1))


def _mochi():
    from test_mochi_adapter import CONFIG, mochi_model
    return mochi_model(dict(CONFIG, depth=1), small_feed_forward=False)   # rebuilt by formats.py from its config


class Family(NamedTuple):
    model: Callable          # () -> the float32 ModelPatcher
    inputs: Callable         # (torch, cond, base model) -> float32 kwargs of the diffusion model
    adapter: str             # nodes/<adapter>.py
    kv_heads: int
    heads: Optional[int] = None
    extra: tuple = ()        # conditionings only this family has
    rows: Optional[tuple] = None   # ((format, conditioning), ...) instead of the sweeps


FAMILIES = {
    "wan": Family(_case_model("wan"), wan_inputs, "wan", 4),
    # Wan I2V: the CLIP vision features of the start image in every row (its own model)
    "wan_i2v": Family(_wan_i2v, wan_inputs, "wan", 4,
                      rows=(("bf16", "zeros"), ("bf16", "random"), ("fp8_scaled", "zeros"), ("fp8_scaled", "random"))),
    "flux": Family(_case_model("flux"), flux_inputs, "flux", 4, extra=("reference",)),
    "hunyuan_video": Family(_case_model("hunyuan_video"), hunyuan_inputs, "flux", 4),
    "qwen_image": Family(_case_model("qwen_image"), qwen_inputs, "qwen_image", 4, extra=("reference",)),
    "lumina2": Family(_case_model("lumina2"), lumina_inputs, "lumina", 4, heads=8),
    "ltx_video": Family(_case_model("ltx_video"), ltx_inputs, "ltx", 4),
    "sd3": Family(_case_model("sd3"), sd3_inputs, "sd3", 4),
    "cosmos_predict2": Family(_case_model("cosmos_predict2"), cosmos_inputs, "cosmos", 4),
    "hidream": Family(_case_model("hidream"), hidream_inputs, "hidream", 4),
    "kandinsky5": Family(_kandinsky5, kandinsky5_inputs, "kandinsky5", 4),
    "minimax_h3": Family(_minimax, minimax_inputs, "minimax", 4),
    "cogvideox": Family(_cogvideox, cogvideox_inputs, "cogvideox", 4),
    "mochi": Family(_mochi, mochi_inputs, "mochi", 4),
}

# every format with the zeroed negative; every conditioning in bf16 and fp8-scaled (see the module docstring)
SWEEP_COND = "zeros"
COND_FORMATS = ("bf16", "fp8_scaled")


def _rows():
    rows = []
    for family, spec in FAMILIES.items():
        if spec.rows is not None:
            rows.extend((family, fmt, cond) for fmt, cond in spec.rows)
            continue
        for fmt in formats.FORMATS:
            rows.append((family, fmt, SWEEP_COND))
        for fmt in COND_FORMATS:
            for cond in CONDS + spec.extra:
                if cond != SWEEP_COND:
                    rows.append((family, fmt, cond))
    return rows


ROWS = _rows()


# ----------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def env():
    with comfy_env.split_floor_tokens(comfy_env.pack_modules(), MATRIX_FLOOR) as modules:
        yield modules


@pytest.fixture(scope="module")
def models():
    """Built models, one per (family, format, device) for the module: (family, format, device) -> ModelPatcher."""
    cache = {}

    def get(family, fmt, device="cpu"):
        key = (family, fmt, str(device))
        if key not in cache:
            base_key = (family, "float32", "cpu")
            if base_key not in cache:
                cache[base_key] = FAMILIES[family].model()
            cache[key] = formats.in_format(cache[base_key], fmt, device)
        return cache[key]
    yield get
    cache.clear()


def _floor(env, family, floor):
    """The runtime floor that puts `family`'s own floor (x its split_floor_scale) at `floor`."""
    adapter = importlib.import_module(f"{env.pack.__name__}.nodes.families.{FAMILIES[family].adapter}")
    return comfy_env.split_floor_tokens(env, round(floor / adapter.SPEC.measured.split_floor_scale))


class SelfAttentionCalls:
    """(heads, tokens) of every SDPA self-attention call (as many keys as queries) inside the `with` block: the
    real run's split blocks are the longest (the self-checks run on at most 256 image tokens)."""

    def __init__(self, torch):
        self.torch, self.calls = torch, []

    def __enter__(self):
        torch, calls = self.torch, self.calls

        class Mode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types=(), args=(), kwargs=None):
                if func is torch.nn.functional.scaled_dot_product_attention and args[0].shape[-2] == args[1].shape[-2]:
                    calls.append((args[0].shape[1], args[0].shape[-2]))
                return func(*args, **(kwargs or {}))
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def longest(self) -> set:
        """The head counts of the longest self-attention calls."""
        tokens = max((t for _, t in self.calls), default=None)
        return {h for h, t in self.calls if t == tokens}


def _on(inputs, device):
    import torch

    def move(value):
        if torch.is_tensor(value):
            return value.to(device)
        return [move(v) for v in value] if isinstance(value, list) else value
    return {k: move(v) for k, v in inputs.items()}


def _joined(out):
    """A model's output as one tensor: MiniMax H3's [video, audio] flattened and joined."""
    import torch
    return torch.cat([t.flatten() for t in out]) if isinstance(out, (list, tuple)) else out


def _distance(a, b):
    return float((a.double() - b.double()).norm())


def run_row(env, patcher, family, cond, device="cpu", size=1, split_floor_tokens=MATRIX_FLOOR, expect=None):
    """One row: ComfyUI's forward and the patched one (High, block bounds, SDPA) on `cond`'s inputs in the
    format's compute dtype, judged against the float32 reference (see the module docstring). `expect(stock
    forward)` may add checks of ComfyUI's own run (the GPU rows: real fp8 matmuls). Returns the relative distances
    of ours and of ComfyUI's output from the reference."""
    torch = env.torch
    spec = FAMILIES[family]
    fmt = patcher.qkv_format
    row = (family, fmt.name, cond)
    inputs = _on(formats.as_compute(spec.inputs(torch, cond, patcher.model, size=size), fmt.compute), device)
    float_inputs = formats.as_compute(inputs, torch.float32)
    env.compat.forget_verdicts()   # each row's own conditionings are self-checked
    with _floor(env, family, split_floor_tokens):
        if expect is not None:
            stock = expect(lambda: comfy_env.model_forward(patcher, inputs))
        else:
            stock = comfy_env.model_forward(patcher, inputs)
        dm = patcher.model.diffusion_model
        with torch.no_grad():
            reference = env.compat.exact_reference(dm, dm.forward, {**float_inputs, "transformer_options": {}})
        patched, report = env.node.apply_patch(patcher, "High", "sdpa", True)
        assert report.any_patched and not report.skipped_reasons, (row, report.lines())
        env.core.reset_notices()
        with SelfAttentionCalls(torch) as spy:
            ours = comfy_env.model_forward(patcher, inputs, applied=patched)
        notices = env.core.drain_notices()
    stock, reference, ours = (_joined(out) for out in (stock, reference, ours))
    fallbacks = comfy_env.lines_of_kind(notices, env.core.notices.FALLBACK)
    assert not fallbacks, (row, fallbacks)
    adapter = importlib.import_module(f"{env.pack.__name__}.nodes.families.{spec.adapter}")
    groups = env.core.SplitPolicy(3, group_scale=adapter.SPEC.measured.group_scale).plan(spec.kv_heads, 10**6).groups
    group = (spec.heads or spec.kv_heads) // groups
    assert group in spy.longest(), (row, "no head split", spy.calls, notices)
    assert ours.shape == stock.shape and ours.dtype == stock.dtype, row
    assert bool(torch.isfinite(stock).all()) and bool(torch.isfinite(reference).all()), row
    scale = float(reference.double().norm())
    stock_distance, ours_distance = _distance(stock, reference), _distance(ours, reference)
    allowed = MARGIN * stock_distance + ROUND_OFF[str(fmt.compute).split(".")[-1]] * scale
    assert ours_distance <= allowed, (row, f"ours {ours_distance / scale:.3g}, ComfyUI's {stock_distance / scale:.3g} "
                                           f"from the float32 reference (relative), allowed {allowed / scale:.3g}")
    if fmt.compute == torch.float32 and not fmt.quantizes_input:   # GGUF: dequantized weights, float32 math
        assert comfy_env.rel_err(ours, stock) <= 1e-5, (row, comfy_env.rel_err(ours, stock))
    return {"ours": ours_distance / scale, "stock": stock_distance / scale}


# ----------------------------------------------------------------------------------------------- the matrix

@pytest.mark.parametrize("family,fmt,cond", ROWS, ids=["-".join(r) for r in ROWS])
def test_row(env, models, family, fmt, cond):
    run_row(env, models(family, fmt), family, cond)


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_gguf_f16_file_splits(env, family):
    """A GGUF F16 file (every 2-D Linear weight F16, as city96 publishes them next to the quantized ones): the
    self-check passes, the split runs and the output is stock's within float32 round-off."""
    from support import gguf_env
    base = FAMILIES[family].model()
    patcher = gguf_env.as_gguf_file_mix(base, "F16")
    patcher.qkv_format = formats.Format("gguf_f16", env.torch.float32, True, False)
    run_row(env, patcher, family, SWEEP_COND)


# ----------------------------------------------------------------------------------------------- GPU rows

GPU_ROWS = [(family, fmt, cond) for family in FAMILIES for fmt in ("fp8_scaled", "fp8_scaled_file")
            for cond in CONDS + FAMILIES[family].extra]


@pytest.fixture(scope="module")
def gpu_env():
    """The pack loaded the way the benchmark loads it on a bare GPU machine (`benchmarks.bench`: no comfy_api),
    with ComfyUI set up for CUDA (COMFY_ENV_GPU=1)."""
    import sys
    import types
    import torch
    if os.environ.get("COMFY_ENV_GPU") != "1" or not torch.cuda.is_available():
        pytest.skip("needs CUDA and COMFY_ENV_GPU=1 (a GPU machine)")
    comfy_env.load_on_cuda()
    from benchmarks import bench
    package = bench.PACK_PACKAGE
    modules = types.SimpleNamespace(torch=torch, pack=sys.modules[package],
                                    node=importlib.import_module(f"{package}.nodes.patching"),
                                    compat=importlib.import_module(f"{package}.nodes.compat"),
                                    core=importlib.import_module(f"{package}.qkv_core"))
    with comfy_env.split_floor_tokens(modules, GPU_FLOOR):
        yield modules


def _runs_fp8_matmuls(torch):
    """`expect` for the GPU rows: ComfyUI's own forward multiplies in fp8 (a scaled-mm kernel runs)."""
    def expect(forward):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = forward()
        names = {event.key for event in prof.key_averages()}
        assert any("scaled_mm" in name for name in names), sorted(names)[:40]
        return out
    return expect


@pytest.mark.gpu
@pytest.mark.parametrize("family,fmt,cond", GPU_ROWS, ids=["-".join(r) for r in GPU_ROWS])
def test_gpu_row(gpu_env, models, family, fmt, cond):
    """fp8-scaled in both layouts on CUDA, bf16, 4x the CPU rows' tokens: the layers quantize their inputs for
    real fp8 matmuls (a scaled-mm kernel runs in ComfyUI's own forward)."""
    run_row(gpu_env, models(family, fmt, "cuda"), family, cond, device="cuda", size=GPU_SIZE,
            split_floor_tokens=GPU_FLOOR,
            expect=_runs_fp8_matmuls(gpu_env.torch))
