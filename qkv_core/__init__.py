"""qkv_core: q/k/v projection and attention by groups of heads, with bounded transients.

A model calls the runtime instead of projecting q/k/v itself and calling attention; owning the projections
lets the runtime bound the memory they take. See docs/design.md §2 and README.md. Never imports ComfyUI.
"""
from .backends import (AttentionBackend, StagedCore, available_backends, backend_names, get_attention_backend,
                       native_prefix_kit, pay_attention, register_backend, resolve_backend, set_attention_backend,
                       unregister_backend)
from .head_split import (LEVEL_NAMES, SPLIT_FLOOR_TOKENS, TARGET_GROUPS, HeadGroup, SplitPlan, SplitPolicy,
                         group_count, head_groups, parse_level, split_plan)
from .notices import drain_notices, reset_notices
from .options import AttentionOptions
from .prefix import KVPrefix, PrefixCache, PrefixLayer, cache_prefix, dequantize_prefix, q8_prefix
from .projections import (FusedRows, LinearRows, PreparedProjection, RowProjection, RowsOnDemand, WeightRows,
                          WholeProjection, as_row_projection)
from .q8 import dequantize_q8, dequantize_q8_into, merge_lse_, quantize_q8
from .tally import Tally, drain_tally
from .runtime import cross_qkv_attention, joint_qkv_attention, kv_first_attention, qkv_attention, rows_
from .sequence_parallel import ulysses_qkv_attention

__version__ = "0.2.0"

__all__ = [
    "qkv_attention", "joint_qkv_attention", "cross_qkv_attention", "kv_first_attention", "rows_",
    "ulysses_qkv_attention",
    "AttentionOptions",
    "HeadGroup", "head_groups", "group_count", "split_plan", "SplitPlan", "SplitPolicy", "parse_level",
    "LEVEL_NAMES", "TARGET_GROUPS", "SPLIT_FLOOR_TOKENS",
    "RowProjection", "PreparedProjection", "WeightRows", "RowsOnDemand", "LinearRows", "WholeProjection",
    "FusedRows", "as_row_projection",
    "AttentionBackend", "StagedCore", "pay_attention", "resolve_backend", "register_backend",
    "unregister_backend", "backend_names", "available_backends", "set_attention_backend",
    "get_attention_backend", "native_prefix_kit",
    "quantize_q8", "dequantize_q8", "dequantize_q8_into", "merge_lse_",
    "KVPrefix", "q8_prefix", "cache_prefix", "dequantize_prefix", "PrefixLayer", "PrefixCache",
    "drain_notices", "reset_notices", "drain_tally", "Tally",
]
