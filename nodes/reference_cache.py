"""Reference keys/values kept across sampler steps (issue 12): the reference images of Flux Kontext / Flux.2
(`ref_latents`) and Qwen-Image-Edit run through every block at every step; with the cache, the first step runs
them with the image and every block keeps their keys and values (`qkv_core` `capture_kv` into a `PrefixCache`:
16 bits, q8, or SageAttention 2's native layout; in VRAM or in pinned RAM streamed block by block); later steps
run the image tokens only and attend the cached references (`kv_prefix`).

That equals the model only where the references' keys/values do not change with the step: FLUX.2 klein KV
checkpoints are trained for it; for other models it is an approximation (the references see the noisy image in
every block), said in the log.

Other node packs can put a step-constant prefix of their own (history frames, identity references) into the same
cache: a callable in `transformer_options[PROVIDER_KEY]` (docs/design.md §3.5).

Pieces, one job each:
- `ReferenceCache`: the node's settings and the per-run state. `run()` (the OUTER_SAMPLE wrapper) holds the
  caches of one sampling run and frees them when it ends, however it ends.
- `diffusion_model_wrapper` (DIFFUSION_MODEL wrapper): per model call, the cache entry of its conditioning
  (cond/uncond, the reference latents themselves) and the mode: fill (full sequence, capture), use (references
  dropped, attended from the cache) or full.
- `CallView` (in `transformer_options[STATE_KEY]`): what `nodes/attention.attend` asks per block: the
  `capture_kv` or `kv_prefix` option of that block's joint attention. It checks that every block took part and
  that the token counts are the ones the references explain; otherwise the run goes on without the cache.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import math
from typing import Optional

import torch

from ..qkv_core import PrefixCache

STATE_KEY = "qkv_reference_cache"
# Other node packs' step-constant prefix: a callable `(position, transformer_options) -> (key, value) or None`
# in transformer_options under this key gives the n-th joint attention's keys/values `(B or 1, tokens, kv_heads,
# head_dim)`, normalized and rotated as that attention's keys are; asked once per run and conditioning
PROVIDER_KEY = "qkv_step_constant_prefix"
WRAPPER_KEY = "comfyui_qkv_reference_cache"
STORAGE = ("vram", "ram")
FORMATS = ("q8", "16-bit", "native")
log = logging.getLogger("ComfyUI-QKV")


def _tokens(latent: torch.Tensor, patch: int) -> int:
    """Tokens of a latent `(B, C, [T,] H, W)` patchified by `patch` (padded up, as ComfyUI's models do)."""
    frames = math.prod(latent.shape[2:-2]) if latent.dim() > 4 else 1
    return frames * -(-latent.shape[-2] // patch) * -(-latent.shape[-1] // patch)


def _fingerprint(latent: torch.Tensor) -> tuple:
    """Which reference this is: its shape and two sums (conditionings with other references never share)."""
    flat = latent.detach().flatten().double()
    return tuple(latent.shape), float(flat.sum()), float(flat.abs().sum())


class CallView:
    """One model call's view of its cache entry, read by `attend` for each block's joint attention."""

    def __init__(self, mode: str, cache: PrefixCache, fixed_tokens: int, reference_tokens: int, provider=None,
                 transformer_options: Optional[dict] = None):
        self.mode, self.cache = mode, cache   # mode: "fill", "use" or "provided" (`provider` gives the prefixes)
        self.fixed_tokens, self.reference_tokens = fixed_tokens, reference_tokens
        self.provider, self.transformer_options = provider, transformer_options
        self.blocks_seen = 0   # the blocks run in order, one joint attention each: the n-th is layer n
        self.problem: Optional[str] = None

    def attention_options(self, kv_tokens: int, masked: bool) -> dict:
        """`{"capture_kv": ...}` (fill), `{"kv_prefix": layer}` (use) or `{}`, for a joint self-attention over
        `kv_tokens` tokens whose reference tokens, when present, are its last ones."""
        if self.problem is not None:
            return {}
        if self.mode == "provided":
            return self._provided(masked)
        expected = self.fixed_tokens + (self.reference_tokens if self.mode == "fill" else 0)
        if self.blocks_seen >= len(self.cache) or masked or kv_tokens != expected:
            self.problem = ("more joint attentions than blocks" if self.blocks_seen >= len(self.cache) else
                            "a masked attention" if masked else
                            f"{kv_tokens} key/value tokens where the references explain {expected}")
            return {}
        layer = self.cache[self.blocks_seen]
        self.blocks_seen += 1
        if self.mode == "fill":
            return {"capture_kv": (layer, kv_tokens - self.reference_tokens, kv_tokens)}
        return {"kv_prefix": layer}


    def _provided(self, masked: bool) -> dict:
        """The provider's prefix of this joint attention, asked for once a run and kept by the cache."""
        if self.blocks_seen >= len(self.cache) or masked:
            self.problem = "more joint attentions than blocks" if not masked else "a masked attention"
            return {}
        layer = self.cache[self.blocks_seen]
        position = self.blocks_seen
        self.blocks_seen += 1
        if not layer.populated:
            given = self.provider(position, self.transformer_options)
            if given is None:
                return {}
            key, value = given
            layer.store(key, value)   # quantized for q8 (and for native: the call may have no staged core)
        return {"kv_prefix": layer}


class _Entry:
    """The cache of one conditioning in one run."""

    def __init__(self, cache: PrefixCache):
        self.cache, self.filled, self.refused = cache, False, None
        self.held = 0   # bytes of the filled cache (RAM or VRAM, as stored)


class ReferenceCache:
    """The node's settings (`use_from_step`: the first sampler step that reads the cache; it is filled by the
    first call before it; `storage` "vram"/"ram"; `fmt` "q8"/"16-bit"/"native") and the per-run state."""

    def __init__(self, use_from_step: int = 1, storage: str = "vram", fmt: str = "q8"):
        if storage not in STORAGE or fmt not in FORMATS or use_from_step < 0:
            raise ValueError(f"reference cache: storage one of {STORAGE}, format one of {FORMATS}, "
                             f"use_from_step >= 0; got {storage!r}, {fmt!r}, {use_from_step}")
        self.use_from_step, self.storage, self.fmt = use_from_step, storage, fmt
        self.entries: Optional[dict] = None   # key -> _Entry, during a run only
        self.said: set = set()
        self.counts = dict.fromkeys(("fill", "use", "full"), 0)   # model calls of the current or last run
        self.last_run: dict = {}   # what the last run held: keys, bytes held at its largest, refusals

    def say_once(self, text: str) -> None:
        if text not in self.said:
            self.said.add(text)
            log.info("[QKV] reference cache: %s", text)

    @contextlib.contextmanager
    def run(self):
        """One sampling run: entries live inside, and are cleared after it, whatever ends it."""
        self.entries = {}
        self.counts = dict.fromkeys(self.counts, 0)
        try:
            yield self
        finally:
            entries, self.entries = self.entries, None
            self.last_run = {"keys": list(entries),
                             "bytes": sum(entry.held for entry in entries.values()),
                             "refused": [entry.refused for entry in entries.values() if entry.refused]}
            for entry in entries.values():
                entry.cache.clear()
            entries.clear()

    def summary(self) -> dict:
        """The live run's entries (the run report may be written before this cache's run ends) or the last
        run's: bytes held, format, storage, conditionings, refusals."""
        if self.entries is not None:
            entries = self.entries.values()
            held, count = sum(entry.held for entry in entries), len(self.entries)
            refused = [entry.refused for entry in entries if entry.refused]
        else:
            held, count = self.last_run.get("bytes", 0), len(self.last_run.get("keys", ()))
            refused = list(self.last_run.get("refused", ()))
        return {"bytes": held, "format": self.fmt, "storage": self.storage.upper() if self.storage == "ram"
                else "VRAM", "entries": count, "refused": refused, "calls": dict(self.counts)}

    def new_cache(self, blocks: int, dtype) -> PrefixCache:
        return PrefixCache(blocks, quantize=self.fmt != "16-bit", native=self.fmt == "native",
                           ram=self.storage == "ram", name="references", dtype=dtype)


def summaries(patcher) -> list:
    """What the reference caches on `patcher` (a ModelPatcher) hold, for the run report: one dict per cache
    (bytes, format, storage, conditionings, refusals), from its live run or, after it, its last run."""
    from comfy.patcher_extension import WrappersMP
    out = []
    for wrapper in patcher.get_wrappers(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY):
        state = getattr(wrapper, "state", None)
        if state is not None:
            out.append(state.summary())
    return out


def step_index(transformer_options: dict) -> Optional[int]:
    """The sampler step of this call: where its sigma sits in the run's sigmas (None outside a sampler)."""
    sigmas, sigma = transformer_options.get("sample_sigmas"), transformer_options.get("sigmas")
    if sigmas is None or sigma is None or not torch.is_tensor(sigmas) or not torch.is_tensor(sigma):
        return None
    current = float(sigma.flatten()[0])
    return int(torch.argmin((sigmas.float().cpu() - current).abs()))


def block_count(model) -> int:
    """The blocks whose joint attention `attend` runs, or 0 for a model the cache does not know."""
    count = 0
    for name in ("double_blocks", "single_blocks", "transformer_blocks"):
        blocks = getattr(model, name, None)
        count += len(blocks) if isinstance(blocks, torch.nn.ModuleList) else 0
    return count


def outer_sample_wrapper(state: ReferenceCache):
    def wrapper(executor, *args, **kwargs):
        with state.run():
            return executor(*args, **kwargs)
    wrapper.state = state   # the run report reads what it held
    return wrapper


def diffusion_model_wrapper(state: ReferenceCache):
    def wrapper(executor, *args, **kwargs):
        model = executor.class_obj
        if state.entries is None:   # outside a sampling run (the node's own checks, other callers)
            return executor(*args, **kwargs)
        try:
            bound = inspect.signature(executor.original).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return executor(*args, **kwargs)
        refs = bound.arguments.get("ref_latents")
        options = bound.arguments.get("transformer_options") or {}
        x, context = bound.arguments.get("x"), bound.arguments.get("context")
        patch = getattr(model, "patch_size", None)
        provider = options.get(PROVIDER_KEY)
        if provider is not None:
            return _with_provided_prefix(state, executor, bound, options, provider, refs, model, x)
        if not refs or not torch.is_tensor(x) or not torch.is_tensor(context) or not isinstance(patch, int):
            return executor(*args, **kwargs)
        blocks = block_count(model)
        if not blocks:
            state.say_once(f"{type(model).__name__} is not a model it knows: references run every step")
            return executor(*args, **kwargs)
        step = step_index(options)
        key = (tuple(options.get("cond_or_uncond") or ()), tuple(x.shape), tuple(_fingerprint(r) for r in refs))
        entry = state.entries.get(key)
        if entry is not None and entry.refused:
            state.counts["full"] += 1
            return executor(*args, **kwargs)
        fixed = context.shape[1] + _tokens(x, patch)
        references = sum(_tokens(r, patch) for r in refs)
        if entry is None or not entry.filled:
            if step is not None and step < state.use_from_step - 1:
                state.counts["full"] += 1
                return executor(*args, **kwargs)   # too early to fill: the cache would be older than needed
            entry = entry or state.entries.setdefault(key, _Entry(state.new_cache(blocks, x.dtype)))
            view = CallView("fill", entry.cache, fixed, references)
            state.counts["fill"] += 1
            out = _call(executor, bound, options, view)
            if view.problem is None and view.blocks_seen == blocks:
                entry.filled = True
                entry.held = sum(layer.nbytes() for layer in entry.cache.layers)
            else:
                _refuse(state, entry, view, blocks)
            return out
        if step is not None and step < state.use_from_step:
            state.counts["full"] += 1
            return executor(*args, **kwargs)
        view = CallView("use", entry.cache, fixed, references)
        state.counts["use"] += 1
        bound.arguments["ref_latents"] = None
        out = _call(executor, bound, options, view)
        if view.problem is not None or view.blocks_seen != blocks:
            # the step ran, but some block did not attend the cached references: say so, stop using the cache
            _refuse(state, entry, view, blocks)
        return out
    return wrapper


def _with_provided_prefix(state: ReferenceCache, executor, bound, options: dict, provider, refs, model, x):
    """A call whose transformer_options carry another pack's step-constant prefix (`PROVIDER_KEY`): every block
    attends it; the cache asks for it once per run and conditioning and keeps it as the node says."""
    blocks = block_count(model)
    if refs or not blocks or not torch.is_tensor(x):
        state.counts["full"] += 1
        state.say_once("a step-constant prefix beside reference latents (or in a model it does not know) is not "
                       "attended: one prefix a call")
        return executor(*bound.args, **bound.kwargs)
    key = ("provided", tuple(options.get("cond_or_uncond") or ()), tuple(x.shape), id(provider))
    entry = state.entries.setdefault(key, _Entry(state.new_cache(blocks, x.dtype)))
    if entry.refused:
        state.counts["full"] += 1
        return executor(*bound.args, **bound.kwargs)
    view = CallView("provided", entry.cache, 0, 0, provider, options)
    state.counts["use"] += 1
    out = _call(executor, bound, options, view)
    if view.problem is not None or view.blocks_seen != blocks:
        _refuse(state, entry, view, blocks)
    entry.held = sum(layer.nbytes() for layer in entry.cache.layers)
    return out


def add_reference_cache(model, state: ReferenceCache):
    """A clone of `model` (a ModelPatcher) with the cache's two wrappers (the node's work)."""
    from comfy.patcher_extension import WrappersMP
    patched = model.clone()
    patched.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, outer_sample_wrapper(state))
    patched.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, diffusion_model_wrapper(state))
    return patched


def _call(executor, bound, options: dict, view: CallView):
    bound.arguments["transformer_options"] = dict(options, **{STATE_KEY: view})
    return executor(*bound.args, **bound.kwargs)


def _refuse(state: ReferenceCache, entry: _Entry, view: CallView, blocks: int) -> None:
    entry.refused = view.problem or (f"{view.blocks_seen} of {blocks} blocks ran through the pack (patch the "
                                     f"model with QKV Attention, attention_backend other than comfy)")
    entry.cache.clear()
    state.say_once(f"not used: {entry.refused}; the references run every step")
