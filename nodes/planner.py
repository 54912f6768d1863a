"""The VRAM planner: before anything runs, from a model's dimensions and the latent's size, the peak working set
of its largest block at each head-split level, beside ComfyUI's own block (the family's working sets, its row of
nodes/families/measured.py). It answers "which level fits?" without a ten-minute trial; the run report shows the same
estimate beside the peak it measured."""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional

import torch

from types import SimpleNamespace

from ..qkv_core.backends import resolve_backend
from ..qkv_core.runtime import attends_over_queries
from .dispatch import LEVELS, QKVConfig, choose_backend
from .report import size


@dataclasses.dataclass(frozen=True)
class LevelPlan:
    level: str
    groups: int
    bytes: int
    why: str   # the split policy's reason when it does not split


@dataclasses.dataclass(frozen=True)
class Plan:
    """The estimate for one model call: `batch` items of `tokens` tokens each (the longest attention), width
    `width` in `element_size`-byte activations (|x| = `x_bytes`)."""

    family: str
    block: str           # the block kind whose working set is the largest
    tokens: int
    batch: int
    width: int
    x_bytes: int
    stock_bytes: int
    levels: tuple        # LevelPlan for Off, Low, Medium, High
    block_bounds: bool

    def bytes_at(self, level: str) -> int:
        return next(plan.bytes for plan in self.levels if plan.level == level)

    def lines(self) -> list[str]:
        bounds = "" if self.block_bounds else " (block_bounds off: the stock feed-forward's peak stays)"
        out = [f"{self.family}, {self.batch} x {self.tokens:,} tokens, width {self.width}: |x| = "
               f"{size(self.x_bytes)}; working set of the largest block ({self.block}){bounds}:",
               f"  ComfyUI's own block: {size(self.stock_bytes)}"]
        for plan in self.levels:
            split = f"{plan.groups} head groups" if plan.groups > 1 else f"not split: {plan.why}"
            out.append(f"  {plan.level}: {size(plan.bytes)} ({split})")
        return out

    def as_dict(self) -> dict:
        return {"family": self.family, "block": self.block, "tokens": self.tokens, "batch": self.batch,
                "width": self.width, "x_bytes": self.x_bytes, "stock_bytes": self.stock_bytes,
                "block_bounds": self.block_bounds,
                "levels": [dataclasses.asdict(plan) for plan in self.levels]}


def compute_dtype(base_model) -> Optional[torch.dtype]:
    """The dtype the model computes in (`base_model`: comfy.model_base's model): fp8 / GGUF weights are cast
    to it per call, so activations are in it, not in the weights' dtype."""
    cast = getattr(base_model, "manual_cast_dtype", None)
    if cast is not None:
        return cast
    get_dtype = getattr(base_model, "get_dtype", None)
    dtype = get_dtype() if callable(get_dtype) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize >= 2 else None


@functools.lru_cache(maxsize=1)
def comfy_release() -> Optional[tuple]:
    """The running ComfyUI's release as a tuple of ints (its `comfyui_version.py`), None where it has none: the
    working sets' stock peaks differ on older releases (`WorkingSet.stock_on`)."""
    try:
        import comfyui_version
    except ImportError:
        return None
    numbers = re.findall(r"\d+", str(getattr(comfyui_version, "__version__", "")))[:3]
    return tuple(int(number) for number in numbers) or None


def working_sets(adapter, diffusion_model) -> dict:
    """The `WorkingSet` of each kind of block the model has (every kind the family knows when none is found)."""
    known = adapter.SPEC.measured.working_sets
    kinds = [kind for kind in adapter.block_kinds(diffusion_model) if kind in known]
    return {kind: known[kind] for kind in (kinds or known)}


def over_queries(config: QKVConfig, tokens: int, kv_heads: int, width: int, dtype: torch.dtype,
                 device: Optional[torch.device], transformer_options: Optional[dict] = None) -> bool:
    """Would the runtime attend a split call of `tokens` tokens of one item over its queries
    (`runtime.attends_over_queries`, with the backend `resolve_backend` chooses for it), on `device` (None: not
    known, no)? The
    heads are read as `kv_heads` of `width // kv_heads` channels: the one family with grouped-query attention
    (Lumina 2) has a head dim the kernel does not take either way."""
    choice = choose_backend(config.backend, transformer_options or {})
    if device is None or torch.device(device).type != "cuda" or kv_heads <= 0 or width % kv_heads or \
            choice.comfy_dispatch:
        return False   # the kernel runs on CUDA only
    head_dim = width // kv_heads
    spec = SimpleNamespace(shape=(1, tokens, kv_heads, head_dim), dtype=dtype, device=torch.device(device))
    backend = resolve_backend(spec, spec, spec, None, None, choice.force_attention)
    return backend.staged_core is None and attends_over_queries(backend, tokens, spec.device, dtype, kv_heads,
                                                                kv_heads, head_dim)


def plan(adapter, diffusion_model, latent_shape, config: QKVConfig, batch: Optional[int] = None,
         dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
         transformer_options: Optional[dict] = None) -> Optional[Plan]:
    """The estimate for `adapter`'s `diffusion_model` called on a latent of `latent_shape` (`batch` items per
    call: the latent's batch, doubled where ComfyUI runs cond and uncond together), activations in `dtype`
    (`compute_dtype`; default bf16), on `device` with the model's `transformer_options` (where the runtime may
    attend short calls over their queries: `over_queries`), or None when the shapes cannot be read (said by the
    caller). The split at each level is the one the runtime's calls make: the family's `SplitPolicy`."""
    tokens = adapter.tokens_per_item(diffusion_model, latent_shape)
    config = adapter.SPEC.configure(config)
    width = adapter.SPEC.width(diffusion_model)
    if tokens is None or width is None:
        return None
    batch = int(batch or latent_shape[0])
    dtype = dtype or torch.bfloat16
    element_size = torch.empty((), dtype=dtype).element_size()
    x_bytes = batch * tokens * width * element_size
    sets = working_sets(adapter, diffusion_model)
    release = comfy_release()
    kind = max(sets, key=lambda name: sets[name].stock_on(release))   # the stock peak's block; the pack's may differ
    kv_heads = adapter.kv_heads(diffusion_model) or 2
    unsliceable = adapter.splits_projections(diffusion_model)
    # families that leave calls under the split floor to ComfyUI's own forwards hold stock's peak there
    stock_runs = config.policy.runs_stock(tokens)
    attends_over = over_queries(config, tokens, kv_heads, width, dtype, device, transformer_options)
    plans = []
    for index, name in enumerate(LEVELS):
        split = config._replace(level=index).policy.plan(kv_heads, tokens, unsliceable=unsliceable,
                                                         over_queries=attends_over)
        factor = max(ws.bounded(split.groups, split.share) if config.block and not stock_runs else
                     ws.stock_on(release) for ws in sets.values())
        plans.append(LevelPlan(name, split.groups, int(factor * x_bytes), split.reason or ""))
    return Plan(adapter.FAMILY, kind, tokens, batch, width, x_bytes, int(sets[kind].stock_on(release) * x_bytes),
                tuple(plans), config.block)
