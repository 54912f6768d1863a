"""The contract every model-family adapter meets, and the one description of a family that meets most of it.

An adapter is a module of this package (or any object) with the names of `FamilyAdapter`, its `SPEC` a `Family`;
the registry (`nodes/families/__init__.py`) lists those `Family` objects in the order `nodes/patching.py` tries
them, and a model none of them matches gets the kernel-level patch (`nodes/kernel_patch.py`). A `Family` holds its
row of `measured.py` (`Family.measured`), and `Family.configure(config)` is the one way its constants (split
floor scale, short runs on stock, group scale) enter a call's configuration.

What every adapter used to write again is here, once: `Family` describes a family (its name, its lists of
blocks, where the latent's patch size and the key/value heads are read, which projections must have rows, which
modules are patched and which parts a bounded block computes itself) and answers the rest of the contract from
that (`matches`, `stock_functions`, `tokens_per_item`, `kv_heads`, `splits_projections`, `block_kinds`, `width`, the
patch loop, `configure`); `Family.guard` wraps one forward in `compat.guard_module` with the signature, argument binding and check
inputs every family shares. An adapter keeps what is its own: its attention form, its bounded block, its probes,
its refusals and the extra fields of its self-check's signature and check inputs.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from .. import compat
from ..attention import attribute, is_rms_norm
from ..comfy_ops import not_row_sliceable, quantizes_inputs
from .measured import TABLE, Measured, MemoryFactors, WorkingSet

# Where the planner reads a model's token width (`Family.width`; a family whose model names it otherwise sets its own).
WIDTH_NAMES = ("dim", "hidden_size", "inner_dim", "model_dim", "model_channels")

# The self-check's tokens of a second, short stream (the text beside an image): a quarter of its first stream's.
TEXT_CHECK_TOKENS = compat.CHECK_TOKENS // 4


@runtime_checkable
class FamilyAdapter(Protocol):
    FAMILY: str                      # the name the log and the report use ("Wan")
    SPEC: "Family"                   # the family: its registry entry, measured row (`SPEC.measured`), `configure`

    def matches(self, diffusion_model) -> bool:
        """True for the family's diffusion models (by structure, not by class name alone)."""

    def patch(self, patcher, config, report) -> None:
        """Object patches on `patcher` (a clone) for `config`; every module patched or skipped goes into
        `report` (skipped: with the reason)."""

    def stock_functions(self, diffusion_model) -> set:
        """ComfyUI's functions the pack's forwards stand in for: the self-check verifies each once per process
        (the memory estimate stays ComfyUI's until they all are)."""

    def tokens_per_item(self, diffusion_model, latent_shape) -> Optional[int]:
        """Tokens of one batch item of the longest attention for a latent of `latent_shape`, or None."""

    def kv_heads(self, diffusion_model) -> Optional[int]:
        """Key/value heads of that attention, or None."""

    def splits_projections(self, diffusion_model) -> Optional[str]:
        """None when its q/k/v can be computed by rows (the head split can run), else why not."""

    def block_kinds(self, diffusion_model) -> Sequence[str]:
        """The keys of `SPEC.measured.working_sets` for the blocks this model has."""


def check_adapter(adapter) -> None:
    """A `TypeError` naming what `adapter` lacks of the contract, or a `ValueError` for a measured constant of its
    `SPEC` out of order (`check_measured`)."""
    missing = [name for name in ("FAMILY", "SPEC", "matches", "patch", "stock_functions", "tokens_per_item",
                                 "kv_heads", "splits_projections", "block_kinds") if not hasattr(adapter, name)]
    if missing:
        raise TypeError(f"{getattr(adapter, '__name__', adapter)!s} is not a family adapter: it lacks "
                        f"{', '.join(missing)} (see nodes/families/family.py)")
    check_measured(adapter.FAMILY, adapter.SPEC.measured)


def _number(value, least: float, above: bool = False) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and (value > least if above else
                                                                                 value >= least)


