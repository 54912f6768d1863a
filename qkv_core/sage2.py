"""SageAttention 2's staged core (docs/design.md §2.4): its quantizers run as the runtime hands each of v, k,
q over, then its attention kernel writes the group's heads of the call's output. Built by users from
thu-ml/SageAttention (not on PyPI); its kernels are imported from the installed package, never copied here.

Kernel modes, chosen per call by `Sage2Core.settings` as `sageattn` chooses its kernels by GPU:
- "sm90" (compute capability 9.0, unmasked): what `sageattn` runs on Hopper (`sageattn_qk_int8_pv_fp8_cuda_sm90`):
  q and k int8 with one scale per thread of its MMA tiles (q: warps of 16 rows in tiles of 64; k: tiles of 128,
  smoothed by their mean over the tokens), v fp8 e4m3 transposed to `(B, D, H, tokens padded to 128)` with one
  scale per channel, then its TMA/wgmma kernel writing into a strided output and giving the base-2 LSE.
- "sm80" (8.0, A100), unmasked: `sageattn_qk_int8_pv_fp16_cuda` (fp32 accumulation): q and k int8 per thread
  (warps of 32 rows in tiles of 128; k tiles of 64, smoothed), v fp16, its sm80 kernel (`sm80_compile`'s op).
- "triton" (masked calls, sm86 and any other GPU): `sageattn_qk_int8_pv_fp16_triton`: q and k int8 by blocks
  (q: 128 tokens, softmax scale and log2(e) folded in; k: 64, smoothed), v fp16, its Triton kernel (bool or
  additive masks, LSE). It is also what `sageattn` runs on sm86.
- "sageattn": `sageattn` itself per head group, unstaged, its result copied into the group's heads of the
  output: sm89 (Ada: RTX 40xx, L40) and sm120 (Blackwell consumer cards), and any GPU whose kernel the installed
  build lacks. (Their staged form needs SageAttention's sm89 kernel, which could not be checked: run as PTX on
  Hopper it crashes inside SageAttention's own call; docs/benchmarks.md#sage2.)

Each quantizer takes the runtime's tensor in a list it clears and keeps only the quantized form, so at most one of
q, k, v exists in 16 bits beside the quantized others (upstream `sageattn` holds all three, a smoothed copy of k,
a padded and a transposed copy of v; docs/benchmarks.md#sage2).

Native prefixes (`cache_native_prefix`, "sm90" only): keys smoothed by the prefix's own mean and quantized per
thread, values fp8, kept in those layouts. A call attending one smooths its projected keys by the same mean, runs
the kernel once over the prefix and once over its own keys, and merges the two by their base-2 LSEs
(`q8.merge_lse_`): the smoothing shifts both LSEs by the same q.mean(k), which the merge cancels.
"""
from __future__ import annotations

import functools
import importlib
import math
from types import SimpleNamespace
from typing import Optional

import torch

from . import gpus, kernels
from .sage_internals import sage2_triton_attention, sage2_v_fp8_kernels
from .staged_core import StagedCore
from .prefix import KVPrefix
from .sage import quantize_blocks

LOG2E = 1.44269504
# the sm90 kernel's tiles (CTA_Q query rows, WARP_Q per warp, CTA_K keys) and its per-thread scale counts
CTA_Q, WARP_Q, CTA_K = 64, 16, 128
Q_SCALES_PER_WARP, K_SCALES_PER_TILE = 8, 4
# the sm80 kernel's tiles: (query rows a block, a warp; keys a block, a warp), as `sageattn` quantizes for it
SM80_TILES = (128, 32, 64, 64)
SM90_TILES = (CTA_Q, WARP_Q, CTA_K, CTA_K)
TRITON_Q_BLOCK, TRITON_K_BLOCK = 128, 64   # the Triton kernel's token blocks of q's and k's scales
FP8_MAX = 448.0
NHD, NOT_CAUSAL, PER_THREAD = 0, 0, 3      # the CUDA kernel's codes for layout, causality and scale granularity


def is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and gpus.architecture(device).sage2_kernel == "sm90"


@functools.lru_cache(maxsize=None)
def _has_module(name: str) -> bool:
    """Does the installed SageAttention build have the module `name` (its CUDA kernels' ops are built for some GPUs
    only)?"""
    try:
        importlib.import_module(f"sageattention.{name}")
        return True
    except ImportError:
        return False


# the CUDA kernels' modes (`gpus.Architecture.sage2_kernel`) -> the module that registers their `torch.library` op
_CUDA_MODULES = {"sm90": "sm90_compile", "sm80": "sm80_compile"}


