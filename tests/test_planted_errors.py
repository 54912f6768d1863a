"""Errors planted in the pack's own bounded Wan block are found by the self-check (issue 46, items 1-3).

A tiny Wan 2.1 (8 heads) in every weight format users load (bf16, fp8 cast per call, fp8-scaled in both file
layouts, int8 weight-only, GGUF Q8_0), cond + uncond in one batch of 2, the first item's
text context random or zeroed (ConditioningZeroOut's negative). The pack's block is changed, never ComfyUI's:
its update scaled by 1 %, 2 % or 5 % (`run_block`), its cross-attention queries taken from the wrong tokens
(each token's query from the token before it: `cross_attention_phase`), one head of one group given another
head's output (`self_attention` inside the block). Each planted error must send the block to ComfyUI's own
forward, with the notice `Wan block runs as ComfyUI's own: the outputs differ ...` and the run report's first
line saying so; with nothing planted the pack's block (and every other forward of the pack) is kept.

The rule they test (nodes/compat.py, docs/design.md §3.3): the pack's forward and ComfyUI's both run in float32
with dequantized weights on the check tokens of every distinct conditioning and must agree to float32 round-off
(any change of math, whatever the format); the run in the model's own format is judged only for what the format
adds. Skipped without ComfyUI (or where this ComfyUI cannot build a format, with the reason); a pack that does
not import fails.
"""
from __future__ import annotations

import pytest

from support import comfy_env
from support import formats

pytestmark = pytest.mark.comfyui

MODEL = dict(dim=256, heads=8, layers=1)
SIZE = dict(frames=2, h=16, w=24, batch=2)   # 2 x 192 tokens: the check takes them all, the split forced
# every weight format users load (formats.py); one this ComfyUI or machine cannot build skips with the reason
FORMATS = ("bf16", "fp8_cast", "fp8_scaled", "fp8_scaled_file", "int8_tensorwise", "gguf_q8_0")
CONTEXTS = ("item-0-random", "item-0-zeroed")
PLANTS = ("nothing", "update-1pct", "update-2pct", "update-5pct", "wrong-token-queries", "wrong-head")
WRONG_HEAD, FROM_HEAD = 5, 4   # the head of one group (High: 8 groups of one head) given another's output


@pytest.fixture(scope="module")
def env():
    return comfy_env.pack_modules()


@pytest.fixture(scope="module")
def models(env):
    """One tiny float32 Wan, rebuilt in each weight format on demand (format name -> ModelPatcher)."""
    base = comfy_env.make_wan("t2v", **MODEL)
    built = {}

    def get(name):
        why = formats.unsupported(name)
        if why:
            pytest.skip(why)
        if name not in built:
            built[name] = formats.in_format(base, name)
        return built[name]
    return get


@pytest.fixture(autouse=True)
def _fresh_verdicts(env):
    env.compat.forget_verdicts()
    env.core.reset_notices()
    env.core.drain_tally()
    yield
    env.compat.forget_verdicts()


# --- the plants: the pack's block only (ComfyUI's forwards and the pack's attention-only forwards unchanged) ------
def _scaled_update(run_block, factor):
    """The bounded block with its update (output - x) `factor` times what it computes."""
    def run(block, config, **bound):
        x = bound["x"]
        out = run_block(block, config, **bound)
        return (x.float() + factor * (out.float() - x.float())).to(out.dtype)
    return run


def _wrong_token_queries(wan):
    """`cross_attention_phase` with each token's cross-attention query taken from the token before it."""
    def phase(block, residual, context, context_img_len, config, transformer_options, step):
        cross = wan.CrossAttention(block.cross_attn, context, context_img_len, config, transformer_options,
                                   like=residual)
        shifted = residual.roll(1, dims=1)
        try:
            for a, b in wan.token_ranges(residual.shape[1], step):
                part = cross([block.norm3(shifted[:, a:b])], split_heads=False)
                residual[:, a:b] += cross.out(part.flatten(2))
        finally:
            cross.release()
    return phase


def _wrong_head(monkeypatch, wan):
    """Inside the bounded block's self-attention phase, one head's attention output replaced by another's."""
    phase, attend = wan.self_attention_phase, wan.self_attention
    inside = []

    def planted_phase(*args, **kwargs):
        inside.append(True)
        try:
            return phase(*args, **kwargs)
        finally:
            inside.pop()

    def planted_attention(*args, **kwargs):
        out = attend(*args, **kwargs)
        if inside:
            out[:, :, WRONG_HEAD] = out[:, :, FROM_HEAD].clone()
        return out
    monkeypatch.setattr(wan, "self_attention_phase", planted_phase)
    monkeypatch.setattr(wan, "self_attention", planted_attention)


