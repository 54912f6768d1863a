"""Which attention kernel the adapters' calls use.

"auto" and the backend names go to `qkv_core`'s registry; "comfy" goes through ComfyUI's own dispatcher
(`optimized_attention`: honours `--use-sage-attention` and friends). "auto" also takes ComfyUI's dispatcher
when another node has set an `optimized_attention_override`, so that override is chained, not dropped.
"""
from __future__ import annotations

from typing import NamedTuple

import comfy.ldm.modules.attention as comfy_attention

from ..qkv_core import backend_names, pay_attention

AUTO, COMFY = "auto", "comfy"


class QKVConfig(NamedTuple):
    """What the node asked for (small and deep-copy safe: it lives in patched closures). `level`: head split
    0-3; `backend`: one of `backend_choices()`; `block`: bound the whole block."""
    level: int
    backend: str
    block: bool


def backend_choices() -> list[str]:
    return [AUTO, COMFY] + backend_names()


def uses_comfy_dispatch(config, transformer_options) -> bool:
    return config.backend == COMFY or (config.backend == AUTO and
                                       "optimized_attention_override" in transformer_options)


def comfy_attend(q, k, v, transformer_options):
    """ComfyUI's `optimized_attention` on head-group tensors `(B, N, h, D)` -> `(B, N, h, D)`."""
    heads = q.shape[2]
    if k.shape[2] != heads:  # grouped-query: ComfyUI's dispatcher of this version wants equal heads
        k = k.repeat_interleave(heads // k.shape[2], dim=2)
        v = v.repeat_interleave(heads // v.shape[2], dim=2)
    out = comfy_attention.optimized_attention(q.reshape(*q.shape[:2], -1), k.reshape(*k.shape[:2], -1),
                                              v.reshape(*v.shape[:2], -1), heads=heads,
                                              transformer_options=transformer_options)
    return out.unflatten(-1, (heads, -1))


def attention_kwargs(config, transformer_options) -> dict:
    """Keyword options for a `qkv_core` call: `attention_fn` for ComfyUI's dispatcher, else the backend."""
    if uses_comfy_dispatch(config, transformer_options):
        def through_comfy(qkv, group):
            q, k, v = qkv[:3]
            qkv.clear()
            return comfy_attend(q, k, v, transformer_options)
        return {"attention_fn": through_comfy}
    return {} if config.backend == AUTO else {"force_attention": config.backend}


def attend_group(q, k, v, kwargs: dict, group):
    """One attention with the choice `attention_kwargs` made, for adapters that combine several."""
    if "attention_fn" in kwargs:
        return kwargs["attention_fn"]([q, k, v], group)
    return pay_attention(q, k, v, force_attention=kwargs.get("force_attention"))
