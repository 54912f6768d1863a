"""Kandinsky 5 adapter (`comfy/ldm/kandinsky5/model.py`: Kandinsky 5 video Lite / Pro and Kandinsky 5 image): its
`SelfAttention` and `TransformerDecoderBlock`.

The self-attention: `to_query`, `to_key`, `to_value` Linears, RMSNorm over each head's channels (`query_norm`,
`key_norm`) and RoPE on adjacent pairs in float32 (ComfyUI's `apply_rope1`), one stream: it runs through
`nodes/attention.py` (head split, q/k/v of each head group from that group's weight rows). Patched always, in
the visual (decoder) and the text (encoder) blocks. The cross-attention (queries of the visual tokens, keys
and values of the text) stays ComfyUI's: its keys and values are short.

With block bounds on, `TransformerDecoderBlock.forward` as well: the modulated input (norm, shift, scale) is made
by token chunks and handed off to the runtime, the self-attention's output projection runs into a fresh tensor
that becomes the block's output (ComfyUI's block does not write its input), the gated residual is added by token
chunks, then the cross-attention (ComfyUI's own module, on each chunk of queries: each query's attention over
the text is its own) and the feed-forward by token chunks (its layers cast once), each added into the output
in place with ComfyUI's own `apply_scale_shift_norm` / `apply_gate_sum`. The text (encoder) blocks run as
ComfyUI's: text is short.

Guarded and self-checked like every forward of the pack (`compat.guard_module`). ComfyUI's Kandinsky 5 calls no
q/k/v hooks of other nodes; `patches_replace["dit"]` blocks call the block's forward, whichever is installed.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

try:
    import comfy.ldm.kandinsky5.model as kandinsky_model
except ImportError:   # a ComfyUI from before Kandinsky 5 (v0.3.x): nothing matches
    kandinsky_model = None

from ..attention import AttentionForm, NORM_PER_HEAD, ROPE_PAIRS, StreamProjections, attend, is_rms_norm
from ..block_parts import foreign_part, mlp_residual_
from ..comfy_ops import chunk_tokens, linear_handed_off, token_ranges
from .family import BlockList, Family, layout, probe_part

FAMILY = "Kandinsky5"
# The text blocks' self-attention is patched, the visual blocks bounded whole (their parts: every child).
SPEC = Family(FAMILY, "kandinsky5", (BlockList("text_transformer_blocks"), BlockList("visual_transformer_blocks")),
              patch_default=(1, 2, 2), kv_heads_at="block.self_attention.num_heads",
              projections=("self_attention", ("to_query", "to_key", "to_value"), ""), attentions=("self_attention",),
              attention_cls=getattr(kandinsky_model, "SelfAttention", None), attention_label="self-attention",
              bounded=lambda block: kandinsky_model is not None and isinstance(
                  block, kandinsky_model.TransformerDecoderBlock),
              stock_parts=("self_attention", "cross_attention", "feed_forward"), patch_parts=None,
              names=("Kandinsky 5",))

SELF_ATTENTION = AttentionForm(streams=(StreamProjections(q="to_query", k="to_key", v="to_value",
                                                          norm_q="query_norm", norm_k="key_norm"),),
                               norm=NORM_PER_HEAD, rope=ROPE_PAIRS)

# The arguments of ComfyUI's forwards the pack's take (a ComfyUI whose forward has others is left stock).
ATTENTION_ARGS = ("x", "freqs", "transformer_options")
BLOCK_ARGS = ("visual_embed", "text_embed", "time_embed", "freqs", "transformer_options")


# --- probes -----------------------------------------------------------------------------------------------------
def _takes(module, names: tuple) -> Optional[str]:
    """None when the module's own (class) forward takes exactly `names`, else why not."""
    takes = tuple(inspect.signature(type(module).forward).parameters)[1:]
    if takes != names:
        return f"its forward takes ({', '.join(takes)}), the pack's ({', '.join(names)})"
    return None


def probe_attention(attention) -> Optional[str]:
    """None when a `SelfAttention` has the structure the pack's forward uses (whether it computes the same is
    the self-check's job)."""
    reason = _takes(attention, ATTENTION_ARGS)
    if reason:
        return reason
    heads, head_dim = getattr(attention, "num_heads", None), getattr(attention, "head_dim", None)
    if not isinstance(heads, int) or not isinstance(head_dim, int) or heads <= 0 or head_dim % 2:
        return "no num_heads/head_dim (an even head_dim: RoPE rotates pairs)"
    reason = SELF_ATTENTION.probe(attention, heads, head_dim)
    if reason:
        return reason
    if not all(is_rms_norm(norm, head_dim) for norm in (attention.query_norm, attention.key_norm)):
        return f"query_norm/key_norm are not RMSNorms over {head_dim} channels"
    weight = getattr(getattr(attention, "out_layer", None), "weight", None)
    if weight is None or weight.dim() != 2 or weight.shape[1] != heads * head_dim:
        return f"out_layer is not a Linear from {heads * head_dim} features"
    return None


def probe_block(block) -> Optional[str]:
    """None when a `TransformerDecoderBlock` has the structure the bounded forward uses."""
    reason = _takes(block, BLOCK_ARGS)
    if reason:
        return reason
    reason = probe_part(block, "self_attention", probe_attention, kandinsky_model.SelfAttention)
    if reason:
        return reason
    attention = block.self_attention
    width = attention.num_heads * attention.head_dim
    if getattr(attention.out_layer.weight, "shape", (None,))[0] != width:
        return "self_attention.out_layer does not map back to the block's width"
    for name in ("self_attention_norm", "cross_attention_norm", "feed_forward_norm", "cross_attention"):
        if not isinstance(getattr(block, name, None), torch.nn.Module):
            return f"no {name}"
    if feed_forward_layers(getattr(block, "feed_forward", None)) is None:
        return "its feed_forward is not in_layer, GELU, out_layer"
    modulation = getattr(getattr(getattr(block, "visual_modulation", None), "out_layer", None), "weight", None)
    if modulation is None or modulation.shape[0] != 9 * width:
        return "its visual_modulation does not give nine modulations"
    return None


