"""QKV Attention (raylight): the patch node for raylight's Ray workers (docs/design.md §3.7).

raylight loads the model inside one Ray actor per GPU, and its workflow carries `RAY_ACTORS`, never a MODEL: a
patch reaches its model only when it runs on each actor, as raylight's own patch nodes run theirs (its
`ray_patch` decorator: `actor.model_function_runner.remote(fn, ...)`, which sets the actor's model to
`fn(model, ...)`). This node sends `apply_patch` there. The actors import ComfyUI, not the custom nodes, and Ray
pickles a function by reference where its module is importable: ComfyUI names this pack's modules by its folder's
path, which the actors cannot import. So the function sent is made here (`worker_patch`), a closure Ray's
cloudpickle sends by value: on the actor it imports this pack from its folder under the same name, once, and
patches the actor's model there. With raylight's Ulysses on, the bounded Wan blocks then run its attention by head
groups over raylight's own group (`nodes/sequence_parallel.py`).

Registered only where `ray` is installed (raylight cannot run without it)."""
from __future__ import annotations

import importlib.util
import os

from comfy_api.latest import io

from .patch_node import patch_widgets
from .patching import check_options

PACKAGE = __name__.rsplit(".", 2)[0]                                           # this pack as ComfyUI imported it
PACK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))         # its folder
RayActors = io.Custom("RAY_ACTORS")


def worker_patch(package: str = PACKAGE, pack_dir: str = PACK_DIR):
    """`patch(model, level, backend, block_bounds)` for a raylight actor's `model_function_runner`: this pack
    imported there as `package` from `pack_dir` (where the actor has not yet), then the model patched by
    `nodes.patching.apply_patch` and returned (the actor keeps it). A closure: pickled by value."""
    def patch(model, level, backend, block_bounds):
        import importlib
        import importlib.util
        import os
        import sys
        if model is None:
            raise ValueError("QKV Attention (raylight): this Ray actor has no model loaded yet; connect the node "
                             "after raylight's model loader (Load Diffusion Model (Ray))")
        if package not in sys.modules:
            init = os.path.join(pack_dir, "__init__.py")
            if not os.path.isfile(init):
                raise ValueError(f"QKV Attention (raylight): ComfyUI-QKV is not at {pack_dir} on this Ray "
                                 f"worker's machine: install it there too (a remote Ray cluster needs every pack "
                                 f"on each of its machines)")
            spec = importlib.util.spec_from_file_location(package, init, submodule_search_locations=[pack_dir])
            module = importlib.util.module_from_spec(spec)
            sys.modules[package] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(package, None)
                raise
        patching = importlib.import_module(package + ".nodes.patching")
        return patching.apply_patch(model, level, backend, block_bounds)[0]
    return patch


def ray_available() -> bool:
    """Is `ray` installed (found, not imported)?"""
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):   # an imported module without a spec (a stand-in)
        return False


class QKVRaylightPatch(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QKVAttentionRaylight",
            display_name="QKV Attention (raylight)",
            category="model_patches/attention",
            description="QKV Attention for raylight's multi-GPU workers: put it after raylight's model loader "
                        "(RAY_ACTORS in and out). Every GPU's model is patched as QKV Attention patches one; with "
                        "raylight's sequence parallelism (Ulysses) on, a Wan block's attention heads are exchanged "
                        "between the GPUs a group at a time, and the whole block is bounded on each GPU. With "
                        "block_bounds off nothing changes there (raylight's attention replaces the pack's).",
            inputs=[RayActors.Input("ray_actors")] + patch_widgets(),
            outputs=[RayActors.Output()],
        )

    @classmethod
    def execute(cls, ray_actors, head_split, attention_backend, block_bounds) -> io.NodeOutput:
        check_options(head_split, attention_backend)   # before any actor is asked
        import ray
        patch = worker_patch()
        ray.get([actor.model_function_runner.remote(patch, head_split, attention_backend, bool(block_bounds))
                 for actor in ray_actors["workers"]])
        return io.NodeOutput(ray_actors)


def raylight_nodes() -> list:
    """The node where `ray` is installed, else none."""
    return [QKVRaylightPatch] if ray_available() else []


__all__ = ["QKVRaylightPatch", "worker_patch", "raylight_nodes", "ray_available", "PACKAGE", "PACK_DIR"]
