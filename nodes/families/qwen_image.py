"""Qwen-Image adapter (`comfy/ldm/qwen_image/model.py`): Qwen-Image, Qwen-Image-Edit (reference latents joined
to the image tokens, and the `index_timestep_zero` method whose reference tokens take a modulation of their
own) and every model built from its `QwenImageTransformerBlock` (MageFlow, ComfyUI v0.33+).

The attention module (`Attention`: image stream `to_q/k/v`, text stream `add_q/k/v_proj`, per-head RMSNorm,
pair RoPE, joint order [txt, img], outputs `to_out` / `to_add_out`) is patched at every setting: its forward
runs through `nodes/attention.py` (the head split, each stream's norm and the RoPE by head group), the output
projections as ComfyUI's layers compute them. With block bounds on, the whole `QwenImageTransformerBlock` is
patched too: each stream's modulated input is made by token chunks and handed off to the runtime, the output
projections and the MLPs run by token chunks, and the residual updates go in place into the block's output
(a new tensor per stream: ComfyUI's block does not write its inputs, and a `patches_replace["dit"]` wrapper
may read them after the call). The block's own modulation (`_modulate`) makes each chunk's modulated input.

Guarded and self-checked like every forward of the pack (`compat.guard_module`): a call with another node's
`attn1_patch` (ComfyUI v0.33's attention calls it on whole q/k/v), an `attention_mask` argument (no ComfyUI
block passes one; versions differ in what it does) or arguments the pack does not know runs ComfyUI's own.
The text mask (`encoder_hidden_states_mask`) is applied to the text keys as ComfyUI v0.33 does; ComfyUI
v0.8.0's attention ignores it, so there a masked call fails its self-check and runs stock (one log line).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

import comfy.ldm.qwen_image.model as qwen_model

from .. import compat
from ..attention import AttentionForm, NORM_PER_HEAD, ROPE_PAIRS, StreamProjections, attend, attribute, token_freqs
from ..block_parts import (chunk_scale, foreign_part, mlp_residual_, modulated_layer_norm_args, projection_residual_,
                          run_modulated_layer_norm)
from ..comfy_ops import chunk_tokens, module_attr, token_ranges
from .family import TEXT_CHECK_TOKENS, BlockList, Family, layout, probe_linear

FAMILY = "Qwen-Image"
STOCK_MODULATE = getattr(qwen_model.QwenImageTransformerBlock, "_modulate", None)


# Split, the block's output projections and MLPs take token chunks twice block_parts' default (a quarter of the
# tokens): they then hold the outputs, the attention and a chunk's product (2.07 + 0.25 x|x|), or the outputs and
# a chunk's input, hidden activation and product (1.04 + 5 x 0.25), at or under the split attention's own peak at
# the 4-12 groups of Qwen-Image's 24 heads (the modulated inputs, the output buffer and a group's k, v and
# result, 2.07 + 3 x 1.04 / groups), for half the launches: at 1328^2 the split block is bound by the host's
# launches. (In 16 groups, a model of 16 heads, the block holds a little more than the attention alone.)
SPLIT_CHUNK_SCALE = 2

FORM = AttentionForm(streams=(
    StreamProjections(q="add_q_proj", k="add_k_proj", v="add_v_proj", norm_q="norm_added_q", norm_k="norm_added_k"),
    StreamProjections(q="to_q", k="to_k", v="to_v", norm_q="norm_q", norm_k="norm_k"),
), norm=NORM_PER_HEAD, rope=ROPE_PAIRS)

HOOKS_RUN_INSIDE = ("attn1_patch",)   # called by ComfyUI's attention on whole joint q/k/v
ATTENTION_ARGS = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "attention_mask",
                  "image_rotary_emb", "transformer_options")
BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb", "image_rotary_emb",
              "timestep_zero_index", "transformer_options")
# The transformer blocks of Qwen-Image (MageFlow's too): attention and block patched.
SPEC = Family(FAMILY, "qwen_image", (BlockList("transformer_blocks", cls=qwen_model.QwenImageTransformerBlock),),
              kv_heads_at="block.attn.heads",
              projections=("attn", ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"), "attn."),
              attentions=("attn",), stock_parts=("attn", "img_mlp"), patch_parts=("attn",))


# --- probes -------------------------------------------------------------------------------------------------
def _no_dropout(module, name: str) -> Optional[str]:
    layer = attribute(module, name)
    if not isinstance(layer, torch.nn.Dropout) or (layer.p != 0 and layer.training):
        return f"{name} is not an inactive Dropout"
    return None


def probe_attention(attn) -> Optional[str]:
    """None when a Qwen-Image `Attention` has the structure the pack's forward uses."""
    heads, head_dim = getattr(attn, "heads", None), getattr(attn, "dim_head", None)
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        return "no heads/dim_head"
    if getattr(attn, "inner_dim", None) != heads * head_dim:
        return "inner_dim is not heads x dim_head"
    reason = FORM.probe(attn, heads, head_dim)
    if reason:
        return reason
    to_out = getattr(attn, "to_out", None)
    if not isinstance(to_out, torch.nn.ModuleList) or len(to_out) != 2:
        return "to_out is not [Linear, Dropout]"
    return _no_dropout(attn, "to_out.1") or probe_linear(attn, "to_out.0", attn.out_dim) or \
        probe_linear(attn, "to_add_out", attn.out_context_dim)


