"""Which attention kernel the adapters' calls use.

"auto" and the backend names go to `qkv_core`'s registry; "comfy" goes through ComfyUI's own dispatcher
(`optimized_attention`: honours `--use-sage-attention` and friends). "auto" also takes ComfyUI's dispatcher
when another node has set an `optimized_attention_override`, so that override is chained, not dropped, and for
a layer whose model file picks its kernel (`ComfyUI v0.38 on: `comfy_attention.function`), which then runs the
pack's head groups.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

import comfy.ldm.modules.attention as comfy_attention

from ..qkv_core import LEVEL_NAMES, SplitPolicy, backend_names, pay_attention
from ..qkv_core.notices import PASSED_OVER, Notice, notice_once
from ..qkv_core.tally import count_attention

AUTO, COMFY = "auto", "comfy"


LEVELS = tuple(name.capitalize() for name in LEVEL_NAMES)   # the node's names: Off, Low, Medium, High


class QKVConfig(NamedTuple):
    """What the node asked for (small and deep-copy safe: it lives in patched closures). `level`: head split
    0-3; `backend`: one of `backend_choices()`; `block`: bound the whole block; `split_floor_tokens`: the fewest
    tokens that are split (None: the runtime's default times `floor_scale`; the self-check forces the split
    with 0); `floor_scale`, `short_runs_stock`, `group_scale`: the family's multiple of the runtime's floor,
    whether its calls under that floor run ComfyUI's own forwards and its multiple of the level's head groups
    (`Family.configure`). `policy`: all of it as one `SplitPolicy`, what every split decision asks."""
    level: int
    backend: str
    block: bool
    split_floor_tokens: Optional[int] = None
    floor_scale: float = 1
    short_runs_stock: bool = False
    group_scale: float = 1

    @property
    def policy(self) -> SplitPolicy:
        return SplitPolicy(self.level, self.split_floor_tokens, self.floor_scale, self.short_runs_stock,
                           self.group_scale)

    def describe(self) -> str:
        """As the run report names the settings: "High, block bounds, backend auto"."""
        return f"{LEVELS[self.level]}, {'block bounds' if self.block else 'attention only'}, backend {self.backend}"


def backend_choices() -> list[str]:
    return [AUTO, COMFY] + backend_names()


# ComfyUI's attention functions that a user picks by a command-line flag (--use-sage-attention,
# --use-flash-attention, --use-ck-attention, xformers): with `auto`, the pack keeps that choice.
USER_CHOSEN_KERNELS = {"attention_sage", "attention3_sage", "attention_flash", "attention_xformers",
                       "attention_comfy_kitchen_int8"}


def comfy_kernel_chosen() -> bool:
    """Did the user ask ComfyUI for a specific attention kernel (a flag), rather than its default?"""
    return getattr(comfy_attention.optimized_attention, "__name__", "") in USER_CHOSEN_KERNELS


# the pack's backend for a call the model keeps off 8-bit kernels (ComfyUI's `low_precision_attention=False`)
FULL_PRECISION_BACKEND = "sdpa"


class BackendChoice(NamedTuple):
    """How one attention call runs (`choose_backend`): through ComfyUI's dispatcher (`comfy_dispatch`), or on the
    pack's backends with `force_attention` (None: qkv_core's `auto`). `passes_over_layer_kernel`,
    `passes_over_override`: a named backend runs instead of the layer's kernel / another node's override."""
    comfy_dispatch: bool
    force_attention: Optional[str] = None
    passes_over_layer_kernel: bool = False
    passes_over_override: bool = False

    def call_options(self) -> dict:
        """The runtime call's option for the pack's backends (`force_attention` only where one is forced)."""
        return {} if self.force_attention is None else {"force_attention": self.force_attention}


def choose_backend(backend: str, transformer_options: Optional[dict] = None, layer_kernel=None,
                   full_precision: bool = False, dispatcher: bool = True) -> BackendChoice:
    """The one decision of what attends a call, asked by the adapters' attention, the kernel-level override and
    the planner. `backend`: the node's choice (`backend_choices()`). ComfyUI's dispatcher for `comfy`, and for
    `auto` where another node set an attention override (in `transformer_options`), the user picked a kernel with
    ComfyUI's flags or the model file picks `layer_kernel` for the layer; else the pack's backends: `auto`'s
    choice or the named one, SDPA for a `full_precision` call. `dispatcher=False`: a call ComfyUI's dispatcher
    cannot take (the sequence-parallel exchange): `comfy` runs as `auto` there."""
    override = transformer_options is not None and "optimized_attention_override" in transformer_options
    if dispatcher and (backend == COMFY or (backend == AUTO and (override or comfy_kernel_chosen() or
                                                                  layer_kernel is not None))):
        return BackendChoice(True)
    named = backend not in (AUTO, COMFY)
    force = FULL_PRECISION_BACKEND if full_precision else (backend if named else None)
    return BackendChoice(False, force, named and layer_kernel is not None, named and override)


def layer_kernel(module):
    """The attention kernel the model file picks for this layer (ComfyUI v0.38 on: the layer's `ComfyAttention`,
    `comfy_attention.function`, e.g. `attention_comfy_kitchen_int8`), or None: none picked, or not available
    on this device (ComfyUI leaves `function` None then and runs its default)."""
    return getattr(getattr(module, "comfy_attention", None), "function", None)


def comfy_kernel_label(transformer_options, dispatch_kwargs=None) -> str:
    """What ComfyUI's dispatcher runs, as the run report names it."""
    if "optimized_attention_override" in transformer_options:
        return "comfy: another node's attention override"
    picked = getattr((dispatch_kwargs or {}).get("preferred_attention"), "function", None)
    if picked is not None:
        return f"comfy: the model file's {getattr(picked, '__name__', 'layer kernel')}"
    return f"comfy: {getattr(comfy_attention.optimized_attention, '__name__', 'its attention')}"


