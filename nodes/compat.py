"""Does the pack's forward still compute what ComfyUI's does? Guards and a behavioural self-check.

Every forward the pack installs is wrapped by `guarded()`. A call runs ComfyUI's own (stock) forward instead
of the pack's when:
- gradients are enabled (a training node downstream: the pack's forwards are inference-only);
- the call carries arguments the pack's forward does not know (a newer ComfyUI added one);
- another node patched a submodule the pack's forward would bypass (`foreign_forward`);
- the self-check for this kind of call failed.
The self-check runs at the first call of each signature (module kind, the stock forwards' functions, layer
types, dtypes, device, the patch hooks present in `transformer_options`, the node's settings, and what the
adapter says makes a case different: a zeroed context, say): both forwards run on the first `CHECK_TOKENS`
tokens of every distinct conditioning of the real inputs (the adapter's `check_inputs`), with the head split
forced even at that size, and are judged in two steps (`self_check`):
1. the math, exactly: the pack's forward and ComfyUI's, each in float32 with the module's weights dequantized
   and no input quantized (`exact_reference`), must agree to float32 round-off on every batch item
   (`compare_exact`): a change of math shows whatever the weight format;
2. the format, by its noise: both in the module's own format, each measured against ComfyUI's float32 output;
   the pack's may be at most a margin farther from it than ComfyUI's own (`compare`).
A float32 forward that cannot run is a failed check with its reason, never a looser rule. Patch hooks present in
`transformer_options["patches"]` are replaced by probes for the check (other nodes' hooks never run on check
inputs): when ComfyUI's forward calls a hook the pack's does not, the outputs differ and the pack steps
aside. So a ComfyUI release that keeps the math keeps the savings, and one that changes it (a new hook, a new
norm, a new argument) runs stock, with one log line, never with other numbers.

Verdicts are kept for the process, keyed by the function objects (an edited or reloaded ComfyUI is checked
again). The cost is four forwards (ComfyUI's and the pack's, each in float32 and in the model's format) of a
few hundred tokens a conditioning per signature: next to a sampling step of a long sequence, nothing.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..qkv_core.notices import FALLBACK, SHORT_CALL, Notice, muted, notice_once
from ..qkv_core.tally import not_counted
from .check_inputs import (CHECK_ITEMS, CHECK_TOKENS, check_items, check_tokens, exact_reference, fresh_inputs,
                           probe_options, uniform_case)
from .module_tree import (ModuleTree, _local, foreign_forward, is_ours, layers_signature, mark_ours, module_tree,
                          stock_forward)

# Step 1 (`compare_exact`): the pack's forward and ComfyUI's, both in float32 with dequantized weights, may differ
# per batch item by this share of the update the module adds, plus `EXACT_ROUND_OFF` of the output's own norm (the
# rounding of a residual sum). Reordered float32 sums differ by ~1e-6 of the update; a change of math by what it
# changes (a 1 % larger update: 1e-2).
EXACT_RTOL = 1e-4
EXACT_ROUND_OFF = 1e-6
# Step 2 (`compare`): the same forwards in the module's own format, each measured against ComfyUI's float32
# output: the pack's distance may be at most (1 + CHECK_MARGIN) x ComfyUI's own plus a round-off of the output's
# dtype, times the norm of the update. Both distances are the format's noise (bf16 rounding, an fp8 or int8 input
# quantization, a GGUF block scale): reordered sums draw new noise of the same size. Measured on the CPU (tiny Wan
# block, fp8-scaled, bf16): stock and pack 3.9 % from the float32 reference each and 2.8 % from each other; bf16
# weights 0.8 % each. (What the math changes is step 1's to find: this step judges only what the format adds.)
CHECK_MARGIN = 0.25
CHECK_ROUND_OFF = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 4e-3}
# `compare` without a reference (direct callers; the self-check always has one): ComfyUI's output is the
# reference, with these relative tolerances on the update.
CHECK_RTOL = {torch.float64: 1e-6, torch.float32: 1e-4}
CHECK_RTOL_16BIT = 2e-2
# the share of tokens a routed block's step 2 leaves out (`compare(routed=True)`): in 16 bits a few of 256 check
# tokens sit near a tie between two experts. Step 1 leaves none out: in float32 both forwards route alike.
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


def compare_exact(reference, ours, base=None) -> Optional[str]:
    """Step 1 of the self-check: None when `ours` (the pack's forward in float32 with dequantized weights) equals
    `reference` (ComfyUI's, run so: `exact_reference`) to float32 round-off, else why not. Each batch item on its
    own (an error in one conditioning is not diluted by the others): its distance at most `EXACT_RTOL` x the norm
    of its update (`base`: the module's input where it adds an update to it) plus `EXACT_ROUND_OFF` x its output's
    norm. No rows are left out, routed blocks' neither. Tensors or tuples of tensors."""
    if reference is None and ours is None:
        return None
    if reference is None or ours is None:
        return "one output is None, the other is not (in float32)"
    if isinstance(reference, (tuple, list)):
        parts = _parts(reference, ours, base, None)
        if isinstance(parts, str):
            return parts
        for a, b, part_base, _ in parts:
            reason = compare_exact(a, b, part_base)
            if reason:
                return reason
        return None
    if not torch.is_tensor(ours) or ours.shape != reference.shape:
        return f"the float32 output is {getattr(ours, 'shape', type(ours))}, ComfyUI's {tuple(reference.shape)}"
    if not bool(torch.isfinite(reference).all()):
        return "ComfyUI's float32 output is not finite on the check input: nothing to compare against"
    exact64, ours64 = reference.double(), ours.double()
    update = exact64 - base.double() if base is not None and base.shape == reference.shape else exact64
    items = (lambda t: t.reshape(t.shape[0], -1)) if reference.dim() >= 2 else (lambda t: t.reshape(1, -1))
    distance = (items(ours64) - items(exact64)).norm(dim=1)
    scale = items(update).norm(dim=1)
    allowed = EXACT_RTOL * scale + EXACT_ROUND_OFF * items(exact64).norm(dim=1)
    failed = ~(distance <= allowed)   # NaN fails
    if not bool(failed.any()):
        return None
    share = torch.where(failed, distance / scale.clamp_min(1e-30), torch.zeros_like(distance))
    share = torch.nan_to_num(share, nan=float("inf"))
    item = int(share.argmax())
    return (f"the outputs differ in float32 (relative difference {float(share[item]):.3g} from the float32 "
            f"reference, item {item} of {distance.shape[0]}; round-off allows {EXACT_RTOL:g})")


def self_check(signature, functions, run_stock: Callable, run_ours: Callable, base=None,
               quantized: bool = False, routed: bool = False,
               run_reference: Optional[Callable] = None,
               agree: Optional[Callable[[Optional[str]], Optional[str]]] = None,
               run_exact: Optional[Callable] = None, recheck: bool = False,
               run_ready: Optional[Callable] = None) -> Optional[str]:
    """The cached verdict for `signature`, computing it now if needed: None when the pack's forward computes
    what ComfyUI's does, else the reason. Four forwards of the check inputs, in this order on every process:
    `run_stock()` (ComfyUI's, in the module's format), `run_reference()` (ComfyUI's in float32 with dequantized
    weights: `exact_reference`), `run_exact()` (the pack's, so), `run_ours()` (the pack's in the format).
    Step 1, the math: `compare_exact(reference, exact)`; step 2, the format's noise: `compare(stock, ours,
    reference=reference)`. Without a float32 forward (None, or one that raises) the check fails with the reason.
    `functions`: the stock forward functions the verdict is about (their overall record feeds `all_checked`).
    `quantized`: the module has layers that quantize their input; `routed`: it routes tokens to experts (see
    `compare`). `agree(reason)`: the verdict of every process that runs this call together (the ranks of a
    sequence-parallel group: `sequence_parallel.agreement`), so that all take the same forward; where it has
    `any(flag)`, first `run_ready()` (the float32 forwards' preparation, no forward) and whether it raised on any
    rank: then no rank runs them (each rank's exchanges stay the others'). `recheck`: run it even if cached."""
    if signature in _verdicts and not recheck:
        return _verdicts[signature]
    unready = None
    if agree is not None and hasattr(agree, "any") and run_ready is not None:
        try:
            run_ready()
        except Exception as error:  # noqa: BLE001 - agreed below: no rank runs the float32 forwards
            unready = _no_float32(error)
        if agree.any(unready is not None)[0]:
            unready = unready or "ComfyUI's float32 forward cannot run on another rank of the sequence-parallel group"
    try:
        with torch.no_grad(), not_counted():   # the check is not part of the run the report counts
            with _Reference():
                stock = run_stock()
            reference, exact, reason = _float32_forwards(run_reference, run_exact) if unready is None \
                else (None, None, unready)
            ours = run_ours()
            if reason is None:
                reason = compare_exact(reference, exact, base)
            if reason is None:
                reason = compare(stock, ours, base, quantized, routed, reference=reference)
    except Exception as error:  # noqa: BLE001 - a check that cannot run is a failed check, never a crash
        reason = f"the check raised {type(error).__name__}: {error}"
    if agree is not None:
        reason = agree(reason)
    _verdicts[signature] = reason
    for fn in functions:
        _function_verdicts[fn] = _function_verdicts.get(fn, True) and reason is None
    return reason


def _float32_forwards(run_reference: Optional[Callable], run_exact: Optional[Callable]) -> tuple:
    """(ComfyUI's forward in float32, the pack's in float32, None), or (None, None, why they cannot run). Both
    with float32 products at full precision (no TF32) and the runtime's notices muted (a backend that takes 16
    bits only passes float32 calls by: not something the run does). ComfyUI's under `_Reference` (the pack's
    forwards inside it run ComfyUI's)."""
    if run_reference is None or run_exact is None:
        return None, None, "no float32 forward of this module to check the math against"
    with muted(), _full_float32():
        try:
            with _Reference():
                reference = run_reference()
        except Exception as error:  # noqa: BLE001 - no reference: the check fails, saying why
            reference, reason = None, _no_float32(error)
        else:
            return reference, run_exact(), None
        try:   # run anyway: the ranks of a sequence-parallel group make the same exchanges in the same order
            run_exact()
        except Exception:  # noqa: BLE001 - the reason is the reference's
            pass
        return None, None, reason


def _no_float32(error: Exception) -> str:
    return f"ComfyUI's forward does not run in float32 with dequantized weights ({type(error).__name__}: {error})"


class _full_float32:
    """float32 matrix products at full precision inside (`torch.set_float32_matmul_precision("highest")`: no
    TF32, which another node may have turned on), restored after."""

    def __enter__(self):
        try:
            self.saved = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("highest")
        except Exception:  # noqa: BLE001 - a torch that mixes its precision APIs: left as it is
            self.saved = None

    def __exit__(self, *exc):
        if self.saved is not None:
            torch.set_float32_matmul_precision(self.saved)


SHORT_CALL_NOTICE = "ComfyUI's own forward on short sequences"
OTHER_RANK_RUNS_STOCK = "another rank of the sequence-parallel group runs ComfyUI's own"


class ShortCall(str):
    """A refusal by design, not a fallback: a family whose forwards are slower than ComfyUI's on sequences under
    the split floor runs ComfyUI's there (the log says so in other words than for a fallback)."""


def guarded(what: str, stock: Callable, ours: Callable, refuse: Callable, check: Callable,
            agree: Optional[Callable] = None) -> Callable:
    """The forward the pack installs: `ours(*args, **kwargs)`, or `stock(...)` when `refuse(args, kwargs)`
    gives a reason or `check(args, kwargs)` (the cached self-check) does. Each reason is logged once a run
    (`what` says which module).

    Under torch.compile (ComfyUI's `TorchCompileModel`, blocks compiled one by one): the decision and the
    self-check run eagerly (`decide`: host state and checks that a trace would freeze, or trace into ComfyUI's
    casts); the pack's forward runs eagerly as a whole (its transients are freed in an order of its own, which
    a compiled graph's scheduling does not keep: docs/design.md §3.8); ComfyUI's forward, where it runs,
    compiles as it would without the pack. The installed function itself is skipped by dynamo but not what it
    calls: every block shares its code object, which would otherwise be compiled once per block.

    `agree(args, kwargs, reason)`: for a call several processes run together (a sequence-parallel group), the
    group's (reason, recheck) from this rank's refusal, before the check can exchange anything: a refusal on any
    rank is every rank's, and a verdict missing on any rank is checked again on all (`check(..., recheck=True)`)."""

    def decide(args, kwargs) -> Optional[str]:
        reason = None
        if torch.is_grad_enabled():
            reason = "gradients are enabled (the pack's forwards are for inference)"
        outer, _local.trees = getattr(_local, "trees", None), {}   # module trees walked once for these checks
        try:
            if reason is None:
                reason = refuse(args, kwargs)
            recheck = False
            if agree is not None:
                reason, recheck = agree(args, kwargs, reason)
            if reason is None:
                reason = check(args, kwargs, recheck=True) if recheck else check(args, kwargs)
        finally:
            _local.trees = outer
        if isinstance(reason, ShortCall):
            notice_once(f"short:{what}", Notice(SHORT_CALL, what, str(reason),
                                                f"[QKV] {what}: {SHORT_CALL_NOTICE} ({reason})"))
        elif reason is not None:
            notice_once(f"stock:{what}:{reason}", Notice(FALLBACK, what, str(reason),
                                                         f"[QKV] {what} runs as ComfyUI's own: {reason}"))
        return None if reason is None else "stock"

    decide = torch.compiler.disable(decide, reason="QKV: the guards and the self-check run eagerly")
    run_ours = torch.compiler.disable(ours, reason="QKV: the bounded forward keeps its own order of frees")

    def forward(*args, **kwargs):
        if _in_reference() or decide(args, kwargs) is not None:
            return stock(*args, **kwargs)
        return run_ours(*args, **kwargs)

    installed = mark_ours(torch.compiler.disable(forward, recursive=False,
                                                 reason="QKV: one code object for every block's guard"))
    installed.comfyui_qkv_decide = decide
    return installed


def decide_call(forward: Callable, *args, **kwargs) -> Optional[str]:
    """What a call of `forward` (a `guarded` forward) decides before it computes: its guards and, at the first call
    of its kind, the self-check (cached as that call's would be). None when the pack's forward would run, else
    "stock". Nothing of the forward itself runs: a measurement can start with the verdict already cached."""
    return forward.comfyui_qkv_decide(args, kwargs)


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


def guard_module(what: str, module, names, ours_factory, config, *, functions: Callable, signature: Callable,
                 check_inputs: Callable, residual: Optional[str] = None, quantized: Optional[Callable] = None,
                 refuse_more: Optional[Callable] = None, refuse_call: Optional[Callable] = None,
                 routed: bool = False, agree: Optional[Callable] = None) -> Callable:
    """`guarded` for one module of a family: ours = `ours_factory(module, config)`, self-checked once per
    kind of call against the module's own forward on `check_inputs(bound)` (the call's first tokens), with
    the head split forced (`config._replace(split_floor_tokens=0)`).

    `names`: the forward's parameters (a call with others runs stock); `functions()`: ComfyUI's functions
    whose math ours replaces (the verdict is kept for them); `signature(bound)`: what makes a call another
    kind (dtype, layouts, hooks present, ...); `residual`: the input a block adds its update to (the check
    compares the updates), or a tuple of them for a block returning several streams in that order;
    `quantized()`: whether the module quantizes its inputs now (a looser tolerance);
    `refuse_more(module)`: a reason to run stock for a module state the check cannot see; `refuse_call(bound)`:
    one for a call's arguments (e.g. another node's hook the pack's forward cannot run between its groups);
    `routed`: the module routes tokens to experts (see `compare`); `agree(bound)` (`bound` None for unknown
    arguments): None, or how a call run by several processes together takes one path on all
    (`sequence_parallel.Agreement`: every reason to run stock and whether the verdict is cached, agreed in one
    all-reduce before the check; then the check's verdict, `self_check`'s `agree`). A call whose sequences are
    all under the split floor runs ComfyUI's own forward where `config.policy.runs_stock` says so (families whose
    bounded forwards are slower than ComfyUI's there, for little memory saved: docs/benchmarks.md#split-floors)."""
    stock = stock_forward(module)
    ours = ours_factory(module, config)
    checked = ours_factory(module, config._replace(split_floor_tokens=0))
    policy = config.policy

    def refuse(args, kwargs):
        bound = bind_args(names, args, kwargs)
        if bound is None:
            return unknown_args(names, args, kwargs)
        if policy.short_runs_stock:
            tokens = max((value.shape[1] for value in bound.values() if torch.is_tensor(value) and value.dim() == 3),
                         default=None)
            if tokens is not None and policy.runs_stock(tokens):
                return ShortCall(f"{tokens} tokens, under the split floor of "
                                 f"{policy.effective_split_floor_tokens}: faster there")
        if refuse_call is not None:
            reason = refuse_call(bound)
            if reason is not None:
                return reason
        return refuse_more(module) if refuse_more is not None else None

    def check(args, kwargs, recheck: bool = False):
        bound = bind_args(names, args, kwargs)
        call_signature = signature(bound)
        known, reason = known_verdict(call_signature)
        if known and not recheck:   # every call after the first of its kind: no check inputs are made
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
                          agree=agree(bound) if agree is not None else None,
                          run_exact=lambda: exact_reference(module, checked, inputs), recheck=recheck,
                          run_ready=lambda: exact_reference(module, lambda **_: None, inputs))

    def agree_call(args, kwargs, reason):
        bound = bind_args(names, args, kwargs)
        agreement = agree(bound)
        if agreement is None or not hasattr(agreement, "any"):   # not in a group: nothing exchanged
            return reason, False
        unknown = reason is None and not known_verdict(signature(bound))[0]
        refused, unknown = agreement.any(reason is not None, unknown)
        if refused:
            return reason or OTHER_RANK_RUNS_STOCK, False
        return None, unknown

    return guarded(what, stock, ours, refuse, check, agree_call if agree is not None else None)


__all__ = ["guarded", "decide_call", "guard_module", "self_check", "known_verdict", "compare", "compare_exact", "exact_reference",
           "probe_options", "check_items", "uniform_case", "CHECK_ITEMS",
           "mark_ours", "is_ours", "stock_forward", "foreign_forward", "forget_verdicts", "all_checked",
           "check_tokens", "CHECK_TOKENS", "ROUTED_SHARE", "bind_args", "unknown_args", "layers_signature",
           "module_tree", "ModuleTree", "fresh_inputs", "hooks_set", "hooks_refusal"]
