"""Test helper: any family's tiny model in a GGUF file's mix of types (llama.cpp's K-quants with their fallback
types where a layer's rows do not split into 256-blocks, or city96's F16 files), built on `gguf_env`'s quantizers
and ComfyUI-GGUF's own layers. Reachable as ``gguf_env.as_gguf_file_mix``."""
from __future__ import annotations

from support.gguf_env import (block_size, f32_tensor, pack_module, qtype_enum, quantize_tensor,
                              rebuilt_gguf_patcher, require_gguf)


# The type llama.cpp's quantizer stores a tensor in when its rows do not split into the K-quant's 256-blocks
# (`llama_tensor_get_type`, "falling back"): what a Q4_K GGUF holds for such layers.
K_QUANT_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def f16_tensor(t):
    """A float tensor as the loader hands over an F16 GGUF tensor (city96's F16 files): ``GGMLTensor`` of float16
    data with tensor_type F16 (torch-compatible: ComfyUI-GGUF computes it as a plain cast weight)."""
    import gguf
    import torch
    ops = pack_module("ops")
    t = t.detach().to(torch.float16).clone()
    return ops.GGMLTensor(t, tensor_type=gguf.GGMLQuantizationType.F16, tensor_shape=t.shape)


def as_gguf_file_mix(patcher, qtype="Q4_K", fallback=None):
    """Any family's tiny model (as ``as_gguf``) with its 2-D Linear weights stored as a GGUF file of ``qtype``
    stores them: ``qtype`` where the input size is a multiple of its block, else llama.cpp's fallback type
    (``K_QUANT_FALLBACK``, or ``fallback``) where that block fits, else F32; ``qtype="F16"``: every 2-D Linear
    weight F16 (city96's F16 files). Everything else F32. A ``GGUFModelPatcher`` carrying ``gguf_keys`` (the
    keys not F32) and ``gguf_types`` ({key: type name})."""
    require_gguf()
    import torch
    qt = qtype_enum(qtype)
    fallback = fallback or K_QUANT_FALLBACK.get(qt.name)
    model = patcher.model
    linear = {f"{name}.weight" for name, m in model.diffusion_model.named_modules() if isinstance(m, torch.nn.Linear)}
    float_sd = {k: v.detach().clone().float() for k, v in model.diffusion_model.state_dict().items()}
    sd, types = {}, {}
    for key, value in float_sd.items():
        if key in linear and value.ndim == 2:
            if qt.name == "F16":
                sd[key], types[key] = f16_tensor(value), "F16"
                continue
            for name in (qt.name, fallback):
                if name is not None and value.shape[-1] % block_size(name) == 0:
                    sd[key], types[key] = quantize_tensor(value, name), name
                    break
        if key not in sd:
            sd[key] = f32_tensor(value)
    out = rebuilt_gguf_patcher(model, sd)
    out.gguf_keys = sorted(types)
    out.gguf_types = types
    return out
