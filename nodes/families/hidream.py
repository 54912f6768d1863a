"""HiDream-I1 adapter (`comfy/ldm/hidream/model.py`): every `HiDreamAttention` of the double and single stream
blocks.

A double block's attention joins the image stream (`to_q/k/v`, norms `q_rms_norm` / `k_rms_norm`) and the text
stream (`to_q_t/k_t/v_t`, `q_rms_norm_t` / `k_rms_norm_t`) in the order [image, text]; a single block's has the
image stream alone (the text tokens are joined to it by the model). The q/k norms are RMSNorms over the whole
inner width (all heads: exact per head group through the runtime's per-token statistics, `NORM_SPANS_HEADS`),
then RoPE on adjacent pairs of every head's channels from ComfyUI's tables `(B, N, 1, D/2, 2, 2)`. Patched at
the attention (projection level: the head split through `nodes/attention.py`'s `attend()`, the output
projections by token chunks into the attention's own storage).

With block bounds on, the double and single blocks are bounded too: each stream's modulated input is made by
token chunks and handed off to the runtime, the output projections add into the residual by token chunks, and
the feed-forwards run by token chunks: the text stream's SwiGLU cast once, the image stream's routed mixture of
experts computed as ComfyUI's `MOEFeedForwardSwiGLU` computes it, within a budget (`hidream_moe.py`). The residual
updates go into a new tensor per stream (ComfyUI's block does not write its inputs). Routing makes the block
sensitive to round-off: in 16 bits a token near a tie between two experts may take the other one (the whole block
then differs on that token by an expert's output, as it does between ComfyUI's own attention kernels), so the
block's self-check leaves out the 2% of its check tokens farthest from stock (`compat.compare(routed=True)`).

Left to ComfyUI (its forward runs, one log line): `image_tokens_masks` (a per-token key multiplier; ComfyUI's
model passes none), a RoPE table that does not cover each head's channels (the partial RoPE of other
configurations), another node's `attn1_patch` inside ComfyUI's attention call. Guarded and self-checked like
every forward of the pack (`compat.guard_module`).
"""
from __future__ import annotations

from typing import Optional

import torch

import comfy.ldm.hidream.model as hidream_model

from .. import compat
from ..attention import AttentionForm, NORM_SPANS_HEADS, ROPE_PAIRS, StreamProjections, attend
from ..block_parts import SWIGLU, chunk_scale, foreign_part, output_projection_, projection_residual_
from .family import TEXT_CHECK_TOKENS, BlockList, Family, probe_linear, probe_norms
from .hidream_moe import add_gated, feed_forward_, is_moe, modulate_, moe_functions

FAMILY = "HiDream"

IMAGE = StreamProjections(q="to_q", k="to_k", v="to_v", norm_q="q_rms_norm", norm_k="k_rms_norm")
TEXT = StreamProjections(q="to_q_t", k="to_k_t", v="to_v_t", norm_q="q_rms_norm_t", norm_k="k_rms_norm_t")
DOUBLE = AttentionForm(streams=(IMAGE, TEXT), norm=NORM_SPANS_HEADS, rope=ROPE_PAIRS)
SINGLE = AttentionForm(streams=(IMAGE,), norm=NORM_SPANS_HEADS, rope=ROPE_PAIRS)

HOOKS_RUN_INSIDE = ("attn1_patch",)   # ComfyUI's attention would call it on the whole joint q/k/v
ATTENTION_ARGS = ("norm_image_tokens", "image_tokens_masks", "norm_text_tokens", "rope", "transformer_options")
BLOCK_ARGS = ("image_tokens", "image_tokens_masks", "text_tokens", "adaln_input", "rope", "transformer_options")
# Keys kept from the spanning norm's statistics pass: all of them with the attention patched alone (the block's
# peak is then its MoE feed-forward's, far above the attention's), 10% in the bounded block: in its 10 groups
# (group_scale 0.5) keeping 30% (as Wan's and LTX's) puts the double block over the level's peak, and keeping none
# costs time (docs/benchmarks.md#families).
ATTENTION_KEPT_KEYS = 1.0
BLOCK_KEPT_KEYS = 0.1


