"""ComfyUI-QKV: ComfyUI loads this file as the custom node pack (V3 entry point `comfy_entrypoint`)."""
from .nodes import comfy_entrypoint

WEB_DIRECTORY = "./web"

__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
