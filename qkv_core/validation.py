"""Checks of a call's arguments, before any work: each is a `ValueError` that names the argument and the fix
(docs/design.md §2.1).

Every check comes before the hand-off: an entry point looks at the tensors in the caller's lists
(`peek_activation`, `validate_kv_first`, `validate_cache_prefix`), checks everything it can (types, widths,
dtypes, devices, options, the prefix and the mask), and only then clears the lists (`hand_off`). A refused call
leaves the caller's lists as they were: `lst[0]` is still the tensor passed.

Order matters where a check has a side effect or reads the result of another: a call runs `validate_call`, then
resolves a `PrefixLayer` (`prefix_join.resolve_prefix`), then `validate_prefix`, then `validate_mask` (which may
choose the backend). Every check reads attributes only (shapes, dtypes, devices, types): no GPU work, no sync.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Optional

import torch

from .backends import AUTO, backend_names
from .head_split import parse_level
from .options import AttentionOptions
from .prefix import KVPrefix
from .projections import FusedRows, LinearRows, WholeProjection
from .streams import CallStreams, TokenStream


# --- the hand-off ----------------------------------------------------------------------------------------------
def peek_activation(tensor_list: Any, what: str) -> torch.Tensor:
    """The tensor of a one-element list, checked and left in the list (`hand_off` clears it once every check of
    the call has passed): a floating-point `(batch, tokens, features)`, a `(tokens, features)` one taken as batch
    1 (a view)."""
    name = what.removesuffix("_list")
    if not isinstance(tensor_list, list) or len(tensor_list) != 1 or not torch.is_tensor(tensor_list[0]):
        raise ValueError(f"{what} must be a one-element list holding the tensor (the runtime clears it, so it "
                         f"holds the only reference): pass [{name}]")
    tensor = tensor_list[0]
    if not tensor.is_floating_point():
        raise ValueError(f"{name} (in {what}) must be a floating-point tensor (float16, bfloat16 or float32), got "
                         f"{tensor.dtype}: cast it to the model's compute dtype first, e.g. {name}.to(torch.bfloat16)")
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(0)
    if tensor.dim() != 3:
        raise ValueError(f"{what}: expected (batch, tokens, features) or (tokens, features), got "
                         f"{tuple(tensor.shape)}: pass [{name}] with {name} of 2 or 3 dims")
    return tensor


def hand_off(*tensor_lists: list) -> None:
    """Clear the caller's lists (after every check of the call): the runtime then holds the only references."""
    for tensor_list in tensor_lists:
        tensor_list.clear()


def take_activation(tensor_list: Any, what: str) -> torch.Tensor:
    """`peek_activation`, then the list is cleared (the runtime then holds the only reference)."""
    tensor = peek_activation(tensor_list, what)
    tensor_list.clear()
    return tensor


def require_projections(**projections) -> None:
    """Each named projection is given (not None)."""
    for name, projection in projections.items():
        if projection is None:
            raise ValueError(f"{name} is None: q, k and v projections are all needed (a layer, a RowProjection "
                             f"or a callable)")


def unpack_stream(number: int, stream: Any) -> tuple[Any, tuple]:
    """`(x_list, (q_proj, k_proj, v_proj, extra_proj or None))` of one `joint_qkv_attention` stream."""
    try:
        x_list, projections = stream
        q_proj, k_proj, v_proj, *rest = projections
    except (TypeError, ValueError):
        raise ValueError(f"stream {number} must be (x_list, (q_proj, k_proj, v_proj[, extra_proj]))") from None
    if len(rest) > 1:
        raise ValueError(f"stream {number} has {3 + len(rest)} projections; at most 4 (q, k, v, extra)")
    return x_list, (q_proj, k_proj, v_proj, rest[0] if rest else None)


def validate_extras(streams: list[TokenStream]) -> None:
    """Every stream of a joint call carries a fourth projection, or none does."""
    extras = {"extra" in s.proj for s in streams}
    if len(extras) > 1:
        raise ValueError("either every stream carries a fourth projection or none does")


