"""Triton kernels (optional), each with the PyTorch path it replaces.

`norm_rope_`: in place on `(batch, tokens, heads, head_dim)` (a strided view is fine: the last dim must be
contiguous): optionally scale every token by a per-token factor (an RMSNorm's inverse RMS, e.g. computed over
all heads), multiply a per-channel weight, round once to the tensor's dtype (as the model's norm does), then
rotate adjacent channel pairs with a RoPE table `(1 or batch, tokens, 1, head_dim / 2, 2, 2)` (Flux / Wan /
Qwen convention, `out[2i + r] = f[i, r, 0] * x[2i] + f[i, r, 1] * x[2i + 1]`) in float32, and round again.
One pass over the tensor instead of PyTorch's several (each with float32 temporaries), and one launch
instead of one per chunk. Runs on CUDA with Triton installed, or anywhere with `TRITON_INTERPRET=1` (tests).
Returns False when it cannot run; the caller then takes its PyTorch path (same math).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

try:  # Triton is optional: ComfyUI installs on Windows and Macs often have none
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - a broken Triton install must not break the pack
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if triton is not None:
    @triton.jit
    def _norm_rope_kernel(x_ptr, inv_ptr, w_ptr, f_ptr, tokens,
                          stride_xb, stride_xt, stride_xh, stride_ib, stride_it, stride_fb, stride_ft,
                          HALF: tl.constexpr, BLOCK_T: tl.constexpr, HAS_INV: tl.constexpr,
                          HAS_W: tl.constexpr, HAS_F: tl.constexpr):
        block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        i = tl.arange(0, HALF)
        rows = t < tokens
        mask = rows[:, None]
        even = x_ptr + batch * stride_xb + t[:, None] * stride_xt + head * stride_xh + 2 * i[None, :]
        xe = tl.load(even, mask=mask, other=0.0)
        xo = tl.load(even + 1, mask=mask, other=0.0)
        out_dtype = xe.dtype
        xe, xo = xe.to(tl.float32), xo.to(tl.float32)
        if HAS_INV:
            inv = tl.load(inv_ptr + batch * stride_ib + t * stride_it, mask=rows, other=0.0).to(tl.float32)
            xe, xo = xe * inv[:, None], xo * inv[:, None]
        if HAS_W:
            weights = w_ptr + head * 2 * HALF + 2 * i
            xe = xe * tl.load(weights).to(tl.float32)[None, :]
            xo = xo * tl.load(weights + 1).to(tl.float32)[None, :]
        if HAS_INV or HAS_W:  # the norm's output is rounded before the rotation, as the model does
            xe, xo = xe.to(out_dtype).to(tl.float32), xo.to(out_dtype).to(tl.float32)
        if HAS_F:
            table = f_ptr + batch * stride_fb + t[:, None] * stride_ft + 4 * i[None, :]
            f00 = tl.load(table, mask=mask, other=0.0)
            f01 = tl.load(table + 1, mask=mask, other=0.0)
            f10 = tl.load(table + 2, mask=mask, other=0.0)
            f11 = tl.load(table + 3, mask=mask, other=0.0)
            xe, xo = f00 * xe + f01 * xo, f10 * xe + f11 * xo
        tl.store(even, xe.to(out_dtype), mask=mask)
        tl.store(even + 1, xo.to(out_dtype), mask=mask)


def can_run(t: torch.Tensor) -> bool:
    """Is Triton usable for this tensor (CUDA, or the interpreter on CPU)?"""
    return triton is not None and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))


def norm_rope_(t: torch.Tensor, inverse_rms: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
               freqs: Optional[torch.Tensor] = None) -> bool:
    """In place on `t` `(B, N, h, D)`: `t = rope(round(t * inverse_rms * weight))` (each part optional).

    `inverse_rms`: float32 `(B, N)` or `(B, N, 1[, 1])`; `weight`: `(h, D)` or `(h * D,)`; `freqs`:
    float32 `(1 or B, N, 1, D/2, 2, 2)`. Returns False (nothing done) when the kernel cannot take the call.
    """
    if not can_run(t) or t.dim() != 4 or t.stride(-1) != 1 or t.shape[-1] % 2 or t.numel() == 0:
        return False
    batch, tokens, heads, dim = t.shape
    half = dim // 2
    if half & (half - 1):  # tl.arange needs a power of two
        return False
    dummy = t
    inv = dummy
    if inverse_rms is not None:
        inv = inverse_rms.reshape(inverse_rms.shape[0], inverse_rms.shape[1])
        if inv.shape[1] != tokens or inv.device != t.device:
            return False
    w = dummy
    if weight is not None:
        w = weight.reshape(-1)
        if w.numel() != heads * dim or not w.is_contiguous() or w.device != t.device:
            return False
    f = dummy
    if freqs is not None:
        f = freqs
        if f.dim() != 6 or f.shape[1] != tokens or f.shape[-3:] != (half, 2, 2) or f.device != t.device:
            return False
        if f.stride()[-3:] != (4, 2, 1):
            f = f.contiguous()
        if f.dtype != torch.float32:
            return False
    block_t = 16 if half <= 64 else 8
    grid = (triton.cdiv(tokens, block_t), heads, batch)
    _norm_rope_kernel[grid](
        t, inv, w, f, tokens,
        t.stride(0), t.stride(1), t.stride(2),
        inv.stride(0) if inverse_rms is not None else 0, inv.stride(1) if inverse_rms is not None else 0,
        f.stride(0) if freqs is not None and f.shape[0] > 1 else 0, f.stride(1) if freqs is not None else 0,
        HALF=half, BLOCK_T=block_t, HAS_INV=inverse_rms is not None, HAS_W=weight is not None,
        HAS_F=freqs is not None)
    return True


def norm_rope_reference(t: torch.Tensor, inverse_rms: Optional[torch.Tensor] = None,
                        weight: Optional[torch.Tensor] = None, freqs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same math in PyTorch, out of place (for tests and as the documentation of the kernel)."""
    out = t.float()
    if inverse_rms is not None:
        out = out * inverse_rms.reshape(t.shape[0], t.shape[1], 1, 1).float()
    if weight is not None:
        out = out * weight.reshape(t.shape[2], t.shape[3]).float()
    if inverse_rms is not None or weight is not None:
        out = out.to(t.dtype).float()
    if freqs is not None:
        pairs = out.unflatten(-1, (-1, 1, 2))
        out = (freqs[..., 0] * pairs[..., 0] + freqs[..., 1] * pairs[..., 1]).flatten(-2)
    return out.to(t.dtype)
