"""RoPE as the attention forms of `nodes/attention.py` name it (`ROPE_KINDS`: rotation matrices of adjacent pairs
or of each head's halves, or cos/sin tables) and the norms they pair with (`NORM_KINDS`), with each kind's rotation
of a chunk of token rows in PyTorch (`rotate_rows`: a head group takes its own rows and columns of the tables).
`norm_rope.py` runs them on each head group, by fused Triton passes where they apply, else by these."""
from __future__ import annotations

import torch

NORM_PER_HEAD = "per_head"
NORM_SPANS_HEADS = "spans_heads"
ROPE_PAIRS = "pairs"                    # rotation matrices of the pairs (2i, 2i + 1) (Flux, Wan, LTX 0.33+)
ROPE_SPLIT_HALF = "split_half"          # the same matrices for the pairs (i, i + D/2) of each head (LTX "split")
ROPE_COS_SIN = "cos_sin"                # (cos, sin) over the whole width, pairs (2i, 2i + 1) (LTX before 0.33)
ROPE_COS_SIN_HALVES = "cos_sin_halves"  # (cos, sin) per head, pairs (i, i + D/2) (LTX "split" before 0.33)
# (cos, sin) of each pair (2i, 2i + 1), one per head, over the first tokens only (Mochi's video; its text after)
ROPE_COS_SIN_PAIRS = "cos_sin_pairs"
NORM_KINDS = (None, NORM_PER_HEAD, NORM_SPANS_HEADS)
ROPE_KINDS = (None, ROPE_PAIRS, ROPE_SPLIT_HALF, ROPE_COS_SIN, ROPE_COS_SIN_HALVES, ROPE_COS_SIN_PAIRS)
# the RoPE kinds `PerHeadNormRope` rotates by (with a norm over each head's channels)
PER_HEAD_ROPE_KINDS = (ROPE_PAIRS, ROPE_SPLIT_HALF, ROPE_COS_SIN_PAIRS)