def validate_kv_first(qkv_list: Any, force_attention: Optional[str] = None) -> None:
    """`kv_first_attention`'s `[q, k, v]`: three floating-point `(batch, tokens, heads, head_dim)` tensors of one
    dtype and device, k and v alike, q with their batch and head_dim and a multiple of their heads; and its
    `force_attention`. The list is not touched."""
    if not isinstance(qkv_list, list) or len(qkv_list) != 3:
        raise ValueError("kv_first_attention takes [q, k, v] in a three-element list that it clears")
    shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in qkv_list]
    if not all(torch.is_tensor(t) and t.dim() == 4 for t in qkv_list):
        raise ValueError(f"kv_first_attention takes q, k, v as (batch, tokens, heads, head_dim), got {shapes}: "
                         f"unflatten (batch, tokens, heads * head_dim) with .unflatten(-1, (heads, head_dim))")
    q, k, v = qkv_list
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"kv_first_attention: k and v must match, and q share their batch and head_dim with "
                         f"a multiple of their heads; got {shapes}")
    if not (q.is_floating_point() and q.dtype == k.dtype == v.dtype):
        raise ValueError(f"kv_first_attention: q, k and v (qkv_list) must be floating point of one dtype, got "
                         f"{[str(t.dtype) for t in qkv_list]}: cast them to the model's compute dtype, e.g. "
                         f"t.to(torch.bfloat16)")
    if not q.device == k.device == v.device:
        raise ValueError(f"kv_first_attention: q, k and v (qkv_list) must be on one device, got "
                         f"{[str(t.device) for t in qkv_list]}: move them to the model's device first")
    validate_backend_name(force_attention)


def validate_cache_prefix(key: torch.Tensor, value: torch.Tensor, q8: bool) -> None:
    """`cache_prefix`'s key and value (their form already checked): floating point, and for q8 (`q8`: no staged
    core keeps it natively) a head_dim that is a multiple of 32. The list is not touched."""
    if not (key.is_floating_point() and value.is_floating_point()):
        raise ValueError(f"cache_prefix takes float keys and values (kv_list), got {key.dtype} and {value.dtype}: "
                         f"pass them as attention sees them, e.g. key.to(torch.bfloat16)")
    if q8 and key.shape[-1] % 32:
        raise ValueError(f"cache_prefix (kv_list) keeps it as q8 here: q8 needs head_dim divisible by 32, got "
                         f"{key.shape[-1]}: keep this prefix in 16 bits (pass kv_prefix=(key, value))")


# --- one call ----------------------------------------------------------------------------------------------------
def validate_call(o: AttentionOptions, streams: CallStreams, norm_rope: Any = None) -> None:
    """Heads, projection widths, the streams' batch, dtype and device, their inputs against the layers that read
    them (`validate_inputs`), `norm_rope`, and the options' values and combinations (all but the prefix and the
    mask: `validate_prefix`, `validate_mask`). Reads the streams' inputs (before `prepare`)."""
    validate_heads(streams.heads, streams.head_dim, o.kv_heads)
    heads, kv_heads = streams.heads, streams.kv_heads
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}) for grouped-query "
                         f"attention; pass kv_heads=heads for plain attention")
    validate_widths(streams)
    batches = {s.x.shape[0] for s in streams.all_streams}
    if len(batches) != 1:
        raise ValueError(f"all token streams must have the same batch size, got {sorted(batches)}")
    dtypes = {s.x.dtype for s in streams.all_streams}
    if len(dtypes) != 1:
        raise ValueError(f"all token streams must have one dtype, got {sorted(map(str, dtypes))}: cast them "
                         f"to the model's compute dtype first")
    validate_inputs(streams)
    validate_split_options(o.head_split_level, o.split_floor_tokens, o.head_split_group_scale)
    validate_switches(norm_spans_heads=o.norm_spans_heads, split_heads=o.split_heads, reuse_input=o.reuse_input)
    validate_callables(norm_rope=norm_rope, attention_fn=o.attention_fn, norm_stats=o.norm_stats, norm_v=o.norm_v,
                       fused_quant=o.fused_quant)
    validate_softmax_scale(o.softmax_scale)
    if o.attention_fn is None:   # with attention_fn no backend is asked for
        validate_backend_name(o.force_attention)
    if o.softmax_scale is not None and (o.force_attention != "sdpa" or o.attention_fn is not None):
        raise ValueError("softmax_scale is only honoured by the SDPA path: pass force_attention='sdpa' and no "
                         "attention_fn (an attention_fn applies its own scale)")
    if o.norm_stats is not None and not o.norm_spans_heads:
        raise ValueError("norm_stats is only used with norm_spans_heads=True: pass both, or neither")
    if o.keep_keys is not None:
        if isinstance(o.keep_keys, bool) or not isinstance(o.keep_keys, (int, float)) or \
                not 0 <= o.keep_keys <= 1:
            raise ValueError(f"keep_keys is the fraction (0 to 1) of the keys the statistics pass may keep, "
                             f"not {o.keep_keys!r}")
        if not o.norm_spans_heads:
            raise ValueError("keep_keys only applies to the statistics pass of a norm that spans heads: pass "
                             "norm_spans_heads=True, or drop keep_keys")
    if o.attention_fn is None and any("extra" in s.proj for s in streams.all_streams):
        raise ValueError("a fourth projection (extra_proj) is only handed to attention_fn: pass attention_fn, "
                         "or drop the fourth projection")
    if o.fused_quant is not None and o.attention_fn is not None:
        raise ValueError("fused_quant needs the staged quantizers, which attention_fn turns off: pass one "
                         "of them")
    if o.norm_key_into is not None and not callable(o.norm_key_into):
        raise ValueError(f"norm_key_into is a callable (key, dest, group) -> bool that writes the normalized "
                         f"keys into dest, not {type(o.norm_key_into).__name__}: pass one, or leave it out")
    validate_capture(o, streams.kv_tokens)


