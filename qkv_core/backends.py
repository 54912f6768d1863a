"""Attention backends behind one registry (docs/design.md §2.4).

Every backend takes q `(batch, q_tokens, heads, head_dim)` and k, v `(batch, kv_tokens, kv_heads,
head_dim)` (the runtime's layout; strided views are fine) and returns `(batch, q_tokens, heads, head_dim)`.
`pay_attention` dispatches by `force_attention` (default `auto`); a backend that is missing or cannot
take a call (mask, head dim, dtype, device) hands it to the next one with a one-time notice, never an
exception mid-run. SDPA takes every call.

Staged cores (`StagedCore`) are the seam for SageAttention cores that expose their quantizers separately:
the runtime then quantizes v, k and q as each is projected (GPU backends register them).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from . import gpus
from .notices import AUTO_CHOICE, PASSED_OVER, Notice, notice_once
from .staged_core import StagedCore
from .tally import count_attention

AUTO = "auto"


class AttentionBackend:
    """One attention implementation. Subclasses set `name` and override `attend`."""

    name = "?"
    #: a staged core (quantizers separate from the attention), or None
    staged_core: Optional["StagedCore"] = None
    #: `auto` takes it only where a one-time measurement on this GPU finds it faster than SDPA (`auto_measured`)
    measured_in_auto: bool = False

    def unavailable_reason(self) -> Optional[str]:
        """None when the backend can run in this process, else why not (not installed, no CUDA, ...)."""
        return None

    def cannot_take(self, q, k, v, mask, softmax_scale) -> Optional[str]:
        """None when this call can run here, else the reason (mask, head dim, dtype, device)."""
        return None

    def auto_declines(self, q, k, mask) -> Optional[str]:
        """Why `auto` passes this backend by for a call it could take (it is still used when forced), or None.
        `q`, `k`: anything with the call's `shape` `(batch, tokens, heads, head_dim)`, `dtype` and `device`."""
        return None

    def attend(self, q, k, v, mask=None, softmax_scale=None) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


# SDPA's kernel order for long CUDA calls, by compute capability (`gpus.Architecture.sdpa_cudnn_first`): the
# ambient order depends on the ComfyUI version, so the pack sets its own, the faster kernel first: cuDNN attention
# on Hopper and Blackwell, FlashAttention 2 on Ampere and Ada (docs/benchmarks.md#wan-block).
SDPA_ORDER_MIN_ELEMENTS = 1024 * 128   # below this, the ambient order (ComfyUI measured cuDNN slower there)


