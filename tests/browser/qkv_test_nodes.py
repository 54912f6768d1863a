"""Test-only ComfyUI node (tests/test_browser.py installs this file into a temporary custom_nodes folder).

A real Wan text encoder (umt5-xxl) cannot be tiny, so the browser test's workflow takes its conditioning from
this node instead: zeros of the tiny model's text width, in ComfyUI's conditioning format
[[tensor (1, tokens, text_dim), {}]].
"""
import torch


class QKVTestZeroConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "tokens": ("INT", {"default": 16, "min": 1, "max": 512}),
            "text_dim": ("INT", {"default": 64, "min": 1, "max": 8192}),
        }}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"

    def make(self, tokens, text_dim):
        return ([[torch.zeros((1, tokens, text_dim)), {}]],)


NODE_CLASS_MAPPINGS = {"QKVTestZeroConditioning": QKVTestZeroConditioning}
NODE_DISPLAY_NAME_MAPPINGS = {"QKVTestZeroConditioning": "QKV Test Zero Conditioning"}
