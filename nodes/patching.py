"""Patching a model: the adapter that matches it, the object patches and the run wrapper on a clone, and the
memory estimate ComfyUI plans each run with. No node API here (`patch_node` is the node), so scripts and
bare GPU machines can patch a ModelPatcher without `comfy_api`."""
from __future__ import annotations

import torch

import comfy.patcher_extension

from ..qkv_core import drain_notices, drain_tally, reset_notices
from ..qkv_core.notices import FALLBACK, Notice
from . import compat, kernel_patch, planner, reference_cache
from .dispatch import LEVELS, QKVConfig, backend_choices
from .families import ADAPTERS
from .families.family import check_adapter
from .report import UI_EVENT, PatchReport, RunReport, logger, send_to_ui

WRAPPER_KEY = "comfyui_qkv"
RUN_WRAPPER_KINDS = (comfy.patcher_extension.WrappersMP.OUTER_SAMPLE,
                     comfy.patcher_extension.WrappersMP.CALC_COND_BATCH)

# ADAPTERS: the registry's families (nodes/families/__init__.py), in the order they are tried
for _adapter in ADAPTERS:   # each meets nodes/families/family.py's contract (a clear error at import otherwise)
    check_adapter(_adapter)


def memory_factor(config: QKVConfig, adapter, diffusion_model, latent_shape,
                  transformer_options) -> tuple[float, str]:
    """The share of ComfyUI's activation estimate a run of the patched model needs, and why: `adapter`'s
    model `diffusion_model` sampled on a latent of `latent_shape` with these `transformer_options`. The
    family's measured factors (`adapter.SPEC.measured.memory_factors`) where the pack's forwards run; attention patched
    alone leaves the stock feed-forward's peak (1.0), and anything not verified yet in this process, or
    with other nodes' hooks, runs at ComfyUI's own estimate: a self-check that failed keeps it there for the
    process (`compat.all_checked`), and a module that runs ComfyUI's own forward during a run puts it back for
    the rest of that run (`make_run_wrappers`)."""
    factors = adapter.SPEC.measured.memory_factors
    config = adapter.SPEC.configure(config)
    if not config.block:
        return 1.0, "attention patched alone: the stock feed-forward's peak stays"
    if not compat.all_checked(adapter.stock_functions(diffusion_model)):
        return 1.0, ("not every forward of the pack has passed its self-check in this process (not checked yet, "
                     "or one failed)")
    hooks = sorted(compat.hooks_set(transformer_options))
    if hooks:
        return 1.0, f"other nodes' hooks are set ({', '.join(hooks)}): blocks may run as ComfyUI's"
    tokens = adapter.tokens_per_item(diffusion_model, latent_shape)
    if tokens is None:
        return factors.unsplit, f"no head split known for a latent of shape {latent_shape}"
    # the split policy the runtime's calls ask, for one batch item: cond and uncond may run apart
    plan = config.policy.plan(adapter.kv_heads(diffusion_model) or 2, tokens,
                              unsliceable=adapter.splits_projections(diffusion_model))
    if plan.groups == 1:
        return factors.unsplit, f"no head split ({plan.reason})"
    return factors.split, "head split"


def find_adapter(diffusion_model):
    for adapter in ADAPTERS:
        if adapter.matches(diffusion_model):
            return adapter
    return None


class _ActiveRun:
    """A sampling run in progress: its report, and the model whose estimate it may have lowered."""

    def __init__(self, run: RunReport, base_model, stock_factor: float, factor: float):
        self.run, self.base_model, self.stock_factor, self.factor = run, base_model, stock_factor, factor
        self.notices: list[Notice] = []

    def watch(self) -> None:
        """Before each batch of conds (ComfyUI sizes it from the model's estimate): the notices so far are kept
        for the report, and a module that ran ComfyUI's own forward (a self-check failed on a call of a new kind,
        say) puts ComfyUI's own estimate back for the rest of the run: that module's memory is stock's."""
        notices = drain_notices()
        if not notices:
            return
        self.notices += notices
        if self.factor != 1.0 and any(notice.kind == FALLBACK for notice in notices):
            self.base_model.memory_usage_factor = self.stock_factor
            self.factor = 1.0
            self.run.estimate_restored = True
            logger.info("[QKV] run: memory estimate back to ComfyUI's own (a module ran ComfyUI's forward)")