def _sdpa_order(device: torch.device, elements: int) -> Optional[list]:
    """The kernel order for an SDPA call whose q has `elements` elements on `device`, or None (ambient)."""
    if device.type != "cuda" or elements < SDPA_ORDER_MIN_ELEMENTS or _SDPA_KERNEL is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SDPA_ORDERS:
        from torch.nn.attention import SDPBackend
        first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] \
            if gpus.architecture(torch.device("cuda", index)).sdpa_cudnn_first else \
            [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        _SDPA_ORDERS[index] = first + [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return _SDPA_ORDERS[index]


_HELD = threading.local()   # .order: the order `held_sdpa_order` has set around the current call's groups


@contextlib.contextmanager
def held_sdpa_order(device: torch.device, group_elements: int):
    """Sets SDPA's kernel order once around all the head groups of one call, each group's q having
    `group_elements` elements, so that `SDPABackend.attend` does not enter `sdpa_kernel` per group (its host
    time is that of a short group's attention; docs/benchmarks.md#fast-paths, `sdpa_order`). Nothing is set
    where the order is the ambient one, or already held."""
    order = _sdpa_order(device, group_elements)
    if order is None or getattr(_HELD, "order", None) is not None:
        yield
        return
    with _SDPA_KERNEL(order, set_priority=True):
        _HELD.order = order
        try:
            yield
        finally:
            _HELD.order = None


def _sdpa_kernel_with_priority():
    try:
        import inspect
        from torch.nn.attention import sdpa_kernel
        return sdpa_kernel if "set_priority" in inspect.signature(sdpa_kernel).parameters else None
    except (ImportError, TypeError, ValueError):
        return None


_SDPA_KERNEL = _sdpa_kernel_with_priority()
_SDPA_ORDERS: dict = {}


class SDPABackend(AttentionBackend):
    """`torch.nn.functional.scaled_dot_product_attention`: any device, dtype, mask, GQA. Long CUDA calls run
    with the kernel order of `_sdpa_order` (the fastest fused kernel of the GPU first)."""

    name = "sdpa"

    def attend(self, q, k, v, mask=None, softmax_scale=None) -> torch.Tensor:
        gqa = k.shape[2] != q.shape[2]
        order = None if getattr(_HELD, "order", None) is not None else _sdpa_order(q.device, q.numel())
        args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        if order is None:
            out = F.scaled_dot_product_attention(*args, attn_mask=mask, scale=softmax_scale, enable_gqa=gqa)
        else:
            with _SDPA_KERNEL(order, set_priority=True):
                out = F.scaled_dot_product_attention(*args, attn_mask=mask, scale=softmax_scale, enable_gqa=gqa)
        return out.transpose(1, 2)


def _cuda_half(q) -> Optional[str]:
    if q.device.type != "cuda":
        return f"needs a CUDA tensor, got {q.device.type}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16/bf16, got {q.dtype}"
    return None


def _import_problem(module: str) -> Optional[str]:
    """None when `module` imports, else why not; asked once per process (a failing import is slow)."""
    if module not in _IMPORT_PROBLEMS:
        try:
            importlib.import_module(module)
            _IMPORT_PROBLEMS[module] = None
        except Exception as e:  # ImportError, or a broken CUDA build raising anything
            _IMPORT_PROBLEMS[module] = f"{module} is not importable ({type(e).__name__})"
    return _IMPORT_PROBLEMS[module]


_IMPORT_PROBLEMS: dict[str, Optional[str]] = {}


class FlashBackend(AttentionBackend):
    """FlashAttention (`flash_attn.flash_attn_func`), unmasked, CUDA fp16/bf16, head dim <= 256."""

    name = "flash"

    def unavailable_reason(self):
        return _import_problem("flash_attn")

    def cannot_take(self, q, k, v, mask, softmax_scale):
        if mask is not None:
            return "it takes no attention mask"
        if q.shape[-1] > 256 or q.shape[-1] % 8:
            return f"head dim {q.shape[-1]} is not supported"
        return _cuda_half(q)

    def attend(self, q, k, v, mask=None, softmax_scale=None):
        from flash_attn import flash_attn_func
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale)


def sage_major_version(module) -> int:
    """The major version of the imported SageAttention `module` (2, 1, or 0 when unknown), read from what it
    offers: SageAttention 2 has `sageattn_qk_int8_pv_fp16_triton`, 1.x has `sageattn` without it. The
    installed metadata counts only where the module does not tell: a build used from its source folder (`setup.py
    build_ext --inplace`, a folder on PYTHONPATH or copied into ComfyUI portable's site-packages) has none, and
    an older install's metadata can sit beside the module that imports first."""
    if callable(getattr(module, "sageattn_qk_int8_pv_fp16_triton", None)):
        return 2
    try:
        version = importlib.metadata.version("sageattention")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is not None:
        try:
            return int(version.split(".")[0])
        except ValueError:
            pass
    return 1 if callable(getattr(module, "sageattn", None)) else 0


# `auto` runs SageAttention 2's staged core on calls of at least this many tokens (q or kv, per batch item):
# shorter calls spend more on its quantization passes than they save. Masked calls on Hopper stay on SDPA: the
# Triton kernel that takes masks is slower there than cuDNN's attention.
SAGE2_AUTO_MIN_TOKENS = 16384


class SageBackend(AttentionBackend):
    """SageAttention (1.x from PyPI or a user-built 2.x), CUDA fp16/bf16, head dims 64 and 128. The runtime's
    calls run its staged core (`sage.Sage1Core`, `sage2.Sage2Core`: its quantizers as each of v, k, q is handed
    over, its kernel writing into the call's output). Masks: SageAttention 2 only (its Triton kernel). `attend`
    (unstaged) with SageAttention 1 consumes k: its `sageattn` subtracts the key mean in place."""

    name = "sage"

    _major: Optional[int] = None
    _core: Optional["StagedCore"] = None

    @property
    def measured_in_auto(self) -> bool:
        # SageAttention 1 against PyTorch's attention depends on the GPU (docs/benchmarks.md#sage2): `auto`
        # measures it once per GPU, head dim and dtype
        return self.major_version() == 1

    @property
    def staged_core(self) -> Optional["StagedCore"]:
        if self.unavailable_reason() is not None or self.major_version() not in (1, 2):
            return None
        if self._core is None:
            if self.major_version() == 1:
                from .sage import Sage1Core
                self._core = Sage1Core()
            else:
                from .sage2 import Sage2Core
                self._core = Sage2Core()
        return self._core

    def unavailable_reason(self):
        return _import_problem("sageattention")

    def major_version(self) -> int:
        """SageAttention's major version (`sage_major_version`), 0 when it does not import."""
        if self._major is None:
            self._major = 0 if self.unavailable_reason() is not None else \
                sage_major_version(importlib.import_module("sageattention"))
        return self._major

    def cannot_take(self, q, k, v, mask, softmax_scale):
        major = self.major_version()
        if mask is not None and major != 2:
            return "SageAttention 1 takes no attention mask" if major == 1 else "it takes no attention mask here"
        dim = q.shape[-1]
        if dim not in (64, 128):
            return f"head dim {dim} is not 64 or 128 (the staged kernels)"
        return _cuda_half(q)

    def auto_declines(self, q, k, mask):
        if self.major_version() != 2:
            return None
        if max(q.shape[1], k.shape[1]) < SAGE2_AUTO_MIN_TOKENS:
            return (f"calls under {SAGE2_AUTO_MIN_TOKENS} tokens, where its quantization passes cost more than "
                    f"they save")
        device = torch.device(q.device)
        if mask is not None and device.type == "cuda" and gpus.architecture(device).sage2_masked_on_sdpa:
            return "masked calls on Hopper (its Triton kernel, the one that takes masks, is slower than cuDNN's)"
        return None

    def attend(self, q, k, v, mask=None, softmax_scale=None):
        import sageattention
        if mask is not None:   # SageAttention 2's Triton kernel, the one that takes masks
            return sageattention.sageattn_qk_int8_pv_fp16_triton(q, k, v, tensor_layout="NHD", attn_mask=mask,
                                                                 sm_scale=softmax_scale)
        return sageattention.sageattn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=softmax_scale)


