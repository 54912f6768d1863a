"""SageAttention's kernels that the staged cores launch and SageAttention offers no public call for: the one module
that imports its private names (docs/design.md §2.4). Its CUDA attention kernels are not here: `sage2` calls them
through the `torch.library` ops SageAttention registers (`sm90_compile`, `sm80_compile`).

Each function imports on first use (SageAttention is optional; its CUDA modules are built for some GPUs only).
"""
from __future__ import annotations


def sage1_kernels() -> tuple:
    """SageAttention 1's Triton `(quant_per_block_int8_kernel, _attn_fwd)`."""
    from sageattention.attn_qk_int8_per_block import _attn_fwd
    from sageattention.quant_per_block import quant_per_block_int8_kernel
    return quant_per_block_int8_kernel, _attn_fwd


def sage2_triton_attention():
    """SageAttention 2's Triton attention kernel (`_attn_fwd`, the one that takes masks and returns LSEs)."""
    from sageattention.triton.attn_qk_int8_per_block import _attn_fwd
    return _attn_fwd


def sage2_v_fp8_kernels() -> tuple:
    """SageAttention 2's CUDA `(transpose_pad_permute_cuda, scale_fuse_quant_cuda)`: v to fp8 per channel into
    the caller's buffers (its public `per_channel_fp8` allocates its own and pads to 64 tokens, not 128)."""
    from sageattention import _fused
    return _fused.transpose_pad_permute_cuda, _fused.scale_fuse_quant_cuda


__all__ = ["sage1_kernels", "sage2_triton_attention", "sage2_v_fp8_kernels"]
