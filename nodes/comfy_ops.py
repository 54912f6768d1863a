"""The one mechanism every model adapter shares: ComfyUI weights by rows, norms by head group, token chunks.

- `ComfyLinearRows`: a ComfyUI Linear as a `qkv_core.RowProjection`, each head group's rows computed as the
  layer computes them. Weights on the device with nothing applied on the fly (fp8 cast per call, GGUF):
  only the rows a group needs are cast or dequantized (`row_caster`); otherwise the weight is taken once per
  layer call through `comfy.ops.cast_bias_weight` (LoRA weight functions, offload, scaled-fp8
  `scale_weight`; `cast_owned`: copied out of an offload stream's shared buffer) or the GGUF layer's own
  cast, then sliced. Layers that compute in their own format run their own matmul on row slices of the
  weight (`QuantizedRows`: fp8-scaled, int8_tensorwise, nvfp4/mxfp8 by 128-row blocks, ComfyUI's fp8 ops),
  the input quantized once for q, k and v. Anything else says "not row-sliceable" and runs whole.
- `CastLinear`: the same cast, held for a whole layer call, applied to token chunks (FFN, output projection).
- `rms_norm_rows` / `module_rows`: an RMSNorm over all heads on a chunk of one head group (from precomputed
  mean squares), or the model's own norm on a chunk holding every head.
- `chunk_tokens` / `token_ranges`: bounded token chunks.
"""
from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import comfy.model_management
import comfy.ops

from ..qkv_core import PreparedProjection, RowProjection, RowsOnDemand, WeightRows, WholeProjection

_CAST_OFFLOADABLE = "offloadable" in inspect.signature(comfy.ops.cast_bias_weight).parameters
_UNCAST = getattr(comfy.ops, "uncast_bias_weight", None)
_QUANTIZED_TENSOR = getattr(comfy.ops, "QuantizedTensor", None)
_CAST_CONTEXT = getattr(comfy.ops, "CastBiasWeightContext", None)
_QUANT_ALGOS = getattr(comfy.ops, "QUANT_ALGOS", {})
_FP8_PARAMS = getattr(getattr(comfy.ops, "TensorCoreFP8Layout", None), "Params", None)
# QuantizedTensor layouts whose rows are rows of the quantized data with the same (per-tensor) scale
PER_TENSOR_FP8_LAYOUTS = {"TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout", "TensorCoreFP8E5M2Layout"}
PER_TENSOR_WEIGHT_ONLY_LAYOUTS = {"TensorWiseINT8Layout"}
# Block-scaled layouts whose scales are stored by blocks of 128 weight rows (cuBLAS's blocked layout, as a 2-D
# tensor of the padded row count): rows [128 k, 128 (k + 1)) of the data and of that scale tensor belong
# together, so whole 128-row blocks slice exactly. The field holding those scales:
BLOCK_ROW_LAYOUTS = {"TensorCoreNVFP4Layout": "block_scale", "TensorCoreMXFP8Layout": "scale"}
ROW_BLOCK = 128
_RUN_EVERY_OP = getattr(comfy.ops, "run_every_op", None)
# torch's product with an activation epilogue. On CUDA its GELU is cuBLASLt's GELU_BIAS epilogue, the tanh
# approximation (or, where cuBLASLt is not taken, the product then `gelu_(..., "tanh")`); its CPU kernel applies
# the exact GELU instead, so it is used on CUDA only (`CastLinear.gelu`).
_ADDMM_ACTIVATION = getattr(torch, "_addmm_activation", None)
# LayerNorm classes whose forward is `F.layer_norm(x, shape, weight, bias, eps)` (weights cast when needed)
_CANONICAL_LAYER_NORM_FORWARDS = {torch.nn.LayerNorm.forward, comfy.ops.disable_weight_init.LayerNorm.forward}
_CANONICAL_LAYER_NORM_CASTS = {comfy.ops.disable_weight_init.LayerNorm.forward_comfy_cast_weights}

# Linear classes whose forward is exactly "cast_bias_weight when needed, then F.linear": their rows are exact
_CANONICAL_FORWARDS = {comfy.ops.disable_weight_init.Linear.forward}
_CANONICAL_CAST_FORWARDS = {comfy.ops.disable_weight_init.Linear.forward_comfy_cast_weights}


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


