"""Attention written over its own queries (optional Triton kernel), for the split path's output buffer.

In a split call every group's q is projected into its heads of the call's output buffer first (`GroupLoop`);
a library attention then returns the group's result in a new tensor, which is copied over q. That result is a
transient of one group's size beside the group's k and v, and the copy is one more launch a group. This kernel
reads each block of queries once, attends it over the keys and values with an online softmax (float32
statistics and accumulator, exp2), and writes the block's result where its queries were: each program owns
its rows of one head, so nothing it writes is read by another.

`attend_over_queries_(q, k, v, softmax_scale)`: q `(B, Nq, h, D)` (a strided view; channels contiguous) is
overwritten with softmax(q k^T * scale) v; k, v `(B, Nk, hk, D)` with hk dividing h (query head i uses key head
i // (h // hk)). No mask. Returns False (nothing done) when the kernel cannot take the call: no Triton, not
CUDA (or the interpreter on CPU), not fp16/bf16, a head dim other than 128, a GPU under compute
capability 8.0; the caller then runs its backend and copies, as before.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import fast_paths, gpus
from .kernels import capability, cdiv, runs_on, triton
from .launch import kept_across_calls, shared_launch

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _key_block(q, acc, best, total, k_base, v_base, cols, kv_tokens, stride_kt, stride_vt, c, scale_log2,
                   UPCAST: tl.constexpr, MASKED: tl.constexpr):
        # one block of keys and values into the running softmax (`best`: each row's largest score so far,
        # `total`: its sum of exponentials, `acc`: its weighted values); MASKED: the last, partial block
        if MASKED:
            valid = cols < kv_tokens
            k = tl.load(k_base + cols[None, :] * stride_kt + c[:, None], mask=valid[None, :], other=0.0)
        else:
            k = tl.load(k_base + cols[None, :] * stride_kt + c[:, None])          # (DIM, BLOCK_N)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k) * scale_log2
        if MASKED:
            s = tl.where(valid[None, :], s, float("-inf"))
        new_best = tl.maximum(best, tl.max(s, 1))
        p = tl.math.exp2(s - new_best[:, None])
        alpha = tl.math.exp2(best - new_best)
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(v_base + cols[:, None] * stride_vt + c[None, :], mask=valid[:, None], other=0.0)
        else:
            v = tl.load(v_base + cols[:, None] * stride_vt + c[None, :])          # (BLOCK_N, DIM)
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, new_best, total

    @triton.jit
    def _attention_over_q_kernel(q_ptr, k_ptr, v_ptr, q_tokens, kv_tokens, scale_log2,
                                 stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                                 stride_vb, stride_vt, stride_vh, heads,
                                 GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, WHOLE_BLOCKS: tl.constexpr):
        # one block of BLOCK_M queries of one head of one batch item; the result goes over those queries.
        # For the interpreter: UPCAST computes the products in float32 (numpy has no bfloat16 products) and
        # WHOLE_BLOCKS is the count of whole key blocks as a constant (Triton 3.6's interpreter takes no runtime
        # loop bound); on a GPU it is 0 and the count a runtime value (one compiled kernel for every length)
        block, item_head = tl.program_id(0), tl.program_id(1)
        item, head = item_head // heads, item_head % heads
        kv_head = head // GROUP
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        c = tl.arange(0, DIM)
        q_ptrs = q_ptr + item * stride_qb + head * stride_qh + rows[:, None] * stride_qt + c[None, :]
        row_mask = rows[:, None] < q_tokens
        q = tl.load(q_ptrs, mask=row_mask, other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_base = k_ptr + item * stride_kb + kv_head * stride_kh
        v_base = v_ptr + item * stride_vb + kv_head * stride_vh
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM], tl.float32)
        if WHOLE_BLOCKS > 0:
            for index in range(0, WHOLE_BLOCKS):   # whole blocks of keys: no masks
                acc, best, total = _key_block(q, acc, best, total, k_base, v_base,
                                              index * BLOCK_N + tl.arange(0, BLOCK_N), kv_tokens, stride_kt,
                                              stride_vt, c, scale_log2, UPCAST, False)
        else:
            for index in range(0, kv_tokens // BLOCK_N):
                acc, best, total = _key_block(q, acc, best, total, k_base, v_base,
                                              index * BLOCK_N + tl.arange(0, BLOCK_N), kv_tokens, stride_kt,
                                              stride_vt, c, scale_log2, UPCAST, False)
        if kv_tokens % BLOCK_N != 0:   # the last, partial block of keys
            acc, best, total = _key_block(q, acc, best, total, k_base, v_base,
                                          (kv_tokens // BLOCK_N) * BLOCK_N + tl.arange(0, BLOCK_N), kv_tokens,
                                          stride_kt, stride_vt, c, scale_log2, UPCAST, True)
        acc = acc / total[:, None]
        tl.store(q_ptrs, acc.to(q_ptr.dtype.element_ty), mask=row_mask)


# (head dim) -> (BLOCK_M, BLOCK_N, num_warps, num_stages), tuned on Hopper (docs/benchmarks.md#split-floors).
# Head dim 128 only: 64 (Kandinsky 5) has no tuned tiles, and untuned ones ran slower than SDPA, so those calls
# keep SDPA.
_CONFIGS = {128: (128, 64, 8, 3)}
_INTERPRET_CONFIG = (16, 16, 1, 1)


def declines(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> Optional[str]:
    """None when calls of this device, dtype and geometry can run the kernel (what a call knows before it
    projects anything), else why not."""
    if triton is None:
        return "Triton is not installed"
    if not runs_on(device):
        return f"needs a CUDA tensor, got {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16/bf16, got {dtype}"
    if head_dim not in _CONFIGS:
        return f"head dim {head_dim} (128 is taken)"
    if kv_heads <= 0 or heads % kv_heads:
        return f"{heads} heads over {kv_heads} key/value heads"
    if device.type == "cuda" and capability(device) < gpus.OVER_QUERIES_FROM:
        return "needs compute capability 8.0 or more"
    return None


def cannot_attend_over_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """None when `attend_over_queries_` takes these tensors, else why not."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape != v.shape:
        return "needs q (B, Nq, h, D) and k, v of one shape (B, Nk, hk, D)"
    reason = declines(q.device, q.dtype, q.shape[2], k.shape[2], q.shape[3])
    if reason is not None:
        return reason
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        return f"q, k and v of one dtype and device, got {q.dtype}, {k.dtype}, {v.dtype}"
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        return f"k/v of shape {tuple(k.shape)} for q {tuple(q.shape)}"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "channels must be contiguous"
    if q.numel() == 0 or k.shape[1] == 0:
        return "empty"
    return None


