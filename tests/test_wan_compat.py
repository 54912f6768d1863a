"""Living with ComfyUI releases and with the other nodes of a workflow (real ComfyUI, tiny Wan models).

- The behavioural self-check: an edit of ComfyUI's forward that keeps the math keeps the patch (and the
  split); one that changes the math runs ComfyUI's forward, with one log line.
- Other nodes' hooks (`attn1_patch`, `attn2_patch`, `double_block`) and object patches (on a block's
  self_attn, cross_attn or the block itself), in both orders: the result equals stock with the same patches.
- The node applied twice replaces its own patch; a forced backend says that an override is unused; gradients
  run stock; a weight format the pack does not know (GGUF) runs as ComfyUI runs it.
Every test here passes on each ComfyUI version (hooks that a version does not call are ignored by stock and
by the pack alike).
"""
from __future__ import annotations

import importlib
import logging

import pytest

from support import comfy_env
from support.wan_runs import MODEL, SdpaHeads, _fresh_verdicts, env, forward, rel_err  # noqa: F401

pytestmark = pytest.mark.comfyui



# --- the self-check -------------------------------------------------------------------------------------
def _rewritten_self_attention(torch, wan_model, scale_q=1.0):
    """WanSelfAttention.forward written another way (v first, one helper): the same math when scale_q=1."""
    attention = importlib.import_module("comfy.ldm.modules.attention")

    def forward(self, x, freqs, transformer_options={}):
        b, s = x.shape[:2]
        v = self.v(x)
        rotated = [wan_model.apply_rope1(norm(proj(x)).view(b, s, self.num_heads, self.head_dim), freqs)
                   for proj, norm in ((self.q, self.norm_q), (self.k, self.norm_k))]
        q, k = rotated[0] * scale_q, rotated[1]
        out = attention.optimized_attention(q.view(b, s, -1), k.view(b, s, -1), v, heads=self.num_heads,
                                            transformer_options=transformer_options)
        return self.o(out)
    return forward


@pytest.mark.parametrize("scale_q,kept", [(1.0, True), (1.25, False)], ids=["same-math", "changed-math"])
def test_an_edited_comfyui_forward_is_judged_by_its_math(env, monkeypatch, caplog, scale_q, kept):
    torch = env.torch
    import comfy.ldm.wan.model as wan_model
    monkeypatch.setattr(wan_model.WanSelfAttention, "forward",
                        _rewritten_self_attention(torch, wan_model, scale_q))
    base = comfy_env.make_wan("t2v", **MODEL)
    reference = forward(base)
    patched, report = env.node.apply_patch(base, "High", "sdpa", False)
    assert "diffusion_model.blocks.0.self_attn.forward" in patched.object_patches   # structure probes clean
    caplog.set_level(logging.INFO)
    with SdpaHeads(torch) as spy:
        out = forward(base, patched)
    assert rel_err(out, reference) <= 1e-5
    runs_stock = "Wan self-attention runs as ComfyUI's own: the outputs differ" in caplog.text
    assert runs_stock != kept
    assert set(spy.self_heads) == ({1} if kept else {8})   # High: 8 groups of 1 head; stock: all 8 at once
    if not kept:
        assert caplog.text.count("Wan self-attention runs as ComfyUI's own") == 1


def test_a_changed_block_runs_stock(env, monkeypatch, caplog):
    """A block whose math changed (here: no cross-attention) runs ComfyUI's block; its attention modules
    keep the pack's forwards (they passed their own check)."""
    import comfy.ldm.wan.model as wan_model
    original = wan_model.WanAttentionBlock.forward

    def no_cross_attention(self, x, e, freqs, context, context_img_len=257, transformer_options={}):
        return original(self, x, e, freqs, context * 0, context_img_len, transformer_options=transformer_options)
    monkeypatch.setattr(wan_model.WanAttentionBlock, "forward", no_cross_attention)
    base = comfy_env.make_wan("t2v", **MODEL)
    reference = forward(base)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    caplog.set_level(logging.INFO)
    with SdpaHeads(env.torch) as spy:
        out = forward(base, patched)
    assert rel_err(out, reference) <= 1e-5
    assert "Wan block runs as ComfyUI's own: the outputs differ" in caplog.text
    assert set(spy.self_heads) == {1}   # self-attention still split inside the stock block


def test_the_check_is_cached_and_cheap(env):
    """One check per kind of call: later calls and later runs reuse the verdict."""
    base = comfy_env.make_wan("t2v", **MODEL)
    patched, _ = env.node.apply_patch(base, "High", "sdpa", True)
    forward(base, patched)
    verdicts = dict(env.compat._verdicts)
    assert verdicts and all(reason is None for reason in verdicts.values())
    forward(base, patched)
    assert env.compat._verdicts == verdicts


