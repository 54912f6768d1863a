"""Attention Head Split: how many groups of heads a call is attended in (docs/design.md §2.3).

Levels Off/Low/Medium/High (the integers 0-3, or their names) target 1/4/8/16 groups. The group count is the
divisor of `kv_heads` closest to the target (ties: the smaller), so every group holds whole key/value heads
and the query heads that share them. Sequences under `SPLIT_FLOOR_TOKENS` query tokens of one batch item are
never split: there is little to save and the extra launches cost time. (Counted per item: on whole models on
an H200, cond + uncond of 1 MP images counted together were split and ran 1.2-8.4x stock's time for ~0.5 GiB;
docs/benchmarks.md#family-models.)

`SplitPolicy` is the one decision: the runtime's calls, the node's memory estimate, the planner and the
bounded blocks' chunk sizes all ask it (`split_plan` is its arithmetic).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

LEVEL_NAMES = ("off", "low", "medium", "high")
TARGET_GROUPS = (1, 4, 8, 16)
SPLIT_FLOOR_TOKENS = 8192
DEFAULT_LEVEL = 3   # High: a call that names no level
# A split whose groups are attended over their queries (`inplace_attention`: short SDPA calls, see
# `runtime.OVER_QUERIES_MAX_TOKENS`) holds k and v but no result a group: two transients where SDPA's hold three,
# so the level's peak is reached with 2/3 of its groups (Qwen-Image's 24 heads at Medium: 6 groups instead of 8,
# which also run faster: the kernel's 4 heads a group fill the GPU better than 3).
OVER_QUERIES_GROUP_SCALE = 2 / 3

Level = Union[int, str]


class HeadGroup(NamedTuple):
    """One group of heads. `q`, `kv`: ranges of query and key/value head indices. `mean_squares`: None, or
    `(q_mean_squares, k_mean_squares)`, float32 `(batch, tokens, 1)`, the per-token mean of squares over
    all heads, for norms that span heads (`norm_spans_heads=True` with more than one group). `tokens`: None
    when the tensors a norm is handed hold every token of the call; else the range of the call's tokens they
    hold (a call that reuses its input normalizes token chunks of every head, `reuse_input`, with no
    `mean_squares`: the chunks hold every head, so a norm that spans heads takes each token's from them)."""

    q: range
    kv: range
    mean_squares: Optional[tuple] = None
    tokens: Optional[range] = None


def parse_level(level: Level) -> int:
    """0-3 from an int 0-3 or a name off/low/medium/high (any case); anything else is a ValueError."""
    if isinstance(level, bool):
        raise ValueError(f"head_split_level must be 0-3 or one of {LEVEL_NAMES}, not {level!r}")
    if isinstance(level, int):
        if 0 <= level <= 3:
            return level
    elif isinstance(level, str) and level.strip().lower() in LEVEL_NAMES:
        return LEVEL_NAMES.index(level.strip().lower())
    raise ValueError(f"head_split_level must be 0-3 or one of {LEVEL_NAMES}, not {level!r}")


class SplitPlan(NamedTuple):
    """How many head groups a call runs in; `reason`: why not more than one (None when it splits); `share`: what a
    group holds of a plain SDPA group's transients (`OVER_QUERIES_GROUP_SCALE` for groups attended over their
    queries, else 1)."""

    groups: int
    reason: Optional[str] = None
    share: float = 1.0


def split_plan(kv_heads: int, tokens: int, level: Optional[Level] = None, floor: Optional[int] = None,
               split_heads: Optional[bool] = None, unsliceable: Optional[str] = None,
               target_scale: float = 1.0) -> SplitPlan:
    """The one place that decides the head split, for the runtime's calls and for whoever plans memory
    around them (the node's memory estimate): `kv_heads` key/value heads, `tokens` query tokens of one batch
    item (for cross attention the longer of the two sequences; a batch of short sequences is not split: on a
    GPU a whole model of 1 MP images, cond and uncond batched, ran 3-8x slower split, for ~100 MiB), `level` (default:
    `DEFAULT_LEVEL`), `floor` (the fewest tokens that are split; default `SPLIT_FLOOR_TOKENS`), `split_heads=False`
    (the caller's "never"), `unsliceable` (why a projection that would be split cannot be computed by rows),
    `target_scale` (the level's target count times this: a call whose groups hold fewer transients reaches the
    level's peak in fewer groups, see `runtime.OVER_QUERIES_GROUP_SCALE`)."""
    lvl = DEFAULT_LEVEL if level is None else parse_level(level)
    floor = SPLIT_FLOOR_TOKENS if floor is None else floor
    if split_heads is False:
        return SplitPlan(1, "split_heads=False")
    if lvl == 0:
        return SplitPlan(1, "head split Off")
    if tokens < floor:
        return SplitPlan(1, f"{tokens} tokens, under {floor}")
    if kv_heads <= 1:
        return SplitPlan(1, "one key/value head")
    target = TARGET_GROUPS[lvl] * target_scale
    divisors = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0]
    if unsliceable is not None:
        return SplitPlan(1, unsliceable)
    return SplitPlan(min(divisors, key=lambda d: (abs(d - target), d)))


