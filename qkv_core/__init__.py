"""qkv_core: q/k/v projection and attention by groups of heads, with bounded transients.

A model calls the runtime instead of projecting q/k/v itself and calling attention; owning the projections
lets the runtime bound the memory they take (docs/design.md §2). Never imports ComfyUI.

The public API is what the node pack and a model author use; everything else is reached through its module
(`qkv_core.head_split`, `qkv_core.backends`, `qkv_core.kernels`, ...) and may change with it.

- the calls: `qkv_attention`, `joint_qkv_attention`, `cross_qkv_attention`, `kv_first_attention`,
  `ulysses_qkv_attention` (sequence-parallel), and `rows_` for a norm or RoPE written in PyTorch; their options:
  `AttentionOptions`;
- what the calls hand to the caller's hooks: `HeadGroup` (to `norm_rope`, `norm_v`, `attention_fn`),
  `StagedCore` (to `fused_quant`);
- the head split: `split_plan` (and its `SplitPlan`), `group_count`, `parse_level`, `LEVEL_NAMES`
  (the level names, 0-3 in order), `SPLIT_FLOOR_TOKENS` (the fewest query tokens of one batch item that are
  split by default);
- projections by rows: `RowProjection`, `PreparedProjection`, `WeightRows`, `RowsOnDemand`, `WholeProjection`,
  `FusedRows`;
- backends: `pay_attention`, `backend_names`, `native_prefix_kit`;
- key/value prefixes: `KVPrefix`, `cache_prefix`, `q8_prefix`, `dequantize_prefix`, `PrefixCache`,
  `PrefixLayer`;
- what a run did: `drain_notices`, `reset_notices` (`Notice` objects; kinds in `qkv_core.notices`), `drain_tally`,
  `Tally`.
"""
from .backends import backend_names, native_prefix_kit, pay_attention
from .head_split import (LEVEL_NAMES, SPLIT_FLOOR_TOKENS, HeadGroup, SplitPlan, SplitPolicy, group_count,
                         parse_level, split_plan)
from .notices import Notice, drain_notices, reset_notices
from .options import AttentionOptions
from .prefix import KVPrefix, PrefixCache, PrefixLayer, cache_prefix, dequantize_prefix, q8_prefix
from .projections import FusedRows, PreparedProjection, RowProjection, RowsOnDemand, WeightRows, WholeProjection
from .runtime import cross_qkv_attention, joint_qkv_attention, kv_first_attention, qkv_attention, rows_
from .sequence_parallel import ulysses_qkv_attention
from .staged_core import StagedCore
from .tally import Tally, drain_tally

__version__ = "0.2.0"

__all__ = [
    "qkv_attention", "joint_qkv_attention", "cross_qkv_attention", "kv_first_attention", "rows_",
    "ulysses_qkv_attention",
    "AttentionOptions", "HeadGroup", "StagedCore",
    "split_plan", "SplitPlan", "SplitPolicy", "group_count", "parse_level", "LEVEL_NAMES", "SPLIT_FLOOR_TOKENS",
    "RowProjection", "PreparedProjection", "WeightRows", "RowsOnDemand", "WholeProjection", "FusedRows",
    "pay_attention", "backend_names", "native_prefix_kit",
    "KVPrefix", "cache_prefix", "q8_prefix", "dequantize_prefix", "PrefixCache", "PrefixLayer",
    "Notice", "drain_notices", "reset_notices", "drain_tally", "Tally",
]
