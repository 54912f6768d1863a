"""HiDream-I1 adapter (`comfy/ldm/hidream/model.py`): every `HiDreamAttention` of the double and single stream
blocks.

A double block's attention joins the image stream (`to_q/k/v`, norms `q_rms_norm` / `k_rms_norm`) and the text
stream (`to_q_t/k_t/v_t`, `q_rms_norm_t` / `k_rms_norm_t`) in the order [image, text]; a single block's has the
image stream alone (the text tokens are joined to it by the model). The q/k norms are RMSNorms over the whole
inner width (all heads: exact per head group through the runtime's per-token statistics, `NORM_SPANS_HEADS`),
then RoPE on adjacent pairs of every head's channels from ComfyUI's tables `(B, N, 1, D/2, 2, 2)`. Patched at
the attention (projection level: the head split through `nodes/attention.py`'s `attend()`, the output
projections by token chunks into the attention's own storage).

The blocks keep ComfyUI's forward (block bounds are reported as not applied): their feed-forward is a routed
mixture of experts that picks two of four experts per token from the block's residual. A bounded block would
change that residual by round-off (the output projection added in other chunks), and in 16 bits that flips the
routing of tokens near a tie between two experts: the block's output then differs from stock's by whole expert
outputs on those tokens (measured on an H200, 2048^2, bf16: up to 15% of the block's largest value, while the
pack's attention equals stock's to 4.7e-3), which no self-check can tell from a broken forward. The block's peak
stays the MoE's (15 x |x| at 2048^2); the attention's head split runs.

Left to ComfyUI (its forward runs, one log line): `image_tokens_masks` (a per-token key multiplier; ComfyUI's
model passes none), a RoPE table that does not cover each head's channels (the partial RoPE of other
configurations), another node's `attn1_patch` inside ComfyUI's attention call. Guarded and self-checked like
every forward of the pack (`compat.guard_module`).
"""
from __future__ import annotations

from typing import Optional

import torch

import comfy.ldm.hidream.model as hidream_model

from . import compat
from .attention import (AttentionForm, NORM_SPANS_HEADS, ROPE_PAIRS, StreamProjections, attend, attribute,
                        is_rms_norm)
from .block_parts import chunk_scale, output_projection_
from .comfy_ops import not_row_sliceable, quantizes_inputs
from .dispatch import attention_splits
from .family import MemoryFactors, patch_module

FAMILY = "HiDream"
# Not measured on a whole model: ComfyUI's own activation estimate is kept (the blocks' MoE feed-forward is
# ComfyUI's, so its peak stays).
MEMORY_FACTORS = MemoryFactors(split=1.0, unsplit=1.0, measured="not measured: ComfyUI's estimate kept")

IMAGE = StreamProjections(q="to_q", k="to_k", v="to_v", norm_q="q_rms_norm", norm_k="k_rms_norm")
TEXT = StreamProjections(q="to_q_t", k="to_k_t", v="to_v_t", norm_q="q_rms_norm_t", norm_k="k_rms_norm_t")
DOUBLE = AttentionForm(streams=(IMAGE, TEXT), norm=NORM_SPANS_HEADS, rope=ROPE_PAIRS)
SINGLE = AttentionForm(streams=(IMAGE,), norm=NORM_SPANS_HEADS, rope=ROPE_PAIRS)

HOOKS_RUN_INSIDE = ("attn1_patch",)   # ComfyUI's attention would call it on the whole joint q/k/v
ATTENTION_ARGS = ("norm_image_tokens", "image_tokens_masks", "norm_text_tokens", "rope", "transformer_options")
BLOCK_KINDS = (("double_stream_blocks", False), ("single_stream_blocks", True))
ATTENTION_KEPT_KEYS = 1.0


def _form(attn) -> AttentionForm:
    return SINGLE if attn.single else DOUBLE


def _head_dim(attn) -> int:
    return attn.inner_dim // attn.heads


# --- probes -------------------------------------------------------------------------------------------------
def _linear_out(module, name: str, features: int, inputs: int) -> Optional[str]:
    weight = getattr(attribute(module, name), "weight", None)
    if weight is None or weight.dim() != 2 or tuple(weight.shape) != (features, inputs):
        return f"{name} is not a Linear from {inputs} to {features} features"
    return None


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
    for stream in form.streams:
        for name in (stream.norm_q, stream.norm_k):
            if not is_rms_norm(attribute(attn, name), inner):
                return f"{name} is not an RMSNorm over {inner} channels"
    for name in ("to_out",) if attn.single else ("to_out", "to_out_t"):
        reason = _linear_out(attn, name, attn.out_dim, inner)
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
    scale = chunk_scale(attention_splits(config, attn.heads, norm_image_tokens.shape[0], tokens))
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


