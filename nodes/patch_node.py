"""The patch node: MODEL -> MODEL with head split, attention backend and block-level bounds."""
from __future__ import annotations

from comfy_api.latest import io, ui

from .dispatch import AUTO, QKVConfig, backend_choices
from .families import display_names
from .patching import LEVELS, apply_patch, find_adapter
from .planner import compute_dtype, plan as plan_working_set
from .reference_cache import FORMATS, STORAGE, ReferenceCache, add_reference_cache


def patch_widgets() -> list:
    """The widgets QKV Attention and QKV Attention (raylight) share: head_split, attention_backend, block_bounds."""
    return [
        io.Combo.Input("head_split", options=list(LEVELS), default="High",
                       tooltip="Attend long sequences (from 8,192 to 28,672 tokens of one image or "
                               "video on, by family: the README says which) one group of heads at a "
                               "time. Off: as ComfyUI does. Low/Medium/High: about 4/8/16 groups; the "
                               "higher, the less VRAM. Shorter sequences (images of about 1 MP, 1 MP "
                               "edits with a reference, short 480p clips) are not split. The QKV VRAM "
                               "Planner node estimates each level for your latent."),
        io.Combo.Input("attention_backend", options=backend_choices(), default=AUTO,
                       tooltip="auto: the best installed kernel (SageAttention 2 on long calls, "
                               "FlashAttention, else PyTorch SDPA), or ComfyUI's dispatcher if you "
                               "chose a kernel with ComfyUI's flags or another node set an attention "
                               "override. sage: the pack's staged SageAttention (its kernel, far less "
                               "memory). comfy: ComfyUI's own choice. A backend that is missing or "
                               "cannot take a call falls back to the next, said once in the log."),
        io.Boolean.Input("block_bounds", default=True,
                         tooltip="Also bound the whole transformer block: the modulated input is freed "
                                 "once projected, the residual is updated in place, cross-attention "
                                 "and the feed-forward run by token chunks. Off: only attention is "
                                 "patched, and the stock feed-forward's peak (the block's largest) "
                                 "stays."),
    ]


class QKVPatch(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QKVAttentionPatch",
            display_name="QKV Attention (low VRAM)",
            category="model_patches/attention",
            description="Runs the model's q/k/v projection and attention through ComfyUI-QKV: attention by groups "
                        "of heads and block-level bounds on every transient, for less VRAM at the same "
                        f"results. Put it after the model loader. Adapted: {', '.join(display_names())}; other "
                        "models get the attention kernel only; anything unsupported passes through unchanged.",
            inputs=[io.Model.Input("model")] + patch_widgets(),
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.unique_id],   # the node the run report is drawn on (web/qkv_report.js)
        )

    @classmethod
    def execute(cls, model, head_split, attention_backend, block_bounds) -> io.NodeOutput:
        node_id = getattr(getattr(cls, "hidden", None), "unique_id", None)
        patched, _ = apply_patch(model, head_split, attention_backend, block_bounds, node_id=node_id)
        return io.NodeOutput(patched)


class QKVReferenceCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QKVReferenceCache",
            display_name="QKV Reference Cache",
            category="model_patches/attention",
            description="Keeps the reference images' keys and values (Flux Kontext / Flux.2 reference latents, "
                        "Qwen-Image-Edit) from the first sampler step and runs the later steps on the image "
                        "tokens only: faster steps, less VRAM with q8 or RAM storage. Exact for checkpoints "
                        "trained for it (FLUX.2 klein KV); an approximation for other models (their references "
                        "change a little at every step). Put it after QKV Attention; anything it cannot cache "
                        "runs as before, said in the log.",
            inputs=[
                io.Model.Input("model"),
                io.Boolean.Input("enabled", default=True),
                io.Int.Input("use_from_step", default=1, min=0, max=10000,
                             tooltip="The first sampler step that reads the cache; the step before it fills "
                                     "it (1: filled at the first step)."),
                io.Combo.Input("storage", options=list(STORAGE), default="vram",
                               tooltip="vram: on the GPU. ram: in pinned system memory, streamed to the GPU "
                                       "one block ahead (about two blocks' references in VRAM)."),
                io.Combo.Input("format", options=list(FORMATS), default="q8",
                               tooltip="q8: int8 with a scale per 32 channels (about half of 16-bit). 16-bit: "
                                       "as computed. native: SageAttention 2's own layout (int8 keys, fp8 "
                                       "values) on sm90 GPUs with attention_backend sage or auto, else q8."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, enabled, use_from_step, storage, format) -> io.NodeOutput:
        if not enabled:
            return io.NodeOutput(model)
        return io.NodeOutput(add_reference_cache(model, ReferenceCache(use_from_step, storage, format)))


class QKVPlanner(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QKVVRAMPlanner",
            display_name="QKV VRAM Planner",
            category="model_patches/attention",
            description="Before you render: the pack's estimate of the largest transformer block's working set "
                        "(the VRAM a sampling step needs beside the weights) for this model and latent, at each "
                        "head_split level and for ComfyUI's own block. Queue it alone (it runs in a moment); "
                        "the estimates come from measured peaks of each family's block.",
            inputs=[
                io.Model.Input("model"),
                io.Latent.Input("latent"),
                io.Boolean.Input("cond_uncond_batched", default=True,
                                 tooltip="CFG above 1 runs the positive and negative prompts as one batch when "
                                         "ComfyUI thinks they fit: plan for both (on), or for one (off)."),
                io.Boolean.Input("block_bounds", default=True,
                                 tooltip="As on the QKV Attention node."),
            ],
            outputs=[io.String.Output(display_name="plan")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model, latent, cond_uncond_batched, block_bounds) -> io.NodeOutput:
        diffusion_model = getattr(model.model, "diffusion_model", None)
        adapter = find_adapter(diffusion_model) if diffusion_model is not None else None
        samples = latent["samples"]
        plan = None
        if adapter is not None:
            batch = samples.shape[0] * (2 if cond_uncond_batched else 1)
            plan = plan_working_set(adapter, diffusion_model, tuple(samples.shape),
                                    QKVConfig(3, AUTO, bool(block_bounds)), batch=batch,
                                    dtype=compute_dtype(model.model), device=model.load_device,
                                    transformer_options=model.model_options.get("transformer_options", {}))
        if plan is None:
            name = type(diffusion_model).__name__ if diffusion_model is not None else type(model.model).__name__
            text = (f"{name}: no estimate (not a family the pack adapts, or a latent of shape "
                    f"{tuple(samples.shape)} it cannot read)")
        else:
            text = "\n".join(plan.lines())
        return io.NodeOutput(text, ui=ui.PreviewText(text))


NODES = [QKVPatch, QKVReferenceCache, QKVPlanner]
