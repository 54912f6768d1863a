"""Test helper: fake staged cores behind fake attention backends, for the staged-core seam of qkv_core
(docs/design.md §2.4, §2.5). Their quantizers keep 16-bit or float tensors, so results equal SDPA's.

  * `FakeCore` / `FakeBackend` (backend "fake-staged"): identity quantizers that take the tensor out of the list
    they are handed and log their calls (tests/test_staged_seam.py, test_prefix_capture.py);
  * `row_tiled_backend(core_module)` (backend "fake-rows"): a staged core that keeps float copies as its
    "quantized" forms and assembles q by tiles of `TILE` tokens, as SageAttention 2's sm90 core does, for
    `core_module`, the process's `qkv_core` or the pack's own (tests/test_input_reuse.py,
    test_wan_input_reuse.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import qkv_core as qc

ROWS_NAME = "fake-rows"
TILE = 64


class FakeCore(qc.StagedCore):
    name = "fake-core"

    def __init__(self, log):
        self.log = log
        self.lists = []
        self.settings_calls = []
        self.masks = []

    def settings(self, q_shape, k_shape, dtype, device, softmax_scale=None, masked=False, native_prefix=None):
        self.settings_calls.append((tuple(q_shape), tuple(k_shape), dtype))
        return {"scale": softmax_scale}

    def _quantize(self, which, tensor_list):
        assert isinstance(tensor_list, list) and len(tensor_list) == 1 and torch.is_tensor(tensor_list[0])
        self.lists.append(tensor_list)
        self.log.append(f"quantize {which}")
        tensor = tensor_list.pop()  # the core takes the tensor out of the list it is handed
        return ("quantized", which, tensor)

    def staged_quantize_v(self, v_list, settings):
        return self._quantize("v", v_list)

    def staged_quantize_k(self, k_list, settings):
        return self._quantize("k", k_list)

    def staged_quantize_q(self, q_list, settings):
        return self._quantize("q", q_list)

    def staged_attention(self, out, quantized, settings, mask=None):
        (_, wq, q), (_, wk, k), (_, wv, v) = quantized
        assert (wq, wk, wv) == ("q", "k", "v")
        self.log.append("attention")
        self.masks.append(mask)
        result = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                attn_mask=mask, scale=settings["scale"],
                                                enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
        out.copy_(result)


class FakeBackend(qc.backends.AttentionBackend):
    name = "fake-staged"

    def __init__(self, core):
        self.staged_core = core
        self.attend_calls = 0

    def attend(self, q, k, v, mask=None, softmax_scale=None):  # the unstaged call
        self.attend_calls += 1
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, scale=softmax_scale,
                                              enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


def row_tiled_backend(core_module, name: str = ROWS_NAME):
    """A backend of `core_module` (the process's `qkv_core`, or the pack's own when ComfyUI loads it) whose
    staged core keeps float copies as its "quantized" forms and assembles q by tiles of `TILE` tokens."""

    class RowsCore(core_module.StagedCore):
        name = "fake-rows-core"

        def __init__(self):
            self.log = []

        def settings(self, q_shape, k_shape, dtype, device, softmax_scale=None, masked=False,
                     native_prefix=None):
            return dict(scale=softmax_scale, dtype=dtype, device=device)

        def staged_quantize_v(self, v_list, settings):
            self.log.append("quantize v")
            return v_list.pop().clone()

        def staged_quantize_k(self, k_list, settings):
            self.log.append("quantize k")
            return k_list.pop().clone()

        def staged_quantize_q(self, q_list, settings):
            self.log.append("quantize q")
            return q_list.pop().clone()

        def q_row_tile(self, settings):
            return TILE

        def empty_quantized_q(self, q_shape, settings):
            return torch.full(q_shape, float("nan"), dtype=settings["dtype"], device=settings["device"])

        def place_quantized_q_rows(self, full, part, token_start):
            assert token_start % TILE == 0
            self.log.append(f"place q {token_start}")
            full[:, token_start:token_start + part.shape[1]] = part

        def quantized_q_heads(self, full, heads):
            return full[:, :, heads.start:heads.stop]

        def staged_attention(self, out, quantized, settings, mask=None):
            q, k, v = quantized
            assert not torch.isnan(q).any(), "a query tile was never placed"
            self.log.append("attention")
            out.copy_(F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     attn_mask=mask, scale=settings["scale"],
                                                     enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2))

    class RowsBackend(core_module.backends.AttentionBackend):
        def __init__(self, staged):
            self.name = name
            self.staged_core = staged

        def attend(self, q, k, v, mask=None, softmax_scale=None):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=mask, scale=softmax_scale).transpose(1, 2)

    return RowsBackend(RowsCore())