def feed_forward_layers(mlp) -> Optional[torch.nn.Sequential]:
    """Qwen-Image's `FeedForward` (`net`: GELU(proj) with its approximation, Dropout(0), Linear) as the
    `Sequential(Linear, GELU, Linear)` it computes, over the model's own layers (nothing copied), or None
    for another MLP. The Sequential is what `block_parts.ChunkedMLP` casts once and runs by token chunks."""
    # read through the modules' own dicts (asked at every block call: `Module.__getattr__` costs host time)
    net = module_attr(mlp, "net")
    if not isinstance(net, torch.nn.ModuleList) or len(net) != 3:
        return None
    gelu, dropout, down = net._modules.values()
    approximate = getattr(gelu, "approximate", None)
    if type(gelu) is not qwen_model.GELU or approximate not in ("none", "tanh") or \
            not isinstance(dropout, torch.nn.Dropout) or (dropout.p != 0 and dropout.training) or \
            module_attr(down, "weight") is None:
        return None
    proj = module_attr(gelu, "proj")
    if proj is None:
        return None
    cached = _FEED_FORWARDS.get(mlp)
    if cached is not None and cached[0] is proj and cached[1] is down and cached[2] == approximate:
        return cached[3]
    layers = torch.nn.Sequential(proj, torch.nn.GELU(approximate=approximate), down)
    _FEED_FORWARDS[mlp] = (proj, down, approximate, layers)
    return layers


# a FeedForward's Sequential (with the layers and approximation it was made of), made once (building modules at
# every block call cost host time): kept while the FeedForward lives, remade when its layers change
_FEED_FORWARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def probe_block(block) -> Optional[str]:
    """None when a `QwenImageTransformerBlock` has the structure the pack's bounded forward uses."""
    attn = getattr(block, "attn", None)
    if attn is None:
        return "no attn"
    reason = probe_attention(attn)
    if reason:
        return f"attn: {reason}"
    width = attn.inner_dim
    if getattr(block, "dim", None) != width or attn.out_dim != width or attn.out_context_dim != width:
        return "the attention's width is not the block's"
    for name in ("img_mod", "txt_mod"):
        mod = getattr(block, name, None)
        if not isinstance(mod, torch.nn.Sequential) or len(mod) != 2 or probe_linear(mod, "1", 6 * width):
            return f"{name} is not SiLU, Linear to 6 x width"
    for name in ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2"):
        if getattr(block, name, None) is None:
            return f"no {name}"
    for name in ("img_mlp", "txt_mlp"):
        if feed_forward_layers(getattr(block, name, None)) is None:
            return f"{name} is not Qwen-Image's FeedForward"
    if not callable(getattr(block, "_modulate", None)):
        return "no _modulate"
    return None


# --- the text mask, modulation by token chunks -----------------------------------------------------------------
def joint_key_mask(text_mask: Optional[torch.Tensor], img: torch.Tensor, text_tokens: int) -> Optional[torch.Tensor]:
    """The additive key mask `(B, 1, text + image tokens)` in `img`'s dtype that ComfyUI v0.33's attention makes
    of `text_mask` (`(B, text)` or `(text,)`): the mask on the text keys, 0 on the image keys."""
    if text_mask is None:
        return None
    mask = img.new_zeros((img.shape[0], 1, text_tokens + img.shape[1]))
    mask[:, 0, :text_tokens] = text_mask
    return mask


