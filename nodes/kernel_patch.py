"""Models no family adapter covers (UNets, other DiTs, families not known yet): a kernel-level patch.

ComfyUI's attention calls of the model (`optimized_attention(q, k, v, heads, ...)`) go through an
`optimized_attention_override` (transformer_options, ComfyUI's own hook) that runs them on the pack's backend:
qkv_core's choice for `auto` (SageAttention 2 / FlashAttention when installed and able to take the call, else
PyTorch SDPA with the pack's kernel order: cuDNN first on Hopper and Blackwell), or the one the node forces.
Projections and memory stay the model's own: this saves no VRAM, the memory estimate is ComfyUI's.

Kept as they are (the call goes on to what would have run): an override another node set (chained), a kernel the
user chose with ComfyUI's flags (`auto`), a per-layer kernel choice (`preferred_attention`, newer ComfyUI), and
any call with arguments the pack does not know.

q, k and v come as tensors, or as ComfyUI's single-owner `AttentionTensorContainer`s (v0.33's MiniMax H3, every
model from v0.40 on): the override has ComfyUI's container path (`container_function`), so ComfyUI's attention
wrapper hands it the containers as they are; it peeks at them to decide and takes them only where the pack's
backend runs the call (a call that goes on gets them untouched), and the wrapper keeps no reference to q/k/v.
"""
from __future__ import annotations

import torch

import comfy.ldm.modules.attention as comfy_attention

from ..qkv_core import pay_attention
from .dispatch import COMFY, choose_backend

OVERRIDE_KEY = "optimized_attention_override"
# keyword arguments of ComfyUI's attention functions the pack reads or may pass over
_KNOWN = {"transformer_options", "_inside_attn_wrapper", "enable_gqa", "attn_precision", "scale",
          "low_precision_attention", "preferred_attention", "skip_reshape", "skip_output_reshape", "mask"}


def make_override(backend: str, previous=None):
    """The override for a model patched at the kernel level with `backend` ("auto" or a backend name).
    `previous`: an override already in the model's transformer_options, which every call goes on to."""

    def override(func, q, k, v, heads, *args, **kwargs):
        if previous is not None:
            return previous(func, q, k, v, heads, *args, **kwargs)
        named = _named(args, kwargs)
        if named is None or not _ours_can_take(backend, *(_peek(t) for t in (q, k, v)), named):
            return func(q, k, v, heads, *args, **kwargs)
        return _attend(backend, *(_take(t) for t in (q, k, v)), heads, **named)

    def container_call(q, k, v, heads, *args, **kwargs):
        """ComfyUI's container path (`wrap_attn` hands an override with `container_function` q/k/v in their
        `AttentionTensorContainer`s, and no `func`): the pack's backend takes them, so no frame of ComfyUI's
        holds q/k/v while the kernel runs; a call the pack does not run goes on to ComfyUI's dispatcher with
        the containers untouched (past its override step: `_inside_attn_wrapper` is in `kwargs`)."""
        named = _named(args, kwargs)
        if named is None or not _ours_can_take(backend, *(_peek(t) for t in (q, k, v)), named):
            return _comfy_dispatcher(named)(q, k, v, heads, *args, **kwargs)
        return _attend(backend, *(_take(t) for t in (q, k, v)), heads, **named)

    override.comfyui_qkv_kernel_patch = True
    override.previous = previous
    if previous is None:
        override.container_function = container_call
    elif hasattr(previous, "container_function"):   # ComfyUI calls the override it finds as it would this one
        override.container_function = previous.container_function
    return override


def _comfy_dispatcher(named):
    """What ComfyUI's wrapper would have run for a call the pack hands on: its masked dispatcher for a call
    with a mask, else its default one."""
    masked = named is not None and named.get("mask") is not None
    return comfy_attention.optimized_attention_masked if masked else comfy_attention.optimized_attention


