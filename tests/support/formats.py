"""Test helper: any family's tiny model (a ModelPatcher built from ComfyUI's own config class, e.g. by
tests/support/family_cases.py) rebuilt in the weight formats users load, the way ComfyUI's loaders build them.

Imported as ``from support import formats``. ``in_format(patcher, name)`` returns a new ModelPatcher of
the same weights (the float32 model's state dict) in format ``name`` (``FORMATS``):

  * ``bf16``, ``fp16``: every weight in that dtype, computed in it (``model_config.set_inference_dtype``);
  * ``fp8_cast``: bf16 compute, every ComfyUI Linear's 2-D weight stored as float8_e4m3fn and cast for each call
    (``comfy_env.fp8_cast_per_call_``: an fp8 checkpoint run in a wider dtype);
  * ``fp8_scaled``: ComfyUI's mixed-precision ops (``comfy.ops.mixed_precision_ops({}, bf16)``), the transformer
    blocks' 2-D Linear weights float8_e4m3fn with a per-tensor ``weight_scale`` and a ``comfy_quant`` entry
    (no ``input_scale``: the layers quantize their inputs with a scale of each call's own), bf16 compute;
  * ``fp8_scaled_file``: the same weights in the layout of Comfy-Org's ``*_fp8_scaled`` files (``scale_weight``
    and ``scale_input`` per layer and a ``scaled_fp8`` marker), converted by ComfyUI's own
    ``comfy.utils.convert_old_quants`` as its loader does (``comfy_env._as_scaled_fp8_file``): the layers quantize
    their inputs with the file's fixed input scale;
  * ``int8_tensorwise``: the mixed-precision ops with ``fmt="int8_tensorwise"`` weights (int8, one scale a
    tensor, weight-only: inputs are not quantized), bf16 compute;
  * ``gguf_q8_0``, ``gguf_q4_k``: city96's ComfyUI-GGUF (``gguf_env.as_gguf_file_mix``): every 2-D Linear weight
    quantized as a GGUF file of that type holds it (Q4_K where the input size is a multiple of 256, else
    llama.cpp's fallback Q5_0; Q8_0 where it is a multiple of 32; else F32), float32 compute. Q4_K blocks are
    packed by ``gguf_env`` (the ``gguf`` package cannot quantize K-quants); tests/test_gguf_env.py checks that
    gguf's and ComfyUI-GGUF's dequantizers read them back alike.

``unsupported(name)`` says why this ComfyUI (or this machine) cannot build a format, or None. ``as_compute``
casts a forward's floating inputs to the compute dtype as ComfyUI's ``BaseModel._apply_model`` does (the
timestep stays float32).
"""
from __future__ import annotations

import json
from typing import NamedTuple, Optional

from support import comfy_env

FORMATS = ("bf16", "fp16", "fp8_cast", "fp8_scaled", "fp8_scaled_file", "int8_tensorwise", "gguf_q8_0",
           "gguf_q4_k")
SCALED = ("fp8_scaled", "fp8_scaled_file", "int8_tensorwise")   # ComfyUI's mixed-precision ops
GGUF = {"gguf_q8_0": "Q8_0", "gguf_q4_k": "Q4_K"}
# the input scale an fp8_scaled_file layer is stored with (Comfy-Org's files carry one a layer)
FILE_INPUT_SCALE = 0.02


class Format(NamedTuple):
    name: str
    compute: object        # torch dtype the model computes in
    quantized: bool        # some weights are stored quantized (dequantized at each call)
    quantizes_input: bool  # the quantized layers quantize their inputs too (fp8-scaled)


def spec(name: str) -> Format:
    import torch
    compute = {"fp16": torch.float16}.get(name, torch.float32 if name in GGUF else torch.bfloat16)
    return Format(name, compute, name not in ("bf16", "fp16"), name in ("fp8_scaled", "fp8_scaled_file"))


def unsupported(name: str, device="cpu") -> Optional[str]:
    """Why this ComfyUI cannot build format `name` (None when it can)."""
    import comfy.ops
    if name in SCALED:
        if name == "int8_tensorwise":
            try:
                from comfy.quant_ops import QUANT_ALGOS
            except ImportError:
                return "this ComfyUI has no comfy.quant_ops"
            if "int8_tensorwise" not in QUANT_ALGOS:
                return "this ComfyUI has no int8_tensorwise entry in comfy.quant_ops.QUANT_ALGOS"
        if not hasattr(comfy.ops, "mixed_precision_ops") or not hasattr(comfy.ops, "CastBiasWeightContext"):
            return "this ComfyUI has no mixed-precision (fp8-scaled) ops with row slices"
        if name == "fp8_scaled_file":
            import comfy.utils
            if not hasattr(comfy.utils, "convert_old_quants"):
                return "this ComfyUI has no convert_old_quants (scaled_fp8 files load another way)"
    if name in GGUF:
        from support import gguf_env
        try:
            gguf_env.require_gguf()
        except BaseException as error:   # noqa: BLE001 - pytest's Skipped is a BaseException
            return str(error)
        if str(device) != "cpu":
            return "GGUF rows run on the CPU only"
    return None


_BLOCK_LISTS = ("block", "layer", "refiner")


def block_linear_keys(diffusion_model) -> list:
    """The `.weight` keys of the 2-D Linear layers inside the transformer blocks (under a ModuleList whose name
    says blocks, layers or refiners: `blocks.N.`, `double_blocks.N.`, Lumina's `layers.N.` and refiners, ...; not
    the embedders, even those in a Sequential or a list of projections), what fp8-scaled files quantize."""
    import torch
    keys = set()
    for list_name, container in diffusion_model.named_modules():
        if not isinstance(container, torch.nn.ModuleList) or \
                not any(word in list_name.rsplit(".", 1)[-1] for word in _BLOCK_LISTS):
            continue
        for name, module in container.named_modules():
            if isinstance(module, torch.nn.Linear) and "norm" not in name and \
                    getattr(module, "weight", None) is not None and module.weight.dim() == 2:
                keys.add(f"{list_name}.{name}.weight")
    return sorted(keys)