def test_the_layer_signature_tells_formats_and_layers_apart(env):
    """The guards' per-call layer signature (part of every verdict's key): each module once, in
    `named_modules()`' order, its class and weight dtype; a changed weight format or a replaced layer gives
    another signature (a new check), the same model the same one."""
    import torch
    model = comfy_env.make_wan("t2v", **MODEL).model.diffusion_model
    block = model.blocks[0]

    def by_named_modules(module):
        return tuple((name, type(child).__qualname__, str(getattr(getattr(child, "weight", None), "dtype", None)))
                     for name, child in module.named_modules() if hasattr(child, "weight"))

    shared = torch.nn.Sequential(block.self_attn.q, torch.nn.ReLU(), block.self_attn.q)   # one layer twice
    for module in (block, model, shared):
        assert env.compat.layers_signature(module) == by_named_modules(module)
    before = env.compat.layers_signature(block)
    assert env.compat.layers_signature(block) == before
    block.self_attn.k.weight.data = block.self_attn.k.weight.data.to(torch.float16)
    changed_format = env.compat.layers_signature(block)
    assert changed_format != before
    block.self_attn.k = torch.nn.Linear(4, 4)
    assert env.compat.layers_signature(block) not in (before, changed_format)


def test_one_walk_serves_a_guarded_calls_checks_and_the_parts_foreign_to_the_pack(env):
    """`compat.module_tree`: the layer signature and the foreign-part check of one guarded call come from one
    walk (kept for that call's checks only: a change between calls is seen), and the foreign part is the
    first top-level part, in order, with another node's forward or module hook below or on it."""
    import torch
    block = comfy_env.make_wan("t2v", **MODEL).model.diffusion_model.blocks[0]
    compat, parts = env.compat, importlib.import_module(env.pack.__name__ + ".nodes.block_parts")

    def walk_by_hand(module):   # what block_parts.foreign_part did before the shared walk
        for name, part in module.named_children():
            for child in part.modules():
                if compat.foreign_forward(child):
                    return f"another node patched its {name}"
                if child._forward_hooks or child._forward_pre_hooks:
                    return f"another node hooks its {name}"
        return None

    assert parts.foreign_part(block) is None
    handle = block.cross_attn.k.register_forward_hook(lambda *a: None)
    block.ffn[2].forward = lambda x: x   # another node's forward on a later part
    assert parts.foreign_part(block) == walk_by_hand(block) == "another node hooks its cross_attn"
    handle.remove()
    assert parts.foreign_part(block) == walk_by_hand(block) == "another node patched its ffn"
    del block.ffn[2].forward
    assert parts.foreign_part(block) is None
    compat._local.trees = {}   # inside a guarded call's checks: one walk for both asks
    try:
        first = compat.module_tree(block)
        block.self_attn.k.weight.data = block.self_attn.k.weight.data.to(torch.float16)
        assert compat.module_tree(block) is first
    finally:
        compat._local.trees = None
    assert compat.module_tree(block) is not first and compat.layers_signature(block) != first.layers


