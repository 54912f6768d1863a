"""SD3-layout adapter (`comfy/ldm/modules/diffusionmodules/mmdit.py`'s `JointBlock`): Stable Diffusion 3 and
3.5 (Medium, Large, Large Turbo), every `MMDiT` ComfyUI builds.

A `JointBlock` holds two `DismantledBlock`s, the context's and the image's (`x`); the joint attention over
[context, x] lives in the module function `_block_mixing`, so the block's forward is what is patched. Each
stream's q, k and v come from its fused `attn.qkv` ([q, k, v] along features), per-head `ln_q` / `ln_k`
(ComfyUI's RMSNorm, LayerNorm or Identity), no RoPE, through `nodes/attention.py`. SD3.5 Medium's
`x_block_self_attn` blocks (a second attention, `attn2`, of the image tokens alone, added with its own gate)
get a second `attend` of one stream. The last block's context half is `pre_only` (no output projection, no
MLP): the block returns None for the context, as ComfyUI's does.

With block bounds on, the modulated inputs are made by token chunks and handed off, and the output
projections and MLPs (ComfyUI's `Mlp` as a Sequential of its own fc1, act, fc2; `SwiGLUFeedForward` as a
`GatedMLP`) run by token chunks into the block's outputs in place. The outputs are new tensors, as ComfyUI's
(`x + ...`): its block does not write its inputs, the first block's context can be the caller's conditioning
(a model without `context_embedder`), and a `patches_replace["dit"]` wrapper may read its arguments after the
call. Block bounds off: the rest of the block runs as ComfyUI's own `post_attention` / `post_attention_x`.

Guarded and self-checked like every forward of the pack (`compat.guard_module`). ComfyUI's block calls no
patch hook on q/k/v; a call without a context tensor runs ComfyUI's block.
"""
from __future__ import annotations

from typing import Optional

import torch

import comfy.ldm.modules.diffusionmodules.mmdit as mmdit

from ..attention import AttentionForm, NORM_PER_HEAD, StreamProjections, attend
from ..block_parts import SWIGLU, foreign_part, mlp_residual_, projection_residual_
from ..comfy_ops import chunk_tokens, token_ranges
from .family import TEXT_CHECK_TOKENS, BlockList, Family, stream_rows

FAMILY = "SD3"

# One stream of a `SelfAttention`: fused [q, k, v] and its per-head norms (names inside the SelfAttention).
STREAM = StreamProjections(fused="qkv", norm_q="ln_q", norm_k="ln_k")


def _norm_kind(attentions) -> Optional[str]:
    """NORM_PER_HEAD unless every ln_q / ln_k is an Identity (SD3 Medium: qk_norm None)."""
    identity = all(isinstance(getattr(a, name), torch.nn.Identity) for a in attentions for name in ("ln_q", "ln_k"))
    return None if identity else NORM_PER_HEAD


def joint_form(block) -> AttentionForm:
    """[context, x], each from its own `attn`."""
    return AttentionForm(streams=(STREAM, STREAM),
                         norm=_norm_kind((block.context_block.attn, block.x_block.attn)))


def x_self_form(block) -> AttentionForm:
    """`attn2` of `x_block_self_attn` blocks: the image tokens alone."""
    return AttentionForm(streams=(STREAM,), norm=_norm_kind((block.x_block.attn2,)))


