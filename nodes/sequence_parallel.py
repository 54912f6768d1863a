"""Sequence parallelism another node pack installed: raylight's Ulysses (xFuser's USP), recognised on a block's
attention modules, kept, and run by groups of heads (docs/design.md §3.7).

raylight shards a model's tokens over the GPUs of a sequence-parallel group and binds its own forwards to the
attention modules of each block when it loads the model (its self-attention exchanges q, k and v of every head by
one all-to-all; its cross-attention attends each rank's queries over the whole context, which every rank holds).
The pack keeps raylight's model forward and process group, and recognises those bound forwards here: a bounded
block whose self-attention carries a recognised Ulysses forward runs it as `qkv_core.ulysses_qkv_attention` over
that forward's group (one group of heads exchanged at a time), and its cross-attention where every rank has the
whole context (the same numbers, no exchange). Any other forward another node bound to a part keeps the block
ComfyUI's (`block_parts.foreign_part`).

Recognition is by identity: a forward is raylight's when it is the very function its module defines, looked up in
`sys.modules` (raylight imported it to bind it), so nothing here imports raylight or xFuser before they are in
use. Another pack (or a test) adds its own with `register_ulysses_forward`.

Every rank of the group runs the same guarded calls in the same order; `agreement` makes each call's path the
group's before any exchange: whether a rank runs ComfyUI's own (gradients, another node's part, ...), whether a
rank lacks the verdict (then every rank checks again), and the check's verdict (one that failed anywhere fails
everywhere), or the ranks would take different paths and wait on each other's exchanges.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Optional

import torch

from ..qkv_core.sequence_parallel import process_group_of

SELF_ATTENTION = "self-attention"     # exchanges q, k and v over its group (Ulysses)
CROSS_ATTENTION = "cross-attention"   # attends a rank's queries over the whole context every rank holds

# raylight's Wan forwards (komikndr/raylight, src/raylight/diffusion_models/wan/xdit_context_parallel.py), bound to
# every WanAttentionBlock's self_attn and cross_attn when its USP patch loads the model; its group is xFuser's
RAYLIGHT_WAN = "raylight.diffusion_models.wan.xdit_context_parallel"
XFUSER_DISTRIBUTED = "xfuser.core.distributed"


def _xfuser_sp_group():
    """xFuser's sequence-parallel coordinator (raylight's group), from the module raylight's forwards import."""
    distributed = sys.modules.get(XFUSER_DISTRIBUTED)
    if distributed is None:
        raise RuntimeError(f"{XFUSER_DISTRIBUTED} is not imported: no xFuser sequence-parallel group")
    return distributed.get_sp_group()


@dataclasses.dataclass(frozen=True)
class KnownForward:
    """A forward another pack binds to an attention module: the function `name` of the module `module` (looked up
    in `sys.modules` at each question, identity compared) or the function itself (`function`); its `role`
    (`SELF_ATTENTION` or `CROSS_ATTENTION`); `group()`, the process group its exchange runs over (a
    `torch.distributed.ProcessGroup` or xFuser's coordinator; a self-attention's only)."""

    role: str
    module: Optional[str] = None
    name: Optional[str] = None
    function: Optional[Callable] = None
    group: Optional[Callable[[], object]] = None

    def resolve(self) -> Optional[Callable]:
        if self.function is not None:
            return self.function
        return getattr(sys.modules.get(self.module), self.name, None)


_KNOWN: list = [
    KnownForward(SELF_ATTENTION, RAYLIGHT_WAN, "usp_self_attn_forward", group=_xfuser_sp_group),
    KnownForward(CROSS_ATTENTION, RAYLIGHT_WAN, "usp_t2v_cross_attn_forward"),
    KnownForward(CROSS_ATTENTION, RAYLIGHT_WAN, "usp_i2v_cross_attn_forward"),
]


def register_ulysses_forward(function: Callable, role: str, group: Optional[Callable[[], object]] = None) -> None:
    """Recognise `function` (bound to attention modules by another pack) as a sequence-parallel forward of `role`:
    `SELF_ATTENTION` with `group()` its process group (Ulysses over it: every rank holds its shard of the tokens
    with every head), or `CROSS_ATTENTION` (each rank's queries over the whole context, no exchange needed).
    A `ValueError` for another role, or a self-attention without a group."""
    if role not in (SELF_ATTENTION, CROSS_ATTENTION):
        raise ValueError(f"role must be {SELF_ATTENTION!r} or {CROSS_ATTENTION!r}, not {role!r}")
    if role == SELF_ATTENTION and not callable(group):
        raise ValueError("a sequence-parallel self-attention needs group: a callable giving its process group")
    _KNOWN.append(KnownForward(role, function=function, group=group))


def unregister_ulysses_forward(function: Callable) -> None:
    """Forget a forward `register_ulysses_forward` added (tests)."""
    _KNOWN[:] = [known for known in _KNOWN if known.function is not function]


def bound_function(module) -> Optional[Callable]:
    """The function another pack bound to `module` as its forward (an instance attribute), or None."""
    forward = getattr(module, "__dict__", {}).get("forward")
    return None if forward is None else getattr(forward, "__func__", forward)


def recognised(module) -> Optional[KnownForward]:
    """The `KnownForward` of the forward bound to `module`, or None (none bound, or not one known here)."""
    function = bound_function(module)
    if function is None:
        return None
    for known in _KNOWN:
        if known.resolve() is function:
            return known
    return None


def ulysses_group(module):
    """The process group of the sequence-parallel self-attention bound to `module`, or None where none is. Its
    group may refuse the grouped exchange (a ring degree: `qkv_core.process_group_of` says why)."""
    known = recognised(module)
    if known is None or known.role != SELF_ATTENTION:
        return None
    return known.group()


def world_of(group) -> int:
    """The ranks of `group` (an xFuser coordinator's Ulysses group, or a process group)."""
    return torch.distributed.get_world_size(process_group_of(group))


def refusal(group) -> Optional[str]:
    """Why the grouped exchange cannot run over `group` (xFuser's ring attention, say), or None."""
    try:
        process_group_of(group)
    except ValueError as error:
        return str(error)
    return None


class Agreement:
    """How the ranks of `group` take one path: `any(*flags)`, whether each flag is set on any rank (one MAX
    all-reduce of a tiny int tensor: on CUDA for nccl); `agree(reason)` (calling it), a self-check verdict made
    the group's: a check that failed on any rank fails on all (with its own reason where it failed here)."""

    def __init__(self, group):
        self.group = group

    def any(self, *flags: bool) -> tuple:
        values = torch.tensor([1 if flag else 0 for flag in flags], dtype=torch.int32)
        process_group = process_group_of(self.group)
        if torch.distributed.get_backend(process_group) == "nccl":
            values = values.cuda()
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=process_group)
        return tuple(bool(value) for value in values.tolist())

    def __call__(self, reason: Optional[str]) -> Optional[str]:
        (failed,) = self.any(reason is not None)
        if reason is None and failed:
            return "the check failed on another rank of the sequence-parallel group"
        return reason


def agreement(group) -> Agreement:
    """The `Agreement` of `group`'s ranks (`compat.guard_module`'s `agree`): every reason to run ComfyUI's own
    agreed before any exchange, then the self-check's verdict."""
    return Agreement(group)


__all__ = ["SELF_ATTENTION", "CROSS_ATTENTION", "KnownForward", "register_ulysses_forward",
           "unregister_ulysses_forward", "bound_function", "recognised", "ulysses_group", "world_of", "refusal",
           "agreement", "Agreement"]
