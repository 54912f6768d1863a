"""Test helper: tiny random-weight Wan models built from ComfyUI's own config classes (every kind: T2V, I2V, Wan 2.2
5B, VACE, Camera; fp8 cast per call, fp8-scaled in both file layouts), their forward inputs and conditioning, a
short sampling run, and the comparisons the tests make (a model's forward with a patcher's object or weight
patches, `rel_err`, the pack's stock fallbacks). ComfyUI is set up by `comfy_env` (imported here for it); reachable
as ``comfy_env.make_wan`` and so on, as the tests call them."""
from __future__ import annotations

import math

# Kinds accepted by make_wan / make_inputs / run_sample.
WAN_KINDS = ("t2v", "i2v", "wan22_5b", "vace", "camera")


def setup():
    """ComfyUI set up (`comfy_env.setup`), imported when first needed: `python3 tests/support/comfy_env.py`
    (scripts/test's queries) imports this module and nothing of ComfyUI."""
    from support import comfy_env
    comfy_env.setup()

def n_tokens(frames, h, w, patch=(1, 2, 2)):
    """Self-attention tokens of a latent (frames, h, w) with Wan's patch (1, 2, 2)."""
    return math.ceil(frames / patch[0]) * math.ceil(h / patch[1]) * math.ceil(w / patch[2])


def latent_channels(kind):
    return 48 if kind == "wan22_5b" else 16


def _wan_config(kind, dim, heads, layers, ffn_dim, text_dim, vace_layers, extra):
    import comfy.supported_models as sm
    cfg = {
        "image_model": "wan2.1", "dim": dim, "num_heads": heads, "num_layers": layers,
        "ffn_dim": ffn_dim or 2 * dim, "text_dim": text_dim, "freq_dim": 256, "text_len": 512,
        "patch_size": (1, 2, 2), "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True,
        "eps": 1e-6, "in_dim": 16, "out_dim": 16,
    }
    if kind == "t2v":
        cls, cfg["model_type"] = sm.WAN21_T2V, "t2v"
    elif kind == "i2v":
        # WAN21_I2V: in_dim 36 = 16 noise + 4 mask + 16 image latent channels (model_base.WAN21.concat_cond
        # fills zeros when no image is given); cross-attention is WanI2VCrossAttention; img_emb is
        # MLPProj(1280 -> dim) over CLIP-H penultimate hidden states (257 tokens in real use).
        cls, cfg["model_type"], cfg["in_dim"] = sm.WAN21_I2V, "i2v", 36
    elif kind == "wan22_5b":
        # WAN22_T2V (Wan 2.2 TI2V 5B): 48-channel latent (Wan22 latent format), model_base.WAN22.
        cls, cfg["model_type"], cfg["in_dim"], cfg["out_dim"] = sm.WAN22_T2V, "t2v", 48, 48
    elif kind == "vace":
        # VaceWanModel: vace_in_dim 96 = 32 (16 inactive + 16 reactive latent channels) + 64 mask channels,
        # what model_base.WAN21_Vace.extra_conds builds by default.
        cls, cfg["model_type"] = sm.WAN21_Vace, "vace"
        cfg["vace_layers"], cfg["vace_in_dim"] = vace_layers, 96
    elif kind == "camera":
        # WAN21_Camera: CameraWanModel with model_type "camera" (-> i2v cross-attention + img_emb),
        # in_dim 32 (16 noise + 16 image), control adapter input 24 channels at 8x the latent size.
        cls, cfg["model_type"], cfg["in_dim"] = sm.WAN21_Camera, "camera", 32
    else:
        raise ValueError(f"unknown Wan kind {kind!r}; one of {WAN_KINDS}")
    cfg.update(extra)
    return cls, cfg


