"""The torch.compile nodes users put after QKV Attention, as the whole-model benchmark applies them: ComfyUI's
`TorchCompileModel` (the whole diffusion model) and KJNodes' block-by-block compile (`TorchCompileModelAdvanced`'s
defaults), both through ComfyUI's `set_torch_compile_wrapper`, inductor. Not part of the node pack."""
from __future__ import annotations

import logging

class DynamoLimits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings of a run (the frames it gave up compiling)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits = 0

    def emit(self, record):
        self.hits += "recompile_limit" in record.getMessage()


COMPILE_WAYS = ("none", "whole", "blocks")


def compiled(patcher, way: str):
    """`patcher` as the compile nodes users put after QKV Attention leave it (inductor, through ComfyUI's
    `set_torch_compile_wrapper`): "whole", ComfyUI's TorchCompileModel (a clone without Dynamic VRAM, the whole
    diffusion model, its guard filter); "blocks", KJNodes' TorchCompileModelAdvanced defaults (every block compiled
    on its own, static shapes, the same guard filter); "none", `patcher`."""
    if way == "none":
        return patcher
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from comfy_extras.nodes_torch_compile import skip_torch_compile_dict
    options = {"guard_filter_fn": skip_torch_compile_dict}
    if way == "whole":
        try:
            model = patcher.clone(disable_dynamic=True)
        except TypeError:   # a ComfyUI without Dynamic VRAM
            model = patcher.clone()
        set_torch_compile_wrapper(model=model, backend="inductor", options=options)
        return model
    if way != "blocks":
        raise SystemExit(f"--compile: {way!r} is not one of {', '.join(COMPILE_WAYS)}")
    model = patcher.clone()
    blocks = len(model.get_model_object("diffusion_model").blocks)
    set_torch_compile_wrapper(model=model, backend="inductor", options=options, dynamic=False,
                              keys=[f"diffusion_model.blocks.{i}" for i in range(blocks)])
    return model
