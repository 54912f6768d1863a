"""Attention Head Split: how many groups of heads a call is attended in (docs/design.md §2.3).

Levels Off/Low/Medium/High (the integers 0-3, or their names) target 1/4/8/16 groups. The group count is the
divisor of `kv_heads` closest to the target (ties: the smaller), so every group holds whole key/value heads
and the query heads that share them. Sequences under `SPLIT_FLOOR_TOKENS` query tokens of one batch item are
never split: there is little to save and the extra launches cost time. (Counted per item: cond + uncond of
short sequences counted together would be split for little memory at a large cost in time;
docs/benchmarks.md#family-models.)

`SplitPolicy` is the one decision: the runtime's calls, the node's memory estimate, the planner and the
bounded blocks' chunk sizes all ask it (`split_plan` is its arithmetic).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

#: The Head Split levels' names, level 0-3 in order (`parse_level` takes either).
LEVEL_NAMES = ("off", "low", "medium", "high")
TARGET_GROUPS = (1, 4, 8, 16)
#: The fewest query tokens of one batch item that are split, unless a call passes `split_floor_tokens`.
SPLIT_FLOOR_TOKENS = 8192
DEFAULT_LEVEL = 3   # High: a call that names no level
# A split whose groups are attended over their queries (`inplace_attention`: short SDPA calls, see
# `runtime.OVER_QUERIES_MAX_TOKENS`) holds k and v but no result a group: two transients where SDPA's hold three,
# so the level's peak is reached with 2/3 of its groups (Qwen-Image's 24 heads at Medium: 6 groups instead of 8,
# which also run faster: the kernel's 4 heads a group fill the GPU better than 3).
OVER_QUERIES_GROUP_SCALE = 2 / 3

Level = Union[int, str]


class HeadGroup(NamedTuple):
    """One group of heads, as the runtime hands it to `norm_rope`, `norm_v`, `attention_fn` and `fused_quant`.

    Attributes
    ----------
    q : range
        The query heads of the group (indices into the call's heads).
    kv : range
        The key/value heads of the group; query head ``i`` uses key/value head ``i // (heads // kv_heads)``.
    mean_squares : tuple, optional
        ``(q mean squares, k mean squares)``, float32 ``(batch, tokens, 1)``: each token's mean of squares over
        every head, for a norm that spans heads (``norm_spans_heads=True`` with more than one group); else None.
        Owned by the call: a hook reads them and keeps no reference.
    tokens : range, optional
        None when the tensors a hook is handed hold every token of the call; else the call's tokens they hold
        (a call that reuses its input normalizes token chunks of every head, with no `mean_squares`: a norm
        that spans heads then takes each token's from the chunk).
    """

    q: range
    kv: range
    mean_squares: Optional[tuple] = None
    tokens: Optional[range] = None


def parse_level(level: Level) -> int:
    """The Head Split level as an int.

    Parameters
    ----------
    level : int or str
        0-3, or one of `LEVEL_NAMES` in any case and with spaces around.

    Returns
    -------
    int
        0 (Off) to 3 (High).

    Raises
    ------
    ValueError
        Anything else (a bool included).
    """
    if isinstance(level, bool):
        raise ValueError(f"head_split_level must be 0-3 or one of {LEVEL_NAMES}, not {level!r}")
    if isinstance(level, int):
        if 0 <= level <= 3:
            return level
    elif isinstance(level, str) and level.strip().lower() in LEVEL_NAMES:
        return LEVEL_NAMES.index(level.strip().lower())
    raise ValueError(f"head_split_level must be 0-3 or one of {LEVEL_NAMES}, not {level!r}")


class SplitPlan(NamedTuple):
    """How many head groups a call runs in (`split_plan`).

    Attributes
    ----------
    groups : int
        The count; it divides the call's key/value heads.
    reason : str, optional
        Why there is no more than one group (under the floor, level Off, ...); None when the call splits.
    share : float
        What a group holds of a plain SDPA group's transients: `OVER_QUERIES_GROUP_SCALE` for groups
        attended over their queries, else 1.
    """

    groups: int
    reason: Optional[str] = None
    share: float = 1.0


def split_plan(kv_heads: int, tokens: int, level: Optional[Level] = None,
               split_floor_tokens: Optional[int] = None,
               split_heads: Optional[bool] = None, unsliceable: Optional[str] = None,
               target_scale: float = 1.0) -> SplitPlan:
    """The head split of a call: the one place that decides it, for the runtime and for whoever plans memory
    around it (the node's memory estimate and planner).

    The count is the divisor of `kv_heads` closest to the level's target (1, 4, 8, 16; ties: the smaller).

    Parameters
    ----------
    kv_heads : int
        Key/value heads of the call.
    tokens : int
        Query tokens of one batch item (cross-attention: the longer of the two sequences). A batch of short
        sequences is not split (docs/benchmarks.md#split-floors).
    level : int or str, optional
        The Head Split level (`parse_level`). Default: High (`DEFAULT_LEVEL`).
    split_floor_tokens : int, optional
        The fewest tokens that are split. Default `SPLIT_FLOOR_TOKENS`.
    split_heads : bool, optional
        False: the caller's "never".
    unsliceable : str, optional
        Why a projection that would be split cannot be computed by rows (then one group, with this reason).
    target_scale : float
        The level's target count times this: a call whose groups hold fewer transients reaches the level's
        peak in fewer groups (`runtime.OVER_QUERIES_GROUP_SCALE`).

    Returns
    -------
    SplitPlan

    Raises
    ------
    ValueError
        An unknown `level`.
    """
    lvl = DEFAULT_LEVEL if level is None else parse_level(level)
    split_floor_tokens = SPLIT_FLOOR_TOKENS if split_floor_tokens is None else split_floor_tokens
    if split_heads is False:
        return SplitPlan(1, "split_heads=False")
    if lvl == 0:
        return SplitPlan(1, "head split Off")
    if tokens < split_floor_tokens:
        return SplitPlan(1, f"{tokens} tokens, under {split_floor_tokens}")
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

    `level`: 0-3 (Off-High). `split_floor_tokens`: the fewest tokens of one batch item that are split; None:
    `SPLIT_FLOOR_TOKENS` (read at each call) times `floor_scale`, the family's multiple of it where its split
    forwards are bound by the host's launches on shorter sequences. `short_runs_stock`: the family's calls under
    the floor run ComfyUI's own forwards. `group_scale`: the level's target count of groups times this, for a
    family whose attention is wider than its hidden state (runtime option `head_split_group_scale`)."""

    level: int = DEFAULT_LEVEL
    split_floor_tokens: Optional[int] = None
    floor_scale: float = 1
    short_runs_stock: bool = False
    group_scale: float = 1

    @property
    def effective_split_floor_tokens(self) -> int:
        """The fewest tokens of one batch item that are split."""
        if self.split_floor_tokens is not None:
            return self.split_floor_tokens
        return int(SPLIT_FLOOR_TOKENS * self.floor_scale)

    def plan(self, kv_heads: int, tokens: int, *, split_heads: Optional[bool] = None,
             unsliceable: Optional[str] = None, over_queries: bool = False) -> SplitPlan:
        """The head groups of a call with `kv_heads` key/value heads and `tokens` tokens of one batch item (for
        cross-attention the longer sequence): `split_plan` at this level and floor. `over_queries`: its groups
        are attended over their queries, so the level's peak takes `OVER_QUERIES_GROUP_SCALE` of its groups."""
        plan = split_plan(kv_heads, tokens, self.level, self.effective_split_floor_tokens, split_heads,
                          unsliceable, self.group_scale * (OVER_QUERIES_GROUP_SCALE if over_queries else 1.0))
        return plan._replace(share=OVER_QUERIES_GROUP_SCALE) if over_queries and plan.groups > 1 else plan

    def splits(self, kv_heads: int, tokens: int) -> bool:
        """Is a call of `tokens` tokens of one batch item split into head groups (a projection without rows may
        still keep it whole)?"""
        return self.plan(kv_heads, tokens).groups > 1

    def projects_by_rows(self, tokens: int) -> bool:
        """Is a stream of `tokens` tokens of one batch item long enough to be projected by rows, one head group
        at a time? A shorter one is projected whole once and sliced per group."""
        return tokens >= self.effective_split_floor_tokens

    def runs_stock(self, tokens: int) -> bool:
        """Does a call whose longest sequence has `tokens` tokens of one item run ComfyUI's own forward?"""
        return self.short_runs_stock and tokens < self.effective_split_floor_tokens

    def call_options(self) -> dict:
        """The runtime call's options for this policy (`split_floor_tokens` only where it is not the default)."""
        options = {"head_split_level": self.level}
        if self.split_floor_tokens is not None or self.floor_scale != 1:
            options["split_floor_tokens"] = self.effective_split_floor_tokens
        if self.group_scale != 1:
            options["head_split_group_scale"] = self.group_scale
        return options

    @classmethod
    def of_call(cls, level: Optional[Level], split_floor_tokens: Optional[int],
                group_scale: Optional[float] = None) -> "SplitPolicy":
        """The policy of a runtime call's options `head_split_level`, `split_floor_tokens` and
        `head_split_group_scale` (None: defaults)."""
        return cls(DEFAULT_LEVEL if level is None else parse_level(level), split_floor_tokens,
                   group_scale=1 if group_scale is None else group_scale)


def group_count(kv_heads: int, tokens: int, level: Optional[Level] = None,
                split_floor_tokens: Optional[int] = None) -> int:
    """The number of head groups `split_plan` gives.

    Parameters
    ----------
    kv_heads, tokens, level, split_floor_tokens
        As in `split_plan`.

    Returns
    -------
    int

    Raises
    ------
    ValueError
        An unknown `level`.
    """
    return split_plan(kv_heads, tokens, level, split_floor_tokens).groups


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