def dequantizes_itself(linear) -> bool:
    """A layer that dequantizes its own weight: city96/ComfyUI-GGUF's `GGMLLayer`, whose forward is
    `weight, bias = layer.cast_bias_weight(input)` (dequantized, its LoRA patches applied) then `F.linear`. Its
    rows are rows of that weight. Told by structure (a quantized GGML weight and the layer's own cast method);
    the self-check confirms the numbers."""
    # both are methods of the layer's class (GGMLLayer): asked of the class first, no attribute lookup that fails
    if not (callable(getattr(type(linear), "is_ggml_quantized", None)) and
            callable(getattr(type(linear), "cast_bias_weight", None))):
        return False
    is_quantized = getattr(linear, "is_ggml_quantized", None)
    if not callable(is_quantized):
        return False
    try:
        return bool(is_quantized())
    except Exception:  # noqa: BLE001 - an unknown layer that cannot answer is run as it is
        return False


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


def quantizes_inputs(module) -> bool:
    """Does any layer under `module` quantize its input (QuantizedTensor weights: fp8-scaled, int8)? Float
    round-off before such a layer can move an input by one quantization step (see compat.compare)."""
    return any(_is_quantized(getattr(child, "weight", None)) for child in module.modules())


def _needs_cast(linear) -> bool:
    return bool(module_attr(linear, "comfy_cast_weights", False) or module_attr(linear, "weight_function", None)
                or module_attr(linear, "bias_function", None))


_CAST_KWARGS = set(inspect.signature(comfy.ops.cast_bias_weight).parameters)


def cast_owned(layer, x, **kwargs) -> tuple:
    """`comfy.ops.cast_bias_weight(layer, x, **kwargs)` as `(weight, bias)` tensors the caller owns.

    Why: with an offload stream (weights not on the GPU, partially loaded models) ComfyUI casts into one
    buffer per stream that the next cast on that stream overwrites; its own layers use a weight before the
    next layer casts, the pack holds q, k and v (and the FFN's two) at once. Measured on an H200 (a Wan 14B
    partly offloaded on a 24 GB plan): the held weights were overwritten and the self-check found the
    outputs different. So a cast that went through a stream is copied out of its buffer (one GPU copy of a
    weight: microseconds), and the buffer is handed back at once (`uncast_bias_weight`), which also
    releases Dynamic VRAM's pin. A cast with no stream returns fresh tensors (or the layer's own, on the
    GPU already): kept as they are. `kwargs`: `compute_dtype`/`want_requant` where this ComfyUI has them."""
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


_FP8_OPS_LINEAR = getattr(getattr(comfy.ops, "fp8_ops", None), "Linear", None)
_FP8_LINEAR = getattr(comfy.ops, "fp8_linear", None)
FP8_MAX = 448.0   # float8_e4m3fn's largest value: fp8_linear clamps its input to it


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


# the names a layer of a plain class may hold beside its weight and bias, each of which needs the full probes
_NOT_PLAIN_NAMES = ("scale_weight", "scale_input", "layout_type", "weight", "bias", "forward")
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_PARAMETER_NAMES = frozenset(("weight", "bias"))
_plain_classes: dict = {}   # class -> is it a plain class (`_plain_class`)


def _plain_class(cls) -> bool:
    """A class whose layers compute `F.linear` of their stored (or ComfyUI-cast) weight: ComfyUI's own Linear
    (`disable_weight_init` / `manual_cast`), with no scale, quantized layout or GGUF cast of its class."""
    return (cls.forward in _CANONICAL_FORWARDS and
            getattr(cls, "forward_comfy_cast_weights", None) in _CANONICAL_CAST_FORWARDS and
            not callable(getattr(cls, "is_ggml_quantized", None)) and
            (_FP8_OPS_LINEAR is None or not issubclass(cls, _FP8_OPS_LINEAR)) and
            all(getattr(cls, name, None) is None for name in ("scale_weight", "scale_input", "layout_type")))


