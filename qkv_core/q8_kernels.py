"""Triton kernels of the q8 prefix format (optional), each with the PyTorch path it replaces in `q8.py`.

`dequantize_q8_` and `merge_lse_`: one pass each of `q8.dequantize_q8_into` and `q8.merge_lse_` (which call
them first and run their PyTorch paths where these decline): strided outputs, head dims that are powers of two,
compute capability 7.5+ (bf16 from 8.0). Both return False (nothing done) where they cannot run.
"""
from __future__ import annotations

import torch

from .kernels import block_tokens, can_run, cdiv, cuda_capable, dtype_runs, rows_contiguous, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _dequantize_q8_kernel(v_ptr, s_ptr, o_ptr, tokens,
                              stride_vb, stride_vt, stride_vh, stride_sb, stride_st, stride_sh,
                              stride_ob, stride_ot, stride_oh,
                              DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr):
        # a block of tokens of one head of one batch item: int8 values times their group's fp16 scale, in
        # float32, rounded once to the output's dtype (the PyTorch path's math); each scale is read once and
        # broadcast over its group's channels
        block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        g = tl.arange(0, DIM // GROUP)
        k = tl.arange(0, GROUP)
        channel = g[None, :, None] * GROUP + k[None, None, :]
        mask = (t < tokens)[:, None, None]
        values = tl.load(v_ptr + batch * stride_vb + t[:, None, None] * stride_vt + head * stride_vh + channel,
                         mask=mask, other=0)
        scales = tl.load(s_ptr + batch * stride_sb + t[:, None] * stride_st + head * stride_sh + g[None, :],
                         mask=(t < tokens)[:, None], other=0.0)
        x = values.to(tl.float32) * scales.to(tl.float32)[:, :, None]
        tl.store(o_ptr + batch * stride_ob + t[:, None, None] * stride_ot + head * stride_oh + channel,
                 x.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _merge_lse_kernel(o_ptr, l_ptr, p_ptr, q_ptr, tokens,
                          stride_ob, stride_ot, stride_oh, stride_pb, stride_pt, stride_ph,
                          stride_lb, stride_lh, stride_lt, stride_qb, stride_qh, stride_qt,
                          DIM: tl.constexpr, BLOCK_T: tl.constexpr):
        # a block of tokens of one head of one batch item: both partial attentions weighted by their share of
        # the joint (base-2) log-sum-exp, in float32; the merged log-sum-exp written back
        block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.arange(0, DIM)
        rows = t < tokens
        lse_ptrs = l_ptr + batch * stride_lb + head * stride_lh + t * stride_lt
        l1 = tl.load(lse_ptrs, mask=rows, other=0.0)
        l2 = tl.load(q_ptr + batch * stride_qb + head * stride_qh + t * stride_qt, mask=rows, other=0.0)
        top = tl.maximum(l1, l2)
        top = tl.where(tl.abs(top) < float("inf"), top, 0.0)   # -inf on both sides: a query that saw no key
        w1 = tl.exp2(l1 - top)
        w2 = tl.exp2(l2 - top)
        total = w1 + w2
        merged = top + tl.log2(total)
        total = tl.where(total > 0, total, 1.0)
        w1 = (w1 / total)[:, None]
        w2 = (w2 / total)[:, None]
        out_ptrs = o_ptr + batch * stride_ob + t[:, None] * stride_ot + head * stride_oh + c[None, :]
        mask = rows[:, None]
        raw = tl.load(out_ptrs, mask=mask, other=0.0)
        other = tl.load(p_ptr + batch * stride_pb + t[:, None] * stride_pt + head * stride_ph + c[None, :],
                        mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (raw.to(tl.float32) * w1 + other * w2).to(raw.dtype), mask=mask)
        tl.store(lse_ptrs, merged, mask=rows)


def dequantize_q8_(out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, group: int) -> bool:
    """One pass of `out = values * scales` (q8: int8 `values` `(B or 1, N, H, D)`, fp16 `scales` `(B or 1, N, H,
    D / group)`, `out` `(B, N, H, D)` of any float dtype, strided on every dim but the last). False (nothing done)
    where the kernel cannot take the call: the caller's PyTorch path runs (the same math)."""
    if not can_run(out) or not cuda_capable(out) or not dtype_runs(out) or values.dtype != torch.int8:
        return False
    if not rows_contiguous(out, values, scales) or len({out.device, values.device, scales.device}) != 1:
        return False
    batch, tokens, heads, dim = out.shape
    if dim & (dim - 1) or dim < group or values.shape[1:] != out.shape[1:] or values.shape[0] not in (1, batch) \
            or tuple(scales.shape) != (*values.shape[:-1], dim // group) or out.numel() == 0:
        return False
    block_t = block_tokens(dim, 8192)
    broadcast = values.shape[0] == 1 and batch > 1
    grid = (cdiv(tokens, block_t), heads, batch)
    _dequantize_q8_kernel[grid](values, scales, out, tokens,
                                0 if broadcast else values.stride(0), values.stride(1), values.stride(2),
                                0 if broadcast else scales.stride(0), scales.stride(1), scales.stride(2),
                                out.stride(0), out.stride(1), out.stride(2),
                                DIM=dim, GROUP=group, BLOCK_T=block_t, num_warps=8)
    return True


def merge_lse_(out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor) -> bool:
    """One pass of `q8.merge_lse_` (shapes checked there): `out`, `other` `(B, N, H, D)` (strided but for the last
    dim), base-2 `lse`, `other_lse` float32 `(B, H, N)`. False where the kernel cannot take the call."""
    if not can_run(out) or not cuda_capable(out) or not dtype_runs(out) or other.dtype != out.dtype:
        return False
    if lse.dtype != torch.float32 or other_lse.dtype != torch.float32 or not rows_contiguous(out, other):
        return False
    if len({out.device, lse.device, other.device, other_lse.device}) != 1:
        return False
    batch, tokens, heads, dim = out.shape
    if dim & (dim - 1) or dim < 16 or out.numel() == 0:
        return False
    block_t = block_tokens(dim)
    grid = (cdiv(tokens, block_t), heads, batch)
    _merge_lse_kernel[grid](out, lse, other, other_lse, tokens,
                            out.stride(0), out.stride(1), out.stride(2), other.stride(0), other.stride(1),
                            other.stride(2), lse.stride(0), lse.stride(1), lse.stride(2),
                            other_lse.stride(0), other_lse.stride(1), other_lse.stride(2),
                            DIM=dim, BLOCK_T=block_t)
    return True


__all__ = ["dequantize_q8_", "merge_lse_"]
