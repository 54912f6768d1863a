"""ComfyUI face of the pack: the nodes and one adapter per model family. Imported relatively only (ComfyUI
has a top-level module named `nodes`)."""
from comfy_api.latest import ComfyExtension

from .patch_node import NODES
from .raylight_node import raylight_nodes


class QKVExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES) + raylight_nodes()


async def comfy_entrypoint() -> QKVExtension:
    return QKVExtension()