def plain_weights(linear) -> Optional[tuple]:
    """`(weight, bias)` as stored where `linear` is a plain layer: a `_plain_class` layer whose 2-D floating
    weight (a plain tensor) and bias are its parameters, with nothing to apply (no cast flag, no LoRA weight or
    bias function) and nothing else that the probes ask about (a scale, a layout); else None, and the full
    probes answer (`not_row_sliceable`, `stored_weights`). For such a layer they give: rows exact, the weight
    as stored where it is in the input's dtype and device. Read from the layer's own dicts: the probes of
    every projection, MLP and output layer run at every call (host time)."""
    cls = linear.__class__
    plain = _plain_classes.get(cls)
    if plain is None:
        plain = _plain_classes[cls] = isinstance(linear, torch.nn.Module) and _plain_class(cls)
    if not plain:
        return None
    own = linear.__dict__
    params = own.get("_parameters")
    if not params or not _PARAMETER_NAMES.issuperset(params) or own.get("_buffers") or own.get("_modules") or \
            not own.keys().isdisjoint(_NOT_PLAIN_NAMES):
        return None
    weight, bias = params.get("weight"), params.get("bias")
    if weight is None or weight.__class__ not in _PLAIN_TENSOR_TYPES or weight.dim() != 2 or \
            not weight.dtype.is_floating_point or (bias is not None and bias.__class__ not in _PLAIN_TENSOR_TYPES) \
            or (_QUANTIZED_TENSOR is not None and isinstance(weight.data, _QUANTIZED_TENSOR)):
        return None
    if own.get("comfy_cast_weights", getattr(cls, "comfy_cast_weights", False)) or \
            own.get("weight_function", getattr(cls, "weight_function", None)) or \
            own.get("bias_function", getattr(cls, "bias_function", None)):
        return None
    return weight, bias


def not_row_sliceable(linear) -> Optional[str]:
    """None when rows of `linear`'s output can be computed exactly from row slices of its cast weight, else
    why not. Probes structure (attributes, dtypes), so an unknown layer degrades to "run whole"."""
    if plain_weights(linear) is not None:
        return None
    weight = module_attr(linear, "weight")
    if weight is None or not torch.is_tensor(weight) or weight.dim() != 2:
        return f"{type(linear).__name__} has no 2-D weight"
    if dequantizes_itself(linear) or fp8_matmul_rows(linear):
        return None
    if gguf_layer_without_quants(linear) and isinstance(linear, comfy.ops.manual_cast.Linear) and \
            weight.dtype.is_floating_point:
        return None   # ComfyUI's manual-cast Linear computes it: the cast weight's rows are exact
    if _is_quantized(weight) or _is_quantized(getattr(weight, "data", None)):
        mode, problem = quantized_rows_mode(linear) if _is_quantized(weight) else (None, "wrapped")
        if mode is not None:
            return None
        layout = getattr(weight, "_layout_cls", None) or getattr(weight, "layout_type", "?")
        return f"QuantizedTensor weight ({layout}) computes in its own format: {problem}"
    cls = type(linear)
    forward = cls.forward
    if module_attr(linear, "scale_weight", None) is not None and torch.is_tensor(linear.scale_weight):
        # scaled fp8 (ComfyUI before the QuantizedTensor rewrite): exact when it does not use fp8 matmuls
        if getattr(cls, "fp8_matrix_mult", False) or module_attr(linear, "scale_input", None) is not None:
            return "scaled fp8 with fp8 matrix multiplication"
        return None
    if module_attr(linear, "layout_type", None) is not None:
        return f"quantized layout {linear.layout_type}"
    if forward in _CANONICAL_FORWARDS and cls.forward_comfy_cast_weights in _CANONICAL_CAST_FORWARDS:
        # stored in 16/32 bits, or fp8 cast per call (ComfyUI's manual cast): the cast weight's rows are exact
        if weight.dtype.is_floating_point:
            return None
        return f"{weight.dtype} weight"
    if "MixedPrecisionOps" in cls.__qualname__ and hasattr(cls, "_forward") \
            and weight.dtype.is_floating_point and weight.element_size() >= 2:
        # a layer of a mixed-precision checkpoint kept in 16/32 bits: cast_bias_weight + F.linear as well
        return None
    if isinstance(linear, torch.nn.Linear) and cls.forward is torch.nn.Linear.forward:
        return None
    return f"{cls.__module__}.{cls.__qualname__} computes its own way"


_ASK = object()   # an argument not given: the callee probes the layer itself