def _is_int(value: Any) -> bool:
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _int_fix(name: str, value: Any) -> str:
    """How to pass `value` as the int `name`: `name=4` where `value` spells one ('4', 4.0)."""
    if isinstance(value, str) and value.strip().isdigit():
        return f"pass {name}={int(value)}"
    if isinstance(value, float) and value.is_integer():
        return f"pass {name}={int(value)}"
    return f"pass {name} as an int"


def validate_heads(heads: Any, head_dim: Any, kv_heads: Any = None) -> None:
    """`heads`, `head_dim` (and `kv_heads` where given) are ints, `heads` and `head_dim` positive (kv_heads'
    value is the caller's check: a multiple of it, or equal)."""
    for name, value in (("heads", heads), ("head_dim", head_dim), ("kv_heads", kv_heads)):
        if value is not None and not _is_int(value):
            raise ValueError(f"{name} must be a positive int (got {value!r} of type {type(value).__name__}): "
                             f"{_int_fix(name, value)}")
    if heads <= 0 or head_dim <= 0:
        raise ValueError(f"heads ({heads}) and head_dim ({head_dim}) must be positive: pass the model's query "
                         f"heads and the channels of each")


def validate_split_options(level: Any, split_floor_tokens: Any, group_scale: Any) -> None:
    """`head_split_level` (`parse_level`), `split_floor_tokens` (an int >= 0), `head_split_group_scale` (a number
    > 0); None for each: the default."""
    if level is not None:
        parse_level(level)
    if split_floor_tokens is not None and (not _is_int(split_floor_tokens) or split_floor_tokens < 0):
        raise ValueError(f"split_floor_tokens is the fewest tokens (of one batch item) that are split, an int "
                         f">= 0, not {split_floor_tokens!r}; leave it out for the default")
    if group_scale is not None and (isinstance(group_scale, bool) or not isinstance(group_scale, (int, float))
                                    or not group_scale > 0):
        raise ValueError(f"head_split_group_scale multiplies the level's head groups, a number > 0, not "
                         f"{group_scale!r}; leave it out for the default")


def validate_switches(**switches: Any) -> None:
    """Each switch (`norm_spans_heads`, `split_heads`, `reuse_input`, ...) is None, a bool, or 0 or 1."""
    for name, value in switches.items():
        if value is not None and not isinstance(value, bool) and not (_is_int(value) and value in (0, 1)):
            raise ValueError(f"{name} is a switch, True or False, not {value!r} of type {type(value).__name__}: "
                             f"pass {name}=True or {name}=False, or leave it out")


