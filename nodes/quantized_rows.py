"""Rows of layers that compute in their own quantized format (`comfy_ops.ComfyLinearRows`): mixed-precision layers
with `QuantizedTensor` weights (fp8-scaled, int8_tensorwise, nvfp4 / mxfp8 by 128-row blocks) and ComfyUI's fp8 ops,
each head group's rows computed by the layer's own matmul on row slices of its weight, the input quantized once for
q, k and v (`QuantizedRows`)."""
from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

import comfy.model_management
import comfy.ops

from ..qkv_core import PreparedProjection
from .comfy_cast import _CAST_CONTEXT, _QUANT_ALGOS, _QUANTIZED_TENSOR, _is_quantized, cast_owned, module_attr

_FP8_PARAMS = getattr(getattr(comfy.ops, "TensorCoreFP8Layout", None), "Params", None)
# QuantizedTensor layouts whose rows are rows of the quantized data with the same (per-tensor) scale
PER_TENSOR_FP8_LAYOUTS = {"TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout", "TensorCoreFP8E5M2Layout"}
PER_TENSOR_WEIGHT_ONLY_LAYOUTS = {"TensorWiseINT8Layout"}
# Block-scaled layouts whose scales are stored by blocks of 128 weight rows (cuBLAS's blocked layout, as a 2-D
# tensor of the padded row count): rows [128 k, 128 (k + 1)) of the data and of that scale tensor belong
# together, so whole 128-row blocks slice exactly. The field holding those scales:
BLOCK_ROW_LAYOUTS = {"TensorCoreNVFP4Layout": "block_scale", "TensorCoreMXFP8Layout": "scale"}
ROW_BLOCK = 128
_FP8_OPS_LINEAR = getattr(getattr(comfy.ops, "fp8_ops", None), "Linear", None)
_FP8_LINEAR = getattr(comfy.ops, "fp8_linear", None)
FP8_MAX = 448.0   # float8_e4m3fn's largest value: fp8_linear clamps its input to it