def native_prefix_kit() -> Optional[StagedCore]:
    """The staged core that keeps native prefixes in this process, for ``cache_prefix(..., kit=...)``.

    Returns
    -------
    StagedCore or None
        SageAttention 2's core where it is installed, else None (`cache_prefix` then keeps q8).
    """
    backend = _REGISTRY.get("sage")
    core = backend.staged_core if backend is not None else None
    return core if core is not None and hasattr(core, "cache_native_prefix") else None


_REGISTRY: dict[str, AttentionBackend] = {}
#: order in which backends hand a call on: a backend falls back to the next available one after it
_FALLBACK_ORDER: list[str] = []


def register_backend(backend: AttentionBackend, before: Optional[str] = None) -> None:
    """Add (or replace) a backend; it falls back to the backends after it (`before` places it)."""
    _REGISTRY[backend.name] = backend
    if backend.name in _FALLBACK_ORDER:
        _FALLBACK_ORDER.remove(backend.name)
    index = _FALLBACK_ORDER.index(before) if before in _FALLBACK_ORDER else len(_FALLBACK_ORDER) - 1
    _FALLBACK_ORDER.insert(max(index, 0), backend.name)


def unregister_backend(name: str) -> None:
    if name == "sdpa":
        raise ValueError("the sdpa backend cannot be removed: it is every call's last fallback")
    _REGISTRY.pop(name, None)
    if name in _FALLBACK_ORDER:
        _FALLBACK_ORDER.remove(name)


_FALLBACK_ORDER.append("sdpa")
_REGISTRY["sdpa"] = SDPABackend()
register_backend(SageBackend(), before="sdpa")
register_backend(FlashBackend(), before="sdpa")


def backend_names() -> list[str]:
    """The names of every known backend, best first, those not installed included.

    Returns
    -------
    list of str
        A new list; each name is a valid `force_attention`, besides "auto".
    """
    return list(_FALLBACK_ORDER)


def available_backends() -> dict[str, Optional[str]]:
    """name -> None if usable in this process, else why not."""
    return {name: _REGISTRY[name].unavailable_reason() for name in _FALLBACK_ORDER}


def _check_name(name: str) -> None:
    if name != AUTO and name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}: use one of {[AUTO] + backend_names()}")


# The micro-benchmark `auto` runs once per (GPU, backend, head dim, dtype) for a backend with `measured_in_auto`:
# one attention of MEASURE_TOKENS tokens x MEASURE_HEADS heads, MEASURE_REPEATS times after a warm-up, against SDPA.
MEASURE_TOKENS, MEASURE_HEADS, MEASURE_REPEATS = 16384, 8, 3
_MEASURED: dict[tuple, bool] = {}   # key -> the measured backend beat SDPA