def rope_token_dim(freqs: torch.Tensor, tokens: int) -> Optional[int]:
    """The token dimension of pair-RoPE frequencies over `tokens` joint tokens: 2 in the heads-first layout
    `(B, 1, N, D/2, 2, 2)` ComfyUI v0.8+ passes, 1 in the tokens-first `(B, N, 1, D/2, 2, 2)` of older ones;
    None for another layout."""
    if freqs.dim() != 6 or tuple(freqs.shape[-2:]) != (2, 2):
        return None
    if freqs.shape[1] == 1 and freqs.shape[2] == tokens:
        return 2
    if freqs.shape[1] == tokens and freqs.shape[2] == 1:
        return 1
    return None


def runtime_freqs(freqs: Optional[torch.Tensor], tokens: int) -> Optional[torch.Tensor]:
    """The frequencies in the runtime's tokens-first layout (a view)."""
    if freqs is None or rope_token_dim(freqs, tokens) == 1:
        return freqs
    return token_freqs(freqs)


def _cut(zero_from: Optional[int], a: int, b: int) -> Optional[int]:
    """`timestep_zero_index` as seen from the chunk [a, b) (tokens from it on take the zero timestep's
    modulation)."""
    return None if zero_from is None else min(max(zero_from - a, 0), b - a)


def modulated_chunk(block, normed: torch.Tensor, mod: torch.Tensor, zero_from: Optional[int], a: int,
                    b: int) -> torch.Tensor:
    """The block's own `_modulate` of `normed`, the chunk [a, b) of a stream's normed tokens, by `mod`
    `(B or 2B, 3C)` ([shift, scale, gate]; 2B with a `zero_from`)."""
    if zero_from is None:
        return block._modulate(normed, mod)[0]
    return block._modulate(normed, mod, _cut(zero_from, a, b))[0]


