"""What a self-check runs on (`nodes/compat.py`): the call's first tokens of each distinct conditioning
(`check_tokens`, `check_items`), what makes a case another (`uniform_case`, part of a signature), the hooks
replaced by probes (`probe_options`), fresh copies of the inputs, and a forward run in float32 with the module's
weights dequantized (`exact_reference`), the check's measure of the exact math."""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

import comfy.ops

from .reference_cache import STATE_KEY as REFERENCE_CACHE_KEY

CHECK_TOKENS = 256
# the most batch items a check takes (`check_items`: one per distinct conditioning, the most varied first)
CHECK_ITEMS = 4


def check_tokens(tokens: int) -> int:
    return min(tokens, CHECK_TOKENS)


def check_items(condition: Optional[torch.Tensor], batch: int) -> list:
    """The batch items a self-check takes: one per distinct conditioning (`condition`: the call's per-item
    conditioning, e.g. its text context; items equal to an earlier one are left out), at most `CHECK_ITEMS`, those
    whose tokens differ most kept (a zeroed negative, whose tokens are all alike, is the first left out: with
    every key the same, attention cannot show its queries' errors), in batch order. All items up to `CHECK_ITEMS`
    where `condition` is not per item."""
    if not torch.is_tensor(condition) or condition.dim() < 1 or condition.shape[0] != batch or batch <= 1:
        return list(range(min(batch, CHECK_ITEMS)))
    distinct = []
    for item in range(batch):
        if not any(torch.equal(condition[item], condition[other]) for other in distinct):
            distinct.append(item)
    if len(distinct) > CHECK_ITEMS:
        spread = {item: _token_spread(condition[item]) for item in distinct}
        distinct = sorted(sorted(distinct, key=lambda item: -spread[item])[:CHECK_ITEMS])
    return distinct


def _token_spread(item: torch.Tensor) -> float:
    """How much the tokens (rows) of one item's conditioning differ: their variance, averaged over channels."""
    rows = item.reshape(-1, item.shape[-1]).float() if item.dim() >= 2 else item.reshape(-1, 1).float()
    return float(rows.var(dim=0).mean()) if rows.shape[0] > 1 else 0.0


_uniform_memo: list = [None, None, None]   # a weak reference to the last tensor asked, its version, the answer


def uniform_case(condition) -> Optional[tuple]:
    """(some batch item of `condition` has every token alike, some has not), or None for no tensor or one token:
    part of a self-check's signature. A zeroed context (ConditioningZeroOut's negative) reaches the blocks as one
    row repeated (the text embedding of zeros): attention over it is uniform and cannot show its queries' errors,
    so a call with only such items is checked apart from one with others. Asked at every call: answered once per
    tensor and version (every block of a step gets the same context), at one host sync."""
    if not torch.is_tensor(condition) or condition.dim() < 2 or condition.shape[1] < 2:
        return None
    try:
        version = (condition.data_ptr(), condition._version)
    except RuntimeError:   # an inference tensor (ComfyUI runs under inference_mode) counts no versions
        version = (condition.data_ptr(), None)
    ref, seen, answer = _uniform_memo
    if ref is not None and ref() is condition and seen == version:
        return answer
    items = condition.shape[0]
    alike = int((condition == condition[:, :1]).reshape(items, -1).all(dim=1).sum()) if condition.numel() else items
    answer = (alike > 0, alike < items)
    try:
        _uniform_memo[:] = [weakref.ref(condition), version, answer]
    except TypeError:   # a tensor subclass without weak references: asked again next time
        pass
    return answer


