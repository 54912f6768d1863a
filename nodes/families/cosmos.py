"""Cosmos predict2 adapter (`comfy/ldm/cosmos/predict2.py`: `MiniTrainDIT`'s `Block` and its `Attention`; Anima's
DiT is a `MiniTrainDIT` and has the same blocks).

Both attention modules of a block are predict2's `Attention`: q/k/v from `q_proj`/`k_proj`/`v_proj`, `q_norm` /
`k_norm` RMSNorms over each head's channels (any head group runs them: `NORM_PER_HEAD`), and in the
self-attention RoPE on each head's halves (`ROPE_SPLIT_HALF`) from the model's rotation matrices
`(1, T*H*W, 1, D/2, 2, 2)` float32. The cross-attention to the text gets the norms and no RoPE. Each is
patched through `nodes/attention.py`'s `attend()`.

With block bounds on, the `Block` is bounded too: its 5-D residual `(B, T, H, W, D)` is worked on as
`(B, T*H*W, D)` tokens; each modulated input (LayerNorm, then adaLN(-LoRA) scale and shift of the token's frame)
is made by token chunks and handed off, the output projections add into the residual by token chunks in place
(gated), and the feed-forward runs by token chunks. The residual keeps its own dtype (float32 around a float16
model, as ComfyUI does); every part computes in the timestep embedding's dtype.

Left to ComfyUI (the module or block runs its own forward, one log line): calls with another node's
`attn1_patch` / `attn2_patch` (ComfyUI calls them on the whole q/k/v inputs) or `mlp_patch` (the block's whole
MLP input), an `attn_op` another node replaced, a RoPE table of another layout, a self-attention called with a
context, unknown arguments. Guarded and self-checked like every forward of the pack (`compat.guard_module`).
"""
from __future__ import annotations

from typing import Optional

import torch

import comfy.ldm.cosmos.predict2 as predict2

from .. import compat
from ..attention import NORM_PER_HEAD, ROPE_SPLIT_HALF, AttentionForm, StreamProjections, attend
from ..block_parts import foreign_part, mlp_residual_, output_projection_, projection_residual_
from ..comfy_ops import chunk_tokens, token_ranges
from .family import BlockList, Family, probe_heads

FAMILY = "Cosmos"

STREAM = StreamProjections(q="q_proj", k="k_proj", v="v_proj", norm_q="q_norm", norm_k="k_norm")
ROTATED = AttentionForm(streams=(STREAM,), norm=NORM_PER_HEAD, rope=ROPE_SPLIT_HALF)   # self-attention
NORMED = AttentionForm(streams=(STREAM,), norm=NORM_PER_HEAD)   # cross-attention (and a self-attention without RoPE)

ATTENTION_ARGS = ("x", "context", "rope_emb", "transformer_options")
BLOCK_ARGS = ("x_B_T_H_W_D", "emb_B_T_D", "crossattn_emb", "rope_emb_L_1_1_D", "adaln_lora_B_T_3D",
              "extra_per_block_pos_emb", "transformer_options")
BLOCK_PARTS = ("self_attn", "cross_attn", "mlp")
# A `MiniTrainDIT`'s blocks: both attention modules patched, and the block.
SPEC = Family(FAMILY, "cosmos", (BlockList("blocks", cls=predict2.Block),), latent_ranks=(5,),
              patch_size=("patch_temporal", "patch_spatial", "patch_spatial"),
              projections=("self_attn", ("q_proj", "k_proj", "v_proj"), "self_attn."),
              attentions=("self_attn", "cross_attn"), stock_parts=BLOCK_PARTS, patch_parts=BLOCK_PARTS,
              model_class=predict2.MiniTrainDIT)
MODULATIONS = ("self_attn", "cross_attn", "mlp")   # adaln_modulation_<name>, layer_norm_<name>


# --- attention ----------------------------------------------------------------------------------------------

