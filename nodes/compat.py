"""Does the pack's forward still compute what ComfyUI's does? Guards and a behavioural self-check.

Every forward the pack installs is wrapped by `guarded()`. A call runs ComfyUI's own (stock) forward instead
of the pack's when:
- gradients are enabled (a training node downstream: the pack's forwards are inference-only);
- the call carries arguments the pack's forward does not know (a newer ComfyUI added one);
- another node patched a submodule the pack's forward would bypass (`foreign_forward`);
- the self-check for this kind of call failed.
The self-check runs at the first call of each signature (module kind, the stock forwards' functions, layer
types, dtypes, device, the patch hooks present in `transformer_options`, the node's settings): ComfyUI's
forward and the pack's run on the first `CHECK_TOKENS` tokens of one batch item of the real inputs, with the
head split forced even at that size, and both outputs are measured against the same module in float32 with
its weights dequantized (`exact_reference`): the pack's passes when it is no farther from that than ComfyUI's
own, within a margin (`compare`), so each weight format is judged by its own noise. Patch hooks present in
`transformer_options["patches"]` are replaced by probes for the check (other nodes' hooks never run on check
inputs): when ComfyUI's forward calls a hook the pack's does not, the outputs differ and the pack steps
aside. So a ComfyUI release that keeps the math keeps the savings, and one that changes it (a new hook, a new
norm, a new argument) runs stock, with one log line, never with other numbers.

Verdicts are kept for the process, keyed by the function objects (an edited or reloaded ComfyUI is checked
again). The cost is one stock, one float32 and one patched forward of a few hundred tokens per signature: next
to a sampling step of a long sequence, nothing.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

import comfy.ops

from ..qkv_core.notices import notice_once
from ..qkv_core.tally import not_counted
from .module_tree import (ModuleTree, _local, foreign_forward, is_ours, layers_signature, mark_ours, module_tree,
                          stock_forward)
from .reference_cache import STATE_KEY as REFERENCE_CACHE_KEY

CHECK_TOKENS = 256
# How the self-check judges (see `compare`). ComfyUI's forward and the pack's are both measured against the same
# module run in float32 with its weights dequantized and its inputs unquantized (`exact_reference`): the pack's
# distance may be at most (1 + CHECK_MARGIN) x ComfyUI's own plus a round-off of the output's dtype, times the
# norm of the update the module adds. Both distances are the format's noise (bf16 rounding, an fp8 or int8
# input quantization, a GGUF block scale): reordered sums draw new noise of the same size, a change of math
# adds a distance of its own. Measured on the CPU (tiny Wan block, fp8-scaled, bf16): stock and pack 3.9 % from
# the float32 reference each and 2.8 % from each other, whatever the negative prompt; bf16 weights 0.8 % each.
CHECK_MARGIN = 0.25
CHECK_ROUND_OFF = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 4e-3}
# Without a reference (the module does not run in float32): ComfyUI's output is the reference, with these
# relative tolerances on the update. Float32 round-off of the pack's reordered sums is ~1e-6; a change of math
# moves the result by far more.
CHECK_RTOL = {torch.float64: 1e-6, torch.float32: 1e-4}
CHECK_RTOL_16BIT = 2e-2
# the share of tokens a routed block's check leaves out (`compare(routed=True)`): in 16 bits a few of 256 check
# tokens sit near a tie between two experts
ROUTED_SHARE = 0.02

_verdicts: dict = {}           # signature -> None (passed) or the reason it failed
_function_verdicts: dict = {}  # a stock forward function -> True while every check of it passed


def forget_verdicts() -> None:
    """Drop every cached self-check verdict (tests)."""
    _verdicts.clear()
    _function_verdicts.clear()


def all_checked(functions) -> bool:
    """Has every one of these stock forward functions passed a self-check in this process (and none failed)?"""
    return all(_function_verdicts.get(fn) is True for fn in functions)


def _in_reference() -> bool:
    return getattr(_local, "reference", 0) > 0


class _Reference:
    """While ComfyUI's forward computes a check's reference, the pack's forwards inside it run stock too."""

    def __enter__(self):
        _local.reference = getattr(_local, "reference", 0) + 1

    def __exit__(self, *exc):
        _local.reference -= 1


