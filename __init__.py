"""ComfyUI-QKV: ComfyUI loads this file as the custom node pack (V3 entry point `comfy_entrypoint`)."""
try:
    from .nodes import comfy_entrypoint
except ModuleNotFoundError as error:
    # Only outside ComfyUI (e.g. a test runner importing the repository as a package): ComfyUI itself
    # always has these modules, so any other failure is raised.
    if error.name not in ("comfy", "comfy_api"):
        raise
    __all__ = []
else:
    __all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]

WEB_DIRECTORY = "./web"