def _measure_seconds(backend: AttentionBackend, shape: tuple, dtype, device) -> float:
    """The median time of `backend.attend` on random q, k, v of `shape` (CUDA events)."""
    g = torch.Generator(device=device).manual_seed(0)
    times = []
    for repeat in range(MEASURE_REPEATS + 1):
        q, k, v = (torch.randn(shape, device=device, generator=g).to(dtype) for _ in range(3))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        backend.attend(q, k, v)
        end.record()
        torch.cuda.synchronize(device)
        if repeat:
            times.append(start.elapsed_time(end) / 1000)
        del q, k, v
    return sorted(times)[len(times) // 2]


def auto_measured(backend: AttentionBackend, q) -> bool:
    """Does `backend` (one with `measured_in_auto`) beat SDPA for calls like `q` (anything with `shape`, `dtype`,
    `device`: CUDA only) on this GPU? Measured once per GPU, backend, head dim and dtype, kept for the process and
    said once in the log; a measurement that fails says no."""
    device = torch.device(q.device)
    if device.type != "cuda":
        return False
    key = (torch.cuda.get_device_name(device), backend.name, q.shape[-1], q.dtype)
    if key not in _MEASURED:
        shape = (1, MEASURE_TOKENS, MEASURE_HEADS, q.shape[-1])
        try:
            with torch.no_grad():
                mine = _measure_seconds(backend, shape, q.dtype, device)
                theirs = _measure_seconds(_REGISTRY["sdpa"], shape, q.dtype, device)
        except Exception as error:  # noqa: BLE001 - a kernel that fails to run here is simply not chosen
            _MEASURED[key] = False
            why = f"could not be measured on {key[0]} ({type(error).__name__}: {error})"
            notice_once(f"measured:{key}", Notice(AUTO_CHOICE, backend.name, why,
                                                  f"[Attention] auto: {backend.name} {why}; SDPA is used"))
            return False
        _MEASURED[key] = mine < theirs
        winner = backend.name if mine < theirs else "sdpa"
        why = (f"measured on {key[0]}, head dim {key[2]}, {key[3]}: {backend.name} {mine * 1000:.2f} ms, "
               f"sdpa {theirs * 1000:.2f} ms ({MEASURE_TOKENS} tokens x {MEASURE_HEADS} heads)")
        notice_once(f"measured:{key}", Notice(AUTO_CHOICE, backend.name, why,
                                              f"[Attention] auto: {why}: {winner} is used"))
    return _MEASURED[key]


def resolve_backend(q, k, v, mask=None, softmax_scale=None, force_attention: Optional[str] = None
                    ) -> AttentionBackend:
    """The backend that will take this call: the requested one, or the first after it that can. `auto`: the first
    of all that can, a backend with `measured_in_auto` only where it measured faster than SDPA on this GPU."""
    choice = force_attention or AUTO
    _check_name(choice)
    start = 0 if choice == AUTO else _FALLBACK_ORDER.index(choice)
    for name in _FALLBACK_ORDER[start:]:
        backend = _REGISTRY[name]
        reason = backend.unavailable_reason() or backend.cannot_take(q, k, v, mask, softmax_scale)
        if reason is None and choice == AUTO and backend.measured_in_auto and not auto_measured(backend, q):
            continue   # slower than SDPA on this GPU (measured once)
        declined = backend.auto_declines(q, k, mask) if reason is None and choice == AUTO else None
        if declined is not None:
            notice_once(f"auto-declines:{name}:{declined}",
                        Notice(AUTO_CHOICE, name, declined, f"[Attention] auto: {name} is not used for {declined}"))
            continue
        if reason is None:
            return backend
        if choice != AUTO and name == choice:
            notice_once(f"backend:{name}:{reason}", Notice(PASSED_OVER, name, reason, (
                f"[Attention] {name} backend not used: {reason}; falling back to the next one")))
    return _REGISTRY["sdpa"]


def pay_attention(q, k, v, mask=None, force_attention: Optional[str] = None, softmax_scale=None
                  ) -> torch.Tensor:
    """Attention on the first backend that can take the call (the forced one, or "auto"'s choice), with a
    one-time notice for each backend passed over.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, Nq, H, D)``, strided views allowed.
    k, v : torch.Tensor
        ``(B, Nk, Hkv, D)`` in q's dtype and device, ``H`` a multiple of ``Hkv``. Read, not freed: the caller
        drops its references after the call.
    mask : torch.Tensor, optional
        Broadcasts to ``(B, H, Nq, Nk)``: boolean (True attends) or additive float.
    force_attention : str, optional
        A backend name (`backend_names`) or "auto" (the default).
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``.

    Returns
    -------
    torch.Tensor
        ``(B, Nq, H, D)`` in q's dtype: a new tensor (or a view of one) the caller owns.

    Raises
    ------
    ValueError
        An unknown backend name.
    """
    backend = resolve_backend(q, k, v, mask, softmax_scale, force_attention)
    count_attention(backend.name)
    return backend.attend(q, k, v, mask=mask, softmax_scale=softmax_scale)
