"""Key/value prefixes kept across sampler steps (docs/design.md §2.6, §2.7).

A prefix is keys and values computed beforehand (reference images, a history, a text context), already
normalized and rotated, `(batch, prefix_tokens, kv_heads, head_dim)`, attended before the projected keys. It
is passed as `kv_prefix=` in one of two forms:
- 16 bits: a pair `(key, value)` of float tensors;
- cached: a `KVPrefix` of tensors (q8 from `cache_prefix(..., native=False)` / `q8_prefix`, or a staged core's
  native layout when `k_mean` is set).
`PrefixCache` keeps one `PrefixLayer` per model block, in VRAM or in (pinned) RAM streamed block by block.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from .notices import PASSED_OVER, Notice, notice_once
from .q8 import dequantize_q8_into, quantize_q8


class KVPrefix(NamedTuple):
    """A cached key/value prefix (`cache_prefix`, `q8_prefix`), passed as ``kv_prefix=``: tensors only, so
    CUDA graphs can take it as an argument. The runtime reads it and never frees it.

    Attributes
    ----------
    k, v : torch.Tensor
        q8: int8 ``(batch or 1, tokens, kv_heads, head_dim)``. Native: the staged core's own layout.
    k_scale, v_scale : torch.Tensor
        q8: float16 ``(batch or 1, tokens, kv_heads, head_dim // 32)``, one scale per 32 channels. Native: the
        core's scales.
    k_mean : torch.Tensor or None
        None for q8; for a native prefix the keys' mean the core smoothed them by.
    v_mean : torch.Tensor or None
        The core's value mean where it keeps one, else None.
    is_native : bool
        A staged core's layout (read by that core only).
    tokens : int
        Prefix tokens.
    """

    k: torch.Tensor
    k_scale: torch.Tensor
    k_mean: Optional[torch.Tensor]
    v: torch.Tensor
    v_scale: torch.Tensor
    v_mean: Optional[torch.Tensor]

    @property
    def is_native(self) -> bool:
        return self.k_mean is not None

    @property
    def tokens(self) -> int:
        return self.k.shape[1]


def q8_prefix(k: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor, v_scale: torch.Tensor) -> KVPrefix:
    """A `KVPrefix` of q8 tensors held elsewhere (an archive), without copying.

    Parameters
    ----------
    k, v : torch.Tensor
        int8 ``(batch, tokens, kv_heads, head_dim)`` of one shape, or ``(tokens, kv_heads, head_dim)`` (taken
        as batch 1, a view).
    k_scale, v_scale : torch.Tensor
        ``(..., head_dim // 32)`` beside each; other float dtypes are cast to float16 (a new tensor).

    Returns
    -------
    KVPrefix
        Views of the tensors given: the caller keeps them alive as long as the prefix is used.

    Raises
    ------
    ValueError
        Not int8, shapes that do not match, or k and v of different shapes.
    """
    parts = []
    for name, values, scales in (("k", k, k_scale), ("v", v, v_scale)):
        if values.dtype != torch.int8:
            raise ValueError(f"q8_prefix: {name} must be int8, got {values.dtype}; quantize it with cache_prefix")
        if values.dim() == 3:
            values, scales = values.unsqueeze(0), scales.unsqueeze(0)
        if values.dim() != 4 or scales.shape != (*values.shape[:-1], values.shape[-1] // 32):
            raise ValueError(f"q8_prefix: {name} {tuple(values.shape)} and its scales {tuple(scales.shape)} are "
                             f"not (batch, tokens, kv_heads, head_dim) and (..., head_dim // 32)")
        parts.append((values, scales.to(torch.float16) if scales.dtype != torch.float16 else scales))
    if parts[0][0].shape != parts[1][0].shape:
        raise ValueError(f"q8_prefix: k {tuple(parts[0][0].shape)} and v {tuple(parts[1][0].shape)} differ")
    (kq, ks), (vq, vs) = parts
    return KVPrefix(kq, ks, None, vq, vs, None)


def cache_prefix(kv_list: list, native: bool = True, kit=None) -> KVPrefix:
    """A prefix quantized for keeping: a staged core's native layout where one is given, else q8.

    Parameters
    ----------
    kv_list : list
        ``[key, value]``, float ``(batch, tokens, kv_heads, head_dim)`` of one shape, already normalized and
        rotated; ``head_dim`` a multiple of 32 for q8. Once they are checked the list is cleared (a refused call
        leaves it as it was) and the 16-bit tensors are dropped once quantized, so only the quantized form stays.
    native : bool
        Keep the staged core's own layout when `kit` is one; without one (any machine without SageAttention
        2) the prefix is kept as q8, said once.
    kit : StagedCore, optional
        `native_prefix_kit()`.

    Returns
    -------
    KVPrefix
        New tensors on the inputs' device: q8 takes 17/32 of the 16-bit bytes.

    Raises
    ------
    ValueError
        `kv_list` is not a two-element list of 4-D tensors of one shape, (q8) a head dim that is not a
        multiple of 32 or a non-float dtype, or (native) a device, dtype or head dim the core's layout does
        not take.
    """
    if not isinstance(kv_list, list) or len(kv_list) != 2:
        raise ValueError("cache_prefix takes [key, value] in a two-element list that it clears")
    key, value = kv_list
    if not (torch.is_tensor(key) and torch.is_tensor(value) and key.dim() == 4 and key.shape == value.shape):
        shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in (key, value)]
        raise ValueError(f"cache_prefix takes a key and a value of one shape, (batch, tokens, kv_heads, head_dim), "
                         f"got {shapes}")
    from .validation import validate_cache_prefix   # here: validation imports this module
    in_core = native and kit is not None and hasattr(kit, "cache_native_prefix")
    validate_cache_prefix(key, value, q8=not in_core)   # before the list is cleared: a refusal leaves it
    if in_core:
        del key, value
        prefix = kit.cache_native_prefix(kv_list)   # its own checks, then it clears the list
        kv_list.clear()   # (a kit that does not: the list is cleared all the same)
        return prefix
    kv_list.clear()
    if native:
        notice_once("prefix:native-q8", Notice(PASSED_OVER, "the staged SageAttention core", "not here",
                                               "[Attention] no staged SageAttention core here: prefixes are cached "
                                               "as q8"))
    kq, ks = quantize_q8(key)
    del key
    vq, vs = quantize_q8(value)
    del value
    return KVPrefix(kq, ks, None, vq, vs, None)


def dequantize_prefix(prefix: KVPrefix, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16-bit keys and values of a q8 prefix.

    Parameters
    ----------
    prefix : KVPrefix
        A q8 prefix (not native).
    dtype : torch.dtype
        The result's dtype (default bfloat16).

    Returns
    -------
    tuple of torch.Tensor
        ``(key, value)``, ``(batch or 1, tokens, kv_heads, head_dim)``: new tensors the caller owns.

    Raises
    ------
    ValueError
        A native prefix (only its staged core reads it).
    """
    if prefix.is_native:
        raise ValueError("dequantize_prefix takes a q8 prefix; a native prefix is read by its staged core only")
    k = torch.empty(prefix.k.shape, dtype=dtype, device=prefix.k.device)
    dequantize_q8_into(k, prefix.k, prefix.k_scale)
    v = torch.empty(prefix.v.shape, dtype=dtype, device=prefix.v.device)
    dequantize_q8_into(v, prefix.v, prefix.v_scale)
    return k, v


def _to(tensors: Sequence[Optional[torch.Tensor]], device, pin: bool, non_blocking: bool = False,
        copy: bool = False):
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        moved = t.to(device, non_blocking=non_blocking, copy=copy)
        if pin and moved.device.type == "cpu" and not moved.is_pinned():
            moved = moved.pin_memory()
        out.append(moved)
    return out


class PrefixLayer:
    """The prefix of one model block, made by its `PrefixCache`: `store` once, then `kv_prefix` (for
    ``kv_prefix=``, or as a call's ``capture_kv`` target) or `get` (16-bit tensors for an attention outside
    the runtime) at every later pass.

    Methods
    -------
    store(k, v, kit=None)
        Keeps the block's keys and values ``(batch, tokens, kv_heads, head_dim)``, normalized and rotated, in
        the cache's form: quantized caches keep only the quantized form, 16-bit ones a copy (the caller may
        change or free its tensors after).
    kv_prefix()
        A `KVPrefix` (quantized caches) or a ``(key, value)`` pair: the layer's own tensors (with ``ram``, the
        device ring's), to read and not to change.
    get(dtype=None)
        16-bit ``(key, value)`` on the compute device (dequantized: new tensors).
    populated : bool
        `store` has run since the last `clear`.
    clear()
        Drops what the layer holds.
    nbytes()
        The bytes the layer holds.

    Raises
    ------
    RuntimeError
        `kv_prefix` or `get` before `store`.
    """

    def __init__(self, cache: "PrefixCache", index: int):
        self._cache, self.index = cache, index
        self._data: Optional[tuple] = None  # (form, tensors): form "16bit" | "q8" | "native"
        self.device: Optional[torch.device] = None

    @property
    def populated(self) -> bool:
        return self._data is not None

    def store(self, k: torch.Tensor, v: torch.Tensor, kit=None) -> None:
        """Keeps this block's prefix keys/values `(batch, tokens, kv_heads, head_dim)`, already normalized and
        rotated. Quantized caches keep only the quantized form (`k`, `v` are not referenced afterwards)."""
        cache = self._cache
        self.device = k.device
        if cache.quantize:
            prefix = cache_prefix([k, v], native=cache.native, kit=kit)
            form, tensors = ("native" if prefix.is_native else "q8"), tuple(prefix)
        else:
            form, tensors = "16bit", (k, v)
        if cache.ram:
            # 16-bit tensors already in RAM would be kept by reference: copy them (the caller may change them)
            tensors = tuple(_to(tensors, "cpu", pin=torch.cuda.is_available(), copy=not cache.quantize))
        elif not cache.quantize:
            tensors = tuple(t.clone() for t in tensors)  # the caller may change its tensors in place later
        self._data = (form, tensors)

    def _tensors(self) -> tuple[str, tuple]:
        if self._data is None:
            raise RuntimeError("KV cache has not been populated yet.")
        form, tensors = self._data
        if self._cache.ram:
            tensors = self._cache._fetch(self)
        return form, tensors

    def kv_prefix(self):
        """What to pass as `kv_prefix=`: a `KVPrefix` (quantized caches) or a `(key, value)` pair."""
        form, tensors = self._tensors()
        return tensors if form == "16bit" else KVPrefix(*tensors)

    def get(self, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        """16-bit `(key, value)` on the compute device (dequantized from q8: new tensors)."""
        form, tensors = self._tensors()
        if form == "16bit":
            k, v = tensors
            return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))
        return dequantize_prefix(KVPrefix(*tensors), dtype or self._cache.dtype)

    def clear(self) -> None:
        self._data = None

    def nbytes(self) -> int:
        if self._data is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._data[1] if t is not None)