def check_measured(family: str, row: Measured) -> None:
    """A `ValueError` for a constant of `family`'s measured row out of order (factors, working sets, the split
    floor's scale, the short-runs flag, the group scale)."""
    factors = row.memory_factors
    if not 0 < factors.split <= factors.unsplit <= 1:
        raise ValueError(f"{family}: memory factors must be 0 < split <= unsplit <= 1, got {factors}")
    for kind, working_set in row.working_sets.items():
        if not 0 < working_set.bounded(1) <= working_set.stock * 1.5:
            raise ValueError(f"{family}: the {kind} block's working set is out of order: {working_set}")
    if not _number(row.split_floor_scale, 1):
        raise ValueError(f"{family}: split_floor_scale must be a number >= 1 (a multiple of the runtime's split "
                         f"floor), got {row.split_floor_scale!r}")
    if not _number(row.group_scale, 0, above=True):
        raise ValueError(f"{family}: group_scale must be a number > 0 (a multiple of the level's head groups), got "
                         f"{row.group_scale!r}")
    if not isinstance(row.short_runs_stock, bool):
        raise ValueError(f"{family}: short_runs_stock must be True or False, got {row.short_runs_stock!r}")


def unsliceable_projection(module, names: Sequence[str], where: str = "") -> Optional[str]:
    """The adapters' `splits_projections`: why the first of `module`'s projection layers `names` cannot be computed
    by rows (`comfy_ops.not_row_sliceable`), as "<where><name>: <reason>"; None when every one can; "no blocks"
    without a module (a model with no block of the family's)."""
    if module is None:
        return "no blocks"
    for name in names:
        reason = not_row_sliceable(getattr(module, name, None))
        if reason is not None:
            return f"{where}{name}: {reason}"
    return None


def patch_module(patcher, report, family: str, path: str, what: str, make_forward: Callable[[], Callable],
                 probe: Callable[[], Optional[str]], parts=()) -> bool:
    """The patch loop's one step, the same for every family: an object patch of `<path>.forward` on `patcher`
    (a clone) with `make_forward()`, unless another node patched that forward (its patch is kept), or one of
    the module's `parts` the pack's forward computes itself (kept; the module then runs as ComfyUI's and
    calls them), or `probe()` finds the module is not what the pack's forward expects. Every outcome goes
    into `report`; True when patched."""
    def foreign(key: str) -> bool:
        return key in patcher.object_patches and not compat.is_ours(patcher.object_patches[key])

    foreign_parts = [name for name in parts if foreign(f"{path}.{name}.forward")]
    if foreign(f"{path}.forward"):
        reason = "another node patched it (its patch is kept)"
    elif foreign_parts:
        reason = f"another node patched its {', '.join(foreign_parts)} (kept; it runs as ComfyUI's)"
    else:
        reason = probe()
    if reason is not None:
        report.skipped(family, f"{path} ({what})" if what == "block" else path, reason)
        return False
    patcher.add_object_patch(f"{path}.forward", make_forward())
    report.patched(family, what, path)
    return True


# --- the shared description of a family --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockList:
    """One list of a family's transformer blocks: the diffusion model's ModuleList `attribute`; `kind`, the key of
    the family's `measured.working_sets` its blocks are; `label`, what the patch report calls one of them; `cls`, only
    blocks of that class count (None: every entry); `inner`, each entry holds its block in that attribute
    (HiDream's wrappers); `accepts(block)`, a further test a block must pass."""

    attribute: str
    kind: str = "block"
    label: str = "block"
    cls: Optional[type] = None
    inner: Optional[str] = None
    accepts: Optional[Callable] = None

    def blocks(self, model):
        """(path, block) of each of this list's blocks in `model`."""
        entries = getattr(model, self.attribute, None)
        if not isinstance(entries, torch.nn.ModuleList):
            return
        for index, entry in enumerate(entries):
            block = entry if self.inner is None else getattr(entry, self.inner, None)
            if (self.cls is None or isinstance(block, self.cls)) and (self.accepts is None or self.accepts(block)):
                path = f"diffusion_model.{self.attribute}.{index}"
                yield (path if self.inner is None else f"{path}.{self.inner}"), block


# A pair (forward(module, config), probe(module)), or such pairs by attribute name (`Family.patch`).
Patches = Union[tuple, dict, None]