def float_state_dict(patcher) -> dict:
    return {k: v.detach().clone().float() if v.is_floating_point() else v.detach().clone()
            for k, v in patcher.model.diffusion_model.state_dict().items()}


def quantized_state_dict(float_sd: dict, keys, fmt: str = "float8_e4m3fn", input_scale: Optional[float] = None):
    """`float_sd` with the weights `keys` quantized as ComfyUI's quantized checkpoints store them (the
    comfy_quant layout, as `comfy_env.make_fp8_scaled_wan` does for Wan): `fmt` storage with a per-tensor
    `weight_scale`, an `input_scale` where given (fp8 only), and the layer's `comfy_quant` entry."""
    import torch
    storage = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
               "int8_tensorwise": torch.int8}[fmt]
    integer = not storage.is_floating_point
    sd = dict(float_sd)
    for key in keys:
        prefix = key[:-len("weight")]
        weight = sd[key].float()
        scale = weight.abs().amax().clamp_min(1e-12) / (torch.iinfo(storage).max if integer
                                                        else torch.finfo(storage).max)
        sd[key] = (weight / scale).round().to(storage) if integer else (weight / scale).to(storage)
        sd[prefix + "weight_scale"] = scale.reshape(())
        if input_scale is not None and not integer:
            sd[prefix + "input_scale"] = torch.tensor(float(input_scale))
        sd[prefix + "comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
    return sd


def rebuild(patcher, dtype, operations=None, state_dict=None, device="cpu"):
    """`patcher`'s model built again from its config class and unet config, `dtype` inference dtype, ComfyUI's
    ops or `operations`, loaded with `state_dict` (default: its float32 weights); a new ModelPatcher."""
    import torch
    import comfy.model_patcher
    model = patcher.model
    config = type(model.model_config)(dict(model.model_config.unet_config))
    config.set_inference_dtype(dtype, None)
    if operations is not None:
        config.custom_operations = operations
    device = torch.device(device)
    rebuilt = config.get_model({}, device=device)
    sd = float_state_dict(patcher) if state_dict is None else state_dict
    missing, unexpected = rebuilt.diffusion_model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{type(rebuilt.diffusion_model).__name__} in {dtype}: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    rebuilt.to(device)
    rebuilt.eval()
    return comfy.model_patcher.ModelPatcher(rebuilt, load_device=device, offload_device=device)


def in_format(patcher, name: str, device="cpu"):
    """A new ModelPatcher of `patcher`'s weights in format `name` (see the module docstring); skips the test
    with the reason where this ComfyUI cannot build it. Carries `qkv_format` (the `Format`) and `quantized_keys`
    (the diffusion-model keys stored quantized)."""
    import pytest
    import torch
    import comfy.ops
    reason = unsupported(name, device)
    if reason:
        pytest.skip(reason)
    fmt = spec(name)
    dm = patcher.model.diffusion_model
    if name in ("bf16", "fp16"):
        out = rebuild(patcher, fmt.compute, device=device)
        keys = []
    elif name == "fp8_cast":
        out = rebuild(patcher, fmt.compute, device=device)
        linear = {f"{n}.weight" for n, m in out.model.diffusion_model.named_modules()
                  if isinstance(m, comfy.ops.CastWeightBiasOp) and isinstance(m, torch.nn.Linear)
                  and m.weight is not None and m.weight.dim() == 2}
        assert comfy_env.fp8_cast_per_call_(out.model.diffusion_model) > 0
        keys = sorted(linear)
    elif name in SCALED:
        keys = block_linear_keys(dm)
        quant = "int8_tensorwise" if name == "int8_tensorwise" else "float8_e4m3fn"
        sd = quantized_state_dict(float_state_dict(patcher), keys, quant,
                                  input_scale=FILE_INPUT_SCALE if name == "fp8_scaled_file" else None)
        if name == "fp8_scaled_file":
            sd = comfy_env._as_scaled_fp8_file(sd, quant, False)
        out = rebuild(patcher, fmt.compute, comfy.ops.mixed_precision_ops({}, fmt.compute), sd, device=device)
        layers = dict(out.model.diffusion_model.named_modules())
        held = [k for k in keys if type(layers[k[:-len(".weight")]].weight).__name__ == "QuantizedTensor"]
        if held != keys:
            raise RuntimeError(f"{name}: {len(keys) - len(held)} of {len(keys)} block weights did not load "
                               f"quantized (e.g. {sorted(set(keys) - set(held))[:2]})")
    else:
        from support import gguf_env
        out = gguf_env.as_gguf_file_mix(patcher, GGUF[name])
        keys = list(out.gguf_keys)
    if fmt.quantized and not keys:
        raise RuntimeError(f"{name}: no weight of {type(dm).__name__} is quantized at this size")
    out.qkv_format = fmt
    out.quantized_keys = keys
    return out


def as_compute(inputs: dict, dtype, keep=("timestep", "timesteps", "t")) -> dict:
    """`inputs` with floating tensors (also inside lists: reference latents) in `dtype`, as ComfyUI's
    `BaseModel._apply_model` hands them to the diffusion model: the timestep (`keep`) stays float32."""
    import torch

    def cast(value):
        if torch.is_tensor(value) and value.is_floating_point():
            return value.to(dtype)
        if isinstance(value, list):
            return [cast(v) for v in value]
        return value
    return {k: (v if k in keep else cast(v)) for k, v in inputs.items()}