class _HiDream(Family):
    def functions(self, module) -> tuple:
        """ComfyUI's functions the pack's forward of `module` stands in for: an attention's forward and its
        processor's; a block's, its attention's and its feed-forwards' (`hidream_moe.moe_functions`)."""
        if isinstance(module, hidream_model.HiDreamAttention):
            return (type(module).forward, type(module.processor).__call__)
        functions = (type(module).forward,) + self.functions(module.attn1)
        for name in ("ff_i", "ff_t"):
            ff = getattr(module, name, None)
            if ff is not None:
                functions += moe_functions(ff)
        return tuple(dict.fromkeys(functions))


def _has_attention(block) -> bool:
    return isinstance(getattr(block, "attn1", None), hidream_model.HiDreamAttention)


# The double stream blocks, then the single ones (each entry wraps its block): attention and block patched.
SPEC = _HiDream(FAMILY, "hidream", tuple(BlockList(name, inner="block", accepts=_has_attention)
                                         for name in ("double_stream_blocks", "single_stream_blocks")),
                latent_ranks=(4,), kv_heads_at="block.attn1.heads", projections=("attn1", ("to_q", "to_k", "to_v"), ""),
                attentions=("attn1",), patch_parts=("attn1",), model_class=hidream_model.HiDreamImageTransformer2DModel)


def _form(attn) -> AttentionForm:
    return SINGLE if attn.single else DOUBLE


def _head_dim(attn) -> int:
    return attn.inner_dim // attn.heads


# --- probes -------------------------------------------------------------------------------------------------
def probe_attention(attn) -> Optional[str]:
    """None when a `HiDreamAttention` has the structure the pack's forward uses."""
    heads, inner = getattr(attn, "heads", None), getattr(attn, "inner_dim", None)
    if not isinstance(heads, int) or not isinstance(inner, int) or heads <= 0 or inner % heads:
        return "no heads / inner_dim, or inner_dim not a multiple of heads"
    if _head_dim(attn) % 2:
        return "an odd head dim"
    if not isinstance(attn.processor, hidream_model.HiDreamAttnProcessor_flashattn):
        return f"its processor is {type(attn.processor).__name__}, not ComfyUI's"
    form = _form(attn)
    reason = form.probe(attn, heads, _head_dim(attn))
    if reason:
        return reason
    reason = probe_norms(attn, [name for stream in form.streams for name in (stream.norm_q, stream.norm_k)], inner)
    if reason:
        return reason
    for name in ("to_out",) if attn.single else ("to_out", "to_out_t"):
        reason = probe_linear(attn, name, attn.out_dim, inner)
        if reason:
            return reason
    return None


# --- the forward --------------------------------------------------------------------------------------------
def run_attention(attn, config, norm_image_tokens, image_tokens_masks=None, norm_text_tokens=None, rope=None,
                  transformer_options={}):
    """`HiDreamAttention.forward`: the image output `(B, N_img, C)` of a single block's attention, or (image,
    text) outputs of a double block's (views of one buffer: the output projections write back into the
    attention's storage). `rope`: pair-RoPE matrices `(B or 1, N_img + N_txt, 1, D/2, 2, 2)` over the joined
    tokens (the runtime's layout already). (`image_tokens_masks` is refused by the guard.)"""
    image_tokens = norm_image_tokens.shape[1]
    tokens = image_tokens + (0 if attn.single else norm_text_tokens.shape[1])
    scale = chunk_scale(config.policy, attn.heads, tokens)
    x_lists = [[norm_image_tokens]] if attn.single else [[norm_image_tokens], [norm_text_tokens]]
    del norm_image_tokens, norm_text_tokens   # the runtime holds the only references: each freed once projected
    # every group's keys kept from the spanning norm's statistics pass (each k projected once): the block's
    # peak is its MoE feed-forward's, far above the attention's
    attention = attend(attn, _form(attn), x_lists, attn.heads, _head_dim(attn), config, transformer_options,
                       freqs=rope, keep_keys=ATTENTION_KEPT_KEYS)
    if attn.single:
        return output_projection_(attn.to_out, attention, scale=scale)
    flat = attention.flatten(2)
    del attention
    return (output_projection_(attn.to_out, flat[:, :image_tokens], scale=scale),
            output_projection_(attn.to_out_t, flat[:, image_tokens:], scale=scale))