# ComfyUI's attention functions: (q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
# skip_output_reshape=False, **kwargs); models pass the first of these by position too
_POSITIONAL = ("mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def _named(args, kwargs):
    """The call's arguments by name, or None when they are not ComfyUI's attention contract."""
    if len(args) > len(_POSITIONAL):
        return None
    named = dict(zip(_POSITIONAL, args))
    if set(named) & set(kwargs):
        return None
    named.update(kwargs)
    return None if set(named) - _KNOWN else named


def _peek(t):
    """A tensor argument, or the tensor in ComfyUI's `AttentionTensorContainer` (left in it)."""
    peek = getattr(t, "peek", None)
    return peek() if callable(peek) and not torch.is_tensor(t) else t


def _take(t):
    """A tensor argument, or the tensor taken out of its `AttentionTensorContainer` (the container is empty after:
    the pack's backend is its owner now)."""
    take = getattr(t, "take", None)
    return take() if callable(take) and not torch.is_tensor(t) else t


def _ours_can_take(backend, q, k, v, named) -> bool:
    if named.get("preferred_attention") is not None:
        return False   # the model picked a kernel for this layer: kept for every backend here
    if choose_backend(backend).comfy_dispatch:
        return False   # `auto` where the user picked ComfyUI's kernel with its flags
    if not all(torch.is_tensor(t) for t in (q, k, v)) or any(t.requires_grad for t in (q, k, v)):
        return False   # not tensors (something else than ComfyUI's containers), or training: the model's kernel
    mask = named.get("mask")
    return mask is None or torch.is_tensor(mask)


@torch.compiler.disable(reason="QKV: the pack's backend choice and kernels run eagerly")
def _attend(backend, q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, scale=None,
            low_precision_attention=True, **_ignored):
    """ComfyUI's attention contract on the pack's backend. Inputs `(B, N, H*D)` or, with `skip_reshape`,
    `(B, H, N, D)`; the output `(B, N, H*D)` or, with `skip_output_reshape`, `(B, H, N, D)`. A mask of 2 or
    3 dims gains the batch and heads dims as ComfyUI's SDPA path adds them."""
    if skip_reshape:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    else:
        d = q.shape[-1] // heads
        q, k, v = (t.unflatten(-1, (-1, d)) for t in (q, k, v))
    if mask is not None:
        mask = mask.unsqueeze(0) if mask.dim() == 2 else mask
        mask = mask.unsqueeze(1) if mask.dim() == 3 else mask
    # a softmax scale, or a call kept off 8-bit kernels: the full-precision backend (SDPA)
    choice = choose_backend(backend, full_precision=scale is not None or low_precision_attention is False,
                            dispatcher=False)
    out = pay_attention(q, k, v, mask=mask, force_attention=choice.force_attention, softmax_scale=scale)
    if skip_output_reshape:
        return out.transpose(1, 2)
    return out.flatten(2)


def is_ours(override) -> bool:
    return bool(getattr(override, "comfyui_qkv_kernel_patch", False))


def patch(patcher, backend: str, report, family: str) -> bool:
    """Sets the override on `patcher` (a clone) unless `backend` is ComfyUI's own dispatcher; True if set."""
    if backend == COMFY:
        report.note(f"not patched: {family} has no family adapter here, and attention_backend=comfy keeps "
                    f"ComfyUI's kernel")
        return False
    options = patcher.model_options.setdefault("transformer_options", {})
    previous = options.get(OVERRIDE_KEY)
    if is_ours(previous):
        previous = previous.previous
    options[OVERRIDE_KEY] = make_override(backend, previous)
    report.patched(family, "attention kernel", "optimized_attention")
    report.note(f"{family}: kernel only (no family adapter yet): ComfyUI's attention calls run on the pack's "
                f"backend ({backend}); projections and memory stay the model's own")
    return True


def remove(patcher) -> bool:
    """Puts back the override this pack replaced (or none); True if there was one of the pack's."""
    options = patcher.model_options.get("transformer_options", {})
    current = options.get(OVERRIDE_KEY)
    if not is_ours(current):
        return False
    if current.previous is None:
        del options[OVERRIDE_KEY]
    else:
        options[OVERRIDE_KEY] = current.previous
    return True