def validate_callables(**hooks: Any) -> None:
    """Each hook (`norm_rope`, `attention_fn`, ...) is None or callable."""
    for name, hook in hooks.items():
        if hook is not None and not callable(hook):
            raise ValueError(f"{name} must be a callable (see its signature in AttentionOptions / the call's "
                             f"docstring), not {type(hook).__name__}: pass a function, or None")


def validate_softmax_scale(scale: Any) -> None:
    """`softmax_scale` is None or a real number."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise ValueError(f"softmax_scale is a number (the default is 1 / sqrt(head_dim)), not {scale!r} of type "
                         f"{type(scale).__name__}: pass softmax_scale=float(...), or leave it out")


def validate_backend_name(name: Any) -> None:
    """`force_attention` is None, "auto" or a registered backend's name."""
    if name is None or name == AUTO:
        return
    names = backend_names()
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"force_attention: unknown attention backend {name!r}: use one of {[AUTO] + names}")


def _layer_of(projection: Any) -> tuple[Optional[torch.nn.Linear], bool]:
    """`(layer, plain)`: the `torch.nn.Linear` a projection computes with (itself, a `LinearRows`' layer, a
    `FusedRows`' inner one; None for anything else), and whether the runtime multiplies by its weight as it is
    (a Linear with torch's own forward: no cast, so its weight's dtype and device are the input's)."""
    while isinstance(projection, FusedRows):
        projection = projection.inner
    if type(projection) is LinearRows:
        return projection.linear, True
    if isinstance(projection, WholeProjection):
        projection = projection.fn
    if isinstance(projection, torch.nn.Linear):
        return projection, type(projection).forward is torch.nn.Linear.forward
    return None, False


def validate_layer_input(what: str, x: torch.Tensor, name: str, projection: Any,
                         features: Optional[int] = None) -> None:
    """`x` (`what`, its features `features`, default its last dim) against the `torch.nn.Linear` behind
    `projection` (`name`), where there is one: its `in_features`, and for a Linear the runtime multiplies by as it
    is (`_layer_of`) its weight's dtype and device (not under autocast, which casts)."""
    _check_layer_input(what, x.shape[-1] if features is None else features, x.dtype, x.device, name, projection)


def _check_layer_input(what: str, features: int, dtype: torch.dtype, device: torch.device, name: str,
                       projection: Any) -> None:
    layer, plain = _layer_of(projection)
    if layer is None:
        return
    wanted = getattr(layer, "in_features", None)
    if wanted != features and _is_int(wanted):
        raise ValueError(f"{what} has {features} features but the {name} projection takes {wanted} (its "
                         f"in_features): pass the activation this layer projects, or the layer for {features} "
                         f"features")
    if not plain:
        return
    parameters = layer._parameters   # a Linear's weight and bias (a dict: no Module.__getattr__ per read)
    for part in ("weight", "bias"):
        tensor = parameters.get(part)
        if tensor is None:
            continue
        if tensor.dtype is dtype and tensor.device == device:
            continue
        if tensor.device != device:
            raise ValueError(f"{what} is on {device} but the {name} projection's {part} is on {tensor.device}: "
                             f"move the layer (layer.to({str(device)!r})) or {what} to {tensor.device}")
        if not _autocast(device):
            raise ValueError(f"{what} is {dtype} but the {name} projection's {part} is {tensor.dtype} (a "
                             f"torch.nn.Linear is not cast): cast the layer (layer.to({dtype})) or {what} to "
                             f"{tensor.dtype}")


def _autocast(device: torch.device) -> bool:
    """Is autocast on for `device`'s type (a device type autocast does not know: no)?"""
    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:
        return False


def validate_inputs(streams: CallStreams) -> None:
    """The streams' inputs are on one device, and each against the layers that read it (`validate_layer_input`):
    an input width another than the layer's, or a plain Linear of another dtype or device, fails inside torch
    otherwise, after the hand-off."""
    sources = streams.all_streams
    if len(sources) > 1:
        devices = {s.device for s in sources}
        if len(devices) != 1:
            raise ValueError(f"all token streams must be on one device, got {sorted(map(str, devices))}: move "
                             f"them to the model's device first")
    for source in sources:
        features = source.x.shape[-1]
        for name, projection in source.raw.items():
            if name == "v" and source.shared_kv:   # the k projection's module, checked as k
                continue
            _check_layer_input(source.name, features, source.dtype, source.device, name, projection)


