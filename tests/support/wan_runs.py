"""Test helper: what the Wan compatibility tests share (tests/test_wan_compat.py, test_wan_formats.py,
test_wan_other_nodes.py, test_comfyui_december.py, test_wan_workflow_nodes.py, test_wan_input_reuse.py): the tiny
Wan's sizes, the pack's modules with the split floor lowered (fixture `env`) and fresh self-check verdicts around
every test (autouse fixture `_fresh_verdicts`; a test module imports both to use them), a forward with other
nodes' patches, other nodes' hooks, and the tiny Wan in the weight formats people load. ComfyUI is set up by
`comfy_env`."""
from __future__ import annotations

import pytest

from support import comfy_env

SIZE = dict(frames=3, h=64, w=88, batch=2)   # 2 x 4,224 tokens: above the (lowered) split floor
SMALL = dict(frames=2, h=16, w=24, batch=2)  # 2 x 192 tokens: semantics only (the self-check splits anyway)
MODEL = dict(dim=256, heads=8, layers=1)


@pytest.fixture(scope="module")
def env():
    # cond + uncond of 4,224 tokens each: split as 16,384+ tokens an item are (the floor counts one item; Wan's is
    # 2x the runtime's, `wan.SPEC.measured.split_floor_scale`)
    with comfy_env.split_floor_tokens(comfy_env.pack_modules(), 2048) as modules:
        yield modules


@pytest.fixture(autouse=True)
def _fresh_verdicts(env):
    env.compat.forget_verdicts()
    env.core.reset_notices()
    yield
    env.compat.forget_verdicts()


def inputs(patcher, kind="t2v", **size):
    return comfy_env.make_inputs(patcher.model, kind, **(size or SIZE))


def forward(patcher, applied=None, kind="t2v", **size):
    """The diffusion model's output with `applied`'s object patches in place and its transformer_options
    (other nodes' hooks) passed as ComfyUI passes them."""
    import torch
    target = applied if applied is not None else patcher
    target.patch_model(load_weights=False)
    try:
        kwargs = inputs(patcher, kind, **size)
        kwargs["transformer_options"] = dict(target.model_options.get("transformer_options", {}))
        with torch.no_grad():
            return patcher.model.diffusion_model(**kwargs)
    finally:
        target.unpatch_model(unpatch_weights=False)


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


SdpaHeads = comfy_env.SdpaHeads


def other_node_hooks(torch, calls):
    """Other nodes' hooks by name (`attn1_patch`, `attn2_patch`, `double_block`), each appending (name, tokens)
    to `calls` and changing its input."""
    def attn1(args):
        calls.append(("attn1", args["x"].shape[1]))
        return args["x"] * 0.75 + 0.01

    def attn2(args):
        calls.append(("attn2", args["x"].shape[1]))
        return args["x"] * 0.9

    def double_block(args):
        calls.append(("double_block", args["img"].shape[1]))
        return {"img": args["img"] * 0.95}
    return {"attn1_patch": attn1, "attn2_patch": attn2, "double_block": double_block}


def fp8_wan(torch):
    """Tiny Wan stored in fp8_e4m3fn and computed in float32, as ComfyUI's diffusion model loader with
    `weight_dtype fp8_e4m3fn` makes it (manual-cast ops: each layer casts its weight per call)."""
    import comfy.model_patcher
    cls, cfg = comfy_env._wan_config("t2v", MODEL["dim"], MODEL["heads"], MODEL["layers"], None, 32, 1, {})
    model_config = cls(cfg)
    model_config.set_inference_dtype(torch.float8_e4m3fn, torch.float32)
    model = model_config.get_model({}, device=torch.device("cpu"))
    comfy_env.fill_random_(model.diffusion_model, seed=0)
    model.eval()
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    patcher.comfy_env_kind = "t2v"
    return patcher


def wan_in_format(env, fmt):
    """A tiny one-layer T2V Wan (256 wide, 8 heads) in the weight format `fmt`: float32, bf16, fp8 (cast per
    call), fp8-scaled or gguf (Q8_0); skips where this ComfyUI or ComfyUI-GGUF cannot build it."""
    torch = env.torch
    if fmt == "float32":
        return comfy_env.make_wan("t2v", dim=256, heads=8, layers=1)
    if fmt == "bf16":
        return comfy_env.make_wan("t2v", dim=256, heads=8, layers=1, dtype=torch.bfloat16)
    if fmt == "fp8":
        return fp8_wan(torch)
    if fmt == "fp8-scaled":
        import comfy.ops
        if not hasattr(comfy.ops, "mixed_precision_ops"):
            pytest.skip("this ComfyUI has no mixed-precision (fp8-scaled) ops")
        return comfy_env.make_fp8_scaled_wan("t2v", dim=256, heads=8, layers=1)
    from support import gguf_env
    gguf_env.require_gguf()
    return gguf_env.make_gguf_wan("Q8_0", "t2v", layers=1)