def rope_rows(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (ComfyUI's `apply_rope1` math; Flux, Wan, Qwen-Image, Lumina): a chunk
    `(B, n, h, D)` rotated by `freqs` `(B or 1, n, 1 or h, D/2, 2, 2)` float32; returns float32. A few fused
    PyTorch ops: one call per chunk costs far less host time than a kernel dispatch per group."""
    pairs = t.unflatten(-1, (-1, 1, 2))
    out = freqs[..., 0] * pairs[..., 0]          # float32 by type promotion
    out.addcmul_(freqs[..., 1], pairs[..., 1])
    return out.flatten(-2)


def rope_split_half_rows(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE on the pairs (i, i + R/2) of each head (ComfyUI's `apply_rope_split_half1` math; LTX's "split"
    RoPE, Cosmos, MiniMax H3): a chunk `(B, n, h, D)` rotated by the matrices `freqs` `(B or 1, n, 1 or h,
    R/2, 2, 2)`. R = D rotates every channel; R < D (partial rotary, MiniMax H3: 96 of 128) rotates the first R
    channels and passes the rest through, as comfy-kitchen's `rms_rope_split_half(..., rot_dim=R)` does.
    Returns the wider dtype of the two (the model's tables have its dtype: it rotates in that)."""
    rotated = 2 * freqs.shape[-3]
    if rotated < t.shape[-1]:
        dtype = torch.promote_types(t.dtype, freqs.dtype)
        return torch.cat((rope_split_half_rows(t[..., :rotated], freqs), t[..., rotated:].to(dtype)), dim=-1)
    pairs = t.unflatten(-1, (2, -1)).transpose(-2, -1).unsqueeze(-2)   # (B, n, h, D/2, 1, 2)
    out = freqs[..., 0] * pairs[..., 0]
    out.addcmul_(freqs[..., 1], pairs[..., 1])    # (B, n, h, D/2, 2): the rotated first and second halves
    return out.transpose(-2, -1).flatten(-2)


def rope_cos_sin_rows(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs from cos/sin tables with a value per channel (each pair's twice): a chunk
    `(B, n, h, D)` and tables `(B or 1, n, h, D)`: `t * cos + (-t[2i+1], t[2i]) * sin`."""
    pairs = t.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    out = t * cos
    return out.addcmul_(rotated, sin)


def rope_cos_sin_halves_rows(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the pairs (i, i + D/2) of each head from cos/sin tables: a chunk `(B, n, h, D)` and tables
    `(B or 1, n, h, D/2)`: first half `a cos - b sin`, second half `b cos + a sin`."""
    halves = t.unflatten(-1, (2, -1))
    out = halves * cos.unsqueeze(-2)
    out[..., 0, :].addcmul_(halves[..., 1, :], sin, value=-1)
    out[..., 1, :].addcmul_(halves[..., 0, :], sin)
    return out.flatten(-2)


def rope_cos_sin_pairs_rows(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs from per-pair tables (Mochi's `apply_rotary_emb_qk_real` math): a chunk `(B, n, h,
    D)` and tables `(n, h or 1, D/2)`: even `e cos - o sin`, odd `e sin + o cos`, in the wider dtype of the two
    (float32 tables: float32); returns a new tensor."""
    even, odd = t[..., 0::2], t[..., 1::2]
    first = even * cos - odd * sin
    second = even * sin + odd * cos
    return torch.stack((first, second), dim=-1).flatten(-2)


def rotate_rows(kind: str, freqs, t: torch.Tensor, a: int, b: int, heads: range) -> torch.Tensor:
    """The tokens [a, b) of the heads `heads` (`t`: `(B, b - a, len(heads), D)`) rotated by the RoPE `kind`,
    each table sliced to them: `ROPE_PAIRS` / `ROPE_SPLIT_HALF`: matrices `(B or 1, N, 1 or heads, D/2, 2, 2)`;
    `ROPE_COS_SIN`: `(cos, sin)` each `(B or 1, N, heads * D)`; `ROPE_COS_SIN_HALVES`: `(cos, sin)` each
    `(B or 1, heads, N, D/2)`. Returns a new tensor (float32 for float32 tables)."""
    d = t.shape[-1]
    if kind in (ROPE_PAIRS, ROPE_SPLIT_HALF):
        table = freqs[:, a:b]
        if table.shape[2] > 1:   # a rotation per head: the group's own
            table = table[:, :, heads.start:heads.stop]
        return (rope_rows if kind == ROPE_PAIRS else rope_split_half_rows)(t, table)
    cos, sin = freqs
    if kind == ROPE_COS_SIN:
        columns = slice(heads.start * d, heads.stop * d)
        return rope_cos_sin_rows(t, cos[:, a:b, columns].unflatten(-1, (len(heads), d)),
                                 sin[:, a:b, columns].unflatten(-1, (len(heads), d)))
    if kind == ROPE_COS_SIN_HALVES:
        return rope_cos_sin_halves_rows(t, cos[:, heads.start:heads.stop, a:b].transpose(1, 2),
                                        sin[:, heads.start:heads.stop, a:b].transpose(1, 2))
    if kind == ROPE_COS_SIN_PAIRS:
        return cos_sin_pairs_part(t, cos, sin, a, b, heads)
    raise ValueError(f"rope must be one of {ROPE_KINDS[1:]}, not {kind!r}")


def cos_sin_pairs_part(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, a: int, b: int,
                        heads: range) -> torch.Tensor:
    """`ROPE_COS_SIN_PAIRS` on the tokens [a, b) of the heads `heads`: the tables `(N_rot, heads or 1, D/2)` rotate
    the tokens under N_rot, the rest pass through (in the dtype the rotated ones take)."""
    rotated = max(0, min(b, cos.shape[0]) - a)
    if rotated == 0:
        return t
    if cos.shape[1] > 1:   # a rotation per head: the group's own
        cos, sin = cos[:, heads.start:heads.stop], sin[:, heads.start:heads.stop]
    out = rope_cos_sin_pairs_rows(t[:, :rotated], cos[a:a + rotated], sin[a:a + rotated])
    if rotated == t.shape[1]:
        return out
    return torch.cat((out, t[:, rotated:].to(out.dtype)), dim=1)


__all__ = ["NORM_PER_HEAD", "NORM_SPANS_HEADS", "NORM_KINDS", "ROPE_PAIRS", "ROPE_SPLIT_HALF", "ROPE_COS_SIN",
           "ROPE_COS_SIN_HALVES", "ROPE_COS_SIN_PAIRS", "PER_HEAD_ROPE_KINDS", "ROPE_KINDS", "rope_rows",
           "rope_split_half_rows", "rope_cos_sin_rows", "rope_cos_sin_halves_rows", "rope_cos_sin_pairs_rows",
           "cos_sin_pairs_part", "rotate_rows"]
