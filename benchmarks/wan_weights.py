"""A random-weight Wan 2.x 14B state dict in the format a user's file has, and the ModelPatcher ComfyUI's diffusion
model loader (or ComfyUI-GGUF's) makes of it: the weights of the whole-model benchmarks (`wan_model.py`,
`raylight_model.py`, `report_check.py`). Not part of the node pack's runtime."""
from __future__ import annotations

import inspect
import json

import torch

import comfy.ldm.wan.model as wan_model
import comfy.ops

from .wan_block import FP8_SCALED, GGUF_Q8_0, import_gguf_ops, quantize_q8_0, random_like

# fp8_scaled: a per-layer `comfy_quant` entry beside each scaled weight; fp8_scaled_file: the layout of Comfy-Org's
# `*_fp8_scaled` files (`scale_weight` per layer and a `scaled_fp8` marker), which ComfyUI's loader converts
FP8_SCALED_FILE = "fp8_scaled_file"
FORMATS = ("bf16", "fp8_e4m3fn", FP8_SCALED, FP8_SCALED_FILE, GGUF_Q8_0)
# Wan 2.1 / 2.2 14B (T2V), as ComfyUI's model detection finds it in a checkpoint
WAN_14B = dict(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=5120, ffn_dim=13824,
               freq_dim=256, text_dim=4096, out_dim=16, num_heads=40, num_layers=40, window_size=(-1, -1),
               qk_norm=True, cross_attn_norm=True, eps=1e-6)


def _quantizable(key: str, shape) -> bool:
    """The Linear weights of the blocks: what fp8-scaled and GGUF files of Wan quantize."""
    return key.startswith("blocks.") and key.endswith(".weight") and len(shape) == 2 and "norm" not in key


def _convert(key: str, value: torch.Tensor, fmt: str, gguf_ops) -> dict:
    """{key: tensor} of one float32 tensor as a file of `fmt` stores it (on the tensor's device)."""
    quantize = _quantizable(key, value.shape)
    if fmt in ("bf16", "fp8_e4m3fn"):        # fp8_e4m3fn: a bf16 file loaded with weight_dtype fp8_e4m3fn
        return {key: value.to(torch.bfloat16)}
    if fmt in (FP8_SCALED, FP8_SCALED_FILE):
        if not quantize:
            return {key: value.to(torch.bfloat16)}
        prefix = key[:-len("weight")]
        scale = value.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
        weight = (value / scale).to(torch.float8_e4m3fn)
        if fmt == FP8_SCALED_FILE:
            return {key: weight, prefix + "scale_weight": scale.reshape(())}
        quant = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
        return {key: weight, prefix + "weight_scale": scale.reshape(()), prefix + "comfy_quant": quant}
    types = gguf_ops.gguf.GGMLQuantizationType
    if quantize:
        return {key: gguf_ops.GGMLTensor(quantize_q8_0(value), tensor_type=types.Q8_0, tensor_shape=value.shape)}
    return {key: gguf_ops.GGMLTensor(value, tensor_type=types.F32, tensor_shape=value.shape)}


class _EagerOps(comfy.ops.disable_weight_init):
    """ComfyUI's layers with their parameters made at construction: under Dynamic VRAM its Linear and Embedding
    leave them to the state dict's load (no shapes to list). A class of their own load keeps them eager."""

    class Linear(comfy.ops.disable_weight_init.Linear):
        _load_from_state_dict = torch.nn.Linear._load_from_state_dict

    class Embedding(comfy.ops.disable_weight_init.Embedding):
        _load_from_state_dict = torch.nn.Embedding._load_from_state_dict


def wan_state_dict(fmt: str, config: dict, device, seed: int = 0, gguf_ops=None) -> dict:
    """A random-weight Wan state dict (ComfyUI's key names, as in a diffusion-model file) in `fmt`, on the CPU.
    Block 0 is drawn on `device` and converted there; the other blocks are copies of it (random values do
    not change memory or time; drawing 14B of them on a CPU would take minutes)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in
                  wan_model.WanModel(**config, operations=_EagerOps).state_dict().items()}
    generator = torch.Generator(device=device).manual_seed(seed)
    sd, block0 = {}, {}
    for key, shape in shapes.items():
        if key.startswith("blocks.") and not key.startswith("blocks.0."):
            continue
        converted = _convert(key, random_like(shape, key, generator, device), fmt, gguf_ops)
        for k, v in converted.items():
            # .to(), not .cpu(): ComfyUI-GGUF's tensor class keeps its attributes through .to() only
            (block0 if key.startswith("blocks.0.") else sd)[k] = v.to("cpu") if v.device.type != "cpu" else v
    sd.update(block0)
    if fmt == FP8_SCALED_FILE:
        sd["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)   # the file's marker (an fp8 scalar)
    for index in range(1, config["num_layers"]):
        for k, v in block0.items():
            copy = v.clone()
            if gguf_ops is not None and isinstance(v, gguf_ops.GGMLTensor):
                copy = gguf_ops.GGMLTensor(v.as_subclass(torch.Tensor).clone(), tensor_type=v.tensor_type,
                                           tensor_shape=v.tensor_shape)
            sd["blocks.%d.%s" % (index, k[len("blocks.0."):])] = copy
    return sd


def load_model(fmt: str, sd: dict, dynamic: bool, gguf_pack=None):
    """The ModelPatcher the diffusion model loader (or ComfyUI-GGUF's UnetLoaderGGUF) makes of `sd`."""
    import comfy.sd
    options, gguf_nodes = {}, None
    if fmt == "fp8_e4m3fn":
        options["dtype"] = torch.float8_e4m3fn
    if fmt == GGUF_Q8_0:
        ops = import_gguf_ops(gguf_pack)
        operations = ops.GGMLOps()
        operations.Linear.dequant_dtype = operations.Linear.patch_dtype = None   # the loader's defaults
        options["custom_operations"] = operations
        try:   # its ModelPatcher subclass (LoRA on quantized weights, mmap release); needs ComfyUI's nodes
            gguf_nodes = import_gguf_ops(gguf_pack, "nodes")
        except ImportError as e:
            print(f"[{fmt}] ComfyUI-GGUF's nodes do not import here ({e}): ComfyUI's own ModelPatcher holds "
                  f"the GGUF model (the same loading without LoRAs and mmapped files)", flush=True)
    extra = {}
    if "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters:
        extra["disable_dynamic"] = not dynamic
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options=options, **extra)
    if patcher is None:
        raise SystemExit(f"ComfyUI did not detect a model in the {fmt} state dict")
    if gguf_nodes is not None:
        patcher = gguf_nodes.GGUFModelPatcher.clone(patcher)
        patcher.patch_on_device = False
    return patcher
