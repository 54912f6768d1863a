"""The default benchmark's layer (`python -m benchmarks.bench`, `benchmarks/bench.py`): a Wan 2.x 14B self-attention
layer with random weights, ComfyUI v0.8.0's forward reproduced op for op ("stock", not imported from ComfyUI), and
the same layer through `qkv_core.qkv_attention` with Wan's norm and RoPE. Not part of the node pack."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import qkv_core

#: Wan 2.x 14B's self-attention
WAN_14B = dict(dim=5120, heads=40, head_dim=128, eps=1e-6, theta=10000.0)

#: (name, latent grid (t, h, w)): 81 frames -> 21 latent frames; 480p -> 30 x 52, 720p -> 45 x 80 patches
RESOLUTIONS = [("480p x 81 frames", (21, 30, 52)), ("720p x 81 frames", (21, 45, 80))]

DEFAULT_CPU_SCALE = 16


def wan_rope_axes(head_dim: int) -> list[int]:
    """Wan's split of the head dim over (t, h, w): [44, 42, 42] for 128 (comfy/ldm/wan/model.py)."""
    return [head_dim - 4 * (head_dim // 6), 2 * (head_dim // 6), 2 * (head_dim // 6)]


def wan_rope_freqs(grid, tokens: int, head_dim: int, theta: float, device) -> torch.Tensor:
    """ComfyUI's RoPE table for the first `tokens` positions of the latent grid (t, h, w), float32
    `(1, tokens, 1, head_dim // 2, 2, 2)`: per pair the rotation [[cos, -sin], [sin, cos]]."""
    t, h, w = grid
    if tokens > t * h * w:
        t = math.ceil(tokens / (h * w))
    pos = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)
    pos = pos.reshape(-1, 3)[:tokens].to(torch.float64)
    tables = []
    for axis, dim in enumerate(wan_rope_axes(head_dim)):
        scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64)
        angle = pos[:, axis, None] * (1.0 / theta ** scale)                     # (tokens, dim/2)
        rot = torch.stack([angle.cos(), -angle.sin(), angle.sin(), angle.cos()], dim=-1)
        tables.append(rot.view(tokens, dim // 2, 2, 2))
    freqs = torch.cat(tables, dim=-3).to(torch.float32)                          # (tokens, D/2, 2, 2)
    return freqs[None, :, None].contiguous().to(device)


class WanSelfAttentionLayer(nn.Module):
    """Weights of one Wan self-attention layer (random), with the RoPE table of its tokens as a buffer."""

    def __init__(self, dim, heads, head_dim, eps, freqs, device, dtype, seed=0):
        super().__init__()
        self.dim, self.heads, self.head_dim, self.eps = dim, heads, head_dim, eps
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for name in ("q", "k", "v", "o"):
            linear = nn.Linear(dim, dim, bias=True, device="meta")
            bound = 1.0 / math.sqrt(dim)
            weight = (torch.rand(dim, dim, generator=generator) * 2 - 1) * bound
            bias = (torch.rand(dim, generator=generator) * 2 - 1) * bound
            linear.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
            linear.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
            setattr(self, name, linear)
            del weight, bias
        # Wan's norm_q / norm_k: RMSNorm over the full width, with a (trained, here random) weight
        self.norm_q_weight = nn.Parameter((1 + 0.1 * torch.randn(dim, generator=generator)).to(device, dtype),
                                          requires_grad=False)
        self.norm_k_weight = nn.Parameter((1 + 0.1 * torch.randn(dim, generator=generator)).to(device, dtype),
                                          requires_grad=False)
        self.register_buffer("freqs", freqs)


# --- stock: ComfyUI v0.8.0 --------------------------------------------------------------------------------

def apply_rope1_eager(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """ComfyUI's apply_rope1 (comfy/ldm/flux/math.py fallback = comfy_kitchen's eager backend): float32
    copies of x, a new float32 result, cast back."""
    x_ = x.to(dtype=freqs_cis.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    x_out = freqs_cis[..., 0] * x_[..., 0]
    x_out.addcmul_(freqs_cis[..., 1], x_[..., 1])
    return x_out.reshape(*x.shape).type_as(x)


def stock_rope_fn(choice: str) -> tuple[Callable, str]:
    """ComfyUI calls comfy_kitchen.apply_rope1 when comfy_kitchen is installed (CUDA: a fused kernel),
    else the eager formula."""
    if choice in ("auto", "kitchen"):
        try:
            import comfy_kitchen
            return comfy_kitchen.apply_rope1, "comfy_kitchen.apply_rope1"
        except Exception as e:
            if choice == "kitchen":
                raise SystemExit(f"--stock-rope kitchen: comfy_kitchen is not importable ({e})")
    return apply_rope1_eager, "eager apply_rope1 (comfy_kitchen not installed)"


def stock_forward(layer: WanSelfAttentionLayer, x_list: list, apply_rope1=apply_rope1_eager) -> torch.Tensor:
    """WanSelfAttention.forward of ComfyUI v0.8.0 with attention_pytorch (SDPA), o included."""
    x = x_list.pop()
    b, s, n, d = *x.shape[:2], layer.heads, layer.head_dim
    freqs = layer.freqs

    def rms_norm(t, weight):  # comfy.rmsnorm.rms_norm -> torch's rms_norm with the weight cast to t
        return F.rms_norm(t, weight.shape, weight=weight.to(t.dtype), eps=layer.eps)

    def qkv_fn_q(x):
        q = rms_norm(layer.q(x), layer.norm_q_weight).view(b, s, n, d)
        return apply_rope1(q, freqs)

    def qkv_fn_k(x):
        k = rms_norm(layer.k(x), layer.norm_k_weight).view(b, s, n, d)
        return apply_rope1(k, freqs)

    q = qkv_fn_q(x)
    k = qkv_fn_k(x)

    def attention_pytorch(q, k, v, heads):
        b, _, dim_head = q.shape
        dim_head //= heads
        q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
        return out.transpose(1, 2).reshape(b, -1, heads * dim_head)

    x = attention_pytorch(q.view(b, s, n * d), k.view(b, s, n * d), layer.v(x).view(b, s, n * d), heads=n)
    x = layer.o(x)
    return x


# --- qkv_core -----------------------------------------------------------------------------------------------

def make_norm_rope(layer: WanSelfAttentionLayer) -> Callable:
    """Wan's norm_q/norm_k + RoPE for `qkv_core`, in place, by bounded token chunks (`qkv_core.rows_`).
    With `group.mean_squares` the group's heads are normalized by the full-width statistics; without, the
    group must hold every head (unsplit). Same arithmetic as the stock path: normalize in float32, round to
    the model dtype, times the weight; rotate in float32, round."""
    d, eps, freqs = layer.head_dim, layer.eps, layer.freqs

    def one(t: torch.Tensor, heads: range, weight: torch.Tensor, mean_squares: Optional[torch.Tensor]):
        if mean_squares is None and len(heads) * d != layer.dim:
            raise RuntimeError("a norm over all heads needs group.mean_squares when the heads are split")
        w = weight[heads.start * d:heads.stop * d].to(t.dtype).view(len(heads), d)
        if t.is_cuda:   # the fused Triton pass the Wan adapter runs (nodes/attention.py), where it can
            ms = mean_squares if mean_squares is not None else \
                torch.linalg.vector_norm(t, dim=(-2, -1), dtype=torch.float32).square_().div_(layer.dim)
            if qkv_core.kernels.norm_rope_(t, torch.rsqrt(ms + eps), w, freqs):
                return

        def fn(part, a, b):
            f = part.float()
            ms = (f.square().mean(dim=(-2, -1), keepdim=True) if mean_squares is None
                  else mean_squares[:, a:b].unsqueeze(-1))
            f.mul_(torch.rsqrt(ms + eps))
            part.copy_(f)                 # rounded to the model dtype, as rms_norm does before the weight
            part.mul_(w)
            f.copy_(part)
            pairs = f.view(*part.shape[:-1], -1, 1, 2)
            fr = freqs[:, a:b]
            out = fr[..., 0] * pairs[..., 0]
            out.addcmul_(fr[..., 1], pairs[..., 1])
            part.copy_(out.view(part.shape))
            return part

        qkv_core.rows_(t, fn)

    def norm_rope(query, key, group):
        ms = group.mean_squares or (None, None)
        if query is not None:
            one(query, group.q, layer.norm_q_weight, ms[0])
        if key is not None:
            one(key, group.kv, layer.norm_k_weight, ms[1])

    return norm_rope


def qkv_forward(layer: WanSelfAttentionLayer, x_list: list, level: int, norm_rope: Callable) -> torch.Tensor:
    """The same layer through `qkv_core.qkv_attention` (x handed off), then o."""
    out = qkv_core.qkv_attention(x_list, layer.q, layer.k, layer.v, layer.heads, layer.head_dim, norm_rope,
                                 norm_spans_heads=True, head_split_level=level, force_attention="sdpa")
    return layer.o(out.flatten(2))


# ------------------------------------------------------------------------------------------------------
# workloads
# ------------------------------------------------------------------------------------------------------
