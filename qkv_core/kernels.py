"""Triton kernels (optional), each with the PyTorch path it replaces (the q8 prefix's: `q8_kernels.py`).

`norm_rope_`: in place on `(batch, tokens, heads, head_dim)` (a strided view is fine: the last dim must be
contiguous): optionally scale every token by a per-token factor (an RMSNorm's inverse RMS, e.g. computed over
all heads), multiply a per-channel weight, round once to the tensor's dtype (as the model's norm does), then
rotate adjacent channel pairs with a RoPE table `(1 or batch, tokens, 1, head_dim / 2, 2, 2)` (Flux / Wan /
Qwen convention, `out[2i + r] = f[i, r, 0] * x[2i] + f[i, r, 1] * x[2i + 1]`) in float32, and round again.
One pass over the tensor instead of PyTorch's several (each with float32 temporaries), and one launch
instead of one per chunk. Runs on CUDA with Triton installed, or anywhere with `TRITON_INTERPRET=1` (tests).
Returns False when it cannot run; the caller then takes its PyTorch path (same math).

`smooth_quantize_k_per_thread`: SageAttention 2's key smoothing (`k -= mean`) and its per-thread int8 quantizer
in one pass (its sm90 and sm80 staged cores).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from . import fast_paths, gpus
from .launch import kept_across_calls, shared_launch

try:  # Triton is optional: ComfyUI installs on Windows and Macs often have none
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a broken Triton install must not break the pack
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    @triton.jit
    def _norm_rope_kernel(x_ptr, inv_ptr, w_ptr, w2_ptr, f_ptr, q_ptr, s_ptr, tokens, head_eps, split, span_eps,
                          stride_xb, stride_xt, stride_xh, stride_ib, stride_it, stride_fb, stride_ft, stride_wh,
                          stride_qb, stride_qt, stride_qh, stride_sb, stride_sh,
                          HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_T: tl.constexpr, HAS_INV: tl.constexpr,
                          HAS_W: tl.constexpr, HAS_W2: tl.constexpr, HAS_F: tl.constexpr,
                          HEAD_NORM: tl.constexpr, QUANT: tl.constexpr, SPAN_STATS: tl.constexpr):
        # one block of tokens of one batch item, every head: the RoPE table and the inverse RMS of a token
        # are read once and serve all its heads; each head's channels are one contiguous row. QUANT: instead of
        # writing x back, int8 into q_ptr with one float32 scale per pair of rows (r, r + 8) of each 16 rows
        # into s_ptr (SageAttention 2's per-thread q layout: BLOCK_T is a multiple of 16)
        block, batch = tl.program_id(0), tl.program_id(1)
        t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.arange(0, DIM)
        rows = t < tokens
        mask = rows[:, None]
        if HAS_F:
            # table[t, i, r, col] sits at 4 i + 2 r + col = 2 d + col for output channel d = 2 i + r
            table = f_ptr + batch * stride_fb + t[:, None] * stride_ft + 2 * c[None, :]
            f_even = tl.load(table, mask=mask, other=0.0)        # factor of x[2 i]
            f_odd = tl.load(table + 1, mask=mask, other=0.0)     # factor of x[2 i + 1]
        if HAS_INV:
            inv = tl.load(inv_ptr + batch * stride_ib + t * stride_it, mask=rows, other=0.0).to(tl.float32)
        if SPAN_STATS:
            # an RMSNorm over every head: each token's mean square from its whole row first (the block's rows
            # are read again below, from the cache), where a separate reduction would read them from memory
            squares = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for head in range(0, HEADS):
                part = tl.load(x_ptr + batch * stride_xb + t[:, None] * stride_xt + head * stride_xh + c[None, :],
                               mask=mask, other=0.0).to(tl.float32)
                squares += tl.sum(part * part, axis=1)
            inv = tl.rsqrt(squares / (HEADS * DIM) + span_eps)
        for head in range(0, HEADS):   # a compile-time count: Triton 3.6's interpreter takes no runtime one
            ptrs = x_ptr + batch * stride_xb + t[:, None] * stride_xt + head * stride_xh + c[None, :]
            raw = tl.load(ptrs, mask=mask, other=0.0)
            x = raw.to(tl.float32)
            if HAS_INV or SPAN_STATS:
                x = x * inv[:, None]
            if HEAD_NORM:   # an RMSNorm over each head's channels (Flux's QKNorm, ...)
                x = x * tl.rsqrt(tl.sum(x * x, axis=1) / DIM + head_eps)[:, None]
            if HAS_W:
                w = tl.load(w_ptr + head * stride_wh + c).to(tl.float32)[None, :]
                if HAS_W2:   # two streams in one pass: the tokens from `split` on take the second weight
                    w2 = tl.load(w2_ptr + head * stride_wh + c).to(tl.float32)[None, :]
                    w = tl.where((t < split)[:, None], w, w2)
                x = x * w
            if HAS_INV or SPAN_STATS or HAS_W or HEAD_NORM:  # the norm's output rounded before the rotation, as models do
                x = x.to(raw.dtype).to(tl.float32)
            if HAS_F:
                even, odd = tl.split(tl.reshape(x, (BLOCK_T, DIM // 2, 2)))
                even = tl.reshape(tl.join(even, even), (BLOCK_T, DIM))   # x[2 i] under channels 2 i, 2 i + 1
                odd = tl.reshape(tl.join(odd, odd), (BLOCK_T, DIM))
                x = f_even * even + f_odd * odd
            if QUANT:
                # the rounded values the unfused passes would store, then SageAttention 2's arithmetic
                x = x.to(raw.dtype).to(tl.float32)
                row_max = tl.max(tl.abs(x), axis=1)
                scale = tl.max(tl.reshape(row_max, (BLOCK_T // 16, 2, 8)), axis=1) / 127. + 0.0000001
                row_scale = tl.reshape(tl.broadcast_to(tl.reshape(scale, (BLOCK_T // 16, 1, 8)),
                                                       (BLOCK_T // 16, 2, 8)), (BLOCK_T,))
                x = x / row_scale[:, None]
                x += 0.5 * tl.where(x >= 0, 1, -1)
                tl.store(q_ptr + batch * stride_qb + t[:, None] * stride_qt + head * stride_qh + c[None, :],
                         x.to(tl.int8), mask=mask)
                tl.store(s_ptr + batch * stride_sb + head * stride_sh + block * (BLOCK_T // 2)
                         + tl.arange(0, BLOCK_T // 2), tl.reshape(scale, (BLOCK_T // 2,)))
            else:   # in place, or into another tensor of t's shape (q_ptr: t itself unless `into` is given)
                tl.store(q_ptr + batch * stride_qb + t[:, None] * stride_qt + head * stride_qh + c[None, :],
                         x.to(raw.dtype), mask=mask)

    @triton.jit
    def _smooth_quantize_k_kernel(k_ptr, m_ptr, v_ptr, s_ptr, tokens,
                                  stride_kb, stride_kt, stride_kh, stride_mb, stride_mh,
                                  stride_vb, stride_vt, stride_vh, stride_sb, stride_sh,
                                  DIM: tl.constexpr, TILE: tl.constexpr):
        # SageAttention 2's per-thread k layout: program (4 tile + j) of a head covers the rows 8 i + 2 j and
        # 8 i + 2 j + 1 of a tile of TILE keys, one scale for both. The key minus its head's mean, rounded to the
        # key's dtype (what `k -= mean` would store), then its quantizer's arithmetic.
        tile, lane = tl.program_id(0) // 4, tl.program_id(0) % 4
        head, batch = tl.program_id(1), tl.program_id(2)
        c = tl.arange(0, DIM)
        t0 = tile * TILE + tl.arange(0, TILE // 8) * 8 + lane * 2
        t1 = t0 + 1
        mean = tl.load(m_ptr + batch * stride_mb + head * stride_mh + c).to(tl.float32)[None, :]
        base = k_ptr + batch * stride_kb + head * stride_kh + c[None, :]
        raw0 = tl.load(base + t0[:, None] * stride_kt, mask=(t0 < tokens)[:, None], other=0.0)
        raw1 = tl.load(base + t1[:, None] * stride_kt, mask=(t1 < tokens)[:, None], other=0.0)
        # rounded as PyTorch rounds on a GPU (to nearest even; Triton's interpreter truncates bf16 instead)
        x0 = (raw0.to(tl.float32) - mean).to(raw0.dtype).to(tl.float32)
        x1 = (raw1.to(tl.float32) - mean).to(raw1.dtype).to(tl.float32)
        # rows past the end are zeros in the unfused quantizer's load, not minus the mean
        x0 = tl.where((t0 < tokens)[:, None], x0, 0.0)
        x1 = tl.where((t1 < tokens)[:, None], x1, 0.0)
        scale = tl.maximum(tl.max(tl.max(tl.abs(x0), axis=1), axis=0),
                           tl.max(tl.max(tl.abs(x1), axis=1), axis=0)) / 127. + 0.0000001
        x0 = x0 / scale
        x1 = x1 / scale
        x0 += 0.5 * tl.where(x0 >= 0, 1, -1)
        x1 += 0.5 * tl.where(x1 >= 0, 1, -1)
        out = v_ptr + batch * stride_vb + head * stride_vh + c[None, :]
        tl.store(out + t0[:, None] * stride_vt, x0.to(tl.int8), mask=(t0 < tokens)[:, None])
        tl.store(out + t1[:, None] * stride_vt, x1.to(tl.int8), mask=(t1 < tokens)[:, None])
        tl.store(s_ptr + batch * stride_sb + head * stride_sh + tl.program_id(0), scale)

_CAPABILITIES: dict = {}   # CUDA device index -> its compute capability


def capability(device: torch.device) -> tuple:
    """`torch.cuda.get_device_capability` of a CUDA device, asked once per device: the query costs a few
    microseconds of host time, and the kernels' checks ask it at every launch."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _CAPABILITIES.get(index)
    if found is None or not fast_paths.on("capability"):
        found = _CAPABILITIES[index] = tuple(torch.cuda.get_device_capability(index))
    return found


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for host code (`triton.cdiv` is a constexpr function: microseconds a call)."""
    return -(-a // b)


def runs_on(device: torch.device) -> bool:
    """Is Triton usable on this device (CUDA, or the interpreter on CPU)?"""
    return triton is not None and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))


def can_run(t: torch.Tensor) -> bool:
    """Is Triton usable for this tensor (`runs_on` its device)?"""
    return runs_on(t.device)


def norm_rope_(t: torch.Tensor, inverse_rms: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
               freqs: Optional[torch.Tensor] = None, head_norm_eps: Optional[float] = None,
               span_eps: Optional[float] = None, into: Optional[torch.Tensor] = None) -> bool:
    """In place on `t` `(B, N, h, D)`: `t = rope(round(t * inverse_rms * weight))` (each part optional); with
    `into` (t's shape and dtype, channels contiguous, not overlapping t) the result goes there, t unchanged.

    `inverse_rms`: float32 `(B, N)` or `(B, N, 1[, 1])`; `weight`: `(h, D)`, `(h * D,)`, or `(D,)` shared by
    every head; `freqs`: `(1 or B, N, 1, D/2, 2, 2)`, float32 (or 16-bit, computed in float32 all the same).
    `head_norm_eps`: an RMSNorm over each head's own channels first (`t * rsqrt(mean(t^2 over D) + eps)`, in
    float32). `span_eps` (no `inverse_rms`): the inverse RMS over every head of `t` (`t` holds them all),
    `rsqrt(mean(t^2 over h, D) + span_eps)` in float32, computed in the same pass. Returns False (nothing done)
    when the kernel cannot take the call."""
    launch = norm_rope_launch(t, inverse_rms, weight, freqs, head_norm_eps, span_eps=span_eps, into=into)
    if launch is None:
        return False
    launch()
    return True


def norm_rope_quantize_per_thread(t: torch.Tensor, inverse_rms: Optional[torch.Tensor] = None,
                                  weight: Optional[torch.Tensor] = None, freqs: Optional[torch.Tensor] = None,
                                  span_eps: Optional[float] = None) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """`norm_rope_`'s norm and rotation of q `(B, N, h, D)` (not changed), then int8 in SageAttention 2's per-thread
    q layout in one pass: (int8 `(B, N, h, D)`, float32 scales `(B, h, ceil(N / 64) * 32)`), its own quantizer's
    (on a GPU a rare value one int8 step apart). `span_eps`: as in `norm_rope_`. None when the kernel declines."""
    values = torch.empty(t.shape, dtype=torch.int8, device=t.device)
    windows = -(-t.shape[1] // PER_THREAD_Q_TILE) * PER_THREAD_Q_TILE // 2
    scales = torch.empty((t.shape[0], t.shape[2], windows), dtype=torch.float32, device=t.device)
    launch = norm_rope_launch(t, inverse_rms, weight, freqs, quantize_into=(values, scales), span_eps=span_eps)
    if launch is None:
        return None
    launch()
    return values, scales


PER_THREAD_Q_TILE = 64   # SageAttention 2's sm90 q tile: its scales cover whole tiles
PER_THREAD_K_TILE = 128  # its k tile: four scales each (`_smooth_quantize_k_kernel`)


def smooth_quantize_k_per_thread(k: torch.Tensor, mean: torch.Tensor, tile: int = PER_THREAD_K_TILE
                                 ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """`k - mean` quantized to SageAttention 2's per-thread int8 k layout in one pass, where the unfused path
    runs `k -= mean` (a pass over k in place) and then its quantizer: (int8 `(B, N, h, D)`, float32 scales
    `(B, h, ceil(N / tile) * 4)`; `tile`: the kernel's keys a warp, 128 for sm90, 64 for sm80), bitwise
    what those two steps give. `k` `(B, N, h, D)` 16-bit, rows contiguous
    (not changed); `mean` `(B or 1, 1, h, D)` in k's dtype. None when the kernel cannot take the call."""
    if not can_run(k) or not cuda_capable(k) or k.dtype not in (torch.float16, torch.bfloat16) \
            or not dtype_runs(k) or k.dim() != 4 or k.stride(-1) != 1 or k.numel() == 0:
        return None
    batch, tokens, heads, dim = k.shape
    if dim & (dim - 1) or dim < 16 or dim > 256 or mean.dtype != k.dtype or mean.device != k.device or \
            mean.dim() != 4 or mean.shape[1:] != (1, heads, dim) or mean.shape[0] not in (1, batch) or \
            mean.stride(-1) != 1 or tile not in (64, 128):
        return None
    values = torch.empty(k.shape, dtype=torch.int8, device=k.device)
    count = -(-tokens // tile) * 4
    scales = torch.empty((batch, heads, count), dtype=torch.float32, device=k.device)
    _smooth_quantize_k_kernel[(count, heads, batch)](
        k, mean, values, scales, tokens, k.stride(0), k.stride(1), k.stride(2),
        0 if mean.shape[0] == 1 else mean.stride(0), mean.stride(2),
        values.stride(0), values.stride(1), values.stride(2), scales.stride(0), scales.stride(1),
        DIM=dim, TILE=tile)
    return values, scales


class NormRopePass:
    """A `norm_rope_` launch worked out for tensors of one shape, strides, dtype and device (`norm_rope_pass`):
    `run(t)` launches it on such a tensor. It keeps the launch's other arguments (weights, RoPE rows, inverse
    RMS: the caller's, for its call) but no reference to a tensor it ran on, so a caller may keep it for the
    next tensor of that layout (each head group's keys): the checks and arguments are worked out once. A pass
    that writes elsewhere (`into`, `quantize_into`) serves its own tensor only (`fits` is False).

    `args`: the kernel's positional arguments, None in the places (`slots`) of the tensor it runs on; `layout`:
    that tensor's `(shape, strides, dtype, device)`, or None where it serves its own tensor only; `launch`: the
    arguments' `launch.shared_launch`. Made by `for_tensor` (and `_PassLayout.bind`)."""

    __slots__ = ("_args", "_slots", "_layout", "_launch")

    def __init__(self, args: tuple, slots: tuple, layout: Optional[tuple], launch):
        self._args, self._slots, self._layout, self._launch = args, slots, layout, launch

    @classmethod
    def for_tensor(cls, t: torch.Tensor, args: tuple, launch, reusable: bool) -> "NormRopePass":
        """The pass of `args` (`t` in its places), for tensors laid out as `t` where `reusable`."""
        return cls(tuple(None if arg is t else arg for arg in args),
                   tuple(index for index, arg in enumerate(args) if arg is t),
                   (t.shape, t.stride(), t.dtype, t.device) if reusable else None, launch)

    def fits(self, t: torch.Tensor) -> bool:
        """Can `run(t)` take `t` (this pass's shape, strides, dtype and device)?"""
        return self._layout is not None and (t.shape, t.stride(), t.dtype, t.device) == self._layout

    def run(self, t: torch.Tensor) -> None:
        """The pass on `t` (the tensor it was worked out for, or one that `fits`)."""
        args = list(self._args)
        for index in self._slots:
            args[index] = t
        self._launch.launch(args)


_TENSOR_ARGS = 7   # `_norm_rope_kernel`'s tensor arguments come first: x, inverse RMS, weights, RoPE, values, scales


def _placed(x: Optional[torch.Tensor]) -> Optional[tuple]:
    """What a pass's arguments and launch depend on of a tensor: its layout, dtype, device, 16-byte alignment."""
    return None if x is None else (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0)


class _PassLayout:
    """What `norm_rope_pass` works out for an in-place pass (no `into`, no `quantize_into`) from its tensors'
    layouts alone, kept across calls for them (`launch.kept_across_calls`; no tensor held): the non-tensor
    arguments and the `CompiledLaunch` (its grid and meta-parameters), with where each tensor goes and how it is
    viewed. A call's pass of a known layout is then its tensors put in place (`bind`), without the checks
    (host time before a call's first attention: its q pass and first keys' pass)."""

    __slots__ = ("tail", "launch", "flat_weight", "flat_weight2", "contiguous_freqs", "declined")

    def __init__(self, planned: Optional[NormRopePass], weight, weight2, freqs):
        self.declined = planned is None
        if planned is None:
            return
        # the arguments after the tensors: `bind` puts each call's own tensors before them (none of this call's kept)
        self.tail, self.launch = planned._args[_TENSOR_ARGS:], planned._launch
        self.flat_weight = weight is not None and weight.dim() != 1
        self.flat_weight2 = weight2 is not None and weight2.dim() != 1
        self.contiguous_freqs = freqs is not None and freqs.stride()[-3:] != (4, 2, 1)

    def bind(self, t: torch.Tensor, inverse_rms, weight, weight2, freqs) -> NormRopePass:
        """The pass of `t` with these tensors (laid out as the ones this was worked out for), viewed as
        `norm_rope_pass` views them."""
        inv = t if inverse_rms is None else inverse_rms.reshape(inverse_rms.shape[0], inverse_rms.shape[1])
        w = t if weight is None else (weight.reshape(-1) if self.flat_weight else weight)
        w2 = w if weight2 is None else (weight2.reshape(-1) if self.flat_weight2 else weight2)
        f = t if freqs is None else (freqs.contiguous() if self.contiguous_freqs else freqs)
        # (x, inverse RMS, weight, second weight, RoPE, values, scales): `_worked_out_pass`'s order
        tensors = (t, inv, w, w2, f, t, t)
        return NormRopePass(tuple(None if arg is t else arg for arg in tensors) + self.tail,
                            tuple(index for index, arg in enumerate(tensors) if arg is t),
                            (t.shape, t.stride(), t.dtype, t.device), self.launch)


def norm_rope_pass(t: torch.Tensor, inverse_rms: Optional[torch.Tensor] = None,
                   weight: Optional[torch.Tensor] = None, freqs: Optional[torch.Tensor] = None,
                   head_norm_eps: Optional[float] = None, weight2: Optional[torch.Tensor] = None,
                   split: Optional[int] = None, quantize_into: Optional[tuple] = None,
                   span_eps: Optional[float] = None, into: Optional[torch.Tensor] = None) -> Optional[NormRopePass]:
    """`norm_rope_launch`'s pass as a `NormRopePass` for `t`'s layout (same arguments), or None when the kernel
    cannot take the call. An in-place pass is worked out once for its tensors' layouts (`_PassLayout`)."""
    if not can_run(t):
        return None
    if quantize_into is not None or into is not None or not fast_paths.on("pass_layouts"):
        return _worked_out_pass(t, inverse_rms, weight, freqs, head_norm_eps, weight2, split, quantize_into,
                                span_eps, into)
    key = (_PassLayout, _placed(t), _placed(inverse_rms), _placed(weight), _placed(weight2), _placed(freqs),
           head_norm_eps, split, span_eps)
    layout = kept_across_calls(key, lambda: _PassLayout(_worked_out_pass(
        t, inverse_rms, weight, freqs, head_norm_eps, weight2, split, None, span_eps, None), weight, weight2, freqs))
    return None if layout.declined else layout.bind(t, inverse_rms, weight, weight2, freqs)


def _worked_out_pass(t: torch.Tensor, inverse_rms: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                     freqs: Optional[torch.Tensor], head_norm_eps: Optional[float], weight2: Optional[torch.Tensor],
                     split: Optional[int], quantize_into: Optional[tuple], span_eps: Optional[float],
                     into: Optional[torch.Tensor]) -> Optional[NormRopePass]:
    """`norm_rope_pass` worked out from its checks."""
    if not can_run(t) or t.dim() != 4 or t.stride(-1) != 1 or t.shape[-1] % 2 or t.numel() == 0:
        return None
    if span_eps is not None and inverse_rms is not None:
        return None
    batch, tokens, heads, dim = t.shape
    half = dim // 2
    if dim & (dim - 1) or dim < 16:  # tl.arange needs a power of two
        return None
    inv = t
    if inverse_rms is not None:
        inv = inverse_rms.reshape(inverse_rms.shape[0], inverse_rms.shape[1])
        if inv.shape[1] != tokens or inv.device != t.device:
            return None
    w = t
    if weight is not None:
        w = weight if weight.dim() == 1 else weight.reshape(-1)
        if w.numel() not in (dim, heads * dim) or not w.is_contiguous() or w.device != t.device:
            return None
    w2 = w
    if weight2 is not None:
        w2 = weight2 if weight2.dim() == 1 else weight2.reshape(-1)
        if weight is None or split is None or w2.numel() != w.numel() or not w2.is_contiguous() \
                or w2.device != t.device:
            return None
    f = t
    if freqs is not None:
        f = freqs
        if f.dim() != 6 or f.shape[1] != tokens or f.shape[-3:] != (half, 2, 2) or f.device != t.device \
                or f.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return None
        if f.stride()[-3:] != (4, 2, 1):
            f = f.contiguous()
    block_t = max(1, 2048 // dim)
    grid = (cdiv(tokens, block_t), batch)
    values, scales = t, t
    if into is not None:
        if quantize_into is not None or into.shape != t.shape or into.dtype != t.dtype or \
                into.device != t.device or into.stride(-1) != 1:
            return None
        values = into
    if quantize_into is not None:
        values, scales = quantize_into
        if dim > 128 or head_norm_eps is not None or weight2 is not None or values.stride(-1) != 1 or \
                not scales.is_contiguous():
            return None
        block_t = 16   # one window of 16 rows a block: every scale of the padded tiles is written
        grid = (cdiv(tokens, PER_THREAD_Q_TILE) * PER_THREAD_Q_TILE // block_t, batch)
    args = (t, inv, w, w2, f, values, scales, tokens, 0.0 if head_norm_eps is None else float(head_norm_eps),
            0 if split is None else int(split), 0.0 if span_eps is None else float(span_eps),
            t.stride(0), t.stride(1), t.stride(2),
            inv.stride(0) if inverse_rms is not None else 0, inv.stride(1) if inverse_rms is not None else 0,
            f.stride(0) if freqs is not None and f.shape[0] > 1 else 0, f.stride(1) if freqs is not None else 0,
            dim if weight is not None and w.numel() == heads * dim else 0,
            values.stride(0), values.stride(1), values.stride(2), scales.stride(0), scales.stride(1))
    meta = dict(HEADS=heads, DIM=dim, BLOCK_T=block_t, HAS_INV=inverse_rms is not None, HAS_W=weight is not None,
                HAS_W2=weight2 is not None, HAS_F=freqs is not None, HEAD_NORM=head_norm_eps is not None,
                QUANT=quantize_into is not None, SPAN_STATS=span_eps is not None)
    # launches after the first of its layout (this call's or an earlier one's) go straight to the launcher
    return NormRopePass.for_tensor(t, args, shared_launch(_norm_rope_kernel, grid, meta, args),
                                   reusable=into is None and quantize_into is None)


def norm_rope_launch(t: torch.Tensor, inverse_rms: Optional[torch.Tensor] = None,
                     weight: Optional[torch.Tensor] = None, freqs: Optional[torch.Tensor] = None,
                     head_norm_eps: Optional[float] = None, weight2: Optional[torch.Tensor] = None,
                     split: Optional[int] = None, quantize_into: Optional[tuple] = None,
                     span_eps: Optional[float] = None, into: Optional[torch.Tensor] = None):
    """`norm_rope_`'s launch, ready to be called (no arguments; nothing is done until then), or None when the
    kernel cannot take the call. A caller with several passes checks that every one can run before it runs
    any of them. `weight2` and `split`: the tokens from `split` on take `weight2` (laid out as `weight`)
    instead: two adjacent streams whose norms differ only by their weights, in one pass. `quantize_into`:
    `(int8 values, scales)` written instead of `t` (`norm_rope_quantize_per_thread`). `span_eps`: the inverse
    RMS over every head computed in the pass (see `norm_rope_`; not with `inverse_rms`). `into`: the 16-bit
    result written there instead of into `t` (not with `quantize_into`)."""
    planned = norm_rope_pass(t, inverse_rms, weight, freqs, head_norm_eps, weight2, split, quantize_into, span_eps,
                             into)
    if planned is None:
        return None

    def launch():
        planned.run(t)
    return launch


def dtype_runs(t: torch.Tensor) -> bool:
    """16-bit and float32 tensors; bf16 needs a GPU of compute capability 8.0 or more (its conversions)."""
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return t.dtype != torch.bfloat16 or not t.is_cuda or capability(t.device) >= gpus.BF16_KERNELS_FROM


def cuda_capable(t: torch.Tensor) -> bool:
    """Compute capability 7.5 or more (the kernels' targets), or the interpreter."""
    return not t.is_cuda or capability(t.device) >= gpus.TRITON_KERNELS_FROM


def rows_contiguous(*tensors) -> bool:
    return all(t.dim() == 4 and t.stride(-1) == 1 for t in tensors)


def block_tokens(dim: int, elements: int = 4096) -> int:
    return max(1, elements // dim)   # elements a block: enough in flight to stream at full bandwidth


def norm_rope_reference(t: torch.Tensor, inverse_rms: Optional[torch.Tensor] = None,
                        weight: Optional[torch.Tensor] = None, freqs: Optional[torch.Tensor] = None,
                        head_norm_eps: Optional[float] = None, weight2: Optional[torch.Tensor] = None,
                        split: Optional[int] = None) -> torch.Tensor:
    """The same math in PyTorch, out of place (for tests and as the documentation of the kernel)."""
    if weight2 is not None:   # two streams: each its own weight
        return torch.cat((norm_rope_reference(t[:, :split], None if inverse_rms is None else inverse_rms[:, :split],
                                              weight, None if freqs is None else freqs[:, :split], head_norm_eps),
                          norm_rope_reference(t[:, split:], None if inverse_rms is None else inverse_rms[:, split:],
                                              weight2, None if freqs is None else freqs[:, split:], head_norm_eps)),
                         dim=1)
    out = t.float()
    if inverse_rms is not None:
        out = out * inverse_rms.reshape(t.shape[0], t.shape[1], 1, 1).float()
    if head_norm_eps is not None:
        out = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + head_norm_eps)
    if weight is not None:
        out = out * weight.reshape(-1, t.shape[3]).float()
    if inverse_rms is not None or weight is not None or head_norm_eps is not None:
        out = out.to(t.dtype).float()
    if freqs is not None:
        pairs = out.unflatten(-1, (-1, 1, 2))
        out = (freqs[..., 0] * pairs[..., 0] + freqs[..., 1] * pairs[..., 1]).flatten(-2)
    return out.to(t.dtype)
