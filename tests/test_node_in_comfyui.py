"""The pack as ComfyUI loads it: `nodes.load_custom_node` on the repository folder, and its node run by
ComfyUI's own execution engine inside an API-format prompt (model build, patch, sampler)."""
from __future__ import annotations

import textwrap
import uuid

import pytest

from support import comfy_env

pytestmark = pytest.mark.comfyui

# A helper pack for the prompt: a node that builds a tiny random-weight Wan (with its conditioning and an
# empty latent) and a node that hands the sampled latent back to the test.
HELPER_PACK = """
    from comfy_api.latest import ComfyExtension, io
    from support import comfy_env

    class TinyWan(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(node_id="QKVTestTinyWan{suffix}", category="testing", inputs=[],
                             outputs=[io.Model.Output(), io.Conditioning.Output(display_name="positive"),
                                      io.Conditioning.Output(display_name="negative"), io.Latent.Output()])

        @classmethod
        def execute(cls):
            import torch
            model = comfy_env.make_wan("t2v", dim=64, heads=2, layers=1)
            positive, negative = comfy_env.make_conds(model, "t2v")
            return io.NodeOutput(model, positive, negative, {{"samples": torch.zeros(1, 16, 2, 8, 8)}})

    class Capture(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(node_id="QKVTestCapture{suffix}", category="testing",
                             inputs=[io.Latent.Input("samples"), io.String.Input("key")], outputs=[],
                             is_output_node=True)

        @classmethod
        def execute(cls, samples, key):
            comfy_env.CAPTURED[key] = samples["samples"].clone()
            return io.NodeOutput()

    class Ext(ComfyExtension):
        async def get_node_list(self):
            return [TinyWan, Capture]

    async def comfy_entrypoint():
        return Ext()
"""


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    comfy_env.require_comfyui()
    import nodes
    assert comfy_env.load_custom_node(comfy_env.REPO_ROOT) is True
    suffix = "_" + uuid.uuid4().hex[:8]
    helper = tmp_path_factory.mktemp("custom_nodes") / "qkv_test_helper"
    helper.mkdir()
    (helper / "__init__.py").write_text(textwrap.dedent(HELPER_PACK.format(suffix=suffix)))
    assert comfy_env.load_custom_node(helper) is True
    comfy_env.CAPTURED = {}
    return nodes, suffix


def test_pack_registers_its_node(loaded):
    nodes, _ = loaded
    assert "QKVAttentionPatch" in nodes.NODE_CLASS_MAPPINGS
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["QKVAttentionPatch"] == "QKV Attention (low VRAM)"
    assert "KSampler" in nodes.NODE_CLASS_MAPPINGS            # ComfyUI's own `nodes` module, not ours


def _prompt(suffix, key, patch=None):
    prompt = {
        "1": {"class_type": "QKVTestTinyWan" + suffix, "inputs": {}},
        "3": {"class_type": "KSampler", "inputs": {
            "model": ["2", 0] if patch else ["1", 0], "positive": ["1", 1], "negative": ["1", 2],
            "latent_image": ["1", 3], "seed": 0, "steps": 2, "cfg": 4.0, "sampler_name": "euler",
            "scheduler": "simple", "denoise": 1.0}},
        "4": {"class_type": "QKVTestCapture" + suffix, "inputs": {"samples": ["3", 0], "key": key}},
    }
    if patch:
        prompt["2"] = {"class_type": "QKVAttentionPatch", "inputs": {"model": ["1", 0], **patch}}
    return prompt


def test_node_runs_in_a_prompt_with_stock_results(loaded):
    _, suffix = loaded
    stock = comfy_env.run_prompt(_prompt(suffix, "stock"))
    assert stock.success, comfy_env.execution_error(stock)
    for level, backend, block in (("High", "auto", True), ("Low", "sdpa", False), ("Off", "comfy", True)):
        ex = comfy_env.run_prompt(_prompt(suffix, level, {"head_split": level, "attention_backend": backend,
                                                          "block_bounds": block}))
        assert ex.success, comfy_env.execution_error(ex)
        latent, reference = comfy_env.CAPTURED[level], comfy_env.CAPTURED["stock"]
        assert float((latent - reference).abs().max() / reference.abs().max()) <= 1e-5, level


def test_bad_widget_value_is_refused(loaded):
    """ComfyUI's validation refuses an unknown level (v0.8.0); where it does not (v0.3.64), the node says
    which values are allowed."""
    _, suffix = loaded
    bad = _prompt(suffix, "bad", {"head_split": "Extreme", "attention_backend": "auto", "block_bounds": True})
    try:
        ex = comfy_env.run_prompt(bad)
    except AssertionError as refused:
        assert "validation" in str(refused)
        return
    assert not ex.success
    assert "head split level must be one of" in comfy_env.execution_error(ex)["exception_message"]
