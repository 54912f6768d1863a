"""ComfyUI's cast of a layer's weight, and what the pack's row projections read of a layer (`nodes/comfy_ops.py`,
`nodes/quantized_rows.py`): its data attributes without `Module.__getattr__`'s cost, whether a weight is a
`QuantizedTensor`, and `cast_owned`, the weight and bias cast for an input as tensors the caller owns."""
from __future__ import annotations

import dataclasses
import inspect

import torch

import comfy.ops

_CAST_OFFLOADABLE = "offloadable" in inspect.signature(comfy.ops.cast_bias_weight).parameters
_UNCAST = getattr(comfy.ops, "uncast_bias_weight", None)
_QUANTIZED_TENSOR = getattr(comfy.ops, "QuantizedTensor", None)
_CAST_CONTEXT = getattr(comfy.ops, "CastBiasWeightContext", None)
_QUANT_ALGOS = getattr(comfy.ops, "QUANT_ALGOS", {})
_RUN_EVERY_OP = getattr(comfy.ops, "run_every_op", None)


def _is_quantized(tensor) -> bool:
    return _QUANTIZED_TENSOR is not None and isinstance(tensor, _QUANTIZED_TENSOR)


def module_attr(module, name: str, default=None):
    """`getattr(module, name, default)` for a data attribute of a module (a flag, a scale, a LoRA function
    list), without `Module.__getattr__`'s cost where the module has none (it raises and catches an
    AttributeError: microseconds, and the probes below ask a dozen a layer at every call). The instance's own
    attributes, parameters, buffers and submodules, then its class's plain attributes; a class descriptor
    (a property, a method) goes through `getattr`."""
    found = getattr(module, "__dict__", None)
    if found is None:
        return getattr(module, name, default)
    value = found.get(name, _ABSENT)
    if value is not _ABSENT:
        return value
    for store in ("_parameters", "_buffers", "_modules"):
        values = found.get(store)
        if values and name in values:
            return values[name]
    value = getattr(type(module), name, _ABSENT)
    if value is _ABSENT:
        return default
    if hasattr(type(value), "__get__"):
        return getattr(module, name, default)   # a descriptor: what the instance gives
    return value


_ABSENT = object()


def _needs_cast(linear) -> bool:
    return bool(module_attr(linear, "comfy_cast_weights", False) or module_attr(linear, "weight_function", None)
                or module_attr(linear, "bias_function", None))


_CAST_KWARGS = set(inspect.signature(comfy.ops.cast_bias_weight).parameters)


def cast_owned(layer, x, **kwargs) -> tuple:
    """`comfy.ops.cast_bias_weight(layer, x, **kwargs)` as `(weight, bias)` tensors the caller owns.

    Why: with an offload stream (weights not on the GPU, partially loaded models) ComfyUI casts into one
    buffer per stream that the next cast on that stream overwrites; its own layers use a weight before the
    next layer casts, the pack holds q, k and v (and the FFN's two) at once. With a Wan 14B partly offloaded
    on a 24 GB plan the held weights were overwritten and the self-check found the outputs different. So a
    cast that went through a stream is copied out of its buffer (one GPU copy of a weight: microseconds),
    and the buffer is handed back at once (`uncast_bias_weight`), which also releases Dynamic VRAM's pin. A
    cast with no stream returns fresh tensors (or the layer's own, on the GPU already): kept as they are.
    `kwargs`: `compute_dtype`/`want_requant` where this ComfyUI has them."""
    kwargs = {k: v for k, v in kwargs.items() if k in _CAST_KWARGS}
    if not _CAST_OFFLOADABLE or _UNCAST is None:
        return comfy.ops.cast_bias_weight(layer, x, **kwargs)
    weight, bias, stream = comfy.ops.cast_bias_weight(layer, x, offloadable=True, **kwargs)
    if stream is None or all(part is None for part in stream):
        return weight, bias
    buffers = [part for part in stream[1:] if torch.is_tensor(part)]
    through_buffer = len(buffers) < len(stream) - 1   # a part that is not a tensor: Dynamic VRAM's pin

    def owned(t, own_param):
        if t is None or t is own_param:
            return t
        if through_buffer or any(t is b for b in buffers):
            return _clone(t)
        return t
    weight, bias = owned(weight, getattr(layer, "weight", None)), owned(bias, getattr(layer, "bias", None))
    _UNCAST(layer, weight, bias, stream)
    return weight, bias


def _clone(t):
    if _is_quantized(t):   # the quantized data (and its scale) out of the buffer, the same layout
        params = t._params
        scale = getattr(params, "scale", None)
        if torch.is_tensor(scale):
            params = dataclasses.replace(params, scale=scale.clone())
        return _QUANTIZED_TENSOR(t._qdata.clone(), t._layout_cls, params)
    return t.clone()


def run_every_op() -> None:
    """ComfyUI's per-op hook (its interrupt check), as its own layers call it, where this ComfyUI has one."""
    if _RUN_EVERY_OP is not None:
        _RUN_EVERY_OP()


__all__ = ["module_attr", "cast_owned", "run_every_op"]
