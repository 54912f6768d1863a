"""CogVideoX adapter (`comfy/ldm/cogvideo/model.py`: CogVideoX 2B / 5B, 1.5 5B, I2V and Fun inpainting): its
`CogVideoXBlock`s.

A block attends one joint sequence, the text then the video tokens, through `q`, `k`, `v` Linears over both,
LayerNorms over each head's channels (`norm_q`, `norm_k`) and, for the RoPE checkpoints (5B, 1.5), rotation of the
video tokens' adjacent channel pairs by `(cos, sin)` tables in float32. The attention lives in the block's own
forward, so the block is what is patched (always, as Flux's single block): the modulated joint input (the block's
`norm1`: one LayerNorm, each stream its shift and scale) is made by token chunks and handed off to the runtime
(head split, each group's q/k/v from its rows of the weights, its LayerNorm and RoPE: the tables as pair rotations,
the text tokens' the identity). With block bounds on, the output projection and the gated residuals run by token
chunks into one new joint buffer (ComfyUI's block does not write its inputs; the two streams it returns are views
of it), then the feed-forward (tanh GELU) by token chunks, its weights cast once; with block bounds off, the rest
as ComfyUI's block computes it.

Guarded and self-checked like every forward of the pack (`compat.guard_module`), on the call's first video tokens
with the whole text. ComfyUI's CogVideoX calls no q/k/v hooks of other nodes.
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    import comfy.ldm.cogvideo.model as cogvideo_model
except ImportError:   # a ComfyUI from before CogVideoX (v0.8.0 and older): nothing matches
    cogvideo_model = None

from ..attention import AttentionForm, NORM_PER_HEAD, ROPE_PAIRS, StreamProjections, attend
from ..block_parts import foreign_part, mlp_residual_, projection_residual_
from ..comfy_ops import chunk_tokens, token_ranges
from .family import BlockList, Family, probe_linear, unsliceable_projection

FAMILY = "CogVideoX"

FORM = AttentionForm(streams=(StreamProjections(q="q", k="k", v="v", norm_q="norm_q", norm_k="norm_k"),),
                     norm=NORM_PER_HEAD, rope=ROPE_PAIRS)
BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "transformer_options")
PROJECTIONS = ("q", "k", "v")


class _CogVideoX(Family):
    def splits_projections(self, diffusion_model) -> Optional[str]:
        """The block's own q/k/v Linears (the attention is the block's)."""
        return unsliceable_projection(self.first(diffusion_model), PROJECTIONS)


SPEC = _CogVideoX(FAMILY, "cogvideox",
                  (BlockList("blocks", cls=getattr(cogvideo_model, "CogVideoXBlock", None) or type(None)),),
                  latent_ranks=(5,), patch_size=("patch_size_t", "patch_size", "patch_size"),
                  kv_heads_at="block.num_heads", blocks_always=True, stock_parts=("norm1",), patch_parts=None)


# --- probes -----------------------------------------------------------------------------------------------------
def probe_block(block) -> Optional[str]:
    """None when a `CogVideoXBlock` has the structure the pack's forward uses (whether it computes the same is the
    self-check's job)."""
    heads, head_dim = getattr(block, "num_heads", None), getattr(block, "head_dim", None)
    if not isinstance(heads, int) or not isinstance(head_dim, int) or head_dim % 2:
        return "no num_heads/head_dim (an even head_dim: RoPE rotates pairs)"
    width = heads * head_dim
    reason = FORM.probe(block, heads, head_dim) or probe_linear(block, "attn_out", block.dim, width)
    if reason:
        return reason
    for name in ("norm_q", "norm_k"):
        weight = getattr(getattr(block, name, None), "weight", None)
        if weight is not None and tuple(weight.shape) != (head_dim,):
            return f"{name} is not a norm over {head_dim} channels"
    for name in ("norm1", "norm2"):
        zero = getattr(block, name, None)
        if not isinstance(zero, cogvideo_model.CogVideoXLayerNormZero) or \
                probe_linear(zero, "linear", 6 * block.dim) is not None:
            return f"its {name} is not a CogVideoXLayerNormZero of six modulations"
    return probe_linear(block, "ff_proj", getattr(getattr(block, "ff_proj", None), "out_features", 0), block.dim) \
        or probe_linear(block, "ff_out", block.dim)


# --- the block --------------------------------------------------------------------------------------------------
def pair_rotations(rotary, text: int, dtype=torch.float32) -> Optional[torch.Tensor]:
    """CogVideoX's RoPE `(cos, sin)`, each `(video tokens, head_dim)` with every pair's value twice, as the
    runtime's pair rotations `(1, text + video tokens, 1, head_dim / 2, 2, 2)` float32: the text tokens' the
    identity (ComfyUI rotates the video tokens alone). None for None."""
    if rotary is None:
        return None
    cos, sin = (t[:, 0::2].to(dtype) for t in rotary)
    table = torch.zeros(1, text + cos.shape[0], 1, cos.shape[1], 2, 2, dtype=dtype, device=cos.device)
    table[0, :text, 0, :, 0, 0] = 1
    table[0, :text, 0, :, 1, 1] = 1
    video = table[0, text:, 0]
    video[..., 0, 0] = cos
    video[..., 0, 1] = -sin
    video[..., 1, 0] = sin
    video[..., 1, 1] = cos
    return table