def replaced_patches(patcher, own_keys) -> list:
    """The keys of `own_keys` (the object patches the node installed) whose patch on `patcher` (the model being
    sampled) is no longer the pack's: another node applied after it replaced them."""
    return [key for key in own_keys if not compat.is_ours(patcher.object_patches.get(key))]


# where ComfyUI's set_torch_compile_wrapper keeps its compile settings in model_options (TORCH_COMPILE_KWARGS)
COMPILE_KWARGS_KEY = "torch_compile_kwargs"
FULLGRAPH_ERROR = ("QKV Attention cannot run inside torch.compile(fullgraph=True): its forwards run eagerly between "
                   "the compiled parts (docs/design.md §3.8). Turn fullgraph off in the compile node, or remove QKV "
                   "Attention from this model.")


def make_run_wrappers(config: QKVConfig, adapter, patch_report: PatchReport, node_id=None, own_keys=()) -> dict:
    """The run's wrappers by kind. OUTER_SAMPLE: for the length of one sampling run, ComfyUI's activation
    estimate of this model is scaled by what `memory_factor` finds for this run (its memory planning happens
    inside the run, before the weights are loaded); at the end (also after an error or a cancel) the run report
    (`report.RunReport`) is logged and sent to the node `node_id` in the browser. CALC_COND_BATCH: before each
    batch of conds, ComfyUI's estimate is put back once a module ran ComfyUI's own forward
    (`_ActiveRun.watch`). `adapter` None: the kernel-level patch (ComfyUI's estimate stays). `own_keys`: the
    object patches the node installed; where another node applied later replaced one of them, that module runs
    the other node's forward and the run keeps ComfyUI's estimate."""
    active: list[_ActiveRun] = []   # the run in progress (a list: a run inside a run stays apart)

    def calc_cond_batch(executor, *args, **kwargs):
        if active:
            active[-1].watch()
        return executor(*args, **kwargs)

    def outer_sample(executor, *args, **kwargs):
        patcher = executor.class_obj.model_patcher
        if (patcher.model_options.get(COMPILE_KWARGS_KEY) or {}).get("fullgraph"):
            raise ValueError(FULLGRAPH_ERROR)
        base_model = patcher.model
        noise = args[0] if args else kwargs.get("noise")
        shape = getattr(noise, "shape", None)
        diffusion_model = base_model.diffusion_model
        replaced = replaced_patches(patcher, own_keys)
        if adapter is None:
            factor, why = 1.0, "kernel-level patch: ComfyUI's estimate"
        elif replaced:
            factor, why = 1.0, (f"another node replaced {len(replaced)} of the pack's patches ({replaced[0]}"
                                f"{', ...' if len(replaced) > 1 else ''}): those modules run its forward")
        else:
            factor, why = memory_factor(config, adapter, diffusion_model, shape,
                                        patcher.model_options.get("transformer_options", {}))
        stock_factor = base_model.memory_usage_factor
        base_model.memory_usage_factor = stock_factor * factor
        logger.info("[QKV] run: memory estimate x%.2f (%s)", factor, why)
        reset_notices()   # each fallback reason is logged once in every run
        drain_tally()
        family = adapter.FAMILY if adapter is not None else type(diffusion_model).__name__
        run = RunReport(family, config.describe(), patch_report)
        run.estimate = (factor, why)
        state = _ActiveRun(run, base_model, stock_factor, factor)
        active.append(state)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            return executor(*args, **kwargs)
        except BaseException as error:   # a cancelled prompt raises too: the report says how the run ended
            run.ended = "interrupted" if type(error).__name__ == "InterruptProcessingException" else \
                f"with an error ({type(error).__name__})"
            raise
        finally:
            base_model.memory_usage_factor = stock_factor
            active.remove(state)
            try:   # a report must never fail the run, nor hide the error that ended it
                finish_report(run, patcher, adapter, diffusion_model, shape, config, cuda, state.notices)
                run.log()
                if node_id is not None:
                    send_to_ui(UI_EVENT, {"node": str(node_id), "report": run.as_payload()})
            except Exception as error:  # noqa: BLE001
                logger.warning("[QKV] no run report for this run: %s: %s", type(error).__name__, error)

    return {comfy.patcher_extension.WrappersMP.OUTER_SAMPLE: outer_sample,
            comfy.patcher_extension.WrappersMP.CALC_COND_BATCH: calc_cond_batch}