def rope_refusal(rope_emb, tokens: int, heads: int, head_dim: int) -> Optional[str]:
    """None for the model's self-attention RoPE argument (rotation matrices `(1 or B, tokens, 1 or heads, D/2,
    2, 2)`), else why the pack's forward does not take it."""
    if rope_emb is None:
        return None
    if not torch.is_tensor(rope_emb) or rope_emb.dim() != 6 or rope_emb.shape[1] != tokens or \
            rope_emb.shape[2] not in (1, heads) or tuple(rope_emb.shape[3:]) != (head_dim // 2, 2, 2):
        return f"a RoPE table of shape {tuple(getattr(rope_emb, 'shape', ()))} for {tokens} tokens"
    return None


def attention_refusal(module, x, context, rope_emb, transformer_options) -> Optional[str]:
    """Why the pack's attention must not take this call (ComfyUI's forward then runs), else None."""
    hook = "attn1_patch" if module.is_selfattn else "attn2_patch"
    reason = compat.hooks_refusal(transformer_options, (hook,))
    if reason is not None:
        return reason
    if getattr(module, "attn_op", None) is not predict2.torch_attention_op:
        return "its attn_op was replaced"
    if not torch.is_tensor(x) or x.dim() != 3:
        return "an input that is not (B, N, C)"
    if module.is_selfattn:
        if context is not None:
            return "a self-attention called with a context"
        return rope_refusal(rope_emb, x.shape[1], module.n_heads, module.head_dim)
    if not torch.is_tensor(context) or context.dim() != 3:
        return "a cross-attention without a (B, M, C) context"
    return None


def attention(module, config, x_list: list, transformer_options, context=None, rope_emb=None) -> torch.Tensor:
    """predict2 `Attention` of `[x]` (the list is cleared: handed off), x `(B, N, C)`, without the output
    projection: `(B, N, n_heads, head_dim)`. A self-attention rotates by `rope_emb`; a cross-attention attends
    to `context` `(B, M, context_dim)` (kept: it is the caller's). A call `attention_refusal` passed."""
    if not module.is_selfattn:
        return attend(module, NORMED, [x_list], module.n_heads, module.head_dim, config, transformer_options,
                      context_list=[context])
    form = NORMED if rope_emb is None else ROTATED
    return attend(module, form, [x_list], module.n_heads, module.head_dim, config, transformer_options,
                  freqs=rope_emb)


def probe_attention(module) -> Optional[str]:
    """None when `module` (predict2's `Attention`) has the structure the pack's forward uses."""
    heads, head_dim, reason = probe_heads(module, "n_heads", "head_dim", STREAM, ("q_norm", "k_norm"))
    if reason:
        return reason
    width = heads * head_dim
    if not isinstance(getattr(module, "v_norm", None), torch.nn.Identity):
        return "v_norm is not an Identity"
    weight = getattr(getattr(module, "output_proj", None), "weight", None)
    if weight is None or weight.dim() != 2 or weight.shape[1] != width:
        return "output_proj is not a Linear over the inner width"
    if not isinstance(getattr(module, "output_dropout", None), (torch.nn.Identity, torch.nn.Dropout)):
        return "output_dropout is neither Identity nor Dropout"
    if getattr(module, "attn_op", None) is not predict2.torch_attention_op:
        return "its attn_op was replaced"
    return None


# --- the bounded block --------------------------------------------------------------------------------------
class _FrameValues:
    """One of a block's adaLN(-LoRA) modulations, `shift`, `scale`, `gate` each `(B, 1 or T, D)` (one row per
    frame), for a token range of the flattened `(t h w)` tokens at a time: `(B, 1 or b - a, D)`."""

    def __init__(self, block, name: str, emb: torch.Tensor, adaln_lora, tokens_per_frame: int):
        values = getattr(block, f"adaln_modulation_{name}")(emb)
        if block.use_adaln_lora:
            values = values + adaln_lora
        self.shift, self.scale, self.gate = values.chunk(3, dim=-1)
        self.tokens_per_frame = tokens_per_frame

    def rows(self, values: torch.Tensor, a: int, b: int) -> torch.Tensor:
        if values.shape[1] == 1:
            return values
        first, last = a // self.tokens_per_frame, (b - 1) // self.tokens_per_frame
        if first == last:   # one frame: a view
            return values[:, first:first + 1]
        frames = torch.arange(a, b, device=values.device) // self.tokens_per_frame
        return values.index_select(1, frames)


def _modulate(norm, part: torch.Tensor, mod: _FrameValues, a: int, b: int) -> torch.Tensor:
    """`norm(part) * (1 + scale) + shift` for the tokens [a, b), as the model writes it."""
    return norm(part) * (1 + mod.rows(mod.scale, a, b)) + mod.rows(mod.shift, a, b)


def _modulated(norm, x: torch.Tensor, mod: _FrameValues, dtype: torch.dtype) -> torch.Tensor:
    """The modulated `x` `(B, N, D)` in `dtype`, a fresh tensor made by token chunks (the one wide input)."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    step = chunk_tokens(x.shape[1], x[:, :1].numel(), max(1, x.numel() // 8))
    for a, b in token_ranges(x.shape[1], step):
        out[:, a:b] = _modulate(norm, x[:, a:b], mod, a, b)
    return out


def _gated(mod: _FrameValues, residual_dtype: torch.dtype):
    def add_(part, out, a, b):
        part.addcmul_(mod.rows(mod.gate, a, b).to(residual_dtype), out.to(residual_dtype))
    return add_


def run_block(block, config, x_B_T_H_W_D, emb_B_T_D, crossattn_emb, rope_emb_L_1_1_D=None, adaln_lora_B_T_3D=None,
              extra_per_block_pos_emb=None, transformer_options={}):
    """predict2 `Block.forward` with bounded memory: the residual is updated in place (and returned)."""
    x = x_B_T_H_W_D
    if extra_per_block_pos_emb is not None:
        if torch.result_type(x, extra_per_block_pos_emb) == x.dtype:
            x.add_(extra_per_block_pos_emb)
        else:
            x = x + extra_per_block_pos_emb
    x = x.contiguous()
    residual_dtype, compute_dtype = x.dtype, emb_B_T_D.dtype
    batch, frames, height, width, channels = x.shape
    flat = x.view(batch, frames * height * width, channels)   # the residual's own storage
    mods = {name: _FrameValues(block, name, emb_B_T_D, adaln_lora_B_T_3D, height * width) for name in MODULATIONS}

    # self-attention: x += gate * output_proj(self_attn(modulated x))
    handed_off = [_modulated(block.layer_norm_self_attn, flat, mods["self_attn"], compute_dtype)]
    out = attention(block.self_attn, config, handed_off, transformer_options, rope_emb=rope_emb_L_1_1_D)
    projection_residual_(flat, block.self_attn.output_proj, out.flatten(2), _gated(mods["self_attn"], residual_dtype))
    del out
    # cross-attention to the text
    handed_off = [_modulated(block.layer_norm_cross_attn, flat, mods["cross_attn"], compute_dtype)]
    out = attention(block.cross_attn, config, handed_off, transformer_options, context=crossattn_emb)
    projection_residual_(flat, block.cross_attn.output_proj, out.flatten(2),
                         _gated(mods["cross_attn"], residual_dtype))
    del out

    # feed-forward by token chunks
    def mlp_input(a, b):
        return _modulate(block.layer_norm_mlp, flat[:, a:b], mods["mlp"], a, b).to(compute_dtype)
    mlp = block.mlp
    mlp_residual_(flat, torch.nn.Sequential(mlp.layer1, mlp.activation, mlp.layer2), mlp_input,
                  _gated(mods["mlp"], residual_dtype), like=emb_B_T_D)
    return x


def probe_block(block) -> Optional[str]:
    """None when a predict2 `Block` has the structure the bounded block uses."""
    for name in ("self_attn", "cross_attn"):
        module = getattr(block, name, None)
        if not isinstance(module, predict2.Attention):
            return f"no {name}"
        reason = probe_attention(module)
        if reason:
            return f"{name}: {reason}"
    if not block.self_attn.is_selfattn or block.cross_attn.is_selfattn:
        return "self_attn/cross_attn of the other kind"
    for name in MODULATIONS:
        if getattr(block, f"layer_norm_{name}", None) is None or \
                not isinstance(getattr(block, f"adaln_modulation_{name}", None), torch.nn.Sequential):
            return f"no layer_norm_{name} / adaln_modulation_{name}"
    mlp = getattr(block, "mlp", None)
    if type(mlp) is not predict2.GPT2FeedForward or type(getattr(mlp, "activation", None)) is not torch.nn.GELU:
        return "mlp is not GPT2FeedForward(layer1, GELU, layer2)"
    return None


# --- guards and the adapter contract (family.py) ---------------------------------------------------------------
def _rope_layout(rope_emb):
    return None if rope_emb is None else (rope_emb.dim(), tuple(rope_emb.shape[2:]), rope_emb.dtype)


def _attention_extra(bound: dict) -> tuple:
    return (bound.get("context") is None, _rope_layout(bound.get("rope_emb")))


def _rope_rows(bound: dict, n: int, tokens: int) -> dict:
    """The check's RoPE rows: those of its first tokens (a cross-attention's context whole)."""
    return {"rope_emb": lambda rope: rope[:, :n].clone()}


def _refuse_attention(module):
    def refuse(bound) -> Optional[str]:
        return attention_refusal(module, bound["x"], bound.get("context"), bound.get("rope_emb"),
                                 bound.get("transformer_options"))
    return refuse


def run_attention(module, config, x, context=None, rope_emb=None, transformer_options={}):
    """predict2 `Attention.forward`: the output projection of the attention of x."""
    out = attention(module, config, [x], transformer_options, context=context, rope_emb=rope_emb)
    return output_projection_(module.output_proj, out)


def attention_forward(module, config):
    """The guarded forward installed on a predict2 `Attention` (self- or cross-attention)."""
    return SPEC.guard("attention", "attention", module, ATTENTION_ARGS, run_attention, config, x="x",
                      extra=_attention_extra, cut=_rope_rows, refuse_call=_refuse_attention(module))


def _block_extra(bound: dict) -> tuple:
    emb = bound["emb_B_T_D"]
    return (emb.dtype, _rope_layout(bound.get("rope_emb_L_1_1_D")), emb.shape[1] == 1,
            bound.get("adaln_lora_B_T_3D") is None, bound.get("extra_per_block_pos_emb") is None)


def _check_block(bound: dict) -> dict:
    """The call's first tokens: whole frames of the first frames, or the first rows of the first frame, with
    their RoPE rows, per-frame modulation and extra position embedding (the text whole)."""
    x = bound["x_B_T_H_W_D"]
    _, frames, height, width, _ = x.shape
    n = compat.check_tokens(frames * height * width)
    kept_frames, rows = (max(1, n // (height * width)), height) if n >= height * width else (1, max(1, n // width))

    def cut(t):   # (B, T, H, W, ...) -> its first frames and rows
        return t[:, :kept_frames, :rows].clone()

    def per_frame(t):
        return t[:, :kept_frames].clone() if t is not None and t.shape[1] == frames else t
    out = dict(bound, x_B_T_H_W_D=cut(x), emb_B_T_D=per_frame(bound["emb_B_T_D"]))
    if bound.get("adaln_lora_B_T_3D") is not None:
        out["adaln_lora_B_T_3D"] = per_frame(bound["adaln_lora_B_T_3D"])
    if bound.get("extra_per_block_pos_emb") is not None:
        out["extra_per_block_pos_emb"] = cut(bound["extra_per_block_pos_emb"])
    rope = bound.get("rope_emb_L_1_1_D")
    if rope is not None:
        out["rope_emb_L_1_1_D"] = cut(rope.unflatten(1, (frames, height, width))).flatten(1, 3)
    out["transformer_options"] = compat.probe_options(bound.get("transformer_options") or {})
    return out


def _refuse_block(block):
    def refuse(bound) -> Optional[str]:
        x, emb = bound["x_B_T_H_W_D"], bound["emb_B_T_D"]
        if not torch.is_tensor(x) or x.dim() != 5:
            return "a residual that is not (B, T, H, W, D)"
        if not torch.is_tensor(emb) or emb.dim() != 3 or emb.shape[1] not in (1, x.shape[1]):
            return "a timestep embedding neither per call nor per frame"
        lora = bound.get("adaln_lora_B_T_3D")
        if block.use_adaln_lora and (not torch.is_tensor(lora) or lora.shape[1] not in (1, x.shape[1])):
            return "adaLN-LoRA without its per-frame values"
        extra = bound.get("extra_per_block_pos_emb")
        if extra is not None and (not torch.is_tensor(extra) or extra.shape != x.shape):
            return "an extra position embedding of another shape"
        options = bound.get("transformer_options")
        if "mlp_patch" in compat.hooks_set(options):
            return "another node's mlp_patch (ComfyUI calls it on the whole MLP input)"
        tokens = x.flatten(1, 3)   # a view: the attention's (B, N, D)
        return attention_refusal(block.self_attn, tokens, None, bound.get("rope_emb_L_1_1_D"), options) \
            or attention_refusal(block.cross_attn, tokens, bound.get("crossattn_emb"), None, options)
    return refuse


def bounded_block_forward(block, config):
    """The guarded bounded forward installed on a predict2 `Block`."""
    return SPEC.guard("block", "block", block, BLOCK_ARGS, run_block, config, x="x_B_T_H_W_D", extra=_block_extra,
                      check_inputs=_check_block, residual="x_B_T_H_W_D", refuse_call=_refuse_block(block),
                      refuse_more=foreign_part)


def _probe_attention(module) -> Optional[str]:
    return probe_attention(module) if isinstance(module, predict2.Attention) else "not predict2's Attention"


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone): both attention modules of every block that probe clean; with
    block bounds, the blocks."""
    SPEC.patch(patcher, config, report, attention=(attention_forward, _probe_attention),
               block=(bounded_block_forward, probe_block))


matches, stock_functions, tokens_per_item, kv_heads, splits_projections, block_kinds = SPEC.contract()