def quantized_rows_mode(linear) -> tuple[Optional[str], Optional[str]]:
    """How the rows of a mixed-precision layer (fp8-scaled checkpoints: `QuantizedTensor` weights) are
    computed as the layer computes them: `("quantized", None)` when its forward runs the scaled fp8 matmul
    with a per-tensor-scaled weight (rows: that matmul on a row slice of the quantized data, same scales);
    `("dequantized", None)` when its forward dequantizes the weight for a full-precision matmul (old
    scaled-fp8 checkpoints, a LoRA weight function, forced casts: rows of that weight); `("weight_only", None)`
    for weight-only formats with one scale per weight (int8_tensorwise: the weight's own matmul on row slices
    of its data); nvfp4 / mxfp8 are "quantized" too, by whole 128-row blocks; `(None, why)` otherwise (other
    weight-only or block layouts, input smoothing, other classes): run whole."""
    weight = linear.weight
    layout = getattr(weight, "_layout_cls", None)
    if _CAST_CONTEXT is None:
        return None, "this ComfyUI's quantized layers have no CastBiasWeightContext"
    if "MixedPrecisionOps" not in type(linear).__qualname__:
        return None, f"{type(linear).__qualname__} computes its own way"
    if module_attr(linear, "pre_quant_scale", None) is not None:
        return None, "input smoothing (pre_quant_scale)"
    quantized_call = (module_attr(linear, "layout_type", None) is not None and
                      not module_attr(linear, "_full_precision_mm", False) and
                      not module_attr(linear, "comfy_force_cast_weights", False) and
                      not module_attr(linear, "weight_function", None) and
                      not module_attr(linear, "bias_function", None))
    if not quantized_call:
        return "dequantized", None
    if not _QUANT_ALGOS.get(module_attr(linear, "quant_format", None), {}).get("quantize_input", True):
        # weight-only formats (int8_tensorwise, w4a8, ...): the layer hands its 16-bit input to the weight's own
        # matmul; with one scale for the whole weight, a row slice of its data is that matmul's rows
        scale = getattr(getattr(weight, "_params", None), "scale", None)
        if layout not in PER_TENSOR_WEIGHT_ONLY_LAYOUTS or not torch.is_tensor(scale) or scale.numel() != 1:
            return None, f"weight-only {layout} has no row slice here"
        return "weight_only", None
    params = getattr(weight, "_params", None)
    if layout in BLOCK_ROW_LAYOUTS:
        scales = getattr(params, BLOCK_ROW_LAYOUTS[layout], None)
        if getattr(params, "transposed", False) or not torch.is_tensor(scales) or scales.dim() != 2 \
                or scales.shape[0] != -(-weight.shape[0] // ROW_BLOCK) * ROW_BLOCK:
            return None, f"{layout} with scales not stored by 128-row blocks"
        return "quantized", None
    if layout not in PER_TENSOR_FP8_LAYOUTS:
        return None, f"{layout} has no row slice here"
    scale = getattr(params, "scale", None)
    if not torch.is_tensor(scale) or scale.numel() != 1:
        return None, f"{layout} without a per-tensor scale"
    return "quantized", None


def fp8_matmul_rows(linear) -> bool:
    """A layer of ComfyUI's fp8 ops (`--fast fp8_matrix_mult`, or weights it runs in fp8) whose forward is
    `fp8_linear`: the input clamped to fp8's range and cast (scale 1), the fp8 weight (scale 1), one scaled
    fp8 matmul. With scale 1 on both, rows of that matmul are the matmul of the weight's rows. Only where
    `fp8_linear` is the QuantizedTensor version (v0.33+) and nothing patches the weight on the fly."""
    return (_FP8_OPS_LINEAR is not None and _FP8_LINEAR is not None and _QUANTIZED_TENSOR is not None
            and _CAST_CONTEXT is not None and _FP8_PARAMS is not None and isinstance(linear, _FP8_OPS_LINEAR)
            and type(linear).forward_comfy_cast_weights is _FP8_OPS_LINEAR.forward_comfy_cast_weights
            and module_attr(linear, "weight") is not None and module_attr(linear, "weight").dtype == torch.float8_e4m3fn
            and not module_attr(linear, "weight_function", None) and not module_attr(linear, "bias_function", None)
            and module_attr(linear, "scale_weight", None) is None and module_attr(linear, "scale_input", None) is None)


# The quantized input of a layer call, shared by the layers that quantize the same input the same way (q, k
# and v of one attention: one copy instead of three). Weak references to both the input and its quantized
# copy: an entry serves only that very input, and the copy is freed with its last user.
_QUANTIZED_INPUTS: dict = {}


def _quantized_input(linear, x: torch.Tensor):
    """`x` as `linear`'s forward quantizes it (its layout and `input_scale`, else a scale from x), 2-D."""
    scale = getattr(linear, "input_scale", None)
    key = (id(x), x._version, linear.layout_type, None if scale is None else float(scale))
    entry = _QUANTIZED_INPUTS.get(key)
    if entry is not None and entry[0]() is x and entry[1]() is not None:
        return entry[1]()
    for stale in [k for k, (x_ref, q_ref, *_) in _QUANTIZED_INPUTS.items() if x_ref() is None or q_ref() is None]:
        del _QUANTIZED_INPUTS[stale]
    if scale is not None:
        scale = comfy.model_management.cast_to_device(scale, x.device, None)
    quantized = _QUANTIZED_TENSOR.from_float(x.reshape(-1, x.shape[-1]), linear.layout_type, scale=scale)
    _QUANTIZED_INPUTS[key] = (weakref.ref(x), weakref.ref(quantized))
    return quantized


def _fp8_ops_input(x: torch.Tensor):
    """`x` as `fp8_linear` makes its input: clamped to fp8's range in place (the layer does that to its
    caller's tensor too; q, k and v of one input clamp it once) and cast to fp8, scale 1; 2-D. Shared by the
    layers of one input like `_quantized_input`."""
    key = ("fp8_ops", id(x))
    entry = _QUANTIZED_INPUTS.get(key)
    if entry is not None and entry[0]() is x and entry[1]() is not None and entry[2] == x._version:
        return entry[1]()
    flat = x.reshape(-1, x.shape[-1])
    torch.clamp(flat, min=-FP8_MAX, max=FP8_MAX, out=flat)
    params = _FP8_PARAMS(scale=torch.ones((), device=x.device, dtype=torch.float32), orig_dtype=x.dtype,
                         orig_shape=tuple(flat.shape))
    quantized = _QUANTIZED_TENSOR(flat.to(torch.float8_e4m3fn).contiguous(), "TensorCoreFP8Layout", params)
    _QUANTIZED_INPUTS[key] = (weakref.ref(x), weakref.ref(quantized), x._version)
    return quantized


class QuantizedRows(PreparedProjection):
    """Rows of a mixed-precision layer with a per-tensor-scaled fp8 weight (`quantized_rows_mode` is "quantized"),
    computed as the layer computes them: the input quantized once per layer call as the layer's forward
    quantizes it (its `layout_type` and `input_scale`), the weight taken once through ComfyUI's
    `cast_bias_weight` (offload, requantization; `cast_owned`), then the layer's scaled fp8 matmul on a row slice of
    the quantized data with the same scales: each output column equals the layer's."""

    def __init__(self, linear, x: torch.Tensor, weight_only: bool = False, fp8_ops: bool = False):
        self.shape = x.shape
        if fp8_ops:   # as `comfy.ops.fp8_linear`: both operands fp8 with scale 1
            self.qx = _fp8_ops_input(x)
            weight, self.bias = cast_owned(linear, x, dtype=linear.weight.dtype, bias_dtype=x.dtype,
                                           compute_dtype=comfy.model_management.lora_compute_dtype(x.device),
                                           want_requant=True)
            params = _FP8_PARAMS(scale=torch.ones((), device=x.device, dtype=torch.float32), orig_dtype=x.dtype,
                                 orig_shape=tuple(weight.shape))
            self.weight = _QUANTIZED_TENSOR(weight, "TensorCoreFP8Layout", params)
            return
        if weight_only:
            # the layer's weight-only path: the weight cast in its own format and given the input's dtype (still
            # quantized: its matmul quantizes the 16-bit input by token itself, which rows do not change)
            self.qx = x.reshape(-1, x.shape[-1])
            weight, self.bias = cast_owned(linear, None, dtype=linear.weight.dtype, device=x.device,
                                           bias_dtype=x.dtype, compute_dtype=x.dtype, want_requant=True)
            self.weight = weight.to(dtype=x.dtype)
            return
        self.qx = _quantized_input(linear, x)
        self.weight, self.bias = cast_owned(linear, self.qx, compute_dtype=x.dtype, want_requant=True)

    # Token ranges are computed efficiently (`rows_into`), but each product goes through a temporary of the
    # chunk's size (the fp8 matmul has no `out=`): declared not cheap, so the runtime plans its statistics
    # pass group by group, which peaks lower than by tokens.
    by_tokens = False

    @staticmethod
    def _row_slice(tensor, start: int, stop: int):
        """Rows `[start, stop)` of a QuantizedTensor: per-tensor-scaled (the same scale), or block-scaled by
        128-row blocks (`start` a multiple of 128, `stop` too or the last row: see `block_rows`); or of a
        plain tensor."""
        if not _is_quantized(tensor):   # the cast handed back a plain weight (e.g. requantization declined)
            return tensor[start:stop]
        params = tensor._params
        columns = params.orig_shape[1]
        field = BLOCK_ROW_LAYOUTS.get(tensor._layout_cls)
        if field is None:
            params = dataclasses.replace(params, orig_shape=(stop - start, columns))
        else:
            scales = getattr(params, field)
            if start % ROW_BLOCK or (stop % ROW_BLOCK and stop != tensor._qdata.shape[0]):
                raise ValueError(f"rows [{start}, {stop}) of {tensor._layout_cls} must be whole 128-row blocks")
            scale_stop = min(-(-stop // ROW_BLOCK) * ROW_BLOCK, scales.shape[0])
            params = dataclasses.replace(params, orig_shape=(stop - start, columns),
                                         **{field: scales[start:scale_stop]})
        return _QUANTIZED_TENSOR(tensor._qdata[start:stop], tensor._layout_cls, params)

    def _block_rows(self, start: int, stop: int) -> tuple[int, int]:
        """The rows to compute for `[start, stop)`: whole 128-row blocks for block-scaled weights."""
        if not (_is_quantized(self.weight) and self.weight._layout_cls in BLOCK_ROW_LAYOUTS):
            return start, stop
        return start // ROW_BLOCK * ROW_BLOCK, min(-(-stop // ROW_BLOCK) * ROW_BLOCK, self.weight._qdata.shape[0])

    def rows(self, start: int, stop: int) -> torch.Tensor:
        first, last = self._block_rows(start, stop)
        bias = None if self.bias is None else self.bias[first:last]
        out = F.linear(self.qx, self._row_slice(self.weight, first, last), bias)
        if (first, last) != (start, stop):   # a head group inside a 128-row block: its columns of the block's
            out = out[..., start - first:stop - first].contiguous()
        return out.reshape(*self.shape[:-1], stop - start)

    def rows_into(self, out: torch.Tensor, start: int, stop: int, token_start: int = 0) -> None:
        """Only the tokens asked for: rows of the quantized input times rows of the quantized weight (a
        product the size of `out`, not of the whole projection). Block-scaled inputs have their scales by
        128-token blocks too: those compute every token and copy."""
        if self._block_rows(start, stop) != (start, stop) or (_is_quantized(self.qx) and
                                                              self.qx._layout_cls in BLOCK_ROW_LAYOUTS):
            return PreparedProjection.rows_into(self, out, start, stop, token_start)
        tokens = self.shape[-2] if len(self.shape) == 3 else self.shape[0]
        out3 = out if out.dim() == 3 else out.unsqueeze(0)
        weight = self._row_slice(self.weight, start, stop)
        bias = None if self.bias is None else self.bias[start:stop]
        for item in range(out3.shape[0]):
            first = item * tokens + token_start
            out3[item].copy_(F.linear(self._row_slice(self.qx, first, first + out3.shape[1]), weight, bias))

    def full(self) -> torch.Tensor:
        return F.linear(self.qx, self.weight, self.bias).reshape(*self.shape[:-1], -1)

    def release(self) -> None:
        self.qx = self.weight = self.bias = None


__all__ = ["QuantizedRows", "quantized_rows_mode", "fp8_matmul_rows", "BLOCK_ROW_LAYOUTS", "ROW_BLOCK", "FP8_MAX"]
