"""Test helper: what the adapter tests of the families share (tests/test_<family>_adapter.py): a tiny model from
ComfyUI's own config class, the patched model against stock at every level, and a bounded block's MemTracker
peak against ComfyUI's own block and the planner's working set. Imported as ``from support import adapter_checks``
(tests/ is on sys.path)."""
from __future__ import annotations

from typing import Callable, Optional

from support import comfy_env
from support import working_set_check


def tiny_patcher(config_class: str, config: dict, dtype=None, seed: int = 0):
    """A random-weight model from ComfyUI's config class `config_class` (`comfy.supported_models`) on the CPU, as a
    ModelPatcher: float32, or its layers in `dtype` but for those the model keeps in float32."""
    import torch
    import comfy.model_patcher
    import comfy.supported_models
    model_config = getattr(comfy.supported_models, config_class)(dict(config))
    model_config.set_inference_dtype(dtype or torch.float32, None)
    model = model_config.get_model({}, device=torch.device("cpu"))
    comfy_env.fill_random_(model.diffusion_model, seed=seed)
    return comfy.model_patcher.ModelPatcher(model.eval(), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))


def check_every_level(env, base, inputs: dict, heads: int, patched_counts: Callable[[bool], dict],
                      groups: Optional[Callable[[int], int]] = None, tolerance: float = 1e-5) -> None:
    """`base`'s diffusion model patched at every level, with and without block bounds, equals its stock output on
    `inputs` within `tolerance` without a fallback; the report's patched modules are `patched_counts(block
    bounds)`; the head split runs (a self-attention of `heads // groups(level)` heads, by default the runtime's
    groups of `heads` for a long call); the unpatched model is stock again. Run with the split floor at 0
    (`split_everything`)."""
    torch = env.torch
    reference = comfy_env.model_forward(base, inputs)
    groups = groups or (lambda level: env.core.group_count(heads, 10**6, level, split_floor_tokens=0))
    for level in env.node.LEVELS:
        for block in (False, True):
            patched, report = env.node.apply_patch(base, level, "sdpa", block)
            assert not report.skipped_reasons, report.lines()
            assert {what: n for (_, what), n in report.patched_counts.items()} == patched_counts(block)
            env.core.reset_notices()
            with comfy_env.SdpaHeads(torch, check_tokens=0) as spy:
                out = comfy_env.model_forward(base, inputs, applied=patched)
            assert not comfy_env.stock_fallbacks(env), (level, block)
            assert comfy_env.rel_err(out, reference) <= tolerance, (level, block, comfy_env.rel_err(out, reference))
            count = groups(env.node.LEVELS.index(level))
            assert heads // count in spy.self_heads, (level, spy.self_heads)   # the split really ran
    assert comfy_env.rel_err(comfy_env.model_forward(base, inputs), reference) == 0


def check_block_peak(env, adapter, block, inputs: dict, x: str, heads: int, tokens: int, what: str) -> float:
    """One block's MemTracker peak above its inputs, ComfyUI's against the pack's bounded forward (High, block
    bounds; its self-check run first, outside the measurement), in multiples of |x| (`inputs[x]`'s bytes): both
    within the planner's working set (`working_set_check`), the pack's <= 2.5 x |x| and <= 0.4 x stock's.
    Returns the pack's ratio."""
    bounded_forward = adapter.block_forward(block, adapter.SPEC.configure(env.node.QKVConfig(3, "sdpa", True)))
    stock, bounded, ratio_stock, ratio_bounded = working_set_check.measure_block_peaks(env.pack, block,
                                                                                       bounded_forward, inputs, x)
    print(f"\n{what}: stock {ratio_stock:.2f}x|x|, bounded {ratio_bounded:.2f}x|x| "
          f"({bounded.peak_bytes / stock.peak_bytes:.2f} of stock)")
    working_set_check.assert_estimates(env.pack, adapter, "block", heads, tokens, ratio_stock, ratio_bounded)
    assert ratio_bounded <= 2.5
    assert bounded.peak_bytes <= 0.4 * stock.peak_bytes
    return ratio_bounded


__all__ = ["tiny_patcher", "check_every_level", "check_block_peak"]