def plant(monkeypatch, wan, name: str) -> None:
    """Plant error `name` (one of `PLANTS`) in the pack's Wan block; before `apply_patch` (the guard takes
    `run_block` when the patch is made)."""
    if name.startswith("update-"):
        factor = 1 + int(name[len("update-"):-len("pct")]) / 100
        monkeypatch.setattr(wan, "run_block", _scaled_update(wan.run_block, factor))
    elif name == "wrong-token-queries":
        monkeypatch.setattr(wan, "cross_attention_phase", _wrong_token_queries(wan))
    elif name == "wrong-head":
        _wrong_head(monkeypatch, wan)
    elif name != "nothing":
        raise ValueError(name)


def batch_inputs(patcher, context: str) -> dict:
    """Cond + uncond as ComfyUI batches them (2 items), in the model's compute dtype; item 0's text zeroed for
    `item-0-zeroed` (ConditioningZeroOut)."""
    import torch
    inputs = formats.as_compute(comfy_env.make_inputs(patcher.model, "t2v", dtype=torch.float32, **SIZE),
                                patcher.qkv_format.compute)
    inputs.pop("transformer_options")
    if context == "item-0-zeroed":
        inputs["context"][0].zero_()
    return inputs


def run_report_first_line(env, patched, report, notices) -> str:
    """The run report's first line for what ran since the tally was drained (and `notices`), as the run wrapper
    makes it."""
    config = env.node.QKVConfig(env.node.LEVELS.index("High"), "sdpa", True)
    run = env.node.RunReport(env.wan.FAMILY, config.describe(), report)
    env.node.finish_report(run, patched, env.wan, patched.model.diffusion_model, None, config, False,
                          notices)
    return run.lines()[0]


def run_planted(env, models, monkeypatch, fmt: str, context: str, planted: str):
    """(the fallback notices, the run report's first line) of one forward of the planted model."""
    patcher = models(fmt)
    plant(monkeypatch, env.wan, planted)
    patched, report = env.node.apply_patch(patcher, "High", "sdpa", True)
    assert not report.skipped_reasons, report.lines()
    inputs = batch_inputs(patcher, context)
    env.core.drain_tally()
    env.core.reset_notices()
    comfy_env.model_forward(patcher, inputs, applied=patched)
    notices = env.core.drain_notices()
    first = run_report_first_line(env, patched, report, notices)
    return comfy_env.lines_of_kind(notices, env.core.notices.FALLBACK), first


@pytest.mark.parametrize("planted", PLANTS)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_planted_error_in_the_packs_block_falls_back(env, models, monkeypatch, fmt, context, planted):
    fallbacks, first = run_planted(env, models, monkeypatch, fmt, context, planted)
    if planted == "nothing":
        assert fallbacks == [], fallbacks
        assert first == "Wan (High, block bounds, backend sdpa), run finished"
        return
    block = [line for line in fallbacks if line.startswith("[QKV] Wan block runs as ComfyUI's own: ")]
    assert block, f"{planted} ({fmt}, {context}) was kept: {fallbacks}"
    assert block[0].startswith("[QKV] Wan block runs as ComfyUI's own: the outputs differ"), block[0]
    # ComfyUI's block calls the pack's attention modules, which passed their own checks: only the block fell back
    assert len(fallbacks) == 1, fallbacks
    assert first.startswith("Part of the saving this run: Wan block ran as ComfyUI's own (the outputs differ"), first


def built_formats() -> list:
    """The issue's columns (bf16, fp8-scaled) this ComfyUI can build; every format's cells are the parametrized
    test's."""
    return [fmt for fmt in ("bf16", "fp8_scaled") if not formats.unsupported(fmt)]


def planted_table(env, models, monkeypatch) -> dict:
    """{(plant, format, context): "kept" or "fallback"} over the whole matrix (printed by `python3 -m pytest
    tests/test_planted_errors.py -k table -s`)."""
    table = {}
    for planted in PLANTS:
        for fmt in built_formats():
            for context in CONTEXTS:
                env.compat.forget_verdicts()
                with monkeypatch.context() as patch:
                    fallbacks, _ = run_planted(env, models, patch, fmt, context, planted)
                table[planted, fmt, context] = "fallback" if any("Wan block" in line for line in fallbacks) \
                    else "kept"
    return table