def probe_options(transformer_options: dict) -> dict:
    """A copy of `transformer_options` whose patch hooks are replaced by probes: each returns its input's
    `x` scaled by a factor of its own, so a forward that calls a hook gives a visibly different result, and
    another node's hook never runs on check inputs. The reference cache's view of the call is left out: a check
    neither fills nor reads a cache."""
    if REFERENCE_CACHE_KEY in transformer_options:
        transformer_options = {k: v for k, v in transformer_options.items() if k != REFERENCE_CACHE_KEY}
    patches = transformer_options.get("patches")
    if not patches:
        return transformer_options
    probed = {}
    for index, (name, hooks) in enumerate(sorted(patches.items())):
        factor = 0.5 + 0.125 * index

        def probe(args, *rest, _factor=factor, **kwargs):
            if isinstance(args, dict) and torch.is_tensor(args.get("x")):
                return args["x"] * _factor
            return args
        probed[name] = [probe] * len(hooks) if isinstance(hooks, (list, tuple)) else probe
    return {**transformer_options, "patches": probed}


def fresh_inputs(inputs: dict) -> dict:
    """The check inputs again, tensors copied (a forward may hand off or write its inputs)."""
    return {name: value.clone() if torch.is_tensor(value) else value for name, value in inputs.items()}


# Weights of ComfyUI's ops (and of ops built on them: mixed precision, GGUF) are cast to their input's dtype on
# every call when these flags are set; `comfy_force_cast_weights` also keeps a mixed-precision layer from
# quantizing its input. ComfyUI sets the first itself for low-VRAM loads.
_CAST_FLAGS = ("comfy_cast_weights", "comfy_force_cast_weights")
_CAST_OP = getattr(comfy.ops, "CastWeightBiasOp", None)
_QUANTIZED_TENSOR = getattr(comfy.ops, "QuantizedTensor", None)


def _dequantized(weight):
    """A weight function that makes ComfyUI's cast dequantize: a `QuantizedTensor` whose original dtype is
    already the input's (float32 models) would otherwise reach the matmul quantized and quantize its input."""
    return weight.dequantize() if _QUANTIZED_TENSOR is not None and isinstance(weight, _QUANTIZED_TENSOR) else weight


def _quantized_weight(layer) -> bool:
    return _QUANTIZED_TENSOR is not None and isinstance(getattr(layer, "weight", None), _QUANTIZED_TENSOR) \
        and isinstance(getattr(layer, "weight_function", None), list)


def _as_float32(value):
    """A floating tensor in float32 (float64 kept), also inside lists and tuples (RoPE tables, reference latents)."""
    if torch.is_tensor(value):
        return value.float() if value.is_floating_point() and value.dtype != torch.float64 else value
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_as_float32(v) for v in value)
    return value


def exact_reference(module, forward: Callable, inputs: dict):
    """`forward(**inputs)` (ComfyUI's forward of `module`, or the pack's: the self-check runs both so) nearer the
    exact math: floating inputs in float32 and
    every ComfyUI layer under `module` casting its weight to float32 at its call (fp8, int8 and GGUF weights
    dequantized, no input quantized: the layers' own casts, LoRA weight functions applied). Each layer's flags
    are restored afterwards, whatever happens. Costs one forward of the check tokens in float32, one layer's
    float32 weight at a time."""
    if _CAST_OP is None:
        raise RuntimeError("this ComfyUI has no CastWeightBiasOp")
    layers = [layer for layer in module.modules() if isinstance(layer, _CAST_OP)]
    saved = [(layer, {name: layer.__dict__[name] for name in _CAST_FLAGS if name in layer.__dict__})
             for layer in layers]
    quantized = [layer for layer in layers if _quantized_weight(layer)]
    try:
        for layer in layers:
            for name in _CAST_FLAGS:
                setattr(layer, name, True)
        for layer in quantized:
            layer.weight_function.append(_dequantized)
        return forward(**{name: _as_float32(value) for name, value in fresh_inputs(inputs).items()})
    finally:
        for layer in quantized:
            if _dequantized in layer.weight_function:
                layer.weight_function.remove(_dequantized)
        for layer, own in saved:
            for name in _CAST_FLAGS:
                if name in own:
                    setattr(layer, name, own[name])
                else:
                    layer.__dict__.pop(name, None)