@dataclasses.dataclass(frozen=True)
class Family:
    """What the pack needs to know of a family's model, and the contract's plumbing answered from it.

    `name`: the family as the log and the report name it (the adapter's `FAMILY`); `module`: its module under
    `nodes/families/` (its row of `measured.py`). `block_lists`: `BlockList`s, in the order they are patched.
    `latent_ranks`, `patch_size`, `patch_default`: the latents `tokens_per_item` reads, the diffusion model's
    attribute path of its patch size (an int for square patches of the last two dimensions, or one per
    dimension; or a tuple of paths, one int each) and its value where the model has none. `kv_heads_at`: where
    the key/value heads are read, "model.<path>" or "block.<path>" (of the first block). `projections`: (the path
    of a module in the first block, the names of its projection layers that must have rows, the reason's
    prefix). `attentions`: the attention modules of every block the pack patches (attribute names;
    `attention_cls`: only modules of that class), reported as `attention_label` (None: their attribute name).
    `bounded(block)`: which blocks take the bounded forward (None: all; `blocks_always`: whatever block bounds
    say, where the block's forward is the attention's), `unbounded_note`: reported for the others (None: they are
    not). `stock_parts`: a block's parts whose forwards the bounded block stands in for (the self-check's
    functions); `patch_parts`: the parts another node's object patch on one of which keeps the block
    ComfyUI's (None: all its children). `model_class`: the diffusion model's class, where `matches` asks it;
    `first_block`: (attribute, class) the first block's attribute must be for `matches` (else: any bounded
    block). `names`: the models it adapts as the patch node's description names them (None: `name`).
    `width_names`: the diffusion model's attributes its token width may be in, tried in order (`width`).
    `measured`: its row of `measured.py` (None: the row keyed by `module`)."""

    name: str
    module: str
    block_lists: tuple
    latent_ranks: tuple = (4, 5)
    patch_size: Union[str, tuple] = "patch_size"
    patch_default: Union[int, tuple] = 2
    kv_heads_at: str = "model.num_heads"
    projections: tuple = ()
    attentions: tuple = ()
    attention_cls: Optional[type] = None
    attention_label: Optional[str] = "attention"
    bounded: Optional[Callable] = None
    blocks_always: bool = False
    unbounded_note: Optional[str] = None
    stock_parts: tuple = ()
    patch_parts: Optional[tuple] = ()
    model_class: Optional[type] = None
    first_block: Optional[tuple] = None
    names: Optional[tuple] = None
    width_names: tuple = WIDTH_NAMES
    measured: Optional[Measured] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.names is None:
            object.__setattr__(self, "names", (self.name,))
        if self.measured is None:
            object.__setattr__(self, "measured", TABLE[self.module])

    @property
    def adapter(self):
        """The family's adapter: its module `nodes/families/<module>.py`."""
        return importlib.import_module(f"{__package__}.{self.module}")

    def configure(self, config):
        """`config` (a `dispatch.QKVConfig`) with the family's split policy from its measured row: its floor
        (`split_floor_scale` x the runtime's), `short_runs_stock` and `group_scale`. The one way these constants
        enter a call's configuration: the patch loop, the memory estimate and the planner ask it."""
        row = self.measured
        wanted = (row.split_floor_scale, row.short_runs_stock, row.group_scale)
        if (config.floor_scale, config.short_runs_stock, config.group_scale) == wanted:
            return config
        return config._replace(floor_scale=wanted[0], short_runs_stock=wanted[1], group_scale=wanted[2])

    def width(self, diffusion_model) -> Optional[int]:
        """The width of the model's token activations: its first `width_names` attribute that is a positive int
        (None without one)."""
        for name in self.width_names:
            value = getattr(diffusion_model, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    # --- the model's blocks ----------------------------------------------------------------------------------
    def blocks(self, model):
        """(path, its `BlockList`, block) of every block of the family's in `model`, list by list."""
        for blocks in self.block_lists:
            for path, block in blocks.blocks(model):
                yield path, blocks, block

    def first(self, model):
        """The first block, or None."""
        return next(self.blocks(model), (None, None, None))[2]

    def is_bounded(self, block) -> bool:
        return self.bounded is None or bool(self.bounded(block))

    def attention_modules(self, block):
        """(attribute, module) of the block's attention modules the pack patches."""
        for name in self.attentions:
            module = getattr(block, name, None)
            if module is not None and (self.attention_cls is None or isinstance(module, self.attention_cls)):
                yield name, module

    # --- the contract's answers ------------------------------------------------------------------------------
    def matches(self, diffusion_model) -> bool:
        """A model of the family: of `model_class` (where set), with a first block whose attribute is of the
        class `first_block` names, else with a block that takes the bounded forward."""
        if self.model_class is not None and not isinstance(diffusion_model, self.model_class):
            return False
        if self.first_block is not None:
            name, cls = self.first_block
            return isinstance(getattr(self.first(diffusion_model), name, None), cls)
        return any(self.is_bounded(block) for _, _, block in self.blocks(diffusion_model))

    def functions(self, module) -> tuple:
        """ComfyUI's forward functions whose math the pack's forward of `module` (a block or an attention)
        replaces: its own, and its `stock_parts`' where it has them."""
        parts = [getattr(module, name, None) for name in self.stock_parts]
        return (type(module).forward,) + tuple(type(part).forward for part in parts if part is not None)

    def stock_functions(self, diffusion_model) -> set:
        """ComfyUI's functions this family's patches stand in for (the run's memory estimate is lowered only once
        each has passed a self-check): the bounded blocks' and the patched attention modules'."""
        functions = set()
        for _, _, block in self.blocks(diffusion_model):
            if self.is_bounded(block):
                functions.update(self.functions(block))
            for _, module in self.attention_modules(block):
                functions.update(self.functions(module))
        return functions

    def tokens_per_item(self, diffusion_model, latent_shape) -> Optional[int]:
        """Tokens of one batch item for a latent of `latent_shape` (of a rank in `latent_ranks`; else None): each
        dimension after the channels over its patch size, rounded up (a video family's image latent: one frame).
        Other streams (the text, references) come on top; not known here."""
        if latent_shape is None or len(latent_shape) not in self.latent_ranks:
            return None
        dims = [int(size) for size in latent_shape[2:]]
        if isinstance(self.patch_size, tuple):   # one attribute per dimension
            sizes = [attribute(diffusion_model, path) or 1 for path in self.patch_size]
        else:
            size = attribute(diffusion_model, self.patch_size)
            size = self.patch_default if size is None else size
            sizes = list(size) if isinstance(size, (list, tuple)) else [size] * 2
        sizes = ([1] * (len(dims) - len(sizes)) + sizes)[-len(dims):]
        count = 1
        for size, step in zip(dims, sizes):
            count *= -(-size // int(step))
        return count

    def kv_heads(self, diffusion_model) -> Optional[int]:
        """Key/value heads of the family's attention, where `kv_heads_at` says (None where the model does not)."""
        owner, _, path = self.kv_heads_at.partition(".")
        heads = attribute(diffusion_model if owner == "model" else self.first(diffusion_model), path)
        return heads if isinstance(heads, int) else None

    def splits_projections(self, diffusion_model) -> Optional[str]:
        """None when the first block's `projections` can be computed by rows (the head split can run), else why
        not (`unsliceable_projection`)."""
        owner, names, where = self.projections
        return unsliceable_projection(attribute(self.first(diffusion_model), owner), names, where)

    def block_kinds(self, diffusion_model) -> tuple:
        """The `measured.working_sets` keys of the model's blocks: the one kind of the family's lists, or those of the
        blocks it has."""
        kinds = {blocks.kind for blocks in self.block_lists}
        if len(kinds) == 1:
            return tuple(kinds)
        return tuple(sorted({blocks.kind for _, blocks, _ in self.blocks(diffusion_model)}))

    def contract(self) -> tuple:
        """The adapter's `matches, stock_functions, tokens_per_item, kv_heads, splits_projections, block_kinds`."""
        return (self.matches, self.stock_functions, self.tokens_per_item, self.kv_heads, self.splits_projections,
                self.block_kinds)

    # --- patching --------------------------------------------------------------------------------------------
    def patch(self, patcher, config, report, attention: Patches = None, block: Patches = None) -> None:
        """Object patches on `patcher` (a clone) for `config`, every outcome in `report` (`patch_module`): each
        attention module of every block (`attention`: a (forward(module, config), probe(module)) pair, or pairs
        by attribute name), whatever block bounds say (they serve a block that runs ComfyUI's forward too); and
        with block bounds (always, `blocks_always`) every block `bounded` takes (`block`: a pair, or pairs by the
        name of its list). A module another node patched keeps that patch (its block then runs stock)."""
        attention_pairs = attention if isinstance(attention, dict) else dict.fromkeys(self.attentions, attention)
        for path, blocks, module in self.blocks(patcher.model.diffusion_model):
            for name, part in self.attention_modules(module):
                forward, probe = attention_pairs[name]
                patch_module(patcher, report, self.name, f"{path}.{name}", self.attention_label or name,
                             lambda: forward(part, config), lambda: probe(part))
            if block is None or not (config.block or self.blocks_always):
                continue
            if self.is_bounded(module):
                forward, probe = block[blocks.attribute] if isinstance(block, dict) else block
                parts = tuple(name for name, _ in module.named_children()) if self.patch_parts is None \
                    else self.patch_parts
                patch_module(patcher, report, self.name, path, blocks.label, lambda: forward(module, config),
                             lambda: probe(module), parts=parts)
            elif self.unbounded_note is not None:
                report.skipped(self.name, f"{path} ({blocks.label})", f"{type(module).__name__} {self.unbounded_note}")

    # --- guarding a forward ----------------------------------------------------------------------------------
    def guard(self, kind: str, what: str, module, names: Sequence[str], run: Callable, config, *, x: str,
              extra: Optional[Callable] = None, check_inputs: Optional[Callable] = None, cut: Optional[Callable] = None,
              functions: Optional[Callable] = None, residual=None, hooks_inside: Sequence[str] = (),
              refuse_call: Optional[Callable] = None, refuse_more: Optional[Callable] = None,
              routed: bool = False, agree: Optional[Callable] = None) -> Callable:
        """The guarded forward installed on `module` (`compat.guard_module`), what every family shares filled in:

        - the pack's forward: `run(module, config, **bound)`, the call's arguments bound by the names of the
          forward's parameters, `names` (a call with others runs ComfyUI's);
        - the verdict's functions: `functions()`, by default the family's `functions(module)`;
        - the self-check's signature, one verdict per kind of call: `kind`, those functions, the layers'
          classes and dtypes, the dtype and device of the input `x` (a name in `names`), the node's settings,
          the hooks set, whether an attention override is, then `extra(bound)` (the family's own fields);
        - the check inputs: `check_inputs(bound)`, by default the call's first tokens of `x` and the arguments
          `cut` slices with them (`first_tokens`);
        - ComfyUI's forward for a call with another node's hooks `hooks_inside` (those ComfyUI's forward calls on
          whole q/k/v, which the head split never holds), else as `refuse_call(bound)` says;
        - whether its layers quantize their inputs (a looser tolerance).
        `config` splits as it says: the patch loop gives it the family's policy (`configure`).
        `residual`, `refuse_more`, `routed`, `agree`: as `compat.guard_module` takes them."""
        names = tuple(names)
        functions = functions or (lambda: self.functions(module))

        def refuse(bound: dict) -> Optional[str]:
            reason = compat.hooks_refusal(bound.get("transformer_options"), hooks_inside) if hooks_inside else None
            return reason if reason is not None or refuse_call is None else refuse_call(bound)

        def ours_factory(module, config):
            def forward(*args, **kwargs):
                return run(module, config, **compat.bind_args(names, args, kwargs))
            return forward

        def signature(bound: dict) -> tuple:
            options = bound.get("transformer_options") or {}
            tensor = bound[x]
            return (kind, functions(), compat.layers_signature(module), tensor.dtype, tensor.device.type, config,
                    compat.hooks_set(options), "optimized_attention_override" in options) + \
                (extra(bound) if extra is not None else ())

        return compat.guard_module(
            f"{self.name} {what}", module, names, ours_factory, config, functions=functions, signature=signature,
            check_inputs=check_inputs or first_tokens(x, cut), residual=residual,
            quantized=lambda: quantizes_inputs(module),
            refuse_call=refuse if hooks_inside or refuse_call is not None else None, refuse_more=refuse_more,
            routed=routed, agree=agree)


def probe_heads(module, heads: str, head_dim: str, stream=None, norms: Sequence[str] = (),
                spans_heads: bool = False) -> tuple:
    """(heads, head dim, None) of an attention `module` that names them in the attributes `heads` and `head_dim`
    (ints; the head dim even: RoPE rotates pairs), with the layers of `stream` (a `StreamProjections`, q, k and
    v of every head) and `norms`, RMSNorms over a head's channels (over all heads', `spans_heads`); or (None,
    None, why not)."""
    count, dim = getattr(module, heads, None), getattr(module, head_dim, None)
    if not isinstance(count, int) or not isinstance(dim, int):
        return None, None, f"no {heads}/{head_dim}"
    if dim % 2:
        return None, None, "an odd head_dim"
    reason = None if stream is None else stream.probe(module, count * dim, count * dim)
    reason = reason or probe_norms(module, norms, count * dim if spans_heads else dim)
    return (None, None, reason) if reason else (count, dim, None)


def probe_linear(module, name: str, out_features: Optional[int], in_features: Optional[int] = None) -> Optional[str]:
    """Why `module`'s layer `name` (an attribute path) is not a Linear-shaped layer (a 2-D weight) to
    `out_features` features (any, for None) from `in_features` (any, for None), or None."""
    weight = getattr(attribute(module, name), "weight", None)
    if weight is None or weight.dim() != 2 or (out_features is not None and weight.shape[0] != out_features) or \
            (in_features is not None and weight.shape[1] != in_features):
        source = "" if in_features is None else f" from {in_features}"
        target = "" if out_features is None else f" to {out_features} features"
        return f"{name} is not a Linear{source}{target}"
    return None


def probe_norms(module, names: Sequence[str], channels: int) -> Optional[str]:
    """Why one of `module`'s norms `names` (attribute paths) is not an RMSNorm over `channels`, or None."""
    for name in names:
        if not is_rms_norm(attribute(module, name), channels):
            return f"{name} is not an RMSNorm over {channels} channels"
    return None


def probe_part(block, name: str, probe: Callable, cls: Optional[type] = None) -> Optional[str]:
    """Why the block's part `name` is not what the pack's forward computes (not a `cls`, missing, or what
    `probe(part)` finds, named after the part), or None."""
    part = getattr(block, name, None)
    if cls is not None and not isinstance(part, cls):
        return f"its {name} is not a {cls.__name__}"
    if part is None:
        return f"no {name}"
    reason = probe(part)
    return None if reason is None else f"{name}: {reason}"


def first_tokens(x: str, cut: Optional[Callable] = None) -> Callable[[dict], dict]:
    """A guard's check inputs: the call's arguments with the first `compat.CHECK_TOKENS` tokens of `x` (every
    batch item), the arguments `cut(bound, n, tokens)` names ({name: fn(value)}: their rows of those `n` of
    `tokens` tokens, RoPE tables, masks; a None stays None) and probes for the hooks in its transformer_options."""
    def check(bound: dict) -> dict:
        tokens = bound[x].shape[1]
        n = compat.check_tokens(tokens)
        out = dict(bound)
        out[x] = bound[x][:, :n].clone()
        for name, fn in (cut(bound, n, tokens) if cut is not None else {}).items():
            if bound.get(name) is not None:
                out[name] = fn(bound[name])
        out["transformer_options"] = compat.probe_options(bound.get("transformer_options") or {})
        return out
    return check


def layout(t) -> Optional[tuple]:
    """A tensor argument's part of a self-check signature (None, or its rank and dtype)."""
    return None if t is None else (t.dim(), t.dtype)


def stream_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """A stream's first `n` tokens (every batch item), a fresh tensor."""
    return t[:, :n].clone()


__all__ = ["FamilyAdapter", "check_adapter", "check_measured", "WIDTH_NAMES", "unsliceable_projection", "patch_module", "MemoryFactors", "WorkingSet",
           "BlockList", "Family", "first_tokens", "layout", "stream_rows", "TEXT_CHECK_TOKENS", "probe_heads",
           "probe_linear", "probe_norms", "probe_part"]
