"""Test helper: what the tests over every family's case (support/family_cases.py) share: the split floor the cases
run with, the pack's modules with it (fixture `env`) and each family's share of it (autouse fixture `_family_floor`;
a test module imports both to use them), a case's forward with a patcher's patches, the head groups a family's
long call splits into, and the error over a model's outputs. Used by tests/test_family_contract.py and
test_containers.py."""
from __future__ import annotations

import importlib

import pytest

from support import comfy_env
from support import family_cases

# The cases are cond + uncond of 1,024+ tokens each (family_cases.py): the head split is decided per batch
# item, and real sizes split from 8,192 tokens an item. An eighth of that here keeps the cases small and the
# split on, with the text streams as short as on real sizes (projected whole).
CASE_SPLIT_FLOOR = 1024


@pytest.fixture(scope="module")
def env():
    with comfy_env.split_floor_tokens(comfy_env.pack_modules(), CASE_SPLIT_FLOOR) as modules:
        yield modules


def registered(env, case: str):
    """The registry's `Family` (nodes/families/__init__.py, `FAMILIES`) of the case `case`'s adapter."""
    families = importlib.import_module(f"{env.pack.__name__}.nodes.families")
    return next(family for family in families.FAMILIES if family.module == family_cases.ADAPTER_MODULES[case])


@pytest.fixture(autouse=True)
def _family_floor(request, env):
    """A family that splits only from a multiple of the runtime's floor (its registered row's
    `split_floor_scale`) gets that fraction of the cases' floor, so that its 1,024-token items split like the
    others'."""
    family = getattr(getattr(request.node, "callspec", None), "params", {}).get("family")
    scale = registered(env, family).measured.split_floor_scale if family is not None else 1
    if scale == 1:
        yield
        return
    with comfy_env.split_floor_tokens(env, round(CASE_SPLIT_FLOOR / scale)):
        yield


def case_forward(case, applied=None, weights=False, lowvram_layer=None, dtype=None):
    """The diffusion model's output with `applied`'s patches in place (its object patches; with `weights`, its
    weight patches too, e.g. a LoRA); None: as loaded. `lowvram_layer` (a module path in the diffusion model):
    `applied` loaded as ComfyUI's low-VRAM mode loads it (`lowvram_model_memory=1`: weight patches become each
    layer's weight functions, applied at every call), that layer asserted to take the path. `dtype`: the inputs'
    floating tensors of more than one dimension cast to it (timesteps stay float32, as ComfyUI passes them)."""
    import torch
    if applied is not None and lowvram_layer is not None:
        applied.patch_model(device_to=torch.device("cpu"), lowvram_model_memory=1)
        layer = applied.model.diffusion_model.get_submodule(lowvram_layer)
        assert len(layer.weight_function) > 0 and layer.comfy_cast_weights   # the LowVramPatch path
    elif applied is not None:
        applied.patch_model(device_to=torch.device("cpu"), load_weights=weights)
    try:
        inputs = case.inputs()
        if dtype is not None:
            inputs = {name: _cast(value, dtype) for name, value in inputs.items()}
        inputs["transformer_options"] = {**inputs.get("transformer_options", {}),
                                         **(applied or case.patcher).model_options.get("transformer_options", {})}
        with torch.no_grad():
            return case.patcher.model.diffusion_model(**inputs)
    finally:
        if applied is not None:
            applied.unpatch_model(unpatch_weights=weights or lowvram_layer is not None)


def _cast(value, dtype):
    """`value` with its floating tensors of more than one dimension in `dtype` (lists and tuples too)."""
    import torch
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(item, dtype) for item in value)
    if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 1:
        return value.to(dtype)
    return value


def family_groups(env, family: str, kv_heads: int, level: int) -> int:
    """The head groups of a long call of `family`'s (a case name) at `level` (0-3), its `group_scale` applied."""
    group_scale = registered(env, family).measured.group_scale
    return env.core.SplitPolicy(level, group_scale=group_scale).plan(kv_heads, 10**6).groups


def rel_err(a, b):
    """max |a - b| / max |b|; the largest over the streams of a model with several outputs (MiniMax H3's video and
    audio, a list or a nested latent)."""
    if getattr(b, "is_nested", False):
        a, b = a.unbind(), b.unbind()
    if isinstance(b, (list, tuple)):
        return max(rel_err(x, y) for x, y in zip(a, b))
    return float((a - b).abs().max() / b.abs().max())