def probe_options(transformer_options: dict) -> dict:
    """A copy of `transformer_options` whose patch hooks are replaced by probes: each returns its input's
    `x` scaled by a factor of its own, so a forward that calls a hook gives a visibly different result, and
    another node's hook never runs on check inputs. The reference cache's view of the call is left out: a check
    neither fills nor reads a cache."""
    if REFERENCE_CACHE_KEY in transformer_options:
        transformer_options = {k: v for k, v in transformer_options.items() if k != REFERENCE_CACHE_KEY}
    patches = transformer_options.get("patches")
    if not patches:
        return transformer_options
    probed = {}
    for index, (name, hooks) in enumerate(sorted(patches.items())):
        factor = 0.5 + 0.125 * index

        def probe(args, *rest, _factor=factor, **kwargs):
            if isinstance(args, dict) and torch.is_tensor(args.get("x")):
                return args["x"] * _factor
            return args
        probed[name] = [probe] * len(hooks) if isinstance(hooks, (list, tuple)) else probe
    return {**transformer_options, "patches": probed}


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _without_rerouted(error: torch.Tensor, *tensors: torch.Tensor) -> tuple:
    """`tensors` (rows over the last dimension) without the `ROUTED_SHARE` of rows where `error` (one value a row)
    is largest (at least one row)."""
    drop = max(1, int(ROUTED_SHARE * error.shape[0]))
    keep = error.argsort()[:max(error.shape[0] - drop, 1)]
    return tuple(_rows(t)[keep] for t in tensors)


def _parts(stock, ours, base, reference):
    """(stock, ours, base, reference) part by part for outputs that are tuples (several streams), or the error
    that the structures differ."""
    if not isinstance(ours, (tuple, list)) or len(ours) != len(stock):
        return "the outputs have another structure"
    bases = base if isinstance(base, (tuple, list)) else (None,) * len(stock)
    references = reference if isinstance(reference, (tuple, list)) and len(reference) == len(stock) \
        else (None,) * len(stock)
    return list(zip(stock, ours, bases, references))


def compare(stock, ours, base: Optional[torch.Tensor] = None, quantized: bool = False,
            routed: bool = False, reference=None) -> Optional[str]:
    """None when `ours` computes what `stock` (ComfyUI's forward) computes, within the format's noise, else why
    not. Tensors or tuples of tensors. `base`: the module's input when its output is input + update (a block):
    distances are relative to the update, so a changed update is not hidden behind a large residual.

    `reference`: the same module's output in float32 with dequantized weights and unquantized inputs
    (`exact_reference`). Then both outputs are measured against it and `ours` passes when its distance is at
    most (1 + `CHECK_MARGIN`) x stock's plus `CHECK_ROUND_OFF` of the output's dtype: each weight format is
    judged by its own noise (an fp8 input quantization moves a few values a step whenever float round-off
    before it differs, by several per cent of the update for both forwards alike), and a change of math adds a
    distance that stock's does not have. Without a reference ComfyUI's output is the reference: float32 and
    float64 outputs within `CHECK_RTOL`, others (and modules with layers that quantize their input,
    `quantized`) within `CHECK_RTOL_16BIT` plus their own rounding of the output.

    `routed`: a block that routes each token to some of its experts (a mixture of experts): round-off flips the
    choice of tokens near a tie, so the `ROUTED_SHARE` of tokens farthest apart are left out and the rest must
    agree."""
    if stock is None and ours is None:   # a part both forwards leave out (SD3's last context: None)
        return None
    if stock is None or ours is None:
        return "one output is None, the other is not"
    if isinstance(stock, (tuple, list)):
        parts = _parts(stock, ours, base, reference)
        if isinstance(parts, str):
            return parts
        for a, b, part_base, part_reference in parts:
            reason = compare(a, b, part_base, quantized=quantized, routed=routed, reference=part_reference)
            if reason:
                return reason
        return None
    if not torch.is_tensor(ours) or ours.shape != stock.shape or ours.dtype != stock.dtype:
        return (f"the output is {getattr(ours, 'shape', type(ours))} {getattr(ours, 'dtype', '')}, ComfyUI's "
                f"{tuple(stock.shape)} {stock.dtype}")
    if not bool(torch.isfinite(stock).all()):
        return "ComfyUI's own output is not finite on the check input: nothing to compare against"
    usable = torch.is_tensor(reference) and reference.shape == stock.shape and bool(torch.isfinite(reference).all())
    stock64, ours64 = stock.double(), ours.double()
    exact64 = reference.double() if usable else stock64
    residual = base is not None and base.shape == stock.shape
    update = exact64 - base.double() if residual else exact64
    if routed and stock.dim() >= 2 and stock.shape[-2] > 1:
        error = (_rows(ours64) - _rows(exact64)).norm(dim=-1)
        if usable:
            error = torch.maximum(error, (_rows(stock64) - _rows(exact64)).norm(dim=-1))
        stock64, ours64, exact64, update = _without_rerouted(error, stock64, ours64, exact64, update)
    scale = float(update.norm())
    ours_distance = float((ours64 - exact64).norm())
    if usable:
        stock_distance = float((stock64 - exact64).norm())
        allowed = (1 + CHECK_MARGIN) * stock_distance + CHECK_ROUND_OFF.get(stock.dtype, 4e-3) * scale
        if not ours_distance <= allowed:
            return (f"the outputs differ (relative difference {ours_distance / max(scale, 1e-30):.3g} from the "
                    f"float32 reference, ComfyUI's own {stock_distance / max(scale, 1e-30):.3g})")
        return None
    if stock.dtype in CHECK_RTOL and not quantized:
        allowed = CHECK_RTOL[stock.dtype] * scale
    else:
        allowed = CHECK_RTOL_16BIT * scale + torch.finfo(stock.dtype).eps * float(stock64.norm())
    if not ours_distance <= allowed:
        return f"the outputs differ (relative difference {ours_distance / max(scale, 1e-30):.3g})"
    return None