def comfy_attend(q, k, v, transformer_options, **dispatch_kwargs):
    """ComfyUI's `optimized_attention` on head-group tensors `(B, N, h, D)` -> `(B, N, h, D)`.
    `dispatch_kwargs` go to the dispatcher as the model passes them (`preferred_attention`,
    `low_precision_attention`)."""
    heads = q.shape[2]
    count_attention(comfy_kernel_label(transformer_options, dispatch_kwargs))
    if k.shape[2] != heads:  # grouped-query: ComfyUI's dispatcher of this version wants equal heads
        k = k.repeat_interleave(heads // k.shape[2], dim=2)
        v = v.repeat_interleave(heads // v.shape[2], dim=2)
    out = comfy_attention.optimized_attention(q.reshape(*q.shape[:2], -1), k.reshape(*k.shape[:2], -1),
                                              v.reshape(*v.shape[:2], -1), heads=heads,
                                              transformer_options=transformer_options, **dispatch_kwargs)
    return out.unflatten(-1, (heads, -1))


def group_mask(mask: Optional[torch.Tensor], group, heads: int) -> Optional[torch.Tensor]:
    """`mask` (2-, 3- or 4-D, as ComfyUI's attention takes it) for one head group: 4-D, its heads sliced
    when it has one per head."""
    if mask is None:
        return None
    mask = mask.unsqueeze(0) if mask.dim() == 2 else mask
    mask = mask.unsqueeze(1) if mask.dim() == 3 else mask
    if mask.shape[1] == heads and heads > 1:
        mask = mask[:, group.q.start:group.q.stop]
    return mask


def attention_kwargs(config, transformer_options, module=None, mask: Optional[torch.Tensor] = None) -> dict:
    """Keyword options for a `qkv_core` call: `attention_fn` for ComfyUI's dispatcher, else the backend, and
    the level and floor of `config.policy` (`SplitPolicy.call_options`). `module`: the model's attention module,
    whose per-layer attention choice (`comfy_attention`, newer ComfyUI) goes to the dispatcher as the model would
    pass it; with `auto`, a layer whose model file picks a kernel (`layer_kernel`) goes through the dispatcher,
    which runs that kernel on each head group, and a forced backend says once that it runs instead. `mask`: the attention mask `(B or 1, heads or 1, Nq, Nk)` (or 2-/3-D), sliced per head group for the
    dispatcher."""
    split = config.policy.call_options()
    picked = layer_kernel(module)
    choice = choose_backend(config.backend, transformer_options, picked)
    if choice.passes_over_layer_kernel:
        kernel = getattr(picked, '__name__', 'a kernel')
        notice_once(f"layer-kernel:{config.backend}", Notice(
            PASSED_OVER, kernel, f"attention_backend={config.backend} runs its own kernel",
            f"[QKV] the model file picks {kernel} for its attention layers; attention_backend={config.backend} "
            f"runs its own kernel instead (pick auto to use the file's)"))
    if choice.comfy_dispatch:
        # the file's kernel (ComfyUI's dispatcher runs it) takes the pack's head groups as it takes all heads
        preferred = getattr(module, "comfy_attention", None)
        dispatch = {} if preferred is None else {"preferred_attention": preferred}
        heads = getattr(module, "num_heads", None) or getattr(module, "heads", None) or 0

        def through_comfy(qkv, group, **call_kwargs):
            q, k, v = qkv[:3]
            qkv.clear()
            if mask is not None:
                call_kwargs["mask"] = group_mask(mask, group, heads)
            return comfy_attend(q, k, v, transformer_options, **dispatch, **call_kwargs)
        through_comfy.comfy_dispatch = True
        through_comfy.counts_itself = True   # comfy_attend counts each kernel call
        return {"attention_fn": through_comfy, **split}
    if mask is not None:   # 4-D, as the runtime takes it (it slices the heads per group)
        mask = mask.unsqueeze(0) if mask.dim() == 2 else mask
        split["attention_mask"] = mask.unsqueeze(1) if mask.dim() == 3 else mask
    if choice.passes_over_override:
        notice_once(f"override:{config.backend}", Notice(
            PASSED_OVER, "optimized_attention_override", f"attention_backend={config.backend} runs its own kernel",
            f"[QKV] attention_backend={config.backend} runs its own kernel: the attention override another node "
            f"set is not used (pick auto or comfy to keep it)"))
    return choice.call_options() | split


def attend_group(q, k, v, kwargs: dict, group, full_precision: bool = False):
    """One attention with the choice `attention_kwargs` made, for adapters that combine several.
    `full_precision`: a call the model keeps off 8-bit kernels (ComfyUI's `low_precision_attention=False`):
    ComfyUI's dispatcher is told so, and the pack's own backends use SDPA."""
    attention_fn = kwargs.get("attention_fn")
    if attention_fn is not None:
        if full_precision and getattr(attention_fn, "comfy_dispatch", False):
            return attention_fn([q, k, v], group, low_precision_attention=False)
        return attention_fn([q, k, v], group)
    force = FULL_PRECISION_BACKEND if full_precision else kwargs.get("force_attention")
    return pay_attention(q, k, v, force_attention=force)