class SplitPolicy(NamedTuple):
    """How a model's calls are split, asked by everything that depends on it: the runtime's call (its options
    `head_split_level` and `split_floor_tokens` are a policy), and in nodes/ the memory estimate, the planner, the
    bounded blocks' chunk sizes and the guard that leaves short calls to ComfyUI's own forwards.

    `level`: 0-3 (Off-High). `floor_tokens`: the fewest tokens of one batch item that are split; None:
    `SPLIT_FLOOR_TOKENS` (read at each call) times `floor_scale`, the family's multiple of it where its split
    forwards are bound by the host's launches on shorter sequences. `short_runs_stock`: the family's calls under
    the floor run ComfyUI's own forwards."""

    level: int = DEFAULT_LEVEL
    floor_tokens: Optional[int] = None
    floor_scale: float = 1
    short_runs_stock: bool = False

    @property
    def floor(self) -> int:
        """The fewest tokens of one batch item that are split."""
        if self.floor_tokens is not None:
            return self.floor_tokens
        return int(SPLIT_FLOOR_TOKENS * self.floor_scale)

    def plan(self, kv_heads: int, tokens: int, *, split_heads: Optional[bool] = None,
             unsliceable: Optional[str] = None, over_queries: bool = False) -> SplitPlan:
        """The head groups of a call with `kv_heads` key/value heads and `tokens` tokens of one batch item (for
        cross-attention the longer sequence): `split_plan` at this level and floor. `over_queries`: its groups
        are attended over their queries, so the level's peak takes `OVER_QUERIES_GROUP_SCALE` of its groups."""
        plan = split_plan(kv_heads, tokens, self.level, self.floor, split_heads, unsliceable,
                          OVER_QUERIES_GROUP_SCALE if over_queries else 1.0)
        return plan._replace(share=OVER_QUERIES_GROUP_SCALE) if over_queries and plan.groups > 1 else plan

    def splits(self, kv_heads: int, tokens: int) -> bool:
        """Is a call of `tokens` tokens of one batch item split into head groups (a projection without rows may
        still keep it whole)?"""
        return self.plan(kv_heads, tokens).groups > 1

    def runs_stock(self, tokens: int) -> bool:
        """Does a call whose longest sequence has `tokens` tokens of one item run ComfyUI's own forward?"""
        return self.short_runs_stock and tokens < self.floor

    def call_options(self) -> dict:
        """The runtime call's options for this policy (`split_floor_tokens` only where it is not the default)."""
        options = {"head_split_level": self.level}
        if self.floor_tokens is not None or self.floor_scale != 1:
            options["split_floor_tokens"] = self.floor
        return options

    @classmethod
    def of_call(cls, level: Optional[Level], floor_tokens: Optional[int]) -> "SplitPolicy":
        """The policy of a runtime call's options `head_split_level` and `split_floor_tokens` (None: defaults)."""
        return cls(DEFAULT_LEVEL if level is None else parse_level(level), floor_tokens)


def group_count(kv_heads: int, tokens: int, level: Optional[Level] = None, floor: Optional[int] = None) -> int:
    """Number of head groups for `kv_heads` key/value heads and `tokens` query tokens of one item (`split_plan`'s)."""
    return split_plan(kv_heads, tokens, level, floor).groups


def head_groups(heads: int, kv_heads: Optional[int] = None, count: int = 1) -> list[HeadGroup]:
    """`count` groups of consecutive heads; each holds `kv_heads // count` key/value heads and the
    `heads // count` query heads that use them (query head i uses key/value head i // (heads // kv_heads))."""
    kv_heads = heads if kv_heads is None else kv_heads
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if count <= 0 or kv_heads % count:
        raise ValueError(f"the group count ({count}) must divide kv_heads ({kv_heads})")
    q_per, kv_per = heads // count, kv_heads // count
    return [HeadGroup(range(g * q_per, (g + 1) * q_per), range(g * kv_per, (g + 1) * kv_per))
            for g in range(count)]