def validate_capture(o, kv_tokens: int) -> None:
    """`capture_kv`: `(layer, start, stop)`, a layer with `store(k, v, kit=)` and a range inside the call's
    key/value tokens; not beside a `kv_prefix`."""
    capture = o.capture_kv
    if capture is None:
        return
    if not (isinstance(capture, (tuple, list)) and len(capture) == 3 and hasattr(capture[0], "store") and
            all(isinstance(i, int) and not isinstance(i, bool) for i in capture[1:])):
        raise ValueError("capture_kv takes (layer, start, stop): a PrefixLayer (anything with store(k, v, kit=)) "
                         "and the range of the call's key/value tokens to keep")
    if o.kv_prefix is not None:
        raise ValueError("capture_kv and kv_prefix together: capture on the pass that runs the whole sequence, "
                         "attend the prefix on the passes that leave it out")
    _, start, stop = capture
    if not 0 <= start < stop <= kv_tokens:
        raise ValueError(f"capture_kv range ({start}, {stop}) is not inside the {kv_tokens} key/value tokens of "
                         f"the call")


def validate_widths(streams: CallStreams) -> None:
    """Each projection's output width against heads x head_dim (k and v: kv_heads x head_dim), where the
    projection knows its width: rows are sliced by those numbers, so another width gives wrong results
    silently. One layer passed as q and k (a fused qkv layer) is refused with the parts to pass instead."""
    d = streams.head_dim
    for source in streams.all_streams:
        raw = source.raw
        if "q" in raw and raw.get("q") is raw.get("k"):
            width = getattr(source.proj["q"], "out_features", None)
            fused = f" ({width} features)" if width else ""
            raise ValueError(f"one projection{fused} was passed as q and k: a fused qkv layer must be passed as "
                             f"its parts, qkv_core.FusedRows(layer, 0, 3), FusedRows(layer, 1, 3), "
                             f"FusedRows(layer, 2, 3)")
        for name, proj in source.proj.items():
            width = getattr(proj, "out_features", None)
            if width is None or name == "extra":
                continue
            heads = streams.heads if name == "q" else streams.kv_heads
            if width == heads * d:
                continue
            hint = ""
            if name in ("k", "v") and width % d == 0 and width // d != heads and streams.heads % (width // d) == 0:
                hint = f"; for grouped-query attention pass kv_heads={width // d}"
            elif width % (heads * d) == 0 and width // (heads * d) > 1:
                hint = (f"; a fused layer ({width // (heads * d)} parts): pass its rows, "
                        f"qkv_core.FusedRows(layer, index, {width // (heads * d)})")
            raise ValueError(f"the {name} projection has {width} output features, not "
                             f"{'heads' if name == 'q' else 'kv_heads'} x head_dim = {heads} x {d} = "
                             f"{heads * d}{hint}")