class PrefixCache:
    """Key/value prefixes kept across sampler steps: one `PrefixLayer` per model block (``cache[i]``).

    Parameters
    ----------
    blocks : int
        Layers, at least one.
    quantize : bool
        Keep q8 (or a staged core's native layout with `native`); else 16 bits.
    native : bool
        With `quantize`: the native layout where a staged core is passed to `PrefixLayer.store`.
    ram : bool
        The layers live in CPU memory (pinned when CUDA is present) and are copied to the compute device one
        layer ahead of use, through a ring of two device slots, so the device holds about two layers.
    name : str
        A label for the run report.
    dtype : torch.dtype
        The dtype `PrefixLayer.get` dequantizes to by default.

    Methods
    -------
    clear(keep_ring=False)
        Frees every layer (the end of a run); `keep_ring` keeps the device ring for a new `store` (a
        step-dependent LoRA changed the prefix).
    nbytes()
        Bytes the layers hold (RAM with `ram`), the device ring not counted.
    ring_nbytes()
        Bytes of the device ring.

    Raises
    ------
    ValueError
        `blocks` under 1.
    """

    def __init__(self, blocks: int, quantize: bool = False, native: bool = True, ram: bool = False,
                 name: str = "prefix", dtype=torch.bfloat16):
        if blocks <= 0:
            raise ValueError(f"PrefixCache needs at least one block, got {blocks}")
        self.quantize, self.native, self.ram, self.name, self.dtype = quantize, native, ram, name, dtype
        self.layers = [PrefixLayer(self, i) for i in range(blocks)]
        self._ring: list[Optional[tuple]] = [None, None]       # device tensors of two layers
        self._ring_owner: list[Optional[int]] = [None, None]   # which layer each slot holds
        self._ring_ready: list = [None, None]                  # CUDA events of pending copies
        self._stream = None

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> PrefixLayer:
        return self.layers[index]

    def clear(self, keep_ring: bool = False) -> None:
        for layer in self.layers:
            layer.clear()
        self._ring_owner = [None, None]
        self._ring_ready = [None, None]
        if not keep_ring:
            self._ring = [None, None]
            self._stream = None

    def nbytes(self) -> int:
        """Bytes held by the layers (RAM in ram mode), not counting the device ring."""
        return sum(layer.nbytes() for layer in self.layers)

    def ring_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self._ring if slot for t in slot if t is not None)

    # --- RAM streaming -------------------------------------------------------------------------------
    def _copy_into_slot(self, layer: PrefixLayer, slot: int) -> None:
        _, host = layer._data
        device = layer.device
        ring = self._ring[slot]
        if ring is None or len(ring) != len(host) or any(
                (r is None) != (h is None) or (r is not None and (r.shape != h.shape or r.dtype != h.dtype))
                for r, h in zip(ring, host)):
            ring = tuple(None if h is None else torch.empty(h.shape, dtype=h.dtype, device=device) for h in host)
            self._ring[slot] = ring
        if device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            # the slot was last read by the compute stream: copy only after that use is done
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                for r, h in zip(ring, host):
                    if r is not None:
                        r.copy_(h, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            self._ring_ready[slot] = event
        else:
            for r, h in zip(ring, host):
                if r is not None:
                    r.copy_(h)
            self._ring_ready[slot] = None
        self._ring_owner[slot] = layer.index

    def _fetch(self, layer: PrefixLayer) -> tuple:
        slot = layer.index % 2
        if self._ring_owner[slot] != layer.index:
            self._copy_into_slot(layer, slot)
        event = self._ring_ready[slot]
        if event is not None:
            torch.cuda.current_stream(layer.device).wait_event(event)
            self._ring_ready[slot] = None
        tensors = self._ring[slot]
        # stream the next populated layer into the other slot while this one is used
        nxt = self.layers[(layer.index + 1) % len(self.layers)]
        if nxt is not layer and nxt.populated and self._ring_owner[nxt.index % 2] != nxt.index \
                and nxt.index % 2 != slot:
            self._copy_into_slot(nxt, nxt.index % 2)
        return tensors