class CastLinear:
    """A ComfyUI Linear's weight and bias cast once for `x`'s device and dtype (owned: `cast_owned`);
    `release()` drops them. `cast(t)` applies it to any input with `x`'s dtype/device. A layer that computes
    in its own format (QuantizedTensor matmuls, ComfyUI's fp8 ops, unknown op classes) is not cast:
    `cast(t)` runs the layer itself, as ComfyUI runs it (`weight` is None then)."""

    def __init__(self, linear, x: torch.Tensor, sliceable=_ASK):
        """`sliceable`: `not_row_sliceable(linear)` where the caller has just asked it (not asked again)."""
        self._linear = linear
        self.weight = self.bias = None
        plain = plain_weights(linear)
        stored = None if plain is None else _stored_plain(plain, x)
        if stored is not None:   # `stored_weights`' common case, the layer probed once
            self.own_format, (self.weight, self.bias) = None, stored
            return
        self.own_format = not_row_sliceable(linear) if sliceable is _ASK else sliceable
        stored = stored_weights(linear, x) if self.own_format is None else None
        if stored is not None:   # the weight as stored: no cast (the common case, asked first)
            self.weight, self.bias = stored
            return
        if self.own_format is None and _is_quantized(module_attr(linear, "weight")):
            self.own_format = "QuantizedTensor weight: the layer's own quantized matmul"
        if self.own_format is None and fp8_matmul_rows(linear):
            self.own_format = "ComfyUI's fp8 ops: the layer's own fp8 matmul"
        if self.own_format is not None:
            return
        run_every_op()  # ComfyUI's interrupt check, as its own Linear.forward does
        if dequantizes_itself(linear):
            weight, bias = linear.cast_bias_weight(x)   # the layer's own dequantized, patched weight
        elif _needs_cast(linear) or linear.weight.dtype != x.dtype or linear.weight.device != x.device:
            weight, bias = cast_owned(linear, x)
        else:
            weight, bias = linear.weight, linear.bias
        scale = module_attr(linear, "scale_weight", None)
        if scale is not None and torch.is_tensor(scale):
            weight = weight * scale.to(device=weight.device, dtype=weight.dtype)
        self.weight, self.bias = weight, bias

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.own_format is not None:
            return self._linear(t)
        if t.dim() == 3 and t.shape[0] > 1 and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] and \
                not t.is_contiguous():
            # token chunks of several batch items (rows of each item contiguous, the items apart): one batched
            # product over the strided items, the bias added as F.linear adds it to a contiguous input, where
            # F.linear would copy the chunk, multiply and add the bias in three launches
            weight_t = self.weight.t().expand(t.shape[0], -1, -1)
            if self.bias is None:
                return torch.bmm(t, weight_t)
            return torch.baddbmm(self.bias.view(1, 1, -1), t, weight_t)
        return F.linear(t, self.weight, self.bias)

    def gelu(self, t: torch.Tensor, approximate: str) -> torch.Tensor:
        """`gelu(self(t), approximate=approximate)`, a new tensor. On CUDA, for the tanh approximation with a cast
        weight and bias in `t`'s dtype and a contiguous `t`: one product whose epilogue applies the GELU
        (`torch._addmm_activation`): no second pass over the hidden activation, the GELU taken of the product
        before it is rounded (within a rounding of `t`'s dtype of the two steps). Else the product, then the GELU
        in place."""
        if approximate == "tanh" and _ADDMM_ACTIVATION is not None and self.own_format is None and \
                self.bias is not None and t.is_cuda and torch.version.hip is None and t.is_contiguous() and \
                t.dim() >= 2 and self.weight.dtype == t.dtype == self.bias.dtype:
            flat = t.reshape(-1, t.shape[-1])
            return _ADDMM_ACTIVATION(self.bias, flat, self.weight.t(), use_gelu=True).view(*t.shape[:-1], -1)
        hidden = self(t)
        torch.ops.aten.gelu_(hidden, approximate=approximate)
        return hidden

    def release(self) -> None:
        self.weight = self.bias = None


def gguf_layer_without_quants(layer) -> bool:
    """A layer of city96/ComfyUI-GGUF (`GGMLLayer`) with nothing quantized (its F16 / F32 files, and the layers a
    quantized file keeps in F16 or F32): its forward then runs ComfyUI's own (`forward_comfy_cast_weights` of
    ComfyUI's manual-cast Linear or LayerNorm: `cast_bias_weight`, then the plain op), so the layer computes what
    ComfyUI's does. Told by structure, as `dequantizes_itself`."""
    is_quantized = getattr(layer, "is_ggml_quantized", None)
    if not (callable(is_quantized) and callable(getattr(type(layer), "forward_ggml_cast_weights", None))):
        return False
    try:
        return not is_quantized()
    except Exception:  # noqa: BLE001 - an unknown layer that cannot answer runs as it is
        return False