# --- the bounded block ------------------------------------------------------------------------------------------
def probe_block(block) -> Optional[str]:
    """None when a HiDream double or single transformer block has the structure the bounded forward uses."""
    single = isinstance(block, hidream_model.HiDreamImageSingleTransformerBlock)
    if not single and not isinstance(block, hidream_model.HiDreamImageTransformerBlock):
        return f"{type(block).__name__} is not a HiDream transformer block"
    attn = getattr(block, "attn1", None)
    if attn is None or bool(attn.single) != single:
        return "attn1 is not this block's kind of attention"
    reason = probe_attention(attn)
    if reason:
        return f"attn1: {reason}"
    width = attn.inner_dim
    if attn.out_dim != width:
        return "the attention's width is not the block's"
    mod = getattr(block, "adaLN_modulation", None)
    count = 6 if single else 12
    if not isinstance(mod, torch.nn.Sequential) or len(mod) != 2 or \
            tuple(getattr(mod[1], "weight", torch.empty(0)).shape) != (count * width, width):
        return f"adaLN_modulation is not SiLU, Linear to {count} x width"
    for name in ("norm1_i", "norm3_i") if single else ("norm1_i", "norm3_i", "norm1_t", "norm3_t"):
        norm = getattr(block, name, None)
        if not isinstance(norm, torch.nn.LayerNorm) or norm.elementwise_affine:
            return f"{name} is not a LayerNorm without weights"
    for name in ("ff_i",) if single else ("ff_i", "ff_t"):
        ff = getattr(block, name, None)
        if not is_moe(ff) and SWIGLU.linears(ff) is None:
            return f"{name} is neither HiDream's mixture of experts nor a SwiGLU"
    return None


