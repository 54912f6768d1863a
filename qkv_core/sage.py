"""SageAttention's staged cores (docs/design.md §2.4): its quantizers run as the runtime hands each tensor
over, then its attention kernel writes the group's heads of the call's output.

`Sage1Core`: SageAttention 1 (PyPI `sageattention==1.0.6`, Triton). Its `sageattn` converts v to fp16, smooths k
by its mean over the tokens (in the caller's tensor, in place), quantizes q and k to int8 by blocks of tokens (128
for q with the softmax scale and log2(e) folded in, 64 for k) in one call, then attends. Staged, each step runs
as its tensor arrives, so at most one of q, k, v exists in 16 bits beside the quantized others, and the kernel
writes straight into the output: the same kernels, in the same order per tensor, as `sageattn` (tested equal).
No log-sum-exp, no mask: a cached prefix is dequantized into the joined keys before k is quantized (the runtime
does that), and masked calls go to SDPA. Head dims 64 and 128 (its 96 kernels pad the head: not staged).

The kernels are SageAttention's own, imported from the installed package (never copied here).
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import torch

from .sage_internals import sage1_kernels
from .staged_core import StagedCore

LOG2E = 1.44269504   # SageAttention folds log2(e) into q's scale: its kernel takes exp2
Q_BLOCK, K_BLOCK = 128, 64   # SageAttention 1's token blocks of q's and k's scales (its attention kernel's tiles)


def quantize_blocks(x: torch.Tensor, block: int, scale: float, kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """SageAttention's int8 quantization of `x` `(B, N, H, D)` (strided but for the last dim) by blocks of
    `block` tokens of each head, `scale` folded in: (int8 `(B, N, H, D)`, float32 scales `(B, H, blocks, 1)`).
    `kernel`: its `quant_per_block_int8_kernel` (SageAttention 2's Triton one has the same arguments; default
    SageAttention 1's)."""
    quantize = kernel if kernel is not None else sage1_kernels()[0]
    batch, tokens, heads, dim = x.shape
    values = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    blocks = -(-tokens // block)
    scales = torch.empty((batch, heads, blocks, 1), dtype=torch.float32, device=x.device)
    quantize[(blocks, heads, batch)](x, values, scales, tokens, x.stride(0), x.stride(2), x.stride(1),
                                     values.stride(0), values.stride(2), values.stride(1),
                                     scales.stride(0), scales.stride(1), sm_scale=scale, C=dim, BLK=block)
    return values, scales


class Sage1Core(StagedCore):
    """SageAttention 1's staged core. Tensors `(B, N, H, D)` (the runtime's layout, SageAttention's "NHD")."""

    name = "sage1"

    def settings(self, q_shape, k_shape, dtype, device, softmax_scale=None, masked=False, native_prefix=None):
        if masked or native_prefix is not None:
            raise ValueError("SageAttention 1 takes no mask and keeps no native prefix: pass a tensor mask (the "
                             "call goes to SDPA), cache prefixes with native=False (q8), or install SageAttention 2")
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_shape[-1])
        return SimpleNamespace(q_shape=tuple(q_shape), k_shape=tuple(k_shape), dtype=dtype, device=device,
                               scale=scale)

    def staged_quantize_v(self, v_list: list, settings):
        """v in fp16 (the kernel's value type): a new tensor for 16-bit bf16 / float32 inputs (the list's is freed)."""
        v = v_list.pop()
        v_list.clear()
        return v if v.dtype == torch.float16 else v.to(torch.float16)

    def staged_quantize_k(self, k_list: list, settings):
        """k smoothed by its mean over the tokens (in place, as `sageattn` does: the runtime's own k), then int8
        by blocks of `K_BLOCK` tokens."""
        k = k_list.pop()
        k_list.clear()
        k -= k.mean(dim=1, keepdim=True)
        return quantize_blocks(k, K_BLOCK, 1.0)

    def staged_quantize_q(self, q_list: list, settings):
        """q int8 by blocks of `Q_BLOCK` tokens, the softmax scale and log2(e) folded in."""
        q = q_list.pop()
        q_list.clear()
        return quantize_blocks(q, Q_BLOCK, settings.scale * LOG2E)

    def staged_attention(self, out: torch.Tensor, quantized, settings, mask=None) -> None:
        """The attention of the quantized q, k and fp16 v, written into `out` `(B, Nq, heads, D)` (a strided view of
        the call's output: the group's heads)."""
        if mask is not None:
            raise ValueError("SageAttention 1 takes no mask: the runtime sends such calls to SDPA (use "
                             "attention_backend sdpa, or SageAttention 2)")
        (q, q_scale), (k, k_scale), v = quantized
        _, attend = sage1_kernels()
        batch, q_tokens, heads, dim = q.shape
        kv_tokens, kv_heads = k.shape[1], k.shape[2]
        attend[(-(-q_tokens // Q_BLOCK), heads, batch)](
            q, k, v, q_scale, k_scale, out,
            q.stride(0), q.stride(2), q.stride(1), k.stride(0), k.stride(2), k.stride(1),
            v.stride(0), v.stride(2), v.stride(1), out.stride(0), out.stride(2), out.stride(1),
            q_tokens, kv_tokens, heads, heads // kv_heads, HEAD_DIM=dim, BLOCK_M=Q_BLOCK, BLOCK_N=K_BLOCK, STAGE=1,
            num_warps=4 if dim == 64 else 8, num_stages=3 if dim == 64 else 4)


def sage1_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    softmax_scale: Optional[float] = None) -> torch.Tensor:
    """What SageAttention 1's own `sageattn(q, k, v, tensor_layout="NHD")` computes, through its own functions
    (`per_block_int8` launching both quantizers, then its `forward`), without its CUDA-only checks: the unstaged
    call the staged core must equal (tests; `k` is not changed)."""
    from sageattention.attn_qk_int8_per_block import forward
    from sageattention.quant_per_block import per_block_int8
    k = k - k.mean(dim=1, keepdim=True)
    v = v if v.dtype == torch.float16 else v.to(torch.float16)
    q8, q_scale, k8, k_scale = per_block_int8(q, k, sm_scale=softmax_scale, tensor_layout="NHD")
    return forward(q8, k8, v, q_scale, k_scale, tensor_layout="NHD", output_dtype=q.dtype)