def plain_layer_norm_eps(norm) -> Optional[float]:
    """The epsilon of `norm` when it computes `F.layer_norm(x, (C,), None, None, eps)`: a torch or ComfyUI
    LayerNorm over the last dimension without weight or bias (also ComfyUI-GGUF's, which casts like ComfyUI's
    when it has nothing quantized), running its class's own forward; else None."""
    if not isinstance(norm, torch.nn.LayerNorm) or "forward" in vars(norm) or len(norm.normalized_shape) != 1 or \
            getattr(norm, "weight", None) is not None or getattr(norm, "bias", None) is not None:
        return None
    cls = type(norm)
    cast = getattr(cls, "forward_comfy_cast_weights", None)
    if cls.forward not in _CANONICAL_LAYER_NORM_FORWARDS or \
            (cast is not None and cast not in _CANONICAL_LAYER_NORM_CASTS and not gguf_layer_without_quants(norm)):
        return None
    return norm.eps


def run_every_op() -> None:
    """ComfyUI's per-op hook (its interrupt check), as its own layers call it, where this ComfyUI has one."""
    if _RUN_EVERY_OP is not None:
        _RUN_EVERY_OP()


class ComfyLinearRows(RowProjection):
    """A ComfyUI Linear (`comfy.ops.*.Linear`) as a row projection; see the module docs."""

    def __init__(self, linear):
        self.linear = linear
        self.out_features = getattr(linear, "out_features", None)
        self._held: Optional[CastLinear] = None
        if plain_weights(linear) is not None:   # rows exact, no format of its own (asked at every call: cheap)
            self._reason = self._mode = None
            return
        self._reason = not_row_sliceable(linear)
        quantized = self._reason is None and _is_quantized(module_attr(linear, "weight"))
        self._mode = quantized_rows_mode(linear)[0] if quantized else None   # "quantized", "dequantized", "weight_only"
        if self._reason is None and self._mode is None and fp8_matmul_rows(linear):
            self._mode = "fp8_matmul"

    def not_row_sliceable(self) -> Optional[str]:
        return self._reason

    def hold(self, like: torch.Tensor) -> None:
        """Cast the weight once for several layer calls (token chunks of one call) until `release_hold()`."""
        if self._reason is None and self._held is None and self._mode is None:
            self._held = CastLinear(self.linear, like)

    def release_hold(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            held.release()

    def prepare(self, x: torch.Tensor) -> PreparedProjection:
        if self._reason is not None:
            return WholeProjection(self.linear, self._reason).prepare(x)  # the layer's own numerics
        if self._mode == "quantized":
            return QuantizedRows(self.linear, x)
        if self._mode == "dequantized":   # the weight the layer's full-precision call dequantizes, then rows
            weight, bias = cast_owned(self.linear, x, compute_dtype=x.dtype, want_requant=False)
            return WeightRows(x, weight, bias)
        if self._mode == "weight_only":
            return QuantizedRows(self.linear, x, weight_only=True)
        if self._mode == "fp8_matmul":
            return QuantizedRows(self.linear, x, fp8_ops=True)
        if self._held is not None:
            return WeightRows(x, self._held.weight, self._held.bias)
        stored = stored_weights(self.linear, x)
        if stored is not None:
            return WeightRows(x, *stored)
        weight_rows = row_caster(self.linear, x, sliceable=True)
        if weight_rows is not None:
            return RowsOnDemand(x, self.linear.weight.shape[0], weight_rows)
        cast = CastLinear(self.linear, x, sliceable=None)   # probed at construction: rows, no format of its own
        return WeightRows(x, cast.weight, cast.bias, on_release=cast.release)


def stored_weights(linear, x: torch.Tensor) -> Optional[tuple]:
    """`(weight, bias)` as the layer stores them where `CastLinear(linear, x)` would use them so (a row-sliceable
    layer, `not_row_sliceable` None, whose weight is in `x`'s dtype and on its device with nothing to apply: no
    cast, no LoRA function, no scale, not GGUF), after ComfyUI's per-op hook as `CastLinear` runs it; else None.
    The same answer as `row_caster` (None) then `CastLinear` give for such a layer, in a few lookups: every
    projection of every call asks (host time before the first attention)."""
    plain = plain_weights(linear)
    if plain is not None:
        return _stored_plain(plain, x)
    weight = module_attr(linear, "weight")
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or weight.dtype != x.dtype or \
            weight.device != x.device or _needs_cast(linear) or dequantizes_itself(linear) or \
            module_attr(linear, "scale_weight", None) is not None:
        return None
    run_every_op()  # ComfyUI's interrupt check, as its own Linear.forward does
    return weight, module_attr(linear, "bias")


def _stored_plain(plain: tuple, x: torch.Tensor) -> Optional[tuple]:
    """`stored_weights` of a plain layer (`plain_weights` gave `plain`)."""
    if plain[0].dtype != x.dtype or plain[0].device != x.device:
        return None
    run_every_op()  # ComfyUI's interrupt check, as its own Linear.forward does
    return plain


def _plain_tensor(t) -> bool:
    return t is None or (torch.is_tensor(t) and type(t) in (torch.Tensor, torch.nn.Parameter))


def row_caster(linear, x: torch.Tensor, sliceable: bool = False) -> Optional[Callable[[int, int], tuple]]:
    """`(start, stop) -> (weight rows, bias rows)` as the layer's cast would make them, casting only those
    rows, or None where only the whole cast is exact or safe (then the whole weight is cast once per call).

    Rows, for weights already on `x`'s device with nothing applied on the fly (no LoRA weight function, no
    GGUF patch), outside ComfyUI's Dynamic VRAM (whose cast is its own):
    - stored in another dtype and cast per call (fp8 with `weight_dtype fp8_*`, 16-bit weights computed in
      another dtype): an elementwise cast, so the rows of the cast are the cast of the rows;
    - GGUF (city96/ComfyUI-GGUF): every quantized block lies inside one row (a row is whole blocks), so the
      layer's own `get_weight` on a row slice of the raw blocks dequantizes exactly those rows.
    Why: the whole cast weight of k and v stays beside the input for the layer call; at 720p a Wan 14B
    weight is 0.07 |x| each, and holding them put the block at 2.54 |x| (H200, fp8). `sliceable=True`: the
    caller has found `not_row_sliceable(linear)` None (not asked again)."""
    weight, bias = module_attr(linear, "weight"), module_attr(linear, "bias")
    if (module_attr(linear, "_v", _ASK) is not _ASK or module_attr(linear, "weight_function", None)
            or module_attr(linear, "bias_function", None) or weight is None or weight.device != x.device
            or (bias is not None and bias.device != x.device)):
        return None
    if dequantizes_itself(linear):
        return _gguf_row_caster(linear, x)
    if not (_needs_cast(linear) or weight.dtype != x.dtype) or not (_plain_tensor(weight) and _plain_tensor(bias)):
        return None
    if (not sliceable and not_row_sliceable(linear) is not None) or not weight.dtype.is_floating_point:
        return None
    scale = module_attr(linear, "scale_weight", None)
    if scale is not None and (not torch.is_tensor(scale) or scale.numel() != 1):
        return None
    dtype = x.dtype

    def weight_rows(start: int, stop: int):
        rows = weight[start:stop].to(dtype)
        if scale is not None:   # as CastLinear applies an old scaled-fp8 layer's per-tensor scale
            rows = rows * scale.to(device=rows.device, dtype=rows.dtype)
        return rows, None if bias is None else bias[start:stop].to(dtype)
    return weight_rows


def _gguf_row_caster(linear, x: torch.Tensor):
    weight, bias = linear.weight, linear.bias
    shape = getattr(weight, "tensor_shape", None)
    if (getattr(weight, "patches", None) or getattr(bias, "patches", None) or shape is None or len(shape) != 2
            or weight.dim() != 2 or weight.shape[0] != shape[0] or not callable(getattr(linear, "get_weight", None))):
        return None   # LoRA patches apply to the whole weight; a layout whose raw rows are not the weight's
    dtype = x.dtype
    whole_bias = None if bias is None else linear.get_weight(bias, dtype)
    if whole_bias is not None:
        whole_bias = comfy.model_management.cast_to(whole_bias, dtype, x.device)

    def weight_rows(start: int, stop: int):
        rows = weight[start:stop]   # a view of the same class: give it the row slice's description
        rows.tensor_type, rows.tensor_shape, rows.patches = weight.tensor_type, torch.Size((stop - start, shape[1])), []
        rows = comfy.model_management.cast_to(linear.get_weight(rows, dtype), dtype, x.device)
        return rows, None if whole_bias is None else whole_bias[start:stop]
    return weight_rows


def linear_handed_off(linear, x_list: list, like: torch.Tensor) -> torch.Tensor:
    """`linear(x)` of `[x]` (the list is cleared: the caller holds no other reference), as the layer computes
    it. A layer that quantizes its input for an fp8 matmul drops the 16-bit `x` as soon as it is quantized, so
    the product is made beside the fp8 copy (0.5 |x|) rather than beside both. `like`: a tensor of the
    compute dtype and device (for the cast)."""
    x = x_list.pop()
    x_list.clear()
    rows = ComfyLinearRows(linear)
    if rows._mode == "quantized":
        prepared = QuantizedRows(linear, x)
        del x
        try:
            return prepared.full()
        finally:
            prepared.release()
    cast = CastLinear(linear, like)
    try:
        return cast(x)
    finally:
        cast.release()


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
    # pass group by group, which measured lower (H200, 720p Wan 14B block, before q/k/v shared their
    # quantized input: 3.55 |x| group by group against 4.50 by tokens; 2.90 now).
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


def norm_weight(norm, x: torch.Tensor) -> Optional[torch.Tensor]:
    """A ComfyUI RMSNorm's weight cast for `x` (through cast_bias_weight when the op needs it)."""
    weight = module_attr(norm, "weight")
    if weight is None:
        return None
    if _needs_cast(norm):
        return cast_owned(norm, x)[0]
    if weight.dtype == x.dtype and weight.device == x.device:   # what cast_to returns then, without the call
        return weight
    return comfy.model_management.cast_to(weight, dtype=x.dtype, device=x.device)


def rms_norm_rows(part: torch.Tensor, inverse_rms: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.Tensor:
    """One token chunk `(B, n, h, D)` of one head group of a tensor whose RMSNorm spans all heads:
    `part * inverse_rms * weight`, with `inverse_rms` = rsqrt(mean of squares over all heads + eps), float32
    `(B, n, 1, 1)`, and `weight` the group's `(h, D)` rows. Returns a new float32 tensor (the caller rounds
    once, as torch's `rms_norm` computes in float32 and rounds once)."""
    out = torch.mul(part, inverse_rms)   # float32 by type promotion, contiguous
    if weight is not None:
        out.mul_(weight)
    return out


def module_rows(part: torch.Tensor, module: Callable) -> torch.Tensor:
    """One token chunk `(B, n, heads, D)` through a per-token module over the full width (the model's own
    norm, run as the model runs it). Returns a new tensor of the same shape."""
    return module(part.reshape(*part.shape[:2], -1)).unflatten(-1, part.shape[2:])


def chunk_tokens(tokens: int, per_token_elements: int, budget_elements: int, minimum: int = 256) -> int:
    """Tokens per chunk so one chunk's transient (`per_token_elements` a token) stays within
    `budget_elements`, at least `minimum` (GPU efficiency) and at most `tokens`."""
    return max(1, min(tokens, max(minimum, budget_elements // max(1, per_token_elements))))


def even_chunk_tokens(tokens: int, per_token_elements: int, budget_elements: int, multiple: int = 256) -> int:
    """Like `chunk_tokens`, but the chunks are as equal as the budget allows and a multiple of `multiple`
    tokens where that still fits: products over equal, tile-aligned chunks waste less of the GPU's last
    wave than a few full chunks and a small remainder."""
    most = chunk_tokens(tokens, per_token_elements, budget_elements)
    count = -(-tokens // most)
    step = -(-tokens // count)
    aligned = -(-step // multiple) * multiple
    return aligned if aligned <= most else step


def token_ranges(tokens: int, step: int):
    for a in range(0, tokens, step):
        yield a, min(a + step, tokens)


__all__ = ["ComfyLinearRows", "CastLinear", "QuantizedRows", "not_row_sliceable", "quantizes_inputs",
           "dequantizes_itself", "quantized_rows_mode", "norm_weight", "rms_norm_rows", "module_rows",
           "chunk_tokens", "even_chunk_tokens", "token_ranges"]