def test_table(env, models, monkeypatch):
    """The issue's table, printed: a row a plant, a column a format and context."""
    table = planted_table(env, models, monkeypatch)
    columns = [(fmt, context) for fmt in built_formats() for context in CONTEXTS]
    print("\n| planted | " + " | ".join(f"{fmt}, {context}" for fmt, context in columns) + " |")
    for planted in PLANTS:
        print(f"| {planted} | " + " | ".join(table[planted, fmt, context] for fmt, context in columns) + " |")
    assert all(table["nothing", fmt, context] == "kept" for fmt, context in columns)
    assert all(table[planted, fmt, context] == "fallback" for planted in PLANTS[1:] for fmt, context in columns)



def test_a_zeroed_context_alone_is_a_case_of_its_own(env, models, monkeypatch):
    """A call with only the zeroed negative (ComfyUI runs cond and uncond apart when memory is short) cannot show
    the wrong-token queries (every text key the same: uniform attention) and keeps the block; its verdict is not
    reused for a call whose context is not zeroed (`compat.uniform_case`, in the signature: the zeroed text reaches
    the block as one embedded row repeated), which is checked and falls back."""
    patcher = models("bf16")
    plant(monkeypatch, env.wan, "wrong-token-queries")
    patched, _ = env.node.apply_patch(patcher, "High", "sdpa", True)
    inputs = batch_inputs(patcher, "item-0-zeroed")
    alone = {name: value[:1] if name in ("x", "timestep", "context") else value for name, value in inputs.items()}
    comfy_env.model_forward(patcher, alone, applied=patched)
    assert comfy_env.stock_fallbacks(env) == []
    alone["context"] = inputs["context"][1:]
    comfy_env.model_forward(patcher, alone, applied=patched)
    fallbacks = comfy_env.stock_fallbacks(env)
    assert len(fallbacks) == 1 and fallbacks[0].startswith("[QKV] Wan block runs as ComfyUI's own: the outputs "
                                                           "differ in float32"), fallbacks


def test_a_float32_forward_that_cannot_run_is_a_fallback_with_its_reason(env, models, monkeypatch):
    """ComfyUI's forward that does not run in float32 with dequantized weights: the block falls back and says why
    (no looser rule without the reference)."""
    patcher = models("fp8_scaled")
    exact_reference = env.compat.exact_reference

    def no_float32(module, forward, inputs):
        if getattr(forward, "__self__", None) is module:   # ComfyUI's own (bound) forward
            raise RuntimeError("a layer that computes in 16 bits only")
        return exact_reference(module, forward, inputs)
    monkeypatch.setattr(env.compat, "exact_reference", no_float32)
    patched, _ = env.node.apply_patch(patcher, "High", "sdpa", True)
    comfy_env.model_forward(patcher, batch_inputs(patcher, "item-0-random"), applied=patched)
    fallbacks = comfy_env.stock_fallbacks(env)
    assert fallbacks and all("does not run in float32 with dequantized weights (RuntimeError: a layer that "
                             "computes in 16 bits only)" in line for line in fallbacks), fallbacks
    assert any(line.startswith("[QKV] Wan block runs as ComfyUI's own: ") for line in fallbacks)


def test_the_check_takes_every_distinct_conditioning(env):
    """`compat.check_items`: one item per distinct context, in batch order, at most `CHECK_ITEMS` (those whose
    tokens differ most kept: a zeroed negative is the first left out); `uniform_case` tells an item whose tokens are
    all alike (zeroed, or one row repeated) apart, once per tensor and version."""
    torch, compat = env.torch, env.compat
    g = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(1, 16, 32, generator=g), torch.zeros(1, 16, 32)
    assert compat.check_items(torch.cat([uncond, cond]), 2) == [0, 1]
    assert compat.check_items(torch.cat([cond, cond, uncond, uncond]), 4) == [0, 2]
    assert compat.check_items(None, 3) == [0, 1, 2]
    many = torch.cat([uncond] + [torch.randn(1, 16, 32, generator=g) for _ in range(compat.CHECK_ITEMS)])
    assert compat.check_items(many, many.shape[0]) == list(range(1, compat.CHECK_ITEMS + 1))
    assert compat.uniform_case(torch.cat([uncond, cond])) == (True, True)
    assert compat.uniform_case(cond) == (False, True) and compat.uniform_case(uncond) == (True, False)
    assert compat.uniform_case(cond[:, :1].expand(1, 16, 32) + 0.5) == (True, False)   # one row repeated
    context = cond.clone()
    assert compat.uniform_case(context) == (False, True)
    context.zero_()   # written in place: asked again
    assert compat.uniform_case(context) == (True, False)
    assert compat.uniform_case(None) is None
