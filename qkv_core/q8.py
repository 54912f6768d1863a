"""The q8 key/value format and log-sum-exp merges (docs/design.md §2.6): one Triton pass each on CUDA
(`q8_kernels`), else these PyTorch paths (the same math).

q8: int8 `(batch, tokens, heads, head_dim)` with FP16 scales `(batch, tokens, heads, head_dim // 32)`; each
group of 32 channels is scaled by max|x| / 127 (scale clamped at >= 1e-8), rounded and clamped to +-127.
About half the memory of 16 bits. Every pass works on `CHUNK_TOKENS` tokens at a time, so its FP32 scratch
stays bounded whatever the sequence length.
"""
from __future__ import annotations

import torch

from . import q8_kernels

GROUP = 32
CHUNK_TOKENS = 4096
SCALE_FLOOR = 1e-8


def _check_channels(head_dim: int) -> None:
    if head_dim % GROUP:
        raise ValueError(f"q8 needs head_dim divisible by {GROUP}, got {head_dim}: keep this prefix in 16 bits "
                         f"(quantize=False)")


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q8 of a float tensor `(batch, tokens, heads, head_dim)` (or any `(..., tokens, ..., head_dim)` with
    tokens on dim 1) -> `(int8 values, float16 scales)`; new tensors, `x` is not changed."""
    if not x.is_floating_point():
        raise ValueError(f"quantize_q8 takes a float tensor, got {x.dtype}")
    _check_channels(x.shape[-1])
    values = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // GROUP), dtype=torch.float16, device=x.device)
    tokens = x.shape[1] if x.dim() > 1 else 1
    for a in range(0, tokens, CHUNK_TOKENS):
        b = min(a + CHUNK_TOKENS, tokens)
        # a float32 copy even when x is float32: x must not change (it is divided in place below)
        part = x[:, a:b].to(torch.float32, copy=True).unflatten(-1, (-1, GROUP))
        scale = (part.abs().amax(-1, keepdim=True) / 127.0).clamp_min_(SCALE_FLOOR)
        scale16 = scale.to(torch.float16)
        # quantize with the stored (fp16) scale, so dequantization inverts exactly what was rounded
        used = scale16.float().clamp_min_(SCALE_FLOOR)
        values[:, a:b] = part.div_(used).round_().clamp_(-127, 127).flatten(-2).to(torch.int8)
        scales[:, a:b] = scale16.squeeze(-1)
        del part, scale, scale16, used
    return values, scales


def dequantize_q8_into(out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Writes `values * scales` into `out` (same shape as `values`, any float dtype; views welcome: e.g. the
    prefix part of a joined key buffer). `values`/`scales` may have batch 1 for an `out` of batch B."""
    if values.dtype != torch.int8:
        raise ValueError(f"dequantize_q8_into takes int8 values, got {values.dtype}")
    _check_channels(values.shape[-1])
    tokens = values.shape[1]
    if out.shape[1] != tokens or out.shape[2:] != values.shape[2:]:
        raise ValueError(f"output {tuple(out.shape)} does not match q8 values {tuple(values.shape)}")
    if q8_kernels.dequantize_q8_(out, values, scales, GROUP):   # one Triton pass (CUDA)
        return out
    for a in range(0, tokens, CHUNK_TOKENS):
        b = min(a + CHUNK_TOKENS, tokens)
        part = values[:, a:b].float().unflatten(-1, (-1, GROUP))
        part.mul_(scales[:, a:b].float().unsqueeze(-1))
        out[:, a:b] = part.flatten(-2).expand_as(out[:, a:b])
        del part
    return out


def dequantize_q8(values: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """A new `dtype` tensor from q8 values and scales."""
    out = torch.empty(values.shape, dtype=dtype, device=values.device)
    return dequantize_q8_into(out, values, scales)


def merge_lse_(out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor) -> None:
    """In place: `out`, `lse` become the attention over both key sets. `out`, `other`: `(batch, tokens, heads,
    head_dim)` partial attentions, each normalized over its own keys; `lse`, `other_lse`: their base-2 log-sum-exps,
    float32 `(batch, heads, tokens)`, `-inf` where a query saw no key in that part."""
    if out.dim() != 4 or other.shape != out.shape:
        raise ValueError(f"merge_lse_: out and other must be one shape (batch, tokens, heads, head_dim), got "
                         f"{tuple(out.shape)} and {tuple(other.shape)}")
    expected = (out.shape[0], out.shape[2], out.shape[1])
    for name, t in (("lse", lse), ("other_lse", other_lse)):
        if tuple(t.shape) != expected:
            raise ValueError(f"merge_lse_: {name} must be (batch, heads, tokens) = {expected} for out "
                             f"{tuple(out.shape)}, got {tuple(t.shape)}"
                             + ("; it looks (batch, tokens, heads): pass .transpose(1, 2)"
                                if tuple(t.shape) == (out.shape[0], out.shape[1], out.shape[2]) else ""))
    if q8_kernels.merge_lse_(out, lse, other, other_lse):   # one Triton pass (CUDA)
        return
    tokens = out.shape[1]
    for a in range(0, tokens, CHUNK_TOKENS):
        b = min(a + CHUNK_TOKENS, tokens)
        l1, l2 = lse[:, :, a:b].float(), other_lse[:, :, a:b].float()
        top = torch.maximum(l1, l2)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        w1, w2 = torch.exp2(l1 - top), torch.exp2(l2 - top)
        total = w1 + w2
        merged = top + torch.log2(total)
        total = torch.where(total > 0, total, torch.ones_like(total))
        w1, w2 = (w1 / total).transpose(1, 2).unsqueeze(-1), (w2 / total).transpose(1, 2).unsqueeze(-1)
        # `other` is only read (for float32 it is not copied by .float(), so no in-place op on it)
        mixed = out[:, a:b].float().mul_(w1).addcmul_(other[:, a:b].float(), w2)
        out[:, a:b] = mixed
        lse[:, :, a:b] = merged
        del l1, l2, top, w1, w2, total, merged, mixed