_UNCHECKED = object()


def known_verdict(signature) -> tuple[bool, Optional[str]]:
    """(True, the verdict) when `signature` was checked in this process, else (False, None)."""
    verdict = _verdicts.get(signature, _UNCHECKED)   # one hash of the signature (every call asks)
    if verdict is _UNCHECKED:
        return False, None
    return True, verdict


def self_check(signature, functions, run_stock: Callable, run_ours: Callable, base=None,
               quantized: bool = False, routed: bool = False,
               run_reference: Optional[Callable] = None,
               agree: Optional[Callable[[Optional[str]], Optional[str]]] = None) -> Optional[str]:
    """The cached verdict for `signature`, computing it now if needed: None when `run_ours()` computes what
    `run_stock()` does (see `compare`, against `run_reference()` where given and it runs), else the reason.
    `functions`: the stock forward functions the verdict is about (their overall record feeds `all_checked`).
    `quantized`: the module has layers that quantize their input; `routed`: it routes tokens to experts (see
    `compare`). `agree(reason)`: the verdict of every process that runs this call together (the ranks of a
    sequence-parallel group: `sequence_parallel.agreement`), so that all take the same forward."""
    if signature in _verdicts:
        return _verdicts[signature]
    try:
        with torch.no_grad(), not_counted():   # the check is not part of the run the report counts
            with _Reference():
                stock = run_stock()
            reference = _reference_or_none(run_reference)
            ours = run_ours()
            reason = compare(stock, ours, base, quantized, routed, reference=reference)
    except Exception as error:  # noqa: BLE001 - a check that cannot run is a failed check, never a crash
        reason = f"the check raised {type(error).__name__}: {error}"
    if agree is not None:
        reason = agree(reason)
    _verdicts[signature] = reason
    for fn in functions:
        _function_verdicts[fn] = _function_verdicts.get(fn, True) and reason is None
    return reason


def _reference_or_none(run_reference: Optional[Callable]):
    """`run_reference()` under `_Reference` (the pack's forwards inside run ComfyUI's), or None where there is
    none or it cannot run (a layer that does not compute in float32): the check then judges against ComfyUI's
    output alone."""
    if run_reference is None:
        return None
    try:
        with _Reference():
            return run_reference()
    except Exception:  # noqa: BLE001 - no reference: `compare` falls back to ComfyUI's output
        return None


# Weights of ComfyUI's ops (and of ops built on them: mixed precision, GGUF) are cast to their input's dtype on
# every call when these flags are set; `comfy_force_cast_weights` also keeps a mixed-precision layer from
# quantizing its input. ComfyUI sets the first itself for low-VRAM loads.
_CAST_FLAGS = ("comfy_cast_weights", "comfy_force_cast_weights")
_CAST_OP = getattr(comfy.ops, "CastWeightBiasOp", None)


def _as_float32(value):
    if torch.is_tensor(value) and value.is_floating_point() and value.dtype != torch.float64:
        return value.float()
    return value


