"""torch.compile with QKV Attention (real ComfyUI, tiny Wan models, inductor): ComfyUI's `TorchCompileModel` (the
whole diffusion model) and KJNodes' way (`TorchCompileModelWanVideoV2` / `TorchCompileModelAdvanced`: every block
compiled on its own, `keys=diffusion_model.blocks.N`), both through ComfyUI's `set_torch_compile_wrapper`, with
the compile node after QKV Attention and before it; bf16, float32 and fp8-scaled weights in both file layouts.

Each run: no fallback to ComfyUI's block (the self-check ran eagerly and passed), the head split ran, no dynamo
recompile-limit warning over a 3-step run, and the result equals compiled stock: within float32 round-off in
float32, and in bf16 / fp8 within compile's own distance from stock (eager stock against compiled stock, an oracle
of ComfyUI's alone); with the blocks compiled one by one the pack's blocks run as without compile, bit for bit
(`compat.guarded`: the pack's forward is an eager region). On CUDA (`COMFY_ENV_GPU=1`, Triton, fp8 matmuls) the
same cases run as GPU tests.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

from support import comfy_env

pytestmark = pytest.mark.comfyui

SIZE = dict(frames=2, h=32, w=32, batch=1)   # 512 tokens an item: past the check's 256, split from the first
MODEL = dict(dim=128, heads=4, layers=2)     # High: 4 groups of one head
FORMATS = ("float32", "bf16", "fp8_scaled", "scaled_fp8")
CPU_CASES = [("float32", "after", "whole"), ("float32", "before", "blocks"),
             ("bf16", "after", "whole"), ("bf16", "before", "whole"), ("bf16", "after", "blocks"),
             ("bf16", "before", "blocks"),
             ("fp8_scaled", "after", "whole"), ("fp8_scaled", "before", "blocks"),
             ("scaled_fp8", "before", "whole"), ("scaled_fp8", "after", "blocks")]
GPU_CASES = [(fmt, order, way) for fmt in ("bf16", "fp8_scaled", "scaled_fp8") for order in ("after", "before")
             for way in ("whole", "blocks")]


@pytest.fixture(scope="module")
def env():
    with comfy_env.split_floor_tokens(comfy_env.pack_modules(), 0) as modules:
        yield modules


@pytest.fixture(autouse=True)
def _fresh(env):
    torch._dynamo.reset()
    env.compat.forget_verdicts()
    env.core.reset_notices()
    yield
    torch._dynamo.reset()
    env.compat.forget_verdicts()


def _model(fmt: str, device: str):
    """A tiny Wan in `fmt` (fp8_scaled: a `comfy_quant` entry a layer; scaled_fp8: Comfy-Org's file layout,
    converted by ComfyUI's loader code), its patcher loading to `device`."""
    import comfy.model_patcher
    if fmt in ("float32", "bf16"):
        patcher = comfy_env.make_wan("t2v", dtype=torch.bfloat16 if fmt == "bf16" else None, **MODEL)
    else:
        patcher = comfy_env.make_fp8_scaled_wan("t2v", layout="comfy_quant" if fmt == "fp8_scaled" else fmt,
                                                dtype=torch.bfloat16 if device == "cuda" else None, **MODEL)
    if device == "cpu":
        return patcher
    return comfy.model_patcher.ModelPatcher(patcher.model, load_device=torch.device(device),
                                            offload_device=torch.device("cpu"))


def _compiled(patcher, way: str, dynamic=None):
    """`patcher` as ComfyUI's TorchCompileModel (way "whole") or KJNodes' block-by-block nodes (way "blocks")
    leave it: a clone with ComfyUI's compile wrapper (inductor, the guard filter TorchCompileModel passes)."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from comfy_extras.nodes_torch_compile import skip_torch_compile_dict
    model = patcher.clone()
    blocks = len(model.get_model_object("diffusion_model").blocks)
    keys = ["diffusion_model"] if way == "whole" else [f"diffusion_model.blocks.{i}" for i in range(blocks)]
    set_torch_compile_wrapper(model=model, backend="inductor", keys=keys, dynamic=dynamic,
                              options={"guard_filter_fn": skip_torch_compile_dict})
    return model


def _splits_by_rows(fmt: str) -> bool:
    """Does the pack project this format by rows (High: 4 groups of one head)? fp8 layers only where ComfyUI's
    fp8 ops have QuantizedTensor rows (v0.33; v0.8.0's are projected whole: one group of every head)."""
    import comfy.ops
    return fmt in ("float32", "bf16") or (hasattr(comfy.ops, "fp8_linear") and
                                          hasattr(comfy.ops, "CastBiasWeightContext"))


def _sample(patcher, steps: int = 1):
    return comfy_env.run_sample(patcher, steps=steps, **SIZE).float()


class _DynamoWarnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _run_compiled_case(env, fmt: str, order: str, way: str, device: str):
    base = _model(fmt, device)
    # ComfyUI's own mixed-precision Linear does not trace once dynamo makes its shapes dynamic (torch 2.13 CPU:
    # "Expect size to be a plain tuple of ints"); compiled stock is then compiled with static shapes
    reference_dynamic = None if fmt in ("float32", "bf16") else False
    compiled_stock = _sample(_compiled(base, way, reference_dynamic))
    eager_stock = _sample(base)
    eager_pack = _sample(env.node.apply_patch(base, "High", "sdpa", True)[0])
    env.compat.forget_verdicts()
    torch._dynamo.reset()
    if order == "after":
        patched = _compiled(env.node.apply_patch(base, "High", "sdpa", True)[0], way)
    else:
        patched = env.node.apply_patch(_compiled(base, way), "High", "sdpa", True)[0]
    warnings = _DynamoWarnings()
    logging.getLogger("torch._dynamo").addHandler(warnings)
    try:
        with comfy_env.SdpaHeads(torch) as spy:
            ours = _sample(patched)
        comfy_env.run_sample(patched, steps=3, **SIZE)   # the same shapes again, then 3 steps: no recompiles
    finally:
        logging.getLogger("torch._dynamo").removeHandler(warnings)
    assert comfy_env.stock_fallbacks(env) == []
    assert env.compat.all_checked(env.wan.stock_functions(base.model.diffusion_model))   # checked eagerly, passed
    assert set(spy.self_heads) == ({1} if _splits_by_rows(fmt) else {MODEL["heads"]}), spy.self_heads
    assert not [line for line in warnings.lines if "recompile_limit" in line or "cache_size_limit" in line]
    compile_noise = comfy_env.rel_err(eager_stock, compiled_stock)
    error = comfy_env.rel_err(ours, compiled_stock)
    if fmt == "float32":
        assert error <= 1e-5, error
    else:
        assert error <= 1.5 * compile_noise + 2e-3, (error, compile_noise)
    if way == "blocks":   # only the blocks compile, and the pack's run eagerly: the pack's own result
        assert torch.equal(ours, eager_pack)


@pytest.mark.parametrize("fmt,order,way", CPU_CASES, ids=["-".join(case) for case in CPU_CASES])
def test_compiled_model_equals_compiled_stock(env, fmt, order, way):
    _run_compiled_case(env, fmt, order, way, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("COMFY_ENV_GPU") != "1",
                    reason="needs CUDA and COMFY_ENV_GPU=1 (ComfyUI on the GPU)")
@pytest.mark.parametrize("fmt,order,way", GPU_CASES, ids=["-".join(case) for case in GPU_CASES])
def test_compiled_model_on_cuda_equals_compiled_stock(env, fmt, order, way):
    pytest.importorskip("triton", reason="Triton is not installed")
    _run_compiled_case(env, fmt, order, way, "cuda")


def test_the_installed_forward_is_skipped_by_dynamo_not_what_it_calls(env):
    """The guard every block shares is not compiled itself (one code object for every block would be compiled once
    a block, over dynamo's recompile limit), the decision and the pack's forward are eager regions, and ComfyUI's
    forward, where the guard hands a call to it, is left to compile."""
    base = _model("float32", "cpu")
    patched = env.node.apply_patch(base, "High", "sdpa", True)[0]
    forward = patched.object_patches["diffusion_model.blocks.0.forward"]
    assert env.compat.is_ours(forward)
    assert getattr(forward, "_torchdynamo_disable", False)
    assert getattr(forward, "_torchdynamo_disable_recursive", True) is False


@pytest.mark.parametrize("order", ["after", "before"])
def test_fullgraph_compile_is_refused_with_the_fix(env, order):
    """A compile node with fullgraph on (KJNodes offers it) cannot hold the pack's eager regions: the run stops
    before sampling with a ValueError that names the fix, in either order, instead of dynamo's error mid-run."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    base = _model("float32", "cpu")

    def fullgraph(patcher):
        model = patcher.clone()
        set_torch_compile_wrapper(model=model, backend="inductor", fullgraph=True, keys=["diffusion_model.blocks.0"])
        return model
    patched = fullgraph(env.node.apply_patch(base, "High", "sdpa", True)[0]) if order == "after" else \
        env.node.apply_patch(fullgraph(base), "High", "sdpa", True)[0]
    with pytest.raises(ValueError, match="fullgraph off"):
        _sample(patched)