class ChunkModulation:
    """`modulate(normed, a, b)`: the block's `_modulate` of the chunk [a, b) of a stream's normed tokens by `mod`
    (see `modulated_chunk`). Where the block's `_modulate` is ComfyUI's own and every token takes one
    modulation, its split and `1 + scale` are made once for all chunks and each chunk is its one `addcmul`
    (the same operation on the same operands: the same numbers, two launches fewer a chunk)."""

    def __init__(self, block, mod: torch.Tensor, zero_from: Optional[int], parts: Optional[tuple] = None):
        """`parts`: `(shift, 1 + scale, gate)` of `mod` where the caller made them (`modulation_parts`)."""
        self.block, self.mod, self.zero_from = block, mod, zero_from
        self.shift = self.scale = None
        self._fused_for = self._fused_args = None   # (norm, dtype, device, width) -> its `fused` arguments
        if parts is not None:
            self.shift, self.scale = parts[0], parts[1]
        elif zero_from is None and getattr(type(block), "_modulate", None) is STOCK_MODULATE:
            shift, scale, _ = torch.chunk(mod, 3, dim=-1)
            self.shift, self.scale = shift.unsqueeze(1), 1 + scale.unsqueeze(1)

    def __call__(self, normed: torch.Tensor, a: int, b: int) -> torch.Tensor:
        if self.shift is not None:
            return torch.addcmul(self.shift, normed, self.scale)
        return modulated_chunk(self.block, normed, self.mod, self.zero_from, a, b)

    def fused(self, norm, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The modulation of `norm(x)` in one launch where the norm is a plain LayerNorm and one item's
        modulation serves every token (`block_parts.modulated_layer_norm`), else None. Checked once for the
        chunks of one norm and kind of tensor."""
        if self.shift is None:
            return None
        key = (norm, x.dtype, x.device, x.shape[-1])
        if self._fused_for != key:
            self._fused_for, self._fused_args = key, modulated_layer_norm_args(norm, x, self.shift, self.scale)
        return None if self._fused_args is None else run_modulated_layer_norm(x, self._fused_args)

    def of(self, norm, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """The modulation of `norm(x)`, `x` the chunk [a, b) of the stream: `fused`, else the norm, then
        `self(...)`."""
        fused = self.fused(norm, x)
        return fused if fused is not None else self(norm(x), a, b)


def modulation_parts(block, mods: torch.Tensor, zero_from: Optional[int]) -> Optional[tuple]:
    """A stream's two modulations `mods` `(B, 6C)` (`[shift, scale, gate] x 2`, as the block splits them) as
    `((shift, 1 + scale, gate), (shift, 1 + scale, gate))`, each `(B, 1, C)`, where `ChunkModulation` and
    `gated_add` take them: the block's own `_modulate`, one modulation for every token. The views of one
    stream's modulations and one launch for the `1 + scale` that `_modulate` makes for each (the same sums),
    where the split into halves, thirds and their unsqueezed views cost a block call ~20 views a stream (host
    time). Else None."""
    if zero_from is not None or getattr(type(block), "_modulate", None) is not STOCK_MODULATE or \
            mods.dim() != 2 or mods.shape[-1] % 6:
        return None
    width = mods.shape[-1] // 6
    items, plus_one = mods.unsqueeze(1), (1 + mods).unsqueeze(1)
    return tuple((items.narrow(-1, first * width, width), plus_one.narrow(-1, (first + 1) * width, width),
                  items.narrow(-1, (first + 2) * width, width)) for first in (0, 3))


def modulated_input(block, norm, x: torch.Tensor, mod: torch.Tensor, zero_from: Optional[int],
                    scale: int = 1, parts: Optional[tuple] = None) -> torch.Tensor:
    """`_modulate(norm(x), mod)` in a fresh tensor like `x`: one launch where `ChunkModulation.fused` takes
    them (its only transient is its output), else made by token chunks (the norm's and the modulation's
    transients are a chunk each; `scale`: chunks that many times larger, `block_parts.chunk_scale`).
    `parts`: `mod`'s (`modulation_parts`), or None."""
    modulate = ChunkModulation(block, mod, zero_from, parts)
    whole = modulate.fused(norm, x)   # one launch, no chunks needed
    if whole is not None:
        return whole
    out = torch.empty_like(x)
    tokens = x.shape[1]
    for a, b in token_ranges(tokens, chunk_tokens(tokens, x[:, :1].numel(), max(1, x.numel() * scale // 8))):
        out.narrow(1, a, b - a).copy_(modulate(norm(x.narrow(1, a, b - a)), a, b))
    return out


def gated_add(mod: torch.Tensor, zero_from: Optional[int], gate: Optional[torch.Tensor] = None):
    """`add_(part, out, a, b)`: `part += gate * out` for the chunk [a, b), the gate of `mod` ([shift, scale,
    gate], as `_modulate` splits it; `gate`: that gate `(B, 1, C)` where the caller has it); with `zero_from`,
    tokens from it on take the second half of the batch's gate (the zero timestep's)."""
    if gate is None or zero_from is not None:
        gate = mod.chunk(3, dim=-1)[2].unsqueeze(1)
    gates = (gate,) if zero_from is None else gate.chunk(2, dim=0)

    def add_(part, out, a, b):
        if zero_from is None:
            part.addcmul_(gates[0], out)
            return
        cut = _cut(zero_from, a, b)
        part[:, :cut].addcmul_(gates[0], out[:, :cut])
        part[:, cut:].addcmul_(gates[1], out[:, cut:])
    return add_


# --- the forwards -------------------------------------------------------------------------------------------
def run_attention(attn, config, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                  attention_mask=None, image_rotary_emb=None, transformer_options={}):
    """`Attention.forward`: (image output `(B, N_img, C)`, text output `(B, N_txt, C)`) of the image stream
    `hidden_states` and the text stream `encoder_hidden_states`. `image_rotary_emb`: pair-RoPE frequencies
    over the joint tokens (see `rope_token_dim`). (`attention_mask` is refused by the guard.)"""
    text_tokens = encoder_hidden_states.shape[1]
    mask = joint_key_mask(encoder_hidden_states_mask, hidden_states, text_tokens)
    freqs = runtime_freqs(image_rotary_emb, text_tokens + hidden_states.shape[1])
    streams = [[encoder_hidden_states], [hidden_states]]
    del hidden_states, encoder_hidden_states
    attention = attend(attn, FORM, streams, attn.heads, attn.dim_head, config, transformer_options,
                       freqs=freqs, mask=mask).flatten(2)
    del mask
    img = attn.to_out[1](attn.to_out[0](attention[:, text_tokens:]))
    txt = attn.to_add_out(attention[:, :text_tokens])
    return img, txt


def run_block(block, config, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
              image_rotary_emb=None, timestep_zero_index=None, transformer_options={}):
    """The bounded `QwenImageTransformerBlock.forward`: (text `(B, N_txt, C)`, image `(B, N_img, C)`), new
    tensors; the inputs are not written. `temb` `(B, C)`, or `(2B, C)` with `timestep_zero_index` (the
    image tokens from it on take the second half's modulation; the text takes the first half's)."""
    zero_from = timestep_zero_index
    img, txt, attn = hidden_states, encoder_hidden_states, block.attn
    img_mods = block.img_mod(temb)
    txt_mods = block.txt_mod(temb if zero_from is None else temb.chunk(2, dim=0)[0])
    (img_mod1, img_mod2), (txt_mod1, txt_mod2) = img_mods.chunk(2, dim=-1), txt_mods.chunk(2, dim=-1)
    # (shift, 1 + scale, gate) of each modulation, where the block modulates as ComfyUI's does: views made once
    (img_parts1, img_parts2), (txt_parts1, txt_parts2) = (modulation_parts(block, img_mods, zero_from) or (None, None),
                                                          modulation_parts(block, txt_mods, None) or (None, None))
    del img_mods, txt_mods
    text_tokens = txt.shape[1]
    mask = joint_key_mask(encoder_hidden_states_mask, img, text_tokens)
    scale = chunk_scale(config.policy, attn.heads, text_tokens + img.shape[1], SPLIT_CHUNK_SCALE)
    handed_off = [[modulated_input(block, block.txt_norm1, txt, txt_mod1, None, scale, txt_parts1)],
                  [modulated_input(block, block.img_norm1, img, img_mod1, zero_from, scale, img_parts1)]]
    # the runtime holds the only references to the modulated inputs: each is freed once projected
    attention = attend(attn, FORM, handed_off, attn.heads, attn.dim_head, config, transformer_options,
                       freqs=runtime_freqs(image_rotary_emb, text_tokens + img.shape[1]), mask=mask).flatten(2)
    del mask
    img_out, txt_out = img.clone(), txt.clone()   # the outputs: the updates are added into them in place
    gate = lambda parts: None if parts is None else parts[2]  # noqa: E731
    projection_residual_(img_out, attn.to_out[0], attention[:, text_tokens:],
                         gated_add(img_mod1, zero_from, gate(img_parts1)), scale=scale)
    projection_residual_(txt_out, attn.to_add_out, attention[:, :text_tokens],
                         gated_add(txt_mod1, None, gate(txt_parts1)), scale=scale)
    del attention
    for out, norm, mlp, mod, zero, parts in (
            (img_out, block.img_norm2, block.img_mlp, img_mod2, zero_from, img_parts2),
            (txt_out, block.txt_norm2, block.txt_mlp, txt_mod2, None, txt_parts2)):
        modulate = ChunkModulation(block, mod, zero, parts)
        mlp_residual_(out, feed_forward_layers(mlp),
                      lambda a, b, out=out, norm=norm, modulate=modulate: modulate.of(norm, out[:, a:b], a, b),
                      gated_add(mod, zero, gate(parts)), scale=scale)
    return txt_out, img_out


# --- guards and the adapter contract (family.py) ---------------------------------------------------------------
def _refuse_call(bound) -> Optional[str]:
    if bound.get("attention_mask") is not None:
        return "an attention_mask argument (ComfyUI's blocks pass none; its use differs between versions)"
    txt = bound.get("encoder_hidden_states")
    if not torch.is_tensor(txt) or txt.dim() != 3:
        return "no text stream (batch, tokens, width)"
    mask = bound.get("encoder_hidden_states_mask")
    if mask is not None and (mask.dim() > 2 or mask.shape[-1] != txt.shape[1]):
        return f"a text mask of shape {tuple(mask.shape)} (the pack takes (batch, text tokens))"
    freqs = bound.get("image_rotary_emb")
    if freqs is not None and rope_token_dim(freqs, txt.shape[1] + bound["hidden_states"].shape[1]) is None:
        return f"RoPE frequencies of shape {tuple(freqs.shape)} (the pack takes pairs over the joint tokens)"
    return None


def _extra(bound: dict) -> tuple:
    img, freqs = bound["hidden_states"], bound.get("image_rotary_emb")
    tokens = img.shape[1] + bound["encoder_hidden_states"].shape[1]
    return (None if freqs is None else (rope_token_dim(freqs, tokens), freqs.dtype),
            layout(bound.get("encoder_hidden_states_mask")), bound.get("timestep_zero_index") is None)


def _image_keep(tokens: int, zero_from: Optional[int]) -> torch.Tensor:
    """The check's image tokens: the first ones, or, with a `zero_from` inside the sequence, half from each
    side of it (both modulations are checked)."""
    n = compat.check_tokens(tokens)
    if zero_from is None or not 0 < zero_from < tokens or n == tokens:
        return torch.arange(n)
    before = min(n // 2, zero_from)
    return torch.cat((torch.arange(before), zero_from + torch.arange(min(n - before, tokens - zero_from))))


def _text_keep(tokens: int, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The check's text tokens: the first ones, or, with a mask, up to half of them where the mask is not 0
    and the rest where it is (masked and unmasked keys are both checked, wherever the padding is)."""
    n = min(tokens, TEXT_CHECK_TOKENS)
    if mask is None or n == tokens:
        return torch.arange(n)
    marked = (mask.reshape(-1, tokens) != 0).any(0).cpu()
    picked = marked.nonzero().flatten()[:n // 2]
    rest = (~marked).nonzero().flatten()[:n - len(picked)]
    return torch.cat((picked, rest)).sort().values


def _check_inputs(bound: dict) -> dict:
    """The call's check inputs: some image and text tokens of every batch item, with their RoPE rows and
    mask entries, and probes for other nodes' hooks."""
    img, txt = bound["hidden_states"], bound["encoder_hidden_states"]
    zero_from = bound.get("timestep_zero_index")
    mask = bound.get("encoder_hidden_states_mask")
    img_keep, txt_keep = _image_keep(img.shape[1], zero_from), _text_keep(txt.shape[1], mask)
    out = dict(bound)
    out.update(hidden_states=img.index_select(1, img_keep.to(img.device)),
               encoder_hidden_states=txt.index_select(1, txt_keep.to(txt.device)),
               transformer_options=compat.probe_options(bound.get("transformer_options") or {}))
    if mask is not None:
        out["encoder_hidden_states_mask"] = mask.index_select(-1, txt_keep.to(mask.device))
    freqs = bound.get("image_rotary_emb")
    if freqs is not None:
        joint = torch.cat((txt_keep, txt.shape[1] + img_keep)).to(freqs.device)
        out["image_rotary_emb"] = freqs.index_select(rope_token_dim(freqs, txt.shape[1] + img.shape[1]), joint)
    if zero_from is not None:
        out["timestep_zero_index"] = int((img_keep < zero_from).sum())
    return out


def attention_forward(attn, config):
    """The guarded forward installed on a Qwen-Image `Attention`."""
    return SPEC.guard("attention", "attention", attn, ATTENTION_ARGS, run_attention, config, x="hidden_states",
                      extra=_extra, check_inputs=_check_inputs, hooks_inside=HOOKS_RUN_INSIDE,
                      refuse_call=_refuse_call, refuse_more=foreign_part)


def block_forward(block, config):
    """The guarded bounded forward installed on a `QwenImageTransformerBlock` (block bounds on)."""
    return SPEC.guard("block", "block", block, BLOCK_ARGS, run_block, config, x="hidden_states", extra=_extra,
                      check_inputs=_check_inputs, residual=("encoder_hidden_states", "hidden_states"),
                      hooks_inside=HOOKS_RUN_INSIDE, refuse_call=_refuse_call, refuse_more=foreign_part)


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone): every block's attention that probes clean, and with block bounds
    the block too (its attention patch then serves the calls the block hands to ComfyUI's own forward)."""
    SPEC.patch(patcher, config, report, attention=(attention_forward, probe_attention),
               block=(block_forward, probe_block))


matches, stock_functions, tokens_per_item, kv_heads, splits_projections, block_kinds = SPEC.contract()