def _modulations(zero, temb):
    """CogVideoXLayerNormZero's six modulations, each `(B, 1, C)`: shift, scale, gate, and the text's."""
    return [m[:, None, :] for m in zero.linear(zero.silu(temb)).chunk(6, dim=1)]


def _stream_ranges(a: int, b: int, text: int):
    """(start, stop, stream) of the parts of the joint tokens [a, b): stream 1 for the text, 0 for the video."""
    if a < text:
        yield a, min(b, text), 1
    if b > text:
        yield max(a, text), b, 0


def modulated_joint(zero, streams: tuple, shifts, scales) -> torch.Tensor:
    """ComfyUI's `CogVideoXLayerNormZero` of the joint tokens [text | video] in a new tensor `(B, text + N, C)`:
    `streams` (video, text) `(B, n, C)`, each by its own shift and scale (index 0 the video's, 1 the text's), by
    token chunks."""
    video, text = streams
    out = video.new_empty(video.shape[0], text.shape[1] + video.shape[1], video.shape[2])
    step = chunk_tokens(video.shape[1], video.shape[0] * video.shape[2], max(1, video.numel() // 8))
    for stream, x, start in ((1, text, 0), (0, video, text.shape[1])):
        for a, b in token_ranges(x.shape[1], step):
            out[:, start + a:start + b] = zero.norm(x[:, a:b]) * (1 + scales[stream]) + shifts[stream]
    return out


def run_block(block, config, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
              transformer_options=None):
    """`CogVideoXBlock.forward` with the attention's transients bounded (and with block bounds, the rest too);
    returns (video, text), views of one new joint buffer."""
    options = transformer_options or {}
    text = encoder_hidden_states.shape[1]
    shift, scale, gate, enc_shift, enc_scale, enc_gate = _modulations(block.norm1, temb)
    streams = (hidden_states, encoder_hidden_states)
    handed_off = [modulated_joint(block.norm1, streams, (shift, enc_shift), (scale, enc_scale))]
    heads = attend(block, FORM, [handed_off], block.num_heads, block.head_dim, config, options,
                   freqs=pair_rotations(image_rotary_emb, text))
    attended = heads.flatten(2)
    del heads
    # the block's output buffer from here on, once the modulated input is gone
    joint = torch.cat((encoder_hidden_states, hidden_states), dim=1)
    gates = (gate, enc_gate)

    def add_gated(part, update, a, b):
        for lo, hi, stream in _stream_ranges(a, b, text):
            part[:, lo - a:hi - a] += gates[stream] * update[:, lo - a:hi - a]

    if not config.block:   # the rest as ComfyUI's block computes it
        add_gated(joint, block.attn_out(attended), 0, joint.shape[1])
        del attended
        shift, scale, gate, enc_shift, enc_scale, enc_gate = _modulations(block.norm2, temb)
        ff_input = modulated_joint(block.norm2, (joint[:, text:], joint[:, :text]), (shift, enc_shift),
                                   (scale, enc_scale))
        gates = (gate, enc_gate)
        add_gated(joint, block.ff_out(torch.nn.functional.gelu(block.ff_proj(ff_input), approximate="tanh")), 0,
                  joint.shape[1])
        return joint[:, text:], joint[:, :text]
    projection_residual_(joint, block.attn_out, attended, add_gated)
    del attended
    shift, scale, gate, enc_shift, enc_scale, enc_gate = _modulations(block.norm2, temb)
    gates = (gate, enc_gate)

    def ffn_input(a, b):
        out = torch.empty_like(joint[:, a:b])
        for lo, hi, stream in _stream_ranges(a, b, text):
            out[:, lo - a:hi - a] = block.norm2.norm(joint[:, lo:hi]) * (1 + (scale, enc_scale)[stream]) + \
                (shift, enc_shift)[stream]
        return out

    mlp = torch.nn.Sequential(block.ff_proj, torch.nn.GELU(approximate="tanh"), block.ff_out)
    mlp_residual_(joint, mlp, ffn_input, add_gated)
    return joint[:, text:], joint[:, :text]


# --- guards and the adapter contract (family.py) ----------------------------------------------------------------
def _rotary_rows(bound: dict, n: int, tokens: int) -> dict:
    """The check's RoPE rows: those of its first video tokens."""
    return {"image_rotary_emb": lambda rotary: tuple(t[:n].clone() for t in rotary)}


def _extra(bound: dict) -> tuple:
    rotary = bound.get("image_rotary_emb")
    return (None if rotary is None else tuple((t.dim(), t.dtype) for t in rotary),
            bound["encoder_hidden_states"].dtype)


def block_forward(block, config):
    """The guarded forward installed on a `CogVideoXBlock` (bounded with block bounds on)."""
    return SPEC.guard("block", "block", block, BLOCK_ARGS, run_block, config, x="hidden_states", extra=_extra,
                      cut=_rotary_rows, residual=("hidden_states", "encoder_hidden_states"),
                      refuse_more=foreign_part)


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone): every block that probes clean (its attention is the block's own, so
    with block bounds off too). A block another node patched keeps that patch."""
    SPEC.patch(patcher, config, report, block=(block_forward, probe_block))


matches, stock_functions, tokens_per_item, kv_heads, splits_projections, block_kinds = SPEC.contract()
