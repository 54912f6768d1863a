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

from .notices import notice_once
from .q8 import dequantize_q8_into, quantize_q8


class KVPrefix(NamedTuple):
    """A cached prefix: tensors only (so CUDA graphs can take it as an argument).

    q8: `k`, `v` int8 `(batch, tokens, kv_heads, head_dim)`, `k_scale`, `v_scale` float16
    `(..., head_dim // 32)`, `k_mean` = `v_mean` = None. Native (staged cores): `k_mean` is the keys' mean
    used for smoothing, the rest in that core's layout.
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
    """Wraps q8 tensors an archive already holds, without copying. 3-D tensors `(tokens, kv_heads, head_dim)`
    are taken as batch 1 (views)."""
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
    """Quantizes a prefix `[key, value]` (float `(batch, tokens, kv_heads, head_dim)`); the list is cleared.

    `native=True` keeps it in a staged core's own layout when `kit` is one (SageAttention issues add it);
    otherwise, and on any machine without one, it is stored as q8 (said once).
    """
    if not isinstance(kv_list, list) or len(kv_list) != 2:
        raise ValueError("cache_prefix takes [key, value] in a two-element list that it clears")
    key, value = kv_list
    if not (torch.is_tensor(key) and torch.is_tensor(value) and key.dim() == 4 and key.shape == value.shape):
        shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in (key, value)]
        raise ValueError(f"cache_prefix takes a key and a value of one shape, (batch, tokens, kv_heads, head_dim), "
                         f"got {shapes}")
    kv_list.clear()
    if native and kit is not None and hasattr(kit, "cache_native_prefix"):
        return kit.cache_native_prefix([key, value])
    if native:
        notice_once("prefix:native-q8", "[Attention] no staged SageAttention core here: prefixes are cached as q8")
    kq, ks = quantize_q8(key)
    del key
    vq, vs = quantize_q8(value)
    del value
    return KVPrefix(kq, ks, None, vq, vs, None)


def dequantize_prefix(prefix: KVPrefix, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """16-bit `(key, value)` of a q8 prefix (new tensors)."""
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
    """The prefix of one block. `store` once, then `kv_prefix()` (for `kv_prefix=`) or `get()` (16-bit
    tensors for attentions outside the runtime) at every later pass."""

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
    """One `PrefixLayer` per model block.

    `quantize`: keep q8 (or a staged core's native layout with `native=True`); else 16 bits.
    `ram`: layers live in CPU memory (pinned when CUDA is present) and are streamed to the compute device
    one layer ahead of use, through a ring of two device slots, so the device holds about two layers.
    `clear()` at the end of a run; `clear(keep_ring=True)` empties the layers but keeps the device ring for a
    new `store` (e.g. when step-dependent LoRAs change the prefix).
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