def _modulated_input(norm, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`norm(x) * (1 + scale) + shift` in a fresh tensor with the block's own operations (its roundings), the
    product and the sum in place on the norm's output: three launches, no transient beside the result."""
    return modulate_(norm(x).to(dtype=x.dtype), 1 + scale, shift)


def run_block(block, config, image_tokens, image_tokens_masks=None, text_tokens=None, adaln_input=None, rope=None,
              transformer_options={}):
    """The bounded forward of a HiDream double block (returns (image, text)) or single block (returns image):
    new tensors; the inputs are not written. (`image_tokens_masks` is refused by the guard.)"""
    attn = block.attn1
    single = bool(attn.single)
    mods = block.adaLN_modulation(adaln_input)[:, None].chunk(6 if single else 12, dim=-1)
    streams = [(image_tokens, block.norm1_i, block.norm3_i, block.ff_i, mods[:6])]
    if not single:
        streams.append((text_tokens, block.norm1_t, block.norm3_t, block.ff_t, mods[6:]))
    tokens = sum(x.shape[1] for x, *_ in streams)
    chunks = chunk_scale(config.policy, attn.heads, tokens)
    handed_off = [[_modulated_input(norm1, x, m[0], m[1])] for x, norm1, _, _, m in streams]
    attention = attend(attn, _form(attn), handed_off, attn.heads, _head_dim(attn), config, transformer_options,
                       freqs=rope, keep_keys=BLOCK_KEPT_KEYS).flatten(2)
    outs, start = [], 0
    for (x, _, _, _, m), to_out in zip(streams, ("to_out", "to_out_t")):
        out = x.clone()   # the stream's output: the updates are added into it in place
        projection_residual_(out, getattr(attn, to_out), attention[:, start:start + x.shape[1]], add_gated(m[2]),
                             scale=chunks)
        start += x.shape[1]
        outs.append(out)
    del attention, streams[:]
    image = outs[0]
    feed_forward_(image, block.norm3_i, block.ff_i, mods[3], mods[4], mods[5], chunks)
    if single:
        return image
    feed_forward_(outs[1], block.norm3_t, block.ff_t, mods[9], mods[10], mods[11], chunks)
    return image, outs[1]


# --- guards and the adapter contract (family.py) ---------------------------------------------------------------
def rope_refusal(rope, tokens: int, head_dim: int) -> Optional[str]:
    """Why a call's `rope` cannot be taken (None when it can): pair matrices over every joined token, shared by
    the heads, that rotate every channel of a head."""
    if rope is None:
        return "no RoPE table"
    if not torch.is_tensor(rope) or rope.dim() != 6 or tuple(rope.shape[-2:]) != (2, 2) or rope.shape[2] != 1:
        return f"a RoPE table of shape {tuple(getattr(rope, 'shape', ()))} (the pack takes (B, N, 1, D/2, 2, 2))"
    if rope.shape[1] != tokens:
        return f"a RoPE table over {rope.shape[1]} tokens for {tokens}"
    if rope.shape[-3] * 2 != head_dim:
        return (f"RoPE over {rope.shape[-3] * 2} of the head's {head_dim} channels (partial RoPE: ComfyUI's "
                f"forward rotates the first ones)")
    return None


def _refuse_call(attn):
    def refuse(bound) -> Optional[str]:
        if bound.get("image_tokens_masks") is not None:
            return "image_tokens_masks (a per-token key multiplier; ComfyUI's model passes none)"
        img, txt = bound["norm_image_tokens"], bound.get("norm_text_tokens")
        if not attn.single and (not torch.is_tensor(txt) or txt.dim() != 3 or txt.shape[0] != img.shape[0]):
            return "no text stream (batch, tokens, width)"
        tokens = img.shape[1] + (0 if attn.single else txt.shape[1])
        return rope_refusal(bound.get("rope"), tokens, _head_dim(attn))
    return refuse


def _extra(bound: dict) -> tuple:
    rope = bound.get("rope")
    return (None if rope is None else (rope.dtype, rope.shape[0]),)


def _check_inputs(attn):
    def check(bound: dict) -> dict:
        """The call's check inputs: its first image tokens (and the first text tokens), with their RoPE rows."""
        img, txt, rope = bound["norm_image_tokens"], bound.get("norm_text_tokens"), bound["rope"]
        n = compat.check_tokens(img.shape[1])
        out = dict(bound)
        out["norm_image_tokens"] = img[:, :n].clone()
        rows = torch.arange(n)
        if not attn.single:
            m = min(txt.shape[1], TEXT_CHECK_TOKENS)
            out["norm_text_tokens"] = txt[:, :m].clone()
            rows = torch.cat((rows, img.shape[1] + torch.arange(m)))
        out["rope"] = rope.index_select(1, rows.to(rope.device))
        out["transformer_options"] = compat.probe_options(bound.get("transformer_options") or {})
        return out
    return check


def _refuse_block(block):
    attention = _refuse_call(block.attn1)

    def refuse(bound) -> Optional[str]:
        if not torch.is_tensor(bound.get("adaln_input")):
            return "no adaln_input"
        return attention({"norm_image_tokens": bound["image_tokens"], "norm_text_tokens": bound.get("text_tokens"),
                          "image_tokens_masks": bound.get("image_tokens_masks"), "rope": bound.get("rope"),
                          "transformer_options": bound.get("transformer_options")})
    return refuse


def _check_block(block):
    check_attention = _check_inputs(block.attn1)

    def check(bound: dict) -> dict:
        """The call's first image (and text) tokens with their RoPE rows, the modulation input whole."""
        cut = check_attention({"norm_image_tokens": bound["image_tokens"],
                               "norm_text_tokens": bound.get("text_tokens"), "rope": bound["rope"],
                               "transformer_options": bound.get("transformer_options")})
        out = dict(bound)
        out.update(image_tokens=cut["norm_image_tokens"], rope=cut["rope"],
                   transformer_options=cut["transformer_options"])
        if not block.attn1.single:
            out["text_tokens"] = cut["norm_text_tokens"]
        return out
    return check


def block_forward(block, config):
    """The guarded bounded forward installed on a HiDream double or single transformer block."""
    return SPEC.guard("block", "block", block, BLOCK_ARGS, run_block, config, x="image_tokens", extra=_extra,
                      check_inputs=_check_block(block),
                      residual="image_tokens" if block.attn1.single else ("image_tokens", "text_tokens"),
                      hooks_inside=HOOKS_RUN_INSIDE, refuse_call=_refuse_block(block), refuse_more=foreign_part,
                      routed=True)


def attention_forward(attn, config):
    """The guarded forward installed on a `HiDreamAttention`."""
    return SPEC.guard("attention", "attention", attn, ATTENTION_ARGS, run_attention, config, x="norm_image_tokens",
                      extra=_extra, check_inputs=_check_inputs(attn), hooks_inside=HOOKS_RUN_INSIDE,
                      refuse_call=_refuse_call(attn))


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone): every attention that probes clean; with block bounds, every block
    too (its attention patch then serves the calls the block hands to ComfyUI's own forward)."""
    SPEC.patch(patcher, config, report, attention=(attention_forward, probe_attention),
               block=(block_forward, probe_block))


matches, stock_functions, tokens_per_item, kv_heads, splits_projections, block_kinds = SPEC.contract()