def validate_prefix(o: AttentionOptions, kv_heads: int, head_dim: int, batch: int) -> None:
    """`o.kv_prefix` (a `PrefixLayer` already resolved): None, a `(key, value)` pair of `(1 or batch, tokens,
    kv_heads, head_dim)` tensors, or a `KVPrefix`; a native one only without a mask or an attention_fn."""
    prefix = o.kv_prefix
    if isinstance(prefix, KVPrefix) and prefix.is_native:
        if o.attention_mask is not None or o.attention_fn is not None:
            raise ValueError("a native prefix is attended in a pass of its own, unmasked: drop attention_mask/"
                             "attention_fn, or cache the prefix with native=False (q8)")
    elif prefix is not None and not isinstance(prefix, KVPrefix):
        if not (isinstance(prefix, (tuple, list)) and len(prefix) == 2 and all(map(torch.is_tensor, prefix))):
            raise ValueError("kv_prefix must be a (key, value) pair of tensors, a KVPrefix or a PrefixLayer")
    if prefix is None:
        return
    k = prefix[0]
    if k.dim() != 4 or k.shape[2] != kv_heads or k.shape[3] != head_dim:
        raise ValueError(f"kv_prefix keys must be (batch, tokens, kv_heads={kv_heads}, "
                         f"head_dim={head_dim}), got {tuple(k.shape)}")
    if not isinstance(prefix, KVPrefix):
        v = prefix[1]
        if v.dim() != 4 or v.shape[2] != kv_heads or v.shape[3] != head_dim:
            raise ValueError(f"kv_prefix values must be (batch, tokens, kv_heads={kv_heads}, "
                             f"head_dim={head_dim}), got {tuple(v.shape)}")
        if v.shape[:2] != k.shape[:2]:
            raise ValueError(f"kv_prefix keys {tuple(k.shape)} and values {tuple(v.shape)} must have the "
                             f"same batch and tokens: one value per key")
    if k.shape[0] not in (1, batch):
        raise ValueError(f"kv_prefix batch {k.shape[0]} must be 1 or the call's batch {batch}")


def validate_mask(attention_mask: Any, staged_core: Callable[[], Optional[object]],
                  shape: Optional[tuple] = None, dtype: Optional[torch.dtype] = None,
                  device: Optional[torch.device] = None) -> None:
    """`attention_mask`: None, a tensor or a callable. A callable one needs a staged core: `staged_core()`
    (called only for a callable mask, or a float mask of a dtype only a staged core casts; it chooses the call's
    backend) must give one. Where `shape` `(batch, heads, q tokens, kv tokens)` is given (the runtime attends with
    the mask: no attention_fn), a tensor mask is boolean or floating point, on `device`, of 2 to 4 dims that
    broadcast to `shape` (a 3-D one is `(batch, q tokens, kv tokens)`), and a float one float32 or the inputs'
    `dtype` unless a staged core takes it (SDPA takes no other)."""
    mask = attention_mask
    if mask is None:
        return
    if not torch.is_tensor(mask):
        if not callable(mask):
            raise ValueError(f"attention_mask must be a tensor (batch, heads or 1, q_tokens, kv_tokens) or, with a "
                             f"staged core, a callable mask(query, key, group), not {type(mask).__name__}: pass "
                             f"torch.as_tensor(mask)")
        if staged_core() is None:
            raise ValueError("a callable attention_mask needs a staged SageAttention core: pass a tensor mask "
                             "(batch, heads or 1, q_tokens, kv_tokens) instead, or use force_attention with a "
                             "staged backend")
        return
    if shape is None:
        return
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"attention_mask must be boolean (True attends) or an additive float mask, got "
                         f"{mask.dtype}: pass mask.bool() for a 0/1 mask, or mask.to({dtype}) for an additive one")
    if device is not None and mask.device != device:
        raise ValueError(f"attention_mask is on {mask.device} but the inputs are on {device}: pass "
                         f"mask.to({str(device)!r})")
    dims = (mask.shape[0], 1, *mask.shape[1:]) if mask.dim() == 3 else tuple(mask.shape)
    if not 2 <= mask.dim() <= 4 or any(n not in (1, want) for n, want in zip(reversed(dims), reversed(shape))):
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not broadcast to (batch, heads, "
                         f"q tokens, kv tokens) = {tuple(shape)} (kv tokens count a kv_prefix's first; a 3-D mask "
                         f"is (batch, q tokens, kv tokens)): give each dim that size or 1")
    if mask.is_floating_point() and mask.dtype not in (torch.float32, dtype) and staged_core() is None:
        raise ValueError(f"attention_mask is {mask.dtype} but the inputs are {dtype}: an additive mask is float32 or "
                         f"the inputs' dtype; pass mask.to({dtype})")


def validate_native_prefix_core(kv_prefix: Any, staged_core: Optional[object]) -> None:
    """A native prefix is read only by a staged core: the call's backend must have one."""
    if isinstance(kv_prefix, KVPrefix) and kv_prefix.is_native and staged_core is None:
        raise ValueError("a native prefix needs a staged SageAttention core: use a staged backend, or cache "
                         "the prefix with native=False (q8)")