# --- guards ---------------------------------------------------------------------------------------------------
def _stock_functions(attn) -> tuple:
    return (type(attn).forward, type(attn.processor).__call__)


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
        reason = compat.hooks_refusal(bound.get("transformer_options"), HOOKS_RUN_INSIDE)
        if reason is not None:
            return reason
        if bound.get("image_tokens_masks") is not None:
            return "image_tokens_masks (a per-token key multiplier; ComfyUI's model passes none)"
        img, txt = bound["norm_image_tokens"], bound.get("norm_text_tokens")
        if not attn.single and (not torch.is_tensor(txt) or txt.dim() != 3 or txt.shape[0] != img.shape[0]):
            return "no text stream (batch, tokens, width)"
        tokens = img.shape[1] + (0 if attn.single else txt.shape[1])
        return rope_refusal(bound.get("rope"), tokens, _head_dim(attn))
    return refuse


def _signature(attn, config, bound: dict) -> tuple:
    img, rope = bound["norm_image_tokens"], bound.get("rope")
    options = bound.get("transformer_options") or {}
    return ("attention", _stock_functions(attn), compat.layers_signature(attn), img.dtype, img.device.type,
            config, compat.hooks_set(options), "optimized_attention_override" in options,
            None if rope is None else (rope.dtype, rope.shape[0]))


def _check_inputs(attn):
    def check(bound: dict) -> dict:
        """The call's check inputs: its first image tokens (and the first text tokens), with their RoPE rows."""
        img, txt, rope = bound["norm_image_tokens"], bound.get("norm_text_tokens"), bound["rope"]
        n = compat.check_tokens(img.shape[1])
        out = dict(bound)
        out["norm_image_tokens"] = img[:, :n].clone()
        rows = torch.arange(n)
        if not attn.single:
            m = min(txt.shape[1], max(1, compat.CHECK_TOKENS // 4))
            out["norm_text_tokens"] = txt[:, :m].clone()
            rows = torch.cat((rows, img.shape[1] + torch.arange(m)))
        out["rope"] = rope.index_select(1, rows.to(rope.device))
        out["transformer_options"] = compat.probe_options(bound.get("transformer_options") or {})
        return out
    return check


def attention_forward(attn, config):
    """The guarded forward installed on a `HiDreamAttention`."""
    def ours_factory(module, config):
        def forward(*args, **kwargs):
            return run_attention(module, config, **compat.bind_args(ATTENTION_ARGS, args, kwargs))
        return forward
    return compat.guard_module(
        f"{FAMILY} attention", attn, ATTENTION_ARGS, ours_factory, config,
        functions=lambda: _stock_functions(attn), signature=lambda bound: _signature(attn, config, bound),
        check_inputs=_check_inputs(attn), quantized=lambda: quantizes_inputs(attn), refuse_call=_refuse_call(attn))


# --- the adapter contract (nodes/family.py) ---------------------------------------------------------------------
def _attentions(model):
    """(path, attention) of every block, double stream blocks first."""
    for name, _ in BLOCK_KINDS:
        blocks = getattr(model, name, None)
        if not isinstance(blocks, torch.nn.ModuleList):
            continue
        for index, wrapper in enumerate(blocks):
            attn = getattr(getattr(wrapper, "block", None), "attn1", None)
            if isinstance(attn, hidream_model.HiDreamAttention):
                yield f"diffusion_model.{name}.{index}.block.attn1", attn


def matches(diffusion_model) -> bool:
    """A HiDream-I1 model: its blocks' attention is `HiDreamAttention`."""
    return isinstance(diffusion_model, hidream_model.HiDreamImageTransformer2DModel) and \
        next(_attentions(diffusion_model), None) is not None


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone): every attention that probes clean. The blocks keep ComfyUI's
    forward (reported when block bounds were asked for)."""
    model = patcher.model.diffusion_model
    for path, attn in _attentions(model):
        patch_module(patcher, report, FAMILY, path, "attention", lambda attn=attn: attention_forward(attn, config),
                     lambda attn=attn: probe_attention(attn))
    if config.block:
        report.skipped(FAMILY, "blocks (block)", "the blocks keep ComfyUI's forward: their feed-forward routes "
                                                 "tokens to experts, which round-off would flip (the attention is "
                                                 "patched)")


def stock_functions(diffusion_model) -> set:
    functions = set()
    for _, attn in _attentions(diffusion_model):
        functions.update(_stock_functions(attn))
    return functions


def tokens_per_item(diffusion_model, latent_shape) -> Optional[int]:
    """Image tokens of one batch item for a latent `(B, C, H, W)` (the text comes on top; not known here)."""
    if latent_shape is None or len(latent_shape) != 4:
        return None
    step = int(getattr(diffusion_model, "patch_size", 2))
    return -(-int(latent_shape[-2]) // step) * -(-int(latent_shape[-1]) // step)


def kv_heads(diffusion_model) -> Optional[int]:
    attn = next(_attentions(diffusion_model), (None, None))[1]
    return None if attn is None else attn.heads


def splits_projections(diffusion_model) -> Optional[str]:
    attn = next(_attentions(diffusion_model), (None, None))[1]
    if attn is None:
        return "no attention"
    for name in ("to_q", "to_k", "to_v"):
        reason = not_row_sliceable(getattr(attn, name, None))
        if reason is not None:
            return f"{name}: {reason}"
    return None