def finish_report(run: RunReport, patcher, adapter, diffusion_model, shape, config: QKVConfig, cuda: bool,
                  earlier_notices=()):
    """Fills `run` at the end of a sampling run: the runtime's counts and notices (both drained; with those
    drained during the run, `earlier_notices`), the reference caches on `patcher`, the peak VRAM and the
    planner's estimate for the longest call seen."""
    tally = drain_tally()
    run.kernels, run.splits = tally.kernels, tally.splits
    notices = list(earlier_notices) + drain_notices()
    # not fallbacks: chosen (a family's short sequences on ComfyUI's forwards, auto passing a backend by)
    run.fallbacks = [notice for notice in notices if not notice.by_design]
    run.notes = [notice for notice in notices if notice.by_design]
    run.caches = reference_cache.summaries(patcher)
    if cuda:
        run.peak_bytes = torch.cuda.max_memory_allocated()
    if adapter is not None and shape is not None:
        tokens = adapter.tokens_per_item(diffusion_model, shape)
        batch = max(1, round(tally.largest_call / tokens)) if tokens and tally.largest_call else None
        run.plan = planner.plan(adapter, diffusion_model, shape, config, batch=batch,
                                dtype=planner.compute_dtype(patcher.model), device=patcher.load_device,
                                transformer_options=patcher.model_options.get("transformer_options", {}))
        run.level = LEVELS[config.level]


def remove_own_patches(patcher) -> int:
    """Drop this pack's object patches, run wrappers and kernel-level override from `patcher` (a clone): a node
    applied again replaces its own patch instead of stacking on it. Returns how many patches were dropped."""
    own = [key for key, value in patcher.object_patches.items() if compat.is_ours(value)]
    for key in own:
        del patcher.object_patches[key]
    for kind in RUN_WRAPPER_KINDS:
        patcher.remove_wrappers_with_key(kind, WRAPPER_KEY)
    return len(own) + int(kernel_patch.remove(patcher))


def check_options(level: str, backend: str) -> None:
    """`ValueError`s naming the choices, for a head split level or an attention backend the node does not offer."""
    if level not in LEVELS:
        raise ValueError(f"head split level must be one of {LEVELS}, not {level!r}")
    if backend not in backend_choices():
        raise ValueError(f"attention backend must be one of {backend_choices()}, not {backend!r}")


def apply_patch(model, level: str, backend: str, block_bounds: bool, node_id=None):
    """A patched clone of `model` (a ModelPatcher) and its report: a family adapter's patches, else the
    kernel-level patch (`kernel_patch`); a model with no diffusion model, or `backend` comfy without an
    adapter, comes back as an unpatched clone, with the reason logged. `node_id`: the node in the browser
    that shows each run's report."""
    check_options(level, backend)
    config = QKVConfig(LEVELS.index(level), backend, bool(block_bounds))
    patched = model.clone()
    report = PatchReport()
    if remove_own_patches(patched):
        report.note("this model was already patched by this node: that patch is replaced")
    diffusion_model = getattr(patched.model, "diffusion_model", None)
    adapter = find_adapter(diffusion_model) if diffusion_model is not None else None
    if diffusion_model is None:
        report.note(f"not patched: {type(patched.model).__name__} has no diffusion model")
    elif adapter is None:   # every other model: ComfyUI's attention calls on the pack's backend
        kernel_patch.patch(patched, backend, report, type(diffusion_model).__name__)
    else:
        config = adapter.SPEC.configure(config)
        adapter.patch(patched, config, report)
    if report.any_patched:
        own_keys = tuple(key for key, value in patched.object_patches.items() if compat.is_ours(value))
        for kind, wrapper in make_run_wrappers(config, adapter, report, node_id, own_keys).items():
            patched.add_wrapper_with_key(kind, WRAPPER_KEY, wrapper)
    report.log()
    return patched, report
