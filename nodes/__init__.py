"""ComfyUI face of the pack: the nodes and one adapter per model family. Imported relatively only (ComfyUI
has a top-level module named `nodes`)."""
from comfy_api.latest import ComfyExtension

from .patch_node import NODES


class QKVExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)


async def comfy_entrypoint() -> QKVExtension:
    return QKVExtension()