def exact_reference(module, forward: Callable, inputs: dict):
    """`forward(**inputs)` (ComfyUI's forward of `module`) nearer the exact math: floating inputs in float32 and
    every ComfyUI layer under `module` casting its weight to float32 at its call (fp8, int8 and GGUF weights
    dequantized, no input quantized: the layers' own casts, LoRA weight functions applied). Each layer's flags
    are restored afterwards, whatever happens. Costs one forward of the check tokens in float32, one layer's
    float32 weight at a time."""
    if _CAST_OP is None:
        raise RuntimeError("this ComfyUI has no CastWeightBiasOp")
    layers = [layer for layer in module.modules() if isinstance(layer, _CAST_OP)]
    saved = [(layer, {name: layer.__dict__[name] for name in _CAST_FLAGS if name in layer.__dict__})
             for layer in layers]
    try:
        for layer in layers:
            for name in _CAST_FLAGS:
                setattr(layer, name, True)
        return forward(**{name: _as_float32(value) for name, value in fresh_inputs(inputs).items()})
    finally:
        for layer, own in saved:
            for name in _CAST_FLAGS:
                if name in own:
                    setattr(layer, name, own[name])
                else:
                    layer.__dict__.pop(name, None)


SHORT_CALL_NOTICE = "ComfyUI's own forward on short sequences"


class ShortCall(str):
    """A refusal by design, not a fallback: a family whose forwards are slower than ComfyUI's on sequences under
    the split floor runs ComfyUI's there (the log says so in other words than for a fallback)."""


def guarded(what: str, stock: Callable, ours: Callable, refuse: Callable, check: Callable) -> Callable:
    """The forward the pack installs: `ours(*args, **kwargs)`, or `stock(...)` when `refuse(args, kwargs)`
    gives a reason or `check(args, kwargs)` (the cached self-check) does. Each reason is logged once a run
    (`what` says which module).

    Under torch.compile (ComfyUI's `TorchCompileModel`, blocks compiled one by one): the decision and the
    self-check run eagerly (`decide`: host state and checks that a trace would freeze, or trace into ComfyUI's
    casts); the pack's forward runs eagerly as a whole (its transients are freed in an order of its own, which
    a compiled graph's scheduling does not keep: docs/design.md §3.8); ComfyUI's forward, where it runs,
    compiles as it would without the pack. The installed function itself is skipped by dynamo but not what it
    calls: every block shares its code object, which would otherwise be compiled once per block."""

    def decide(args, kwargs) -> Optional[str]:
        reason = None
        if torch.is_grad_enabled():
            reason = "gradients are enabled (the pack's forwards are for inference)"
        outer, _local.trees = getattr(_local, "trees", None), {}   # module trees walked once for these checks
        try:
            if reason is None:
                reason = refuse(args, kwargs)
            if reason is None:
                reason = check(args, kwargs)
        finally:
            _local.trees = outer
        if isinstance(reason, ShortCall):
            notice_once(f"short:{what}", f"[QKV] {what}: {SHORT_CALL_NOTICE} ({reason})")
        elif reason is not None:
            notice_once(f"stock:{what}:{reason}", f"[QKV] {what} runs as ComfyUI's own: {reason}")
        return None if reason is None else "stock"

    decide = torch.compiler.disable(decide, reason="QKV: the guards and the self-check run eagerly")
    run_ours = torch.compiler.disable(ours, reason="QKV: the bounded forward keeps its own order of frees")

    def forward(*args, **kwargs):
        if _in_reference() or decide(args, kwargs) is not None:
            return stock(*args, **kwargs)
        return run_ours(*args, **kwargs)

    return mark_ours(torch.compiler.disable(forward, recursive=False,
                                            reason="QKV: one code object for every block's guard"))


def check_tokens(tokens: int) -> int:
    return min(tokens, CHECK_TOKENS)


# --- guarding one module's forward: what every family adapter shares -------------------------------------
def bind_args(names, args, kwargs) -> Optional[dict]:
    """The call's arguments by name, or None when it passes one the pack's forward does not know."""
    if len(args) > len(names) or any(name not in names for name in kwargs):
        return None
    bound = dict(zip(names, args))
    if any(name in bound for name in kwargs):
        return None
    bound.update(kwargs)
    return bound


def unknown_args(names, args, kwargs) -> str:
    extra = [name for name in kwargs if name not in names] or [f"{len(args)} positional"]
    return f"called with arguments the pack's forward does not take ({', '.join(extra)})"


def hooks_set(transformer_options) -> frozenset:
    """The names of the patch hooks other nodes set in `transformer_options["patches"]` (non-empty ones): part
    of every guarded call's signature, and what some forwards refuse to run around."""
    return frozenset(name for name, hooks in (transformer_options or {}).get("patches", {}).items() if hooks)