def fill_random_(module, seed=0, norm_noise=0.1, modulation_std=0.3, bias_std=0.02):
    """Fill every parameter (ComfyUI's ops leave them uninitialised) with seeded, non-degenerate values.

    Linear/Conv weights ~ N(0, 1/fan_in) (activations keep unit scale through the stack); norm weights
    1 + N(0, norm_noise^2) so RMSNorm/LayerNorm stay near identity but not exactly; Wan ``modulation``
    ~ N(0, modulation_std^2) so the gates are O(0.3), i.e. attention visibly changes the output;
    biases and everything else N(0, bias_std^2)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            is_norm = "norm" in name.lower()
            if leaf == "weight" and is_norm:
                v = 1.0 + norm_noise * torch.randn(p.shape, generator=g)
            elif leaf == "weight" and p.ndim >= 2:
                fan_in = math.prod(p.shape[1:])
                v = torch.randn(p.shape, generator=g) / math.sqrt(fan_in)
            elif "modulation" in leaf:
                v = modulation_std * torch.randn(p.shape, generator=g)
            else:
                v = bias_std * torch.randn(p.shape, generator=g)
            p.copy_(v.to(p.dtype))
    return module


def fp8_cast_per_call_(module, storage=None) -> int:
    """`module`'s ComfyUI Linear layers as ComfyUI runs an fp8 checkpoint computed in a wider dtype: each 2-D
    weight stored in `storage` (default float8_e4m3fn) and cast for every call (`comfy_cast_weights`), its bias
    kept. In place; returns how many layers changed."""
    import torch
    import comfy.ops
    storage = storage or torch.float8_e4m3fn
    count = 0
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, comfy.ops.CastWeightBiasOp) and isinstance(layer, torch.nn.Linear) and \
                    layer.weight is not None and layer.weight.dim() == 2:
                layer.weight = torch.nn.Parameter(layer.weight.to(storage), requires_grad=False)
                layer.comfy_cast_weights = True
                count += 1
    return count


def make_wan(kind="t2v", dim=128, heads=4, layers=2, ffn_dim=None, text_dim=32, vace_layers=1,
             dtype=None, seed=0, device="cpu", **extra_config):
    """Tiny random-weight Wan wrapped in a ``ModelPatcher`` (float32 on CPU by default).

    kind: "t2v" (WAN21_T2V), "i2v" (WAN21_I2V), "wan22_5b" (WAN22_T2V), "vace" (WAN21_Vace),
    "camera" (WAN21_Camera). head_dim = dim // heads must be even and split by Wan's RoPE axes
    (d - 4*(d//6), 2*(d//6), 2*(d//6)) into even parts: 32, 64 and 128 work. ``extra_config`` goes into
    the unet config (e.g. ``flf_pos_embed_token_number=514``, ``in_dim_ref_conv=16``).
    The patcher's ``.model`` is the ``comfy.model_base`` model, ``.model.diffusion_model`` the WanModel."""
    setup()
    import torch
    import comfy.model_patcher
    if dim % heads:
        raise ValueError("dim must be a multiple of heads")
    d = dim // heads
    if any(a % 2 for a in (d - 4 * (d // 6), 2 * (d // 6))):
        raise ValueError(f"head_dim {d} does not split into even RoPE axes; use 32, 64 or 128")
    dtype = dtype or torch.float32
    dev = torch.device(device)
    cls, cfg = _wan_config(kind, dim, heads, layers, ffn_dim, text_dim, vace_layers, extra_config)
    model_config = cls(cfg)
    model_config.set_inference_dtype(dtype, None)
    model = model_config.get_model({}, device=dev)
    fill_random_(model.diffusion_model, seed=seed)
    model.eval()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=dev, offload_device=dev)
    patcher.comfy_env_kind = kind
    return patcher


FP8_LAYOUTS = ("comfy_quant", "scaled_fp8")


def make_fp8_scaled_wan(kind="t2v", dim=128, heads=4, layers=1, input_scale=True, fmt="float8_e4m3fn",
                        full_precision_mm=False, seed=0, dtype=None, layout="comfy_quant", **extra_config):
    """Tiny Wan loaded the way ComfyUI loads an fp8-scaled checkpoint (Comfy-Org's `*_fp8_scaled` files):
    ComfyUI's mixed-precision ops (`comfy.ops.mixed_precision_ops`), the blocks' 2-D Linear weights stored as
    fp8 with a per-tensor `weight_scale` (and `input_scale`) and a `comfy_quant` entry, so they load as
    `QuantizedTensor` weights (``fmt="int8_tensorwise"``: int8 with a per-tensor scale, weight-only);
    everything else float32, computed in float32. The weights are those of
    ``make_wan(kind, ...)`` with the same seed, quantized. ``full_precision_mm``: the layers dequantize their
    weight for a full-precision matmul (what ComfyUI makes of old `scaled_fp8` checkpoints that ask for it).
    ``layout``: "comfy_quant" (a per-layer `comfy_quant` entry, as above) or "scaled_fp8" (the layout of
    Comfy-Org's `*_fp8_scaled` files: `scale_weight` / `scale_input` per layer and a `scaled_fp8` marker,
    converted by ComfyUI's own `comfy.utils.convert_old_quants` as its loader does; skipped where this ComfyUI
    has no such converter)."""
    setup()
    import json
    import torch
    import comfy.model_patcher
    import comfy.ops
    storage = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
               "int8_tensorwise": torch.int8}[fmt]
    integer = not storage.is_floating_point
    float_model = make_wan(kind, dim=dim, heads=heads, layers=layers, seed=seed, **extra_config)
    sd = {k: v.clone() for k, v in float_model.model.diffusion_model.state_dict().items()}
    for key in [k for k, v in sd.items() if k.endswith(".weight") and v.dim() == 2 and "blocks." in k
                and "modulation" not in k and "norm" not in k]:
        prefix = key[:-len("weight")]
        weight = sd[key]
        scale = weight.abs().amax() / (torch.iinfo(storage).max if integer else torch.finfo(storage).max)
        sd[key] = (weight / scale).round().to(storage) if integer else (weight / scale).to(storage)
        sd[prefix + "weight_scale"] = scale.reshape(())
        if input_scale and not integer:   # int8_tensorwise is weight-only: no input scale
            sd[prefix + "input_scale"] = torch.tensor(0.02)
        conf = {"format": fmt, **({"full_precision_matrix_mult": True} if full_precision_mm else {})}
        sd[prefix + "comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    if layout == "scaled_fp8":
        sd = _as_scaled_fp8_file(sd, fmt, full_precision_mm)
    elif layout != "comfy_quant":
        raise ValueError(f"unknown fp8 layout {layout!r}; one of {FP8_LAYOUTS}")
    cls, cfg = _wan_config(kind, dim, heads, layers, None, 32, 1, extra_config)
    model_config = cls(cfg)
    dtype = dtype or torch.float32
    model_config.set_inference_dtype(dtype, None)
    model_config.custom_operations = comfy.ops.mixed_precision_ops({}, dtype)
    model = model_config.get_model({}, device=torch.device("cpu"))
    missing, unexpected = model.diffusion_model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"fp8-scaled Wan: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.eval()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    patcher.comfy_env_kind = kind
    return patcher


def _as_scaled_fp8_file(sd, fmt, full_precision_mm):
    """`sd` (comfy_quant layout) as a Comfy-Org `*_fp8_scaled` file stores it, then converted back by ComfyUI's
    `convert_old_quants` (what its loader does with such a file)."""
    import pytest
    import torch
    import comfy.utils
    if fmt != "float8_e4m3fn":
        raise ValueError("the scaled_fp8 layout stores float8_e4m3fn weights")
    convert = getattr(comfy.utils, "convert_old_quants", None)
    if convert is None:
        pytest.skip("this ComfyUI has no convert_old_quants (scaled_fp8 files load another way)")
    old = {}
    for key, value in sd.items():
        if key.endswith(".comfy_quant"):
            continue
        if key.endswith(".weight_scale"):
            old[key[:-len("weight_scale")] + "scale_weight"] = value
        elif key.endswith(".input_scale"):
            old[key[:-len("input_scale")] + "scale_input"] = value
        else:
            old[key] = value
    # the marker: an fp8 scalar; two elements ask for a full-precision matmul
    old["scaled_fp8"] = torch.zeros(2 if full_precision_mm else 0, dtype=torch.float8_e4m3fn)
    converted, _ = convert(old, "")
    return converted


def _diffusion_model(model):
    if hasattr(model, "model") and hasattr(model.model, "diffusion_model"):   # ModelPatcher
        return model.model.diffusion_model
    if hasattr(model, "diffusion_model"):                                      # BaseModel
        return model.diffusion_model
    return model                                                                # WanModel


def _kind_of(model):
    kind = getattr(model, "comfy_env_kind", None)
    if kind is not None:
        return kind
    dm = _diffusion_model(model)
    name = type(dm).__name__
    if name == "VaceWanModel":
        return "vace"
    if name == "CameraWanModel":
        return "camera"
    if dm.out_dim == 48:
        return "wan22_5b"
    return "i2v" if dm.model_type == "i2v" else "t2v"


def make_inputs(model, kind=None, frames=2, h=8, w=8, batch=1, text_tokens=16, clip_tokens=257,
                vace_contexts=1, per_frame_t=False, timestep=500.0, seed=1, dtype=None):
    """Keyword arguments for a direct ``diffusion_model(**inputs)`` call.

    ``h``, ``w`` are latent sizes; self-attention tokens = ``n_tokens(frames, h, w)`` = frames*(h/2)*(w/2).
    x: (batch, in_dim, frames, h, w) (in_dim includes the i2v/camera concat channels); timestep (batch,)
    in [0, 1000], or (batch, frames) with ``per_frame_t`` (Wan 2.2 5B path -> e0 (B, frames, 6, C));
    context: (batch, text_tokens, text_dim); i2v/camera: clip_fea (batch, clip_tokens, 1280);
    vace: vace_context (batch, vace_contexts, 96, frames, h, w) + vace_strength list;
    camera: camera_conditions (batch, 24, frames, 8h, 8w)."""
    import torch
    dm = _diffusion_model(model)
    kind = kind or _kind_of(model)
    dtype = dtype or next(p.dtype for n, p in dm.named_parameters() if n.startswith("blocks."))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(shape, generator=g).to(dtype)

    in_dim = dm.patch_embedding.weight.shape[1]
    text_dim = dm.text_embedding[0].weight.shape[1]
    out = {
        "x": rnd(batch, in_dim, frames, h, w),
        "timestep": (torch.full((batch, frames), float(timestep)) if per_frame_t
                     else torch.full((batch,), float(timestep))),
        "context": rnd(batch, text_tokens, text_dim),
        "transformer_options": {},
    }
    if per_frame_t:
        # per-frame timesteps, first frame "clean" like Wan 2.2 TI2V with a conditioning image
        out["timestep"][:, 0] = 0.0
    if kind in ("i2v", "camera") and clip_tokens:
        out["clip_fea"] = rnd(batch, clip_tokens, 1280)
    if kind == "vace":
        out["vace_context"] = rnd(batch, vace_contexts, dm.vace_in_dim, frames, h, w)
        out["vace_strength"] = [1.0] * vace_contexts
    if kind == "camera":
        out["camera_conditions"] = rnd(batch, 24, frames, 8 * h, 8 * w)
    return out


class _ClipVisionOutput:
    """What model_base.WAN21.extra_conds reads from a CLIP_VISION_OUTPUT."""

    def __init__(self, penultimate_hidden_states):
        self.penultimate_hidden_states = penultimate_hidden_states


def make_conds(model, kind=None, frames=2, h=8, w=8, batch=1, text_tokens=16, clip_tokens=257, seed=1):
    """(positive, negative) conditioning lists for ``comfy.sample.sample`` matching ``make_wan(kind)``."""
    import torch
    dm = _diffusion_model(model)
    kind = kind or _kind_of(model)
    g = torch.Generator().manual_seed(seed)
    text_dim = dm.text_embedding[0].weight.shape[1]
    pos_ctx = torch.randn((batch, text_tokens, text_dim), generator=g)
    neg_ctx = torch.randn((batch, text_tokens, text_dim), generator=g)
    pos_extra, neg_extra = {}, {}
    if kind in ("i2v", "camera") and clip_tokens:
        clip = _ClipVisionOutput(torch.randn((batch, clip_tokens, 1280), generator=g))
        pos_extra["clip_vision_output"] = clip
        neg_extra["clip_vision_output"] = clip
    if kind == "camera":
        cam = torch.randn((batch, 24, frames, 8 * h, 8 * w), generator=g)
        pos_extra["camera_conditions"] = cam
        neg_extra["camera_conditions"] = cam
    return [[pos_ctx, pos_extra]], [[neg_ctx, neg_extra]]


def run_sample(patcher, kind=None, frames=2, h=8, w=8, batch=1, steps=3, cfg=5.0, seed=0,
               sampler_name="euler", scheduler="simple", positive=None, negative=None, latent=None,
               denoise_mask=None, text_tokens=16, clip_tokens=257, **kwargs):
    """A short ``comfy.sample.sample`` run (3 steps, cond + uncond batched) on a tiny Wan; returns the latent.

    ``denoise_mask`` (batch, 1, frames, h, w) gives Wan 2.2 5B its per-frame timesteps
    (model_base.WAN22.process_timestep). Extra kwargs go to ``comfy.sample.sample``."""
    setup()
    import torch
    import comfy.sample
    kind = kind or _kind_of(patcher)
    if latent is None:
        latent = torch.zeros((batch, latent_channels(kind), frames, h, w))
    if positive is None or negative is None:
        pos, neg = make_conds(patcher, kind, frames, h, w, batch, text_tokens, clip_tokens)
        positive = positive if positive is not None else pos
        negative = negative if negative is not None else neg
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(patcher, noise, steps, cfg, sampler_name, scheduler, positive, negative, latent,
                               noise_mask=denoise_mask, disable_pbar=True, seed=seed, **kwargs)


# --------------------------------------------------------------------------------------------------
# What the family adapters' tests share
# --------------------------------------------------------------------------------------------------

def fresh(value):
    """A copy of a forward argument the model may write: tensors cloned, lists of tensors too."""
    import torch
    if torch.is_tensor(value):
        return value.clone()
    return [v.clone() if torch.is_tensor(v) else v for v in value] if isinstance(value, list) else value


def model_forward(patcher, inputs, applied=None, options=None):
    """`patcher`'s diffusion model on fresh copies of `inputs`, with `applied`'s object patches in place (None:
    as loaded) and its transformer_options (plus `options`)."""
    import torch
    if applied is not None:
        applied.patch_model(load_weights=False)
    try:
        transformer_options = dict((applied or patcher).model_options.get("transformer_options", {}))
        transformer_options.update(options or {})
        with torch.no_grad():
            return patcher.model.diffusion_model(**{k: fresh(v) for k, v in inputs.items()},
                                                 transformer_options=transformer_options)
    finally:
        if applied is not None:
            applied.unpatch_model(unpatch_weights=False)


def weights_forward(patcher, inputs, lowvram=False, layer=None):
    """`patcher`'s diffusion model on fresh copies of `inputs` with its weight patches applied (a LoRA):
    `lowvram=True` loads it as ComfyUI's low-VRAM mode does (`lowvram_model_memory=1`: the patches become each
    layer's weight functions, applied at every call); `layer(diffusion_model)` then names a patched layer, which
    must really take that path. Unpatched afterwards."""
    import torch
    if lowvram:
        patcher.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1)
        if layer is not None:
            patched_layer = layer(patcher.model.diffusion_model)
            assert len(patched_layer.weight_function) > 0 and patched_layer.comfy_cast_weights   # LowVramPatch
    else:
        patcher.patch_model(device_to=torch.device("cpu"))
    try:
        options = dict(patcher.model_options.get("transformer_options", {}))
        with torch.no_grad():
            return patcher.model.diffusion_model(**{k: fresh(v) for k, v in inputs.items()},
                                                 transformer_options=options)
    finally:
        patcher.unpatch_model()


def first_call(module, run) -> tuple:
    """The (args, kwargs) of `module`'s first call while `run()` runs (a forward pre-hook, removed after)."""
    calls = []
    handle = module.register_forward_pre_hook(lambda _, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return calls[0]


def lines_of_kind(notices, *kinds) -> list:
    """The log lines of the `Notice`s in `notices` whose kind is one of `kinds` (qkv_core.notices' kinds)."""
    return [str(notice) for notice in notices if notice.kind in kinds]


def logged_of_kind(records, *kinds) -> list:
    """The messages of the log `records` (caplog's) that carry a notice (`record.notice`) of one of `kinds`."""
    return [record.getMessage() for record in records
            if getattr(getattr(record, "notice", None), "kind", None) in kinds]


def stock_fallbacks(env) -> list:
    """The pack's forwards that ran ComfyUI's own since the last call (a failed self-check, a refusal): the log
    lines of the notices of kind FALLBACK, drained."""
    return lines_of_kind(env.core.drain_notices(), env.core.notices.FALLBACK)


def rel_err(a, b) -> float:
    """max |a - b| / max |b| in float64 (the largest over paired outputs for lists and tuples)."""
    if isinstance(b, (list, tuple)):
        return max(rel_err(x, y) for x, y in zip(a, b))
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