def kernel_mode(device: torch.device, masked: bool) -> str:
    """The kernel mode (module docstring) for a call on `device`: its row of the GPU table, where the installed
    build has that kernel."""
    if masked:
        return "triton"
    mode = gpus.architecture(device).sage2_kernel if device.type == "cuda" else "sageattn"
    if mode in _CUDA_MODULES and not _has_module(_CUDA_MODULES[mode]):
        return "sageattn"
    return mode


# ---- quantizers (each launches SageAttention's own kernel on a strided (B, N, H, D) tensor) ----

def quantize_per_thread(x: torch.Tensor, which: str, tiles: tuple = SM90_TILES) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 `(B, N, H, D)` and float32 scales `(B, H, scales)` as the CUDA kernels read them, for their `tiles`
    (query rows a block, a warp; keys a block, a warp: `SM90_TILES`, `SM80_TILES`): for q (`which="q"`)
    one scale per row index mod 8 of each warp's rows; for k one per pair of rows mod 8 of each warp's keys. No
    softmax scale folded in (the kernel takes it)."""
    from sageattention.triton.quant_per_thread import (quant_key_per_thread_int8_kernel,
                                                        quant_query_per_thread_int8_kernel)
    batch, tokens, heads, dim = x.shape
    q_block, q_warp, k_block, k_warp = tiles
    values = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    if which == "q":
        kernel, block, count = quant_query_per_thread_int8_kernel, q_warp, \
            kernels.cdiv(tokens, q_block) * (q_block // q_warp) * Q_SCALES_PER_WARP
    else:
        kernel, block, count = quant_key_per_thread_int8_kernel, k_warp, \
            kernels.cdiv(tokens, k_block) * (k_block // k_warp) * K_SCALES_PER_TILE
    scales = torch.empty((batch, heads, count), dtype=torch.float32, device=x.device)
    kernel[(count, heads, batch)](x, values, scales, tokens, x.stride(0), x.stride(2), x.stride(1),
                                  values.stride(0), values.stride(2), values.stride(1),
                                  scales.stride(0), scales.stride(1), C=dim, BLK=block)
    return values, scales


def quantize_v_fp8(v_list: list) -> tuple[torch.Tensor, torch.Tensor]:
    """v `(B, N, H, D)` 16-bit (the list is cleared) as fp8 e4m3 `(B, D, H, N padded to 128)`, tokens permuted
    as the fp8 MMA reads them, and float32 scales `(B, H, D)` (max |v| of each channel / 448)."""
    transpose_pad_permute, scale_fuse_quant = sage2_v_fp8_kernels()
    v = v_list.pop()
    v_list.clear()
    batch, tokens, heads, dim = v.shape
    padded = kernels.cdiv(tokens, CTA_K) * CTA_K
    if padded != kernels.cdiv(tokens, 64) * 64:
        # the transposing kernel pads to 64 tokens, the attention reads 128 at a time: give it the zero rows
        v = torch.cat([v, v.new_zeros(batch, padded - tokens, heads, dim)], dim=1)
    transposed = torch.empty((batch, dim, heads, padded), dtype=v.dtype, device=v.device)
    transpose_pad_permute(v, transposed, NHD)
    del v
    values = torch.empty(transposed.shape, dtype=torch.float8_e4m3fn, device=transposed.device)
    scales = torch.empty((batch, heads, dim), dtype=torch.float32, device=transposed.device)
    scale_fuse_quant(transposed, values, scales, padded, FP8_MAX, NHD)
    return values, scales


class Sage2Core(StagedCore):
    """SageAttention 2's staged core. Tensors `(B, N, H, D)` (the runtime's layout, SageAttention's "NHD");
    head dims 64 and 128; fp16 / bf16."""

    name = "sage2"

    def settings(self, q_shape, k_shape, dtype, device, softmax_scale=None, masked=False, native_prefix=None,
                 return_lse=False):
        """`masked`: the call has a mask (the Triton kernel); `native_prefix`: the group's heads of a native
        prefix (`prefix_heads`); `return_lse`: `staged_attention` returns the natural-log LSE."""
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_shape[-1])
        kernel = kernel_mode(torch.device(device), masked)
        if return_lse and kernel == "sageattn":
            kernel = "triton"
        if native_prefix is not None and kernel != "sm90":
            raise ValueError("a native SageAttention 2 prefix is attended by its sm90 kernel, unmasked: cache the "
                             "prefix with native=False (q8) on this GPU or for masked calls")
        return SimpleNamespace(q_shape=tuple(q_shape), k_shape=tuple(k_shape), dtype=dtype, device=device,
                               scale=scale, kernel=kernel, prefix=native_prefix, return_lse=return_lse)

    def staged_quantize_v(self, v_list: list, settings):
        """`(values, scales)`: sm90: fp8 per channel (`quantize_v_fp8`); Triton: fp16 (a new tensor for bf16; the
        list's is freed), no scales; "sageattn": v as it is."""
        if settings.kernel == "sm90":
            return quantize_v_fp8(v_list)
        v = v_list.pop()
        v_list.clear()
        if settings.kernel == "sageattn":
            return v, None
        return (v if v.dtype == torch.float16 else v.to(torch.float16)), None

    def staged_quantize_k(self, k_list: list, settings):
        """k smoothed by its mean over the tokens, or by the native prefix's mean when there is one, then int8:
        `(values, scales, mean)` (sm90, sm80: both in one Triton pass where it runs, k not changed; else k, the
        runtime's own, is smoothed in place first)."""
        k = k_list.pop()
        k_list.clear()
        if settings.kernel == "sageattn":
            return k, None, None
        mean = settings.prefix.k_mean if settings.prefix is not None else k.mean(dim=1, keepdim=True)
        tiles = SM90_TILES if settings.kernel == "sm90" else SM80_TILES
        if settings.kernel in ("sm90", "sm80"):
            # the smoothing and the quantizer in one pass: a strided `k -= mean` of one head group runs far below
            # the memory bandwidth
            fused = kernels.smooth_quantize_k_per_thread(k, mean, tiles[3])
            if fused is not None:
                return (*fused, mean)
        k -= mean
        if settings.kernel in ("sm90", "sm80"):
            return (*quantize_per_thread(k, "k", tiles), mean)
        return (*_triton_quantize(k, TRITON_K_BLOCK, 1.0), mean)

    def staged_quantize_q(self, q_list: list, settings):
        """q int8: `(values, scales, q16)`; `q16` is q itself, kept only when the natural-log LSE is asked for
        (`staged_attention` adds back the smoothing's shift q . mean(k) from it), else None."""
        q = q_list.pop()
        q_list.clear()
        if settings.kernel == "sageattn":
            return q, None, None
        keep = q.clone() if settings.return_lse else None   # q may be a view of the output
        if settings.kernel == "sm90":
            return (*quantize_per_thread(q, "q"), keep)
        if settings.kernel == "sm80":
            return (*quantize_per_thread(q, "q", SM80_TILES), keep)
        return (*_triton_quantize(q, TRITON_Q_BLOCK, settings.scale * LOG2E), keep)

    def norm_rope_quantize_q(self, q: torch.Tensor, inverse_rms, weight, freqs, settings, span_eps=None):
        """`staged_quantize_q`'s result for q `(B, N, h, D)` (not changed) normalized, rotated and quantized in one sm90
        pass (`kernels.norm_rope_`'s arguments; `span_eps`: q holds every head), as the three steps give it (rarely one
        int8 step apart). None where that pass does not apply (the caller then runs them)."""
        if settings.kernel != "sm90" or settings.return_lse:
            return None
        quantized = kernels.norm_rope_quantize_per_thread(q, inverse_rms, weight, freqs, span_eps=span_eps)
        return None if quantized is None else (*quantized, None)

    def q_row_tile(self, settings) -> Optional[int]:
        """64 for the sm90 kernel (its q scales cover tiles of 64 tokens, nothing over all tokens), unless the
        natural-log LSE (it keeps q in 16 bits) or a native prefix is asked for; else None."""
        if settings.kernel != "sm90" or settings.return_lse or settings.prefix is not None:
            return None
        return CTA_Q

    def empty_quantized_q(self, q_shape, settings):
        """int8 `(B, N, heads, D)` and float32 per-thread scales `(B, heads, ceil(N / 64) * 32)`, uninitialized."""
        batch, tokens, heads, _ = q_shape
        scales = kernels.cdiv(tokens, CTA_Q) * (CTA_Q // WARP_Q) * Q_SCALES_PER_WARP
        return (torch.empty(tuple(q_shape), dtype=torch.int8, device=settings.device),
                torch.empty((batch, heads, scales), dtype=torch.float32, device=settings.device), None)

    def place_quantized_q_rows(self, full, part, token_start: int) -> None:
        """`part`'s values and scales into their tokens of `full` (its scales cover whole tiles from
        `token_start` on, a multiple of 64)."""
        values, scales, _ = full
        part_values, part_scales, _ = part
        values[:, token_start:token_start + part_values.shape[1]].copy_(part_values)
        first = token_start // CTA_Q * (CTA_Q // WARP_Q) * Q_SCALES_PER_WARP
        scales[:, :, first:first + part_scales.shape[2]].copy_(part_scales)

    def quantized_q_heads(self, full, heads: range):
        """A view of the heads' values (the kernel reads strided q) and a contiguous copy of their scales (it
        reads them contiguous)."""
        values, scales, _ = full
        return values[:, :, heads.start:heads.stop], scales[:, heads.start:heads.stop].contiguous(), None

    def staged_attention(self, out: torch.Tensor, quantized, settings, mask=None):
        """The attention of the quantized q, k, v written into `out` `(B, Nq, heads, D)` (a strided view of the
        call's output: the group's heads). With a native prefix, merged with the prefix's own pass. Returns the
        natural-log LSE float32 `(B, heads, Nq)` when `settings.return_lse`, else None."""
        (q, q_scale, q16), (k, k_scale, k_mean), (v, v_scale) = quantized
        if settings.kernel == "sageattn":
            from sageattention import sageattn
            out.copy_(sageattn(q, k, v, tensor_layout="NHD", sm_scale=settings.scale))
            return None
        if settings.kernel == "triton":
            lse = _triton_attention(out, q, q_scale, k, k_scale, v, mask, settings.return_lse)
        elif settings.kernel == "sm80":
            if mask is not None:
                raise ValueError("the sm80 kernel takes no mask: settings(masked=True) picks the Triton kernel")
            lse = _sm80_attention(out, q, q_scale, k, k_scale, v, settings.scale, settings.return_lse)
        else:
            if mask is not None:
                raise ValueError("the sm90 kernel takes no mask: settings(masked=True) picks the Triton kernel")
            lse = _sm90_attention(out, q, q_scale, k, k_scale, v, v_scale, settings.scale,
                                  settings.return_lse or settings.prefix is not None)
            if settings.prefix is not None:
                lse = _merge_native_prefix(out, lse, q, q_scale, settings.prefix, settings.scale)
        if not settings.return_lse:
            return None
        # natural log, the smoothing's shift q . mean(k) added back in float32 (SageAttention's wrapper does it in
        # the input dtype, which costs up to ~0.05 with biased keys)
        mean = k_mean.float().expand(q16.shape[0], -1, -1, -1)
        heads, kv_heads = q16.shape[2], mean.shape[2]
        if heads != kv_heads:
            mean = mean.repeat_interleave(heads // kv_heads, dim=2)
        correction = torch.einsum("bnhd,bhd->bhn", q16.float(), mean[:, 0])
        return lse / LOG2E + correction * settings.scale

    def prefix_heads(self, prefix: KVPrefix, heads: range) -> KVPrefix:
        """The key/value heads `heads` of a native prefix (views; `v` is `(B, D, H, tokens)`)."""
        h = slice(heads.start, heads.stop)
        return KVPrefix(prefix.k[:, :, h], prefix.k_scale[:, h], prefix.k_mean[:, :, h], prefix.v[:, :, h],
                        prefix.v_scale[:, h], None)

    def cache_native_prefix(self, kv_list: list) -> KVPrefix:
        """A prefix `[key, value]` `(batch, tokens, kv_heads, head_dim)` 16-bit (the list is cleared) in the sm90
        kernel's layouts: keys smoothed by their own mean (kept as `k_mean`), int8 per thread; values fp8."""
        key, value = kv_list
        if not is_sm90(key.device) or key.dtype not in (torch.float16, torch.bfloat16) or \
                key.shape[-1] not in (64, 128):   # checked before the list is cleared: a refusal leaves it
            raise ValueError("a native SageAttention 2 prefix needs an sm90 GPU, fp16/bf16 and head dim 64 or "
                             "128: cache it with native=False (q8)")
        kv_list.clear()
        mean = key.mean(dim=1, keepdim=True)
        k, k_scale = quantize_per_thread(key - mean, "k")
        del key
        v, v_scale = quantize_v_fp8([value])
        return KVPrefix(k, k_scale, mean, v, v_scale, None)


def _triton_quantize(x: torch.Tensor, block: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel's int8 by blocks of `block` tokens, `scale` folded in (`sage.quantize_blocks` with
    SageAttention 2's quantizer)."""
    from sageattention.triton.quant_per_block import quant_per_block_int8_kernel
    return quantize_blocks(x, block, scale, quant_per_block_int8_kernel)


def _sm90_attention(out, q, q_scale, k, k_scale, v, v_scale, scale, lse: bool) -> Optional[torch.Tensor]:
    """SageAttention 2's sm90 kernel (its `torch.library` op) into `out`; its base-2 LSE `(B, H, Nq)` when `lse`."""
    importlib.import_module("sageattention.sm90_compile")   # registers the op
    result = torch.ops.sageattention_sm90.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf(
        q, k, v, out, q_scale, k_scale, v_scale, NHD, NOT_CAUSAL, PER_THREAD, scale, int(lse))
    return result if lse else None


def _sm80_attention(out, q, q_scale, k, k_scale, v, scale, lse: bool) -> Optional[torch.Tensor]:
    """SageAttention 2's sm80 kernel (fp16 PV, fp32 accumulation; its `torch.library` op) into `out`; its base-2
    LSE `(B, H, Nq)` when `lse`."""
    importlib.import_module("sageattention.sm80_compile")   # registers the op
    result = torch.ops.sageattention.qk_int8_sv_f16_accum_f32_attn(q, k, v, out, q_scale, k_scale, NHD, NOT_CAUSAL,
                                                                   PER_THREAD, scale, int(lse))
    return result if lse else None


def _merge_native_prefix(out, lse, q, q_scale, prefix: KVPrefix, scale) -> torch.Tensor:
    """The prefix's pass (one launch per batch item: a batch-1 prefix serves every item) merged into `out`,
    `lse` (the call's own pass) by base-2 LSE. Returns the merged LSE."""
    from .q8 import merge_lse_
    batch = q.shape[0]
    prefix_out = torch.empty_like(out)
    prefix_lse = []
    for b in range(batch):
        p = 0 if prefix.k.shape[0] == 1 else b
        prefix_lse.append(_sm90_attention(prefix_out[b:b + 1], q[b:b + 1], q_scale[b:b + 1], prefix.k[p:p + 1],
                                          prefix.k_scale[p:p + 1], prefix.v[p:p + 1], prefix.v_scale[p:p + 1],
                                          scale, True))
    prefix_lse = prefix_lse[0] if batch == 1 else torch.cat(prefix_lse)
    merge_lse_(out, lse, prefix_out, prefix_lse)
    return lse


def _triton_attention(out, q, q_scale, k, k_scale, v, mask, lse: bool) -> Optional[torch.Tensor]:
    """SageAttention 2's Triton kernel into `out`, with a bool or additive `mask` broadcast to
    `(B, heads, Nq, Nk)`; its base-2 LSE when `lse`."""
    attention = sage2_triton_attention()
    batch, q_tokens, heads, dim = q.shape
    kv_tokens, kv_heads = k.shape[1], k.shape[2]
    if mask is not None:
        if mask.dim() == 3:
            mask = mask.unsqueeze(1)
        mask = mask.expand(batch, heads, q_tokens, kv_tokens)
        if mask.dtype != torch.bool and mask.dtype != out.dtype:
            mask = mask.to(out.dtype)
        mask_strides = mask.stride()
    else:
        mask_strides = (0, 0, 0, 0)
    result = torch.empty((batch, heads, q_tokens) if lse else (0,), dtype=torch.float32, device=q.device)
    attention[(kernels.cdiv(q_tokens, TRITON_Q_BLOCK), heads, batch)](
        q, k, v, q_scale, k_scale, out, mask, result,
        q.stride(0), q.stride(2), q.stride(1), k.stride(0), k.stride(2), k.stride(1),
        v.stride(0), v.stride(2), v.stride(1), out.stride(0), out.stride(2), out.stride(1),
        *mask_strides, q_tokens, kv_tokens, heads, heads // kv_heads,
        BLOCK_M=TRITON_Q_BLOCK, BLOCK_N=TRITON_K_BLOCK, HEAD_DIM=dim, STAGE=1, RETURN_LSE=lse,
        num_warps=4 if dim == 64 else 8, num_stages=3 if dim == 64 else 4)
    return result if lse else None


def sage2_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float] = None,
                    mask: Optional[torch.Tensor] = None, return_lse: bool = False):
    """SageAttention 2's own unstaged call for `(B, N, H, D)` tensors, the one `Sage2Core` must equal: on sm90
    unmasked `sageattn_qk_int8_pv_fp8_cuda_sm90`, else `sageattn_qk_int8_pv_fp16_triton` (with the mask).
    `k` is not changed."""
    import sageattention
    if mask is None and is_sm90(q.device):
        return sageattention.sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout="NHD", sm_scale=softmax_scale,
                                                              return_lse=return_lse)
    return sageattention.sageattn_qk_int8_pv_fp16_triton(q, k, v, tensor_layout="NHD", attn_mask=mask,
                                                         sm_scale=softmax_scale, return_lse=return_lse)
