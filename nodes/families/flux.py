"""Flux-layout adapter (`comfy/ldm/flux/layers.py`'s `DoubleStreamBlock` and `SingleStreamBlock`): Flux 1 and 2
(Kontext, Krea, Flux.2 klein / dev), Chroma and Chroma Radiance, HunyuanVideo 1.0 and HunyuanImage 2.1 build
their transformers from these two blocks.

Their attention lives inside the block (no attention module with a forward of its own), so the blocks are what
is patched: the double block's joint [txt, img] attention from each stream's fused `qkv`, the single block's
from the q/k/v rows of its fused `linear1` ([q, k, v, mlp]); per-head RMSNorm (`QKNorm`) and pair RoPE in
float32, through `nodes/attention.py`. With block bounds on, the modulated inputs are handed off, the output
projections and MLPs run by token chunks into the residual in place, and the single block's MLP half of
`linear1` is computed per chunk from the block's input (its modulated input is not kept through attention).
Block bounds off: the rest of the block runs as ComfyUI writes it.

Guarded and self-checked like every forward of the pack (`compat.guard_module`). A call with another node's
`attn1_patch` / `attn1_output_patch` runs ComfyUI's block (they see whole q/k/v, which the head split never
holds).
"""
from __future__ import annotations

from typing import Optional

import torch

import comfy.ldm.flux.layers as flux_layers

from .. import compat
from ..attention import AttentionForm, NORM_PER_HEAD, ROPE_PAIRS, StreamProjections, attend, token_freqs
from ..block_parts import chunk_scale, foreign_part, mlp_residual_, projection_residual_
from ..comfy_ops import CastLinear, ComfyLinearRows, chunk_tokens, token_ranges
from .family import TEXT_CHECK_TOKENS, BlockList, Family, layout, stream_rows, unsliceable_projection

FAMILY = "Flux"

DOUBLE = AttentionForm(streams=(
    StreamProjections(fused="txt_attn.qkv", norm_q="txt_attn.norm.query_norm", norm_k="txt_attn.norm.key_norm"),
    StreamProjections(fused="img_attn.qkv", norm_q="img_attn.norm.query_norm", norm_k="img_attn.norm.key_norm"),
), norm=NORM_PER_HEAD, rope=ROPE_PAIRS)


DOUBLE_FLIPPED = AttentionForm(streams=DOUBLE.streams[::-1], norm=NORM_PER_HEAD, rope=ROPE_PAIRS)  # [img, txt]


def _double_form(block) -> AttentionForm:
    """[txt, img]; older ComfyUI (v0.8 and before) also builds [img, txt] blocks (`flipped_img_txt`)."""
    return DOUBLE_FLIPPED if getattr(block, "flipped_img_txt", False) else DOUBLE


def _mlp_first(block) -> int:
    """Features of the MLP half of `linear1` (older ComfyUI has only `mlp_hidden_dim`)."""
    return getattr(block, "mlp_hidden_dim_first", block.mlp_hidden_dim)


def single_form(block) -> AttentionForm:
    return AttentionForm(streams=(StreamProjections(fused="linear1", rest=_mlp_first(block),
                                                    norm_q="norm.query_norm", norm_k="norm.key_norm"),),
                         norm=NORM_PER_HEAD, rope=ROPE_PAIRS)


HOOKS_RUN_INSIDE = ("attn1_patch", "attn1_output_patch")   # hooks the stock blocks call on whole q/k/v
# The double blocks, then the single blocks: patched whatever block bounds say (they hold the attention).
SPEC = Family(FAMILY, "flux", (BlockList("double_blocks", kind="double", label="double block",
                                         cls=flux_layers.DoubleStreamBlock),
                               BlockList("single_blocks", kind="single", label="single block",
                                         cls=flux_layers.SingleStreamBlock)), blocks_always=True,
              names=("Flux (1, 2, Chroma)", "HunyuanVideo"))


# --- probes -------------------------------------------------------------------------------------------------
def _heads(block) -> tuple[int, int]:
    width = block.hidden_size
    return block.num_heads, width // block.num_heads


def _mlp_ok(mlp) -> Optional[str]:
    if isinstance(mlp, torch.nn.Sequential) and len(mlp) == 3:
        return None
    if type(mlp).__name__ == "YakMLP":
        return None
    return "its MLP is neither Linear, activation, Linear nor YakMLP"