def hooks_refusal(transformer_options, names) -> Optional[str]:
    """Why a forward must run ComfyUI's own: another node set one of the hooks `names` that ComfyUI's forward
    calls on whole q/k/v (the head split never holds them), else None."""
    inside = sorted(hooks_set(transformer_options).intersection(names))
    return f"another node's {', '.join(inside)} hook needs whole q/k/v" if inside else None


def fresh_inputs(inputs: dict) -> dict:
    """The check inputs again, tensors copied (a forward may hand off or write its inputs)."""
    return {name: value.clone() if torch.is_tensor(value) else value for name, value in inputs.items()}


def guard_module(what: str, module, names, ours_factory, config, *, functions: Callable, signature: Callable,
                 check_inputs: Callable, residual: Optional[str] = None, quantized: Optional[Callable] = None,
                 refuse_more: Optional[Callable] = None, refuse_call: Optional[Callable] = None,
                 routed: bool = False, agree: Optional[Callable] = None) -> Callable:
    """`guarded` for one module of a family: ours = `ours_factory(module, config)`, self-checked once per
    kind of call against the module's own forward on `check_inputs(bound)` (the call's first tokens), with
    the head split forced (`config._replace(split_floor=0)`).

    `names`: the forward's parameters (a call with others runs stock); `functions()`: ComfyUI's functions
    whose math ours replaces (the verdict is kept for them); `signature(bound)`: what makes a call another
    kind (dtype, layouts, hooks present, ...); `residual`: the input a block adds its update to (the check
    compares the updates), or a tuple of them for a block returning several streams in that order;
    `quantized()`: whether the module quantizes its inputs now (a looser tolerance);
    `refuse_more(module)`: a reason to run stock for a module state the check cannot see; `refuse_call(bound)`:
    one for a call's arguments (e.g. another node's hook the pack's forward cannot run between its groups);
    `routed`: the module routes tokens to experts (see `compare`); `agree(bound)`: None, or how the verdict of a
    call run by several processes together is made theirs (`self_check`'s `agree`). A call whose sequences are
    all under the split floor runs ComfyUI's own forward where `config.policy.runs_stock` says so (families whose
    bounded forwards are slower than ComfyUI's there: whole models on an H200 at 1 MP ran 1.1-1.8x stock's time,
    for ~0.5 GiB)."""
    stock = stock_forward(module)
    ours = ours_factory(module, config)
    checked = ours_factory(module, config._replace(split_floor=0))
    policy = config.policy

    def refuse(args, kwargs):
        bound = bind_args(names, args, kwargs)
        if bound is None:
            return unknown_args(names, args, kwargs)
        if policy.short_runs_stock:
            tokens = max((value.shape[1] for value in bound.values() if torch.is_tensor(value) and value.dim() == 3),
                         default=None)
            if tokens is not None and policy.runs_stock(tokens):
                return ShortCall(f"{tokens} tokens, under the split floor of {policy.floor}: faster there")
        if refuse_call is not None:
            reason = refuse_call(bound)
            if reason is not None:
                return reason
        return refuse_more(module) if refuse_more is not None else None

    def check(args, kwargs):
        bound = bind_args(names, args, kwargs)
        call_signature = signature(bound)
        known, reason = known_verdict(call_signature)
        if known:   # every call after the first of its kind: no check inputs are made
            return reason
        inputs = check_inputs(bound)
        if isinstance(residual, tuple):   # a block with several residual streams returns them in this order
            base = tuple(inputs[name].clone() for name in residual)
        else:
            base = inputs[residual].clone() if residual is not None else None
        return self_check(call_signature, functions(), lambda: stock(**fresh_inputs(inputs)),
                          lambda: checked(**fresh_inputs(inputs)), base=base,
                          quantized=bool(quantized and quantized()), routed=routed,
                          run_reference=lambda: exact_reference(module, stock, inputs),
                          agree=agree(bound) if agree is not None else None)

    return guarded(what, stock, ours, refuse, check)


__all__ = ["guarded", "guard_module", "self_check", "known_verdict", "compare", "exact_reference", "probe_options",
           "mark_ours", "is_ours", "stock_forward", "foreign_forward", "forget_verdicts", "all_checked",
           "check_tokens", "CHECK_TOKENS", "ROUTED_SHARE", "bind_args", "unknown_args", "layers_signature",
           "module_tree", "ModuleTree", "fresh_inputs", "hooks_set", "hooks_refusal"]
