"""The one mechanism every model adapter shares: ComfyUI weights by rows, norms by head group, token chunks.

- `ComfyLinearRows`: a ComfyUI Linear as a `qkv_core.RowProjection`, each head group's rows computed as the
  layer computes them. Weights on the device with nothing applied on the fly (fp8 cast per call, GGUF):
  only the rows a group needs are cast or dequantized (`row_caster`); otherwise the weight is taken once per
  layer call through `comfy.ops.cast_bias_weight` (LoRA weight functions, offload, scaled-fp8
  `scale_weight`; `cast_owned`: copied out of an offload stream's shared buffer) or the GGUF layer's own
  cast, then sliced. Layers that compute in their own format run their own matmul on row slices of the
  weight (`QuantizedRows` in `nodes/quantized_rows.py`: fp8-scaled, int8_tensorwise, nvfp4/mxfp8 by 128-row
  blocks, ComfyUI's fp8 ops), the input quantized once for q, k and v. Anything else says "not row-sliceable"
  and runs whole. The cast itself and the layer attribute reads are in `nodes/comfy_cast.py`.
- `CastLinear`: the same cast, held for a whole layer call, applied to token chunks (FFN, output projection).
- `rms_norm_rows` / `module_rows`: an RMSNorm over all heads on a chunk of one head group (from precomputed
  mean squares), or the model's own norm on a chunk holding every head.
- `chunk_tokens` / `token_ranges`: bounded token chunks.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

import comfy.model_management
import comfy.ops

from ..qkv_core import PreparedProjection, RowProjection, RowsOnDemand, WeightRows, WholeProjection
from .comfy_cast import _QUANTIZED_TENSOR, _is_quantized, _needs_cast, cast_owned, module_attr, run_every_op
from .quantized_rows import _FP8_OPS_LINEAR, QuantizedRows, fp8_matmul_rows, quantized_rows_mode

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


def quantizes_inputs(module) -> bool:
    """Does any layer under `module` quantize its input (QuantizedTensor weights: fp8-scaled, int8)? Float
    round-off before such a layer can move an input by one quantization step (see compat.compare)."""
    return any(_is_quantized(getattr(child, "weight", None)) for child in module.modules())


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
    weight is 0.07 |x| each, and holding them puts the block over High's peak. `sliceable=True`: the
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
           "dequantizes_itself", "quantized_rows_mode", "fp8_matmul_rows", "cast_owned", "module_attr",
           "run_every_op", "norm_weight", "rms_norm_rows", "module_rows", "chunk_tokens", "even_chunk_tokens",
           "token_ranges"]