def _probe_attention(block, form, sizes) -> Optional[str]:
    """Why `block`'s attention is not what `form(block)` describes: one of the int attributes `sizes` missing, a
    width that is not whole heads, or what the form's probe finds; else None."""
    for name in sizes:
        if not isinstance(getattr(block, name, None), int):
            return f"no {name}"
    heads, head_dim = _heads(block)
    if heads * head_dim != block.hidden_size:
        return "hidden_size is not a multiple of num_heads"
    return form(block).probe(block, heads, head_dim)


def probe_double(block) -> Optional[str]:
    """None when a `DoubleStreamBlock` has the structure the pack's forward uses."""
    reason = _probe_attention(block, _double_form, ("num_heads", "hidden_size"))
    if reason:
        return reason
    for name in ("img_norm1", "txt_norm1", "img_norm2", "txt_norm2", "img_attn.proj", "txt_attn.proj"):
        if compat_attr(block, name) is None:
            return f"no {name}"
    return _mlp_ok(block.img_mlp) or _mlp_ok(block.txt_mlp)


def probe_single(block) -> Optional[str]:
    """None when a `SingleStreamBlock` has the structure the pack's forward uses."""
    reason = _probe_attention(block, single_form, ("num_heads", "hidden_size", "mlp_hidden_dim"))
    if reason:
        return reason
    linear2 = getattr(getattr(block, "linear2", None), "weight", None)
    if linear2 is None or tuple(linear2.shape) != (block.hidden_size, block.hidden_size + block.mlp_hidden_dim):
        return "linear2 is not [attention, mlp] -> hidden"
    if getattr(block, "pre_norm", None) is None or not hasattr(block, "mlp_act"):
        return "no pre_norm/mlp_act"
    return None


def compat_attr(module, path: str):
    for name in path.split("."):
        module = getattr(module, name, None)
    return module


# --- modulation by token chunks -------------------------------------------------------------------------------
def _chunk_dims(dims, a: int, b: int):
    """`modulation_dims` ((start, stop, index) token ranges) as seen from the chunk [a, b)."""
    if dims is None:
        return None
    out = []
    for start, stop, index in dims:
        lo, hi = max(start, a), min(stop, b)
        if lo < hi:
            out.append((lo - a, hi - a, index))
    return out


def _modulate(t: torch.Tensor, mult, add, dims, a: int, b: int) -> torch.Tensor:
    """ComfyUI's `apply_mod` on the chunk [a, b) of a stream (per-range modulation as the model applies it)."""
    return flux_layers.apply_mod(t, mult, add, _chunk_dims(dims, a, b))