# --- the self-attention ----------------------------------------------------------------------------------------------
def attention_heads(attention, config, x_list: list, freqs, transformer_options) -> torch.Tensor:
    """The self-attention of `[x]` (cleared: the runtime frees x once projected), x `(B, N, C)`:
    `(B, N, heads, head_dim)`. `freqs`: `(1 or B, N, 1, D/2, 2, 2)` float32, the model's."""
    return attend(attention, SELF_ATTENTION, [x_list], attention.num_heads, attention.head_dim, config,
                  transformer_options, freqs=freqs)


def run_attention(attention, config, x, freqs, transformer_options={}):
    """`SelfAttention.forward`: the output projection of the attention of x."""
    handed_off = [x]
    del x   # the caller (ComfyUI's block) still holds its modulated input: nothing to free here
    return attention.out_layer(attention_heads(attention, config, handed_off, freqs, transformer_options).flatten(2))


# --- the visual block ------------------------------------------------------------------------------------------------
def feed_forward_layers(feed_forward) -> Optional[torch.nn.Sequential]:
    """Kandinsky 5's `FeedForward` (`in_layer`, GELU, `out_layer`; ComfyUI splits long inputs into chunks of
    tokens, which computes the same) as the `Sequential(Linear, GELU, Linear)` over the model's own layers
    (nothing copied) that `block_parts.ChunkedMLP` casts once and runs by token chunks; None for another."""
    layers = tuple(getattr(feed_forward, name, None) for name in ("in_layer", "activation", "out_layer"))
    if type(layers[1]) is not torch.nn.GELU or any(getattr(layer, "weight", None) is None
                                                   for layer in (layers[0], layers[2])):
        return None
    return torch.nn.Sequential(*layers)


def run_block(block, config, visual_embed, text_embed, time_embed, freqs, transformer_options={}):
    """`TransformerDecoderBlock.forward` with every transient bounded; returns a new tensor (the input is not
    written)."""
    x = visual_embed
    self_params, cross_params, ffn_params = torch.chunk(block.visual_modulation(time_embed), 3, dim=-1)
    batch, tokens, width = x.shape
    step = chunk_tokens(tokens, batch * width, max(1, x.numel() // 8))
    shift, scale, gate = kandinsky_model.get_shift_scale_gate(self_params)
    modulated = torch.empty_like(x)
    for a, b in token_ranges(tokens, step):
        modulated[:, a:b] = kandinsky_model.apply_scale_shift_norm(block.self_attention_norm, x[:, a:b], scale, shift)
    handed_off = [modulated]
    del modulated   # the runtime holds the only reference and frees it once q/k/v are projected
    heads = attention_heads(block.self_attention, config, handed_off, freqs, transformer_options)
    handed_off = [heads.flatten(2)]
    del heads
    out = linear_handed_off(block.self_attention.out_layer, handed_off, x)   # the block's output from here on
    for a, b in token_ranges(tokens, step):
        out[:, a:b] = kandinsky_model.apply_gate_sum(x[:, a:b], out[:, a:b], gate)

    shift, scale, gate = kandinsky_model.get_shift_scale_gate(cross_params)
    for a, b in token_ranges(tokens, step):   # each query's attention over the text is its own
        part = out[:, a:b]
        queries = kandinsky_model.apply_scale_shift_norm(block.cross_attention_norm, part, scale, shift)
        attended = block.cross_attention(queries, text_embed, transformer_options=transformer_options)
        del queries
        part.copy_(kandinsky_model.apply_gate_sum(part, attended, gate))
        del attended, part

    shift, scale, gate = kandinsky_model.get_shift_scale_gate(ffn_params)

    def ffn_input(a, b):
        return kandinsky_model.apply_scale_shift_norm(block.feed_forward_norm, out[:, a:b], scale, shift)

    def add_(part, ffn_out, a, b):
        part.copy_(kandinsky_model.apply_gate_sum(part, ffn_out, gate))

    mlp_residual_(out, feed_forward_layers(block.feed_forward), ffn_input, add_)
    return out


# --- guards and the adapter contract (family.py) ----------------------------------------------------------------------
def _freqs_rows(bound: dict, n: int, tokens: int) -> dict:
    """The check's RoPE rows: those of its first tokens."""
    return {"freqs": lambda freqs: freqs[:, :n].clone()}


def _extra(bound: dict) -> tuple:
    return (layout(bound.get("freqs")),)


def attention_forward(attention, config):
    """The guarded forward installed on a `SelfAttention`."""
    return SPEC.guard("attention", "self-attention", attention, ATTENTION_ARGS, run_attention, config, x="x",
                      extra=_extra, cut=_freqs_rows)


def block_forward(block, config):
    """The guarded bounded forward installed on a `TransformerDecoderBlock` (block bounds on)."""
    return SPEC.guard("block", "block", block, BLOCK_ARGS, run_block, config, x="visual_embed", extra=_extra,
                      cut=_freqs_rows, residual="visual_embed", refuse_more=foreign_part)


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone): every self-attention that probes clean, and with block bounds
    every visual block. A module another node patched keeps that patch (its block then runs stock)."""
    SPEC.patch(patcher, config, report, attention=(attention_forward, probe_attention),
               block=(block_forward, probe_block))


matches, stock_functions, tokens_per_item, kv_heads, splits_projections, block_kinds = SPEC.contract()