def test_a_layer_computed_as_stored_is_projected_with_its_own_weight(env):
    """`comfy_ops.stored_weights`, the cheap common case of every call's projections and block layers: a layer
    whose weight is already in the input's dtype and device, with nothing applied on the fly, gives its own
    weight and bias (no cast, no copy) and the layer's numbers; another dtype, a LoRA weight function or
    ComfyUI's cast flag takes the cast path as before, whose numbers are the layer's own too."""
    import comfy.ops
    torch, ops = env.torch, env.ops
    layer = comfy.ops.disable_weight_init.Linear(64, 96, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(2, 10, 64)
    weight, bias = ops.stored_weights(layer, x)
    assert weight is layer.weight and bias is layer.bias
    assert ops.CastLinear(layer, x).weight is layer.weight
    with torch.no_grad():
        stock = layer(x)
        prepared = ops.ComfyLinearRows(layer).prepare(x)
        assert prepared.weight is layer.weight and torch.equal(prepared.rows(0, 96), stock)
        prepared.release()
        assert ops.stored_weights(layer, x.double()) is None
        layer.weight_function = [lambda w: w * 2]   # a LoRA applied on the fly (ComfyUI's low-VRAM patches)
        assert ops.stored_weights(layer, x) is None and ops.CastLinear(layer, x).weight is not layer.weight
        patched = layer(x)
        assert not torch.allclose(patched, stock)
        prepared = ops.ComfyLinearRows(layer).prepare(x)
        assert torch.allclose(prepared.rows(0, 96), patched, rtol=1e-5, atol=1e-5)
        prepared.release()
        layer.weight_function = []
        layer.comfy_cast_weights = True
        assert ops.stored_weights(layer, x) is None


def test_the_plain_layer_fast_path_answers_as_the_full_probes(env, monkeypatch):
    """`comfy_ops.plain_weights`, read from a layer's own dicts at every call, gives `not_row_sliceable` and
    `stored_weights` the answers their full probes give, for plain layers and for each thing that makes a layer
    not plain (a cast flag, LoRA functions, a scale as buffer, parameter or attribute, another class, an fp8 or
    integer weight, a GGUF-like cast, an overridden forward)."""
    import comfy.ops
    torch, ops = env.torch, env.ops

    def layer(cls=comfy.ops.disable_weight_init.Linear, dtype=torch.float32, bias=True, **attributes):
        made = cls(8, 6, bias=bias, dtype=dtype)
        for name, value in attributes.items():
            if isinstance(value, torch.nn.Parameter):
                made.register_parameter(name, value)
            elif name.startswith("buffer_"):
                made.register_buffer(name[len("buffer_"):], value)
            else:
                setattr(made, name, value)
        return made

    class GGUFLike(comfy.ops.disable_weight_init.Linear):
        def is_ggml_quantized(self):
            return False

        def cast_bias_weight(self, x):
            return self.weight, self.bias

    class OwnForward(comfy.ops.disable_weight_init.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    cases = {
        "plain": layer(), "no bias": layer(bias=False), "bf16": layer(dtype=torch.bfloat16),
        "manual cast": layer(comfy.ops.manual_cast.Linear), "cast flag": layer(comfy_cast_weights=True),
        "weight function": layer(weight_function=[lambda w: w]), "bias function": layer(bias_function=[lambda b: b]),
        "scale buffer": layer(buffer_scale_weight=torch.ones(())),
        "scale parameter": layer(scale_weight=torch.nn.Parameter(torch.ones(()), requires_grad=False)),
        "scale attribute": layer(scale_input=torch.ones(())), "fp8 weight": layer(dtype=torch.float8_e4m3fn),
        "gguf-like": layer(GGUFLike), "own forward": layer(OwnForward), "torch Linear": layer(torch.nn.Linear),
    }
    if getattr(comfy.ops, "fp8_ops", None) is not None:
        cases["fp8 ops"] = layer(comfy.ops.fp8_ops.Linear)
    fast = {name: (ops.not_row_sliceable(made), [ops.stored_weights(made, torch.zeros(2, 8, dtype=dtype))
                                                  for dtype in (torch.float32, torch.bfloat16)])
            for name, made in cases.items()}
    assert ops.plain_weights(cases["plain"]) == (cases["plain"].weight, cases["plain"].bias)
    assert ops.plain_weights(cases["weight function"]) is None and ops.plain_weights(cases["gguf-like"]) is None
    monkeypatch.setattr(ops, "plain_weights", lambda linear: None)   # the full probes alone
    for name, made in cases.items():
        full = (ops.not_row_sliceable(made), [ops.stored_weights(made, torch.zeros(2, 8, dtype=dtype))
                                              for dtype in (torch.float32, torch.bfloat16)])
        assert fast[name][0] == full[0], name
        for got, expected in zip(fast[name][1], full[1]):
            assert (got is None) == (expected is None), name
            if got is not None:
                assert got[0] is expected[0] and got[1] is expected[1], name


def test_module_attr_reads_what_getattr_reads(env):
    """The probes' attribute lookup without `Module.__getattr__`'s failed lookups gives what `getattr` gives:
    instance attributes, parameters, buffers, submodules, class attributes, properties and methods, and the
    default for what is missing."""
    import torch
    comfy_ops = importlib.import_module(env.pack.__name__ + ".nodes.comfy_ops")

    class Layer(torch.nn.Linear):
        comfy_cast_weights = False
        weight_function = []

        @property
        def layout_type(self):
            return "from a property"

        def is_ggml_quantized(self):
            return False

    layer = Layer(4, 4)
    layer.register_buffer("scale_weight", torch.ones(()))
    layer.child = torch.nn.Identity()
    layer.bias_function = [print]
    for name in ("weight", "bias", "scale_weight", "child", "comfy_cast_weights", "weight_function",
                 "bias_function", "layout_type", "in_features", "missing", "scale_input"):
        assert comfy_ops.module_attr(layer, name, "default") is getattr(layer, name, "default") or \
            comfy_ops.module_attr(layer, name, "default") == getattr(layer, name, "default"), name
    assert comfy_ops.module_attr(layer, "is_ggml_quantized")() is False   # a bound method
    assert comfy_ops.module_attr(None, "weight") is None
