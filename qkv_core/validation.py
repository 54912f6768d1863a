"""Checks of a call's arguments, before any work: each is a `ValueError` that names the fix (docs/design.md §2.1).

Order matters where a check has a side effect or reads the result of another: a call runs `validate_call`, then
resolves a `PrefixLayer` (`prefix_join.resolve_prefix`), then `validate_prefix`, then `validate_mask` (which may
choose the backend). The hand-off helpers check a list's form before it is cleared (`take_activation` clears it, then checks the
tensor's shape; `validate_kv_first` only checks).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from .head_split import parse_level
from .options import AttentionOptions
from .prefix import KVPrefix
from .streams import CallStreams, TokenStream


# --- the hand-off ----------------------------------------------------------------------------------------------
def take_activation(tensor_list: Any, what: str) -> torch.Tensor:
    """The tensor of a one-element list, which is cleared (the runtime then holds the only reference):
    `(batch, tokens, features)`, a `(tokens, features)` one taken as batch 1."""
    if not isinstance(tensor_list, list) or len(tensor_list) != 1 or not torch.is_tensor(tensor_list[0]):
        raise ValueError(f"{what} must be a one-element list holding the tensor (the runtime clears it, so it "
                         f"holds the only reference): pass [{what.removesuffix('_list')}]")
    tensor = tensor_list[0]
    tensor_list.clear()
    if tensor.dim() == 2:
        tensor = tensor.unsqueeze(0)
    if tensor.dim() != 3:
        raise ValueError(f"{what}: expected (batch, tokens, features) or (tokens, features), got "
                         f"{tuple(tensor.shape)}")
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


def validate_kv_first(qkv_list: Any) -> None:
    """`kv_first_attention`'s `[q, k, v]`: three `(batch, tokens, heads, head_dim)` tensors, k and v alike, q with
    their batch and head_dim and a multiple of their heads. The list is not touched."""
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


# --- autograd ----------------------------------------------------------------------------------------------------
GRAD_FIX = ("qkv_core is for inference: its head groups write q, k, v and the attention into buffers it "
            "allocates, which autograd cannot differentiate. Run the call under torch.no_grad() or "
            "torch.inference_mode(), or use the model's own attention for training")
_WALK_DEPTH = 3      # how far into a projection's attributes (a RowProjection's layer, a closure's cells) to look
_WALK_ITEMS = 16     # the most items of one list or tuple looked at


def refuse_autograd(entry: str, parts) -> None:
    """A `ValueError` when one of `parts` (name, value pairs: input tensors or the lists holding them, projections,
    norms, prefixes, masks) requires grad: called by every entry point while grad mode is on (its caller tests
    `torch.is_grad_enabled()` first, so inference pays one call). Tensors, `torch.nn.Module` parameters, and what
    a projection object holds (its attributes, a bound method's module, a function's closure, a partial's
    arguments, a few levels deep) are looked at; an opaque callable is not. Nothing is cleared or touched."""
    for name, value in parts:
        if value is not None and _requires_grad(value, _WALK_DEPTH, set()):
            raise ValueError(f"{entry}: {name} requires grad with gradient mode on. {GRAD_FIX}")


def _requires_grad(obj: Any, depth: int, seen: set) -> bool:
    if torch.is_tensor(obj):
        return obj.requires_grad
    if isinstance(obj, (str, bytes, int, float, bool, type)) or id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        return any(p.requires_grad for p in obj.parameters())
    if depth <= 0:
        return False
    if isinstance(obj, (list, tuple)):
        return any(_requires_grad(item, depth - 1, seen) for item in obj[:_WALK_ITEMS])
    if isinstance(obj, dict):
        return any(_requires_grad(item, depth - 1, seen) for item in list(obj.values())[:_WALK_ITEMS])
    inner = getattr(obj, "__self__", None)   # a bound method: its object (a module's forward)
    if inner is not None and not isinstance(obj, type(len)):
        return _requires_grad(inner, depth - 1, seen)
    if isinstance(obj, functools.partial):
        return _requires_grad([obj.func, *obj.args, *obj.keywords.values()], depth, seen)
    cells = getattr(obj, "__closure__", None)   # a function: what it closes over
    if cells:
        return any(_requires_grad(_cell(cell), depth - 1, seen) for cell in cells[:_WALK_ITEMS])
    if callable(obj) and not hasattr(obj, "__dict__"):
        return False
    own = getattr(obj, "__dict__", None)
    if isinstance(own, dict):
        return any(_requires_grad(value, depth - 1, seen) for value in list(own.values())[:_WALK_ITEMS])
    return False


def _cell(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:   # an empty cell
        return None


# --- one call ----------------------------------------------------------------------------------------------------
def validate_call(o: AttentionOptions, streams: CallStreams) -> None:
    """Heads, projection widths, the streams' batch and dtype, and the options' values and combinations (all but
    the prefix and the mask: `validate_prefix`, `validate_mask`). Reads the streams' inputs (before `prepare`)."""
    heads, head_dim, kv_heads = streams.heads, streams.head_dim, streams.kv_heads
    if heads <= 0 or head_dim <= 0:
        raise ValueError(f"heads ({heads}) and head_dim ({head_dim}) must be positive")
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
    if o.head_split_level is not None:
        parse_level(o.head_split_level)
    if o.split_floor_tokens is not None and (isinstance(o.split_floor_tokens, bool) or
                                             not isinstance(o.split_floor_tokens, int) or
                                             o.split_floor_tokens < 0):
        raise ValueError(f"split_floor_tokens is the fewest tokens (of one batch item) that are split, an int "
                         f">= 0, not {o.split_floor_tokens!r}; leave it out for the default")
    scale = o.head_split_group_scale
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        raise ValueError(f"head_split_group_scale multiplies the level's head groups, a number > 0, not "
                         f"{scale!r}; leave it out for the default")
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


def validate_mask(attention_mask: Any, staged_core: Callable[[], Optional[object]]) -> None:
    """A callable `attention_mask` needs a staged core: `staged_core()` (called only for a callable mask; it
    chooses the call's backend) must give one."""
    if callable(attention_mask) and not torch.is_tensor(attention_mask) and staged_core() is None:
        raise ValueError("a callable attention_mask needs a staged SageAttention core: pass a tensor mask "
                         "(batch, heads or 1, q_tokens, kv_tokens) instead, or use force_attention with a "
                         "staged backend")


def validate_native_prefix_core(kv_prefix: Any, staged_core: Optional[object]) -> None:
    """A native prefix is read only by a staged core: the call's backend must have one."""
    if isinstance(kv_prefix, KVPrefix) and kv_prefix.is_native and staged_core is None:
        raise ValueError("a native prefix needs a staged SageAttention core: use a staged backend, or cache "
                         "the prefix with native=False (q8)")