# --- probes -------------------------------------------------------------------------------------------------
def _per_head_norm_ok(norm, head_dim: int) -> bool:
    """An Identity, or a norm over each head's channels (ComfyUI's RMSNorm, a LayerNorm / torch RMSNorm)."""
    if isinstance(norm, torch.nn.Identity):
        return True
    if isinstance(norm, mmdit.RMSNorm):
        return norm.weight is None or tuple(norm.weight.shape) == (head_dim,)
    if isinstance(norm, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
        return tuple(norm.normalized_shape) == (head_dim,)
    return False


def _dropout_off(module) -> bool:
    return isinstance(module, torch.nn.Identity) or (
        isinstance(module, torch.nn.Dropout) and (module.p == 0 or not module.training))


def mlp_layers(mlp):
    """ComfyUI's `Mlp` as `Sequential(fc1, act, fc2)` (its dropouts off and no hidden norm: what it computes),
    `SwiGLUFeedForward` as itself (run as `SWIGLU`)."""
    if isinstance(mlp, mmdit.SwiGLUFeedForward):
        return mlp
    return torch.nn.Sequential(mlp.fc1, mlp.act, mlp.fc2)


def _mlp_reason(mlp) -> Optional[str]:
    if isinstance(mlp, mmdit.SwiGLUFeedForward):
        return None if SWIGLU.linears(mlp) is not None else "its SwiGLU lacks w1/w2/w3"
    if not isinstance(mlp, mmdit.Mlp):
        return f"its MLP is a {type(mlp).__name__}"
    for name in ("fc1", "fc2"):
        weight = getattr(getattr(mlp, name, None), "weight", None)
        if weight is None or weight.dim() != 2:
            return f"its MLP's {name} is not a Linear"
    if not (_dropout_off(mlp.drop1) and _dropout_off(mlp.drop2) and isinstance(mlp.norm, torch.nn.Identity)):
        return "its MLP has active dropout or a hidden norm"
    return None


def _half_reason(half, name: str, width: int, heads: int, head_dim: int, outputs: bool) -> Optional[str]:
    """Why a `DismantledBlock` is not what the pack's forward computes, or None."""
    attentions = [half.attn] + ([half.attn2] if getattr(half, "x_block_self_attn", False) else [])
    for attn in attentions:
        if getattr(attn, "num_heads", None) != heads or getattr(attn, "head_dim", None) != head_dim:
            return f"{name}'s attentions have other heads"
        reason = STREAM.probe(attn, width, width)
        if reason:
            return f"{name}: {reason}"
        for norm in ("ln_q", "ln_k"):
            if not _per_head_norm_ok(getattr(attn, norm, None), head_dim):
                return f"{name}'s {norm} is not a norm over each head's channels"
        if outputs and getattr(attn, "proj", None) is None:
            return f"{name} has no output projection"
    if getattr(half, "norm1", None) is None:
        return f"{name} has no norm1"
    if outputs:
        if getattr(half, "norm2", None) is None:
            return f"{name} has no norm2"
        reason = _mlp_reason(getattr(half, "mlp", None))
        if reason:
            return f"{name}: {reason}"
    return None


def probe(block) -> Optional[str]:
    """None when a `JointBlock` has the structure the pack's forward uses."""
    x_half, context_half = getattr(block, "x_block", None), getattr(block, "context_block", None)
    if not isinstance(x_half, mmdit.DismantledBlock) or not isinstance(context_half, mmdit.DismantledBlock):
        return "no context_block/x_block"
    if x_half.pre_only:
        return "its x_block is pre_only"
    heads, head_dim = x_half.attn.num_heads, x_half.attn.head_dim
    width = heads * head_dim
    qkv = getattr(x_half.attn.qkv, "weight", None)
    if qkv is None or qkv.dim() != 2 or qkv.shape[1] != width:
        return "qkv does not take heads x head_dim features"
    if getattr(context_half, "x_block_self_attn", False):
        return "its context_block has a second attention"
    return (_half_reason(context_half, "context_block", width, heads, head_dim, not context_half.pre_only)
            or _half_reason(x_half, "x_block", width, heads, head_dim, True))


# --- modulation -----------------------------------------------------------------------------------------------
MOD_NAMES = {   # (x_block_self_attn, scale_mod_only, pre_only) -> the chunks of adaLN_modulation, in order
    (True, False, False): ("shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp",
                           "shift_msa2", "scale_msa2", "gate_msa2"),
    (False, False, False): ("shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp"),
    (False, False, True): ("shift_msa", "scale_msa"),
    (False, True, False): ("scale_msa", "gate_msa", "scale_mlp", "gate_mlp"),
    (False, True, True): ("scale_msa",),
}


def modulation(half, c: torch.Tensor) -> dict:
    """The half's modulation vectors `(B, C)` by name (a shift the layout lacks is None, as ComfyUI's)."""
    names = MOD_NAMES[(bool(half.x_block_self_attn), bool(half.scale_mod_only), bool(half.pre_only))]
    chunks = half.adaLN_modulation(c).chunk(len(names), dim=1)
    out = dict.fromkeys(("shift_msa", "shift_mlp", "shift_msa2"))
    out.update(zip(names, chunks))
    return out


def modulated_input(norm, x: torch.Tensor, shift, scale) -> torch.Tensor:
    """ComfyUI's `modulate(norm(x), shift, scale)` `(B, N, C)` in a fresh tensor, made by token chunks (the
    norm's transients are a chunk's)."""
    out = torch.empty_like(x)
    step = chunk_tokens(x.shape[1], x[:, :1].numel(), max(1, x.numel() // 8))
    for a, b in token_ranges(x.shape[1], step):
        out[:, a:b] = mmdit.modulate(norm(x[:, a:b]), shift, scale)
    return out


def _gated_add(gate: torch.Tensor):
    """`part += gate * update` for a chunk (the update is the chunk's own: scaled in place)."""
    gate = gate.unsqueeze(1)

    def add_(part, update, a, b):
        part += update.mul_(gate)
    return add_


# --- the block --------------------------------------------------------------------------------------------------
BLOCK_ARGS = ("context", "x", "c", "use_checkpoint", "transformer_options")


def _x_self_attention(block, config, x, mods, transformer_options) -> torch.Tensor:
    """`attn2` of the image tokens `(B, N, C)` from their own modulated input (handed off)."""
    attn2 = block.x_block.attn2
    handed_off = [modulated_input(block.x_block.norm1, x, mods["shift_msa2"], mods["scale_msa2"])]
    return attend(attn2, x_self_form(block), [handed_off], attn2.num_heads, attn2.head_dim, config,
                  transformer_options).flatten(2)


def _bounded_half(half, out: torch.Tensor, attention: torch.Tensor, mods: dict) -> None:
    """`out` += the half's gated output projection of `attention`, then its gated MLP, by token chunks."""
    projection_residual_(out, half.attn.proj, attention, _gated_add(mods["gate_msa"]))
    del attention
    _mlp_residual(half, out, mods)


def _mlp_residual(half, out: torch.Tensor, mods: dict) -> None:
    norm, shift, scale = half.norm2, mods["shift_mlp"], mods["scale_mlp"]
    mlp = mlp_layers(half.mlp)
    mlp_residual_(out, mlp, lambda a, b: mmdit.modulate(norm(out[:, a:b]), shift, scale),
                  _gated_add(mods["gate_mlp"]), gated=SWIGLU if mlp is half.mlp else None)


def run_joint_block(block, config, context, x, c, use_checkpoint=True, transformer_options={}):
    """The `JointBlock` forward: (context `(B, M, C)` or None for a `pre_only` context, x `(B, N, C)`), new
    tensors; the inputs are not written. `c` `(B, C)`: the block's conditioning vector. `use_checkpoint`
    only matters for training (the guard runs ComfyUI's block when gradients are on)."""
    context_half, x_half = block.context_block, block.x_block
    context_mods, x_mods = modulation(context_half, c), modulation(x_half, c)
    heads, head_dim = x_half.attn.num_heads, x_half.attn.head_dim
    context_tokens = context.shape[1]
    handed_off = [[modulated_input(context_half.norm1, context, context_mods["shift_msa"], context_mods["scale_msa"])],
                  [modulated_input(x_half.norm1, x, x_mods["shift_msa"], x_mods["scale_msa"])]]
    # the runtime holds the only references to the modulated inputs: each is freed once projected
    attention = attend(x_half.attn, joint_form(block), handed_off, heads, head_dim, config, transformer_options,
                       stream_modules=(context_half.attn, x_half.attn)).flatten(2)
    del handed_off
    if not config.block:   # the rest as ComfyUI's block computes it
        context_out = None
        if not context_half.pre_only:
            context_out = context_half.post_attention(attention[:, :context_tokens], context, context_mods["gate_msa"],
                                                      context_mods["shift_mlp"], context_mods["scale_mlp"],
                                                      context_mods["gate_mlp"])
        x_attention = attention[:, context_tokens:]
        del attention
        if x_half.x_block_self_attn:
            attention2 = _x_self_attention(block, config, x, x_mods, transformer_options)
            return context_out, x_half.post_attention_x(x_attention, attention2, x, x_mods["gate_msa"],
                                                        x_mods["shift_mlp"], x_mods["scale_mlp"],
                                                        x_mods["gate_mlp"], x_mods["gate_msa2"])
        return context_out, x_half.post_attention(x_attention, x, x_mods["gate_msa"], x_mods["shift_mlp"],
                                                  x_mods["scale_mlp"], x_mods["gate_mlp"])
    context_out = None
    if not context_half.pre_only:
        context_out = context.clone()   # the output: the updates are added into it in place
        _bounded_half(context_half, context_out, attention[:, :context_tokens], context_mods)
    x_out = x.clone()
    projection_residual_(x_out, x_half.attn.proj, attention[:, context_tokens:], _gated_add(x_mods["gate_msa"]))
    del attention
    if x_half.x_block_self_attn:   # from the block's input x (not written), after the joint attention is freed
        attention2 = _x_self_attention(block, config, x, x_mods, transformer_options)
        projection_residual_(x_out, x_half.attn2.proj, attention2, _gated_add(x_mods["gate_msa2"]))
        del attention2
    _mlp_residual(x_half, x_out, x_mods)
    return context_out, x_out


# --- guards and the adapter contract (family.py) ---------------------------------------------------------------
class _SD3(Family):
    def functions(self, module) -> tuple:
        """ComfyUI's functions the block's math is in (looked up now: a reloaded ComfyUI is checked again)."""
        return (type(module).forward, mmdit._block_mixing, mmdit.DismantledBlock.post_attention,
                mmdit.DismantledBlock.post_attention_x)


# Every `JointBlock` of an MMDiT, patched whatever block bounds say (its forward holds the joint attention).
SPEC = _SD3(FAMILY, "sd3", (BlockList("joint_blocks", label="joint block", cls=mmdit.JointBlock),), latent_ranks=(4,),
            projections=("x_block.attn", ("qkv",), "x_block.attn."), blocks_always=True, names=("SD3.5",))


def _refuse_call(bound) -> Optional[str]:
    if not torch.is_tensor(bound.get("context")) or not torch.is_tensor(bound.get("x")):
        return "called without a context or x tensor"
    return None


def _context_rows(bound: dict, n: int, tokens: int) -> dict:
    """The check's first tokens of the context too."""
    return {"context": lambda context: stream_rows(context, min(context.shape[1], TEXT_CHECK_TOKENS))}


def block_forward(block, config):
    """The guarded forward installed on a `JointBlock`."""
    return SPEC.guard("joint", "joint block", block, BLOCK_ARGS, run_joint_block, config, x="x",
                      extra=lambda bound: (bound["context"].dtype,), cut=_context_rows, residual=("context", "x"),
                      refuse_call=_refuse_call, refuse_more=foreign_part)


def patch(patcher, config, report) -> None:
    """Object patches on `patcher` (a clone) for every joint block that probes clean."""
    SPEC.patch(patcher, config, report, block=(block_forward, probe))


matches, stock_functions, tokens_per_item, kv_heads, splits_projections, _ = SPEC.contract()


def block_kinds(diffusion_model) -> tuple:
    return tuple(sorted({"joint_self_attention" if getattr(block.x_block, "x_block_self_attn", False) else "joint"
                         for _, _, block in SPEC.blocks(diffusion_model)}))