class OverQueriesPass:
    """`attend_over_queries_` worked out for q, k and v of one layout (shapes, strides, dtype, device) and one
    softmax scale (`over_queries_pass`): `run(q, k, v)` attends such tensors (each group's q a view of the output
    buffer, its own k and v, all laid out alike). Holds no tensor it ran on."""

    __slots__ = ("_fixed", "_launch")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        batch, q_tokens, heads, dim = q.shape
        interpreted = q.device.type == "cpu"
        block_m, block_n, warps, stages = _INTERPRET_CONFIG if interpreted else _CONFIGS[dim]
        self._fixed = (q_tokens, k.shape[1], scale * math.log2(math.e), q.stride(0), q.stride(1), q.stride(2),
                       k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), heads)
        meta = dict(GROUP=heads // k.shape[2], DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=interpreted,
                    WHOLE_BLOCKS=k.shape[1] // block_n if interpreted else 0, num_warps=warps, num_stages=stages)
        # launches after the first of its layout (this call's or an earlier one's) go straight to the launcher
        self._launch = shared_launch(_attention_over_q_kernel, (cdiv(q_tokens, block_m), batch * heads), meta,
                                     (q, k, v) + self._fixed)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """softmax(q k^T * scale) v written over `q` (tensors of this pass's layout and alignment)."""
        self._launch.launch((q, k, v) + self._fixed)


def _layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    return (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device, k.device,
            v.device)


def over_queries_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      softmax_scale: Optional[float] = None) -> Optional[OverQueriesPass]:
    """The kernel's launch for tensors laid out as q, k, v (see `attend_over_queries_`), or None where
    `cannot_attend_over_queries` gives a reason. Asked by each head group: the pass of this layout, scale and
    alignment is worked out once and kept across calls (the fast path `over_queries_pass`; it holds no tensor),
    the one place it is kept."""
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    if not fast_paths.on("over_queries_pass"):
        return None if cannot_attend_over_queries(q, k, v) is not None else OverQueriesPass(q, k, v, scale)
    key = (OverQueriesPass, _layout(q, k, v), scale, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16,
           _CONFIGS.get(q.shape[3]), _INTERPRET_CONFIG)
    return kept_across_calls(key, lambda: None if cannot_attend_over_queries(q, k, v) is not None else
                             OverQueriesPass(q, k, v, scale))


def attend_over_queries_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         softmax_scale: Optional[float] = None) -> bool:
    """softmax(q k^T * scale) v written over `q` `(B, Nq, h, D)`; k, v `(B, Nk, hk, D)`. `softmax_scale`:
    default 1 / sqrt(D). False (q untouched) where `cannot_attend_over_queries` gives a reason."""
    planned = over_queries_pass(q, k, v, softmax_scale)
    if planned is None:
        return False
    planned.run(q, k, v)
    return True


__all__ = ["attend_over_queries_", "cannot_attend_over_queries", "declines", "over_queries_pass",
           "OverQueriesPass"]