def modulated_input(norm, x: torch.Tensor, mod, dims, scale: int = 1) -> torch.Tensor:
    """`apply_mod(norm(x), 1 + mod.scale, mod.shift, dims)` in a fresh tensor, made by token chunks (the
    norm's and the modulation's transients are a chunk each; `scale`: chunks that many times larger,
    `block_parts.chunk_scale`)."""
    out = torch.empty_like(x)
    step = chunk_tokens(x.shape[1], x[:, :1].numel(), max(1, x.numel() * scale // 8))
    scale = 1 + mod.scale
    for a, b in token_ranges(x.shape[1], step):
        out[:, a:b] = _modulate(norm(x[:, a:b]), scale, mod.shift, dims, a, b)
    return out


def _gated_add(gate, dims):
    """`add_(part, out, a, b)`: `part += apply_mod(out, gate, None, dims)` for the chunk [a, b): one `addcmul_`
    where every token takes the one gate (the same sum, one launch instead of two)."""
    def add_(part, out, a, b):
        if dims is None:
            part.addcmul_(out, gate)
        else:
            part += _modulate(out, gate, None, dims, a, b)
    return add_


def _finite_fp16(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float16:   # as the stock blocks do
        return torch.nan_to_num(t, nan=0.0, posinf=65504, neginf=-65504)
    return t


# --- the double block -------------------------------------------------------------------------------------------
DOUBLE_ARGS = ("img", "txt", "vec", "pe", "attn_mask", "modulation_dims_img", "modulation_dims_txt",
               "transformer_options")


def run_double_block(block, config, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None,
                     modulation_dims_txt=None, transformer_options={}):
    if getattr(block, "modulation", True):   # False: the model modulates all blocks at once (Flux 2, Chroma)
        img_mod1, img_mod2 = block.img_mod(vec)
        txt_mod1, txt_mod2 = block.txt_mod(vec)
    else:
        (img_mod1, img_mod2), (txt_mod1, txt_mod2) = vec
    heads, head_dim = _heads(block)
    form = _double_form(block)
    scale = chunk_scale(config.policy, heads, img.shape[1] + txt.shape[1])
    streams = [[modulated_input(block.txt_norm1, txt, txt_mod1, modulation_dims_txt, scale)],
               [modulated_input(block.img_norm1, img, img_mod1, modulation_dims_img, scale)]]
    if form is DOUBLE_FLIPPED:
        streams.reverse()
    attention = attend(block, form, streams, heads, head_dim, config, transformer_options,
                       freqs=token_freqs(pe), mask=attn_mask).flatten(2)
    if form is DOUBLE_FLIPPED:
        img_attention, txt_attention = attention[:, :img.shape[1]], attention[:, img.shape[1]:]
    else:
        txt_attention, img_attention = attention[:, :txt.shape[1]], attention[:, txt.shape[1]:]
    if config.block:
        projection_residual_(img, block.img_attn.proj, img_attention, _gated_add(img_mod1.gate, modulation_dims_img),
                             scale=scale)
        projection_residual_(txt, block.txt_attn.proj, txt_attention, _gated_add(txt_mod1.gate, modulation_dims_txt),
                             scale=scale)
        del attention, txt_attention, img_attention
        for x, norm, mlp, mod, dims in ((img, block.img_norm2, block.img_mlp, img_mod2, modulation_dims_img),
                                        (txt, block.txt_norm2, block.txt_mlp, txt_mod2, modulation_dims_txt)):
            factor = 1 + mod.scale
            mlp_residual_(x, mlp, lambda a, b, x=x, norm=norm, factor=factor, mod=mod, dims=dims:
                          _modulate(norm(x[:, a:b]), factor, mod.shift, dims, a, b), _gated_add(mod.gate, dims),
                          scale=scale)
    else:   # the rest as ComfyUI's block computes it
        apply_mod = flux_layers.apply_mod
        img += apply_mod(block.img_attn.proj(img_attention), img_mod1.gate, None, modulation_dims_img)
        del img_attention
        img += apply_mod(block.img_mlp(apply_mod(block.img_norm2(img), (1 + img_mod2.scale), img_mod2.shift,
                                                 modulation_dims_img)), img_mod2.gate, None, modulation_dims_img)
        txt += apply_mod(block.txt_attn.proj(txt_attention), txt_mod1.gate, None, modulation_dims_txt)
        del txt_attention, attention
        txt += apply_mod(block.txt_mlp(apply_mod(block.txt_norm2(txt), (1 + txt_mod2.scale), txt_mod2.shift,
                                                 modulation_dims_txt)), txt_mod2.gate, None, modulation_dims_txt)
    return img, _finite_fp16(txt)


# --- the single block -------------------------------------------------------------------------------------------
SINGLE_ARGS = ("x", "vec", "pe", "attn_mask", "modulation_dims", "transformer_options")


def _mlp_activation(block, hidden: torch.Tensor) -> torch.Tensor:
    if getattr(block, "yak_mlp", False):
        half = _mlp_first(block) // 2
        return block.mlp_act(hidden[..., half:]) * hidden[..., :half]
    return block.mlp_act(hidden)


def run_single_block(block, config, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):
    mod = block.modulation(vec)[0] if block.modulation else vec
    heads, head_dim = _heads(block)
    width = block.hidden_size
    mlp_rows = (3 * width, 3 * width + _mlp_first(block))
    chunks = chunk_scale(config.policy, heads, x.shape[1])
    modulated = modulated_input(block.pre_norm, x, mod, modulation_dims, chunks)
    linear1 = ComfyLinearRows(block.linear1)
    if not config.block:   # the MLP half as ComfyUI computes it: whole, from the kept modulated input
        prepared = linear1.prepare(modulated)
        try:
            mlp = _mlp_activation(block, prepared.rows(*mlp_rows))
        finally:
            prepared.release()
        attention = attend(block, single_form(block), [[modulated]], heads, head_dim, config, transformer_options,
                           freqs=token_freqs(pe), mask=attn_mask)
        del modulated
        x += flux_layers.apply_mod(block.linear2(torch.cat((attention.flatten(2), mlp), 2)), mod.gate, None,
                                   modulation_dims)
        return _finite_fp16(x)
    handed_off = [modulated]
    del modulated
    attention = attend(block, single_form(block), [handed_off], heads, head_dim, config, transformer_options,
                       freqs=token_freqs(pe), mask=attn_mask).flatten(2)
    # by token chunks: the MLP half of linear1 from the chunk's own modulated input, then linear2 over
    # [attention, mlp] of the chunk, added into x
    batch, tokens, _ = x.shape
    step = chunk_tokens(tokens, batch * (width + _mlp_first(block)), max(1, x.numel() * chunks // 2))
    scale = 1 + mod.scale
    linear1.hold(x)
    linear2 = CastLinear(block.linear2, x)
    try:
        for a, b in token_ranges(tokens, step):
            prepared = linear1.prepare(_modulate(block.pre_norm(x[:, a:b]), scale, mod.shift, modulation_dims, a, b))
            try:
                mlp = _mlp_activation(block, prepared.rows(*mlp_rows))
            finally:
                prepared.release()
            joined = torch.cat((attention[:, a:b], mlp), 2)
            del mlp
            out = linear2(joined)
            del joined
            x[:, a:b] += _modulate(out, mod.gate, None, modulation_dims, a, b)
            del out
    finally:
        linear1.release_hold()
        linear2.release()
    return _finite_fp16(x)


# --- guards and the adapter contract (family.py) ---------------------------------------------------------------
def _extra(bound: dict) -> tuple:
    dims = tuple(name for name in ("modulation_dims", "modulation_dims_img", "modulation_dims_txt")
                 if bound.get(name) is not None)
    return (bound.get("pe") is None, layout(bound.get("attn_mask")), dims, torch.is_tensor(bound.get("vec")))


def _slice_mask(mask, keep: torch.Tensor):
    """`mask` restricted to the tokens `keep` (indices into the joined sequence), on its query and key dims
    where they span the sequence."""
    if mask is None:
        return None
    out = mask
    for dim in (-1, -2):
        if out.dim() >= -dim and out.shape[dim] > 1:
            out = out.index_select(dim, keep.to(out.device))
    return out.clone()


def _clip_dims(dims, n: int):
    return None if dims is None else _chunk_dims(dims, 0, n)


def _check_double(block):
    def check(bound: dict) -> dict:
        """The call's first tokens of each stream (all batch items), with their RoPE rows and mask entries."""
        img, txt = bound["img"], bound["txt"]
        n_img, n_txt = compat.check_tokens(img.shape[1]), min(txt.shape[1], TEXT_CHECK_TOKENS)
        if _double_form(block) is DOUBLE_FLIPPED:
            keep = torch.cat((torch.arange(n_img), img.shape[1] + torch.arange(n_txt)))
        else:
            keep = torch.cat((torch.arange(n_txt), txt.shape[1] + torch.arange(n_img)))
        pe = bound.get("pe")
        out = dict(bound)
        out.update(img=stream_rows(img, n_img), txt=stream_rows(txt, n_txt),
                   pe=None if pe is None else pe.index_select(2, keep.to(pe.device)),
                   attn_mask=_slice_mask(bound.get("attn_mask"), keep),
                   modulation_dims_img=_clip_dims(bound.get("modulation_dims_img"), n_img),
                   modulation_dims_txt=_clip_dims(bound.get("modulation_dims_txt"), n_txt),
                   transformer_options=compat.probe_options(bound.get("transformer_options") or {}))
        return out
    return check


def _single_rows(bound: dict, n: int, tokens: int) -> dict:
    """The check's RoPE rows, mask entries and modulation ranges of its first tokens."""
    return {"pe": lambda pe: pe[:, :, :n].clone(), "attn_mask": lambda mask: _slice_mask(mask, torch.arange(n)),
            "modulation_dims": lambda dims: _clip_dims(dims, n)}


def double_block_forward(block, config):
    """The guarded forward installed on a `DoubleStreamBlock`."""
    return SPEC.guard("double", "double block", block, DOUBLE_ARGS, run_double_block, config, x="img", extra=_extra,
                      check_inputs=_check_double(block), residual=("img", "txt"), hooks_inside=HOOKS_RUN_INSIDE,
                      refuse_more=foreign_part)


def single_block_forward(block, config):
    """The guarded forward installed on a `SingleStreamBlock`."""
    return SPEC.guard("single", "single block", block, SINGLE_ARGS, run_single_block, config, x="x", extra=_extra,
                      cut=_single_rows, residual="x", hooks_inside=HOOKS_RUN_INSIDE, refuse_more=foreign_part)


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone) for every block that probes clean."""
    SPEC.patch(patcher, config, report, block={"double_blocks": (double_block_forward, probe_double),
                                               "single_blocks": (single_block_forward, probe_single)})


matches, stock_functions, tokens_per_item, kv_heads, _, block_kinds = SPEC.contract()


def splits_projections(diffusion_model) -> Optional[str]:
    """The double blocks' fused `img_attn.qkv`, or the single blocks' `linear1` where the model has only those."""
    block = SPEC.first(diffusion_model)
    if hasattr(block, "img_attn"):
        return unsliceable_projection(block.img_attn, ("qkv",), "img_attn.")
    return unsliceable_projection(block, ("linear1",))
