"""The group loop: projection and attention of one call, a group of heads at a time (docs/design.md §2.2,
§2.3, §2.5).

Two paths per group:
- plain (`GroupLoop.attend`): q, then k, then v, each normalized as soon as it is projected, then the backend's
  attention (or the caller's `attention_fn`); the result `(B, q tokens, heads of the group, D)` is placed by
  `GroupLoop.run`;
- staged (`GroupLoop.attend_staged`, a SageAttention staged core): v, k and q are quantized as each is
  projected, so at most one of them exists in 16 bits, and the core writes the group's heads of the output.

Who frees what: every q/k/v here is a local that is deleted (or handed off in a list the callee clears) as soon
as the next step no longer needs it; the norms and `norm_v` change their tensors in place. Kept keys of the
statistics pass are popped from `kept_keys` by their group. Projections are released by the last group
(`last=True`). The output buffer belongs to the caller.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from . import fast_paths
from .backends import AttentionBackend, SDPABackend, StagedCore, held_sdpa_order, pay_attention
from .head_split import HeadGroup
from .inplace_attention import over_queries_pass
from .options import AttentionOptions
from .capture import KVCapture
from .prefix import KVPrefix
from .prefix_join import join_prefix, prefix_tokens
from .streams import CallStreams
from .tally import count_attention

OVER_QUERIES_LABEL = "sdpa (Triton, over the queries)"


def group_mask(attention_mask: Any, heads: int, group: HeadGroup) -> Any:
    """A tensor mask `(B, heads or 1, q tokens, kv tokens)` (or `(B, q tokens, kv tokens)`) cut to the group's
    query heads (a view); a callable mask or None as it is."""
    mask = attention_mask
    if mask is None or not torch.is_tensor(mask):
        return mask
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    if mask.dim() == 4 and mask.shape[1] == heads and heads > 1:
        mask = mask[:, group.q.start:group.q.stop]
    return mask


class GroupLoop:
    """The groups of one call. `streams`: its prepared projections; `o`: its options (`o.kv_prefix` resolved);
    `norm_rope(q, k, group)`: normalizes and rotates in place (either None); `backend`: the backend chosen for
    the call (None with an `attention_fn`); `kept_keys`: k of the first groups from the statistics pass, by first
    key/value head, `(B, kv tokens, kv heads of the group, D)`, popped by their group."""

    def __init__(self, streams: CallStreams, o: AttentionOptions, norm_rope: Optional[Callable],
                 backend: Optional[AttentionBackend], kept_keys: dict[int, torch.Tensor],
                 capture: Optional[KVCapture] = None, over_queries: bool = False):
        self.streams, self.o, self.norm_rope, self.backend, self.kept_keys = streams, o, norm_rope, backend, kept_keys
        # each group's attention written over its q in the output buffer (`inplace_attention`): the call decides it
        # (`_Call.over_queries`: plain SDPA, no mask, short), the kernel may still decline a group (then SDPA)
        self.over_queries = over_queries
        self.capture = capture   # `capture_kv`: each group's normalized keys and values of the range
        s = streams
        self.output_shape = (s.batch, s.q_tokens, s.heads, s.head_dim)
        prefix = o.kv_prefix
        # a native prefix (a staged core's layout) is attended by the core in a pass of its own, never joined
        self.native_prefix = prefix if isinstance(prefix, KVPrefix) and prefix.is_native else None
        self.joined_prefix = None if self.native_prefix is not None else prefix

    def empty_output(self) -> torch.Tensor:
        """A new, uninitialized output `(B, q tokens, heads, D)` in the inputs' dtype and device."""
        return torch.empty(self.output_shape, dtype=self.streams.dtype, device=self.streams.device)

    def run(self, groups: list[HeadGroup], out: Optional[torch.Tensor], staged: Optional[StagedCore],
            q_in_out: bool) -> torch.Tensor:
        """Every group in order, the output `(B, q tokens, heads, D)`. `out`: the output buffer, or None for one
        group without a staged core (the attention's own result is returned: no buffer beside it, no copy, unless
        its shape or dtype differ). `q_in_out`: every group's q is already in its heads of `out`."""
        single = len(groups) == 1 and staged is None
        # a fused quantizer normalizes q itself
        q_normed = q_in_out and (staged is None or self.o.fused_quant is None) and \
            self.normalize_all_queries(out, groups[0])
        s = self.streams
        # each group's k and v go to the norm and a backend, which keep neither once their work is queued: the
        # next group may project into the same buffers (`CallStreams.buffers`); not where a caller's function,
        # a capture or a staged core gets them
        reuse = staged is None and self.o.attention_fn is None and self.capture is None and len(groups) > 1 and \
            fast_paths.on("group_buffers")
        with contextlib.ExitStack() as held:
            if staged is None and self.o.attention_fn is None and len(groups) > 1 and \
                    isinstance(self.backend, SDPABackend) and not self.over_queries and fast_paths.on("sdpa_order"):
                held.enter_context(held_sdpa_order(s.device, s.batch * s.q_tokens * len(groups[0].q) * s.head_dim))
            s.buffers = {} if reuse else None
            try:
                return self._run_groups(groups, out, staged, q_in_out, q_normed, single)
            finally:
                s.buffers = None

    def _run_groups(self, groups: list[HeadGroup], out: Optional[torch.Tensor], staged: Optional[StagedCore],
                    q_in_out: bool, q_normed: bool, single: bool) -> torch.Tensor:
        for index, group in enumerate(groups):
            last = index == len(groups) - 1
            if staged is not None:
                self.attend_staged(staged, group, out, last, q_in_out, q_normed)
                continue
            result = self.attend(group, out, last, q_in_out, q_normed)
            if result is None:   # written over the group's q in `out`
                continue
            if single and tuple(result.shape) == self.output_shape and result.dtype == self.streams.dtype:
                return result
            if out is None:
                out = self.empty_output()
            out.narrow(2, group.q.start, len(group.q)).copy_(result)
            del result
        return out

    def normalize_all_queries(self, out: torch.Tensor, group: HeadGroup) -> bool:
        """Every head's q, already in `out`, normalized and rotated in place at once, before the groups run,
        where the norm offers it (`norm_rope.query_all_heads_(q, group)`, `group` a group of the call: its
        `mean_squares` are the statistics pass's, for a norm that spans heads; a norm and a RoPE that treat
        each head alike, in one fused pass per stream with no scratch): one launch per stream instead of one
        per group and stream, the same math. False when it does not (each group's q is normalized as before)."""
        whole = getattr(self.norm_rope, "query_all_heads_", None) if fast_paths.on("all_heads_q") else None
        return bool(whole is not None and whole(out, group))

    def values(self, group: HeadGroup, last: bool, k_later: bool) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """`(k, v)` of a group (`CallStreams.project_v`): v normalized by `norm_v` and joined with the prefix,
        `(B, prefix tokens + kv tokens, kv heads of the group, D)`; k (one k/v module in every key/value stream,
        else None) neither normalized nor joined."""
        k, v = self.streams.project_v(group, last, k_later)
        if self.o.norm_v is not None:
            self.o.norm_v(v, group)
        if self.capture is not None:
            self.capture.take("v", v, group)
        v = join_prefix(self.joined_prefix, "v", v, group.kv, self.streams.batch)
        return k, v

    def capture_keys(self, k: torch.Tensor, group: HeadGroup) -> None:
        if self.capture is not None:
            self.capture.take("k", k, group)

    def attend(self, group: HeadGroup, out: Optional[torch.Tensor], last: bool, q_in_out: bool,
               q_normed: bool = False) -> Optional[torch.Tensor]:
        """One group's attention `(B, Nq, heads of the group, D)` for the caller to place, or None where it was written
        over the group's q in `out` (`over_queries` with `q_in_out`). `q_in_out`: q is already in the group's heads of
        `out` (normalized there unless `q_normed`); k and v are normalized as each is projected."""
        o, s = self.o, self.streams
        norm = self.norm_rope
        q = out.narrow(2, group.q.start, len(group.q)) if q_in_out else s.project("q", group.q, last)
        if norm is not None and not (q_in_out and q_normed):
            norm(q, None, group)
        if s.shared_kv:
            k, v = self.values(group, last, k_later=False)
            if norm is not None:
                norm(None, k, group)
            self.capture_keys(k, group)
            k = join_prefix(self.joined_prefix, "k", k, group.kv, s.batch)
        else:
            k = self.kept_keys.pop(group.kv.start, None)
            if k is None:
                k = s.project_k(group, last, v_later=True)
            if norm is not None:
                norm(None, k, group)
            self.capture_keys(k, group)
            k = join_prefix(self.joined_prefix, "k", k, group.kv, s.batch)
            _, v = self.values(group, last, k_later=False)
        extra = s.project("extra", group.q, last) if "extra" in s.q_streams[0].proj else None
        if o.attention_fn is not None:
            qkv = [q, k, v] if extra is None else [q, k, v, extra]
            del q, k, v, extra
            result = o.attention_fn(qkv, group)
            qkv.clear()
        elif self.over_queries and q_in_out and self.attend_over_queries_(q, k, v):
            del q, k, v, extra
            count_attention(OVER_QUERIES_LABEL)
            return None
        else:
            del extra
            result = pay_attention(q, k, v, mask=group_mask(o.attention_mask, s.heads, group),
                                   force_attention=self.backend.name, softmax_scale=o.softmax_scale)
            del q, k, v
        return result

    def attend_over_queries_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """`inplace_attention.attend_over_queries_` through the pass kept for the groups' layout
        (`over_queries_pass`); False (q untouched) where the kernel cannot take them."""
        planned = over_queries_pass(q, k, v, self.o.softmax_scale)
        if planned is None:
            return False
        planned.run(q, k, v)
        return True

    def attend_staged(self, core: StagedCore, group: HeadGroup, out: torch.Tensor, last: bool, q_in_out: bool,
                      q_normed: bool) -> None:
        """One group through a staged core into its heads of `out`: v, k, q quantized as each is projected (handed
        in lists the core clears), at most one in 16 bits. `q_in_out`: q is in `out` (normalized if `q_normed`),
        quantized before the kernel overwrites it. `fused_quant`: not with a callable mask, k's not beside a prefix."""
        o, s = self.o, self.streams
        mask = o.attention_mask
        callable_mask = mask is not None and not torch.is_tensor(mask)
        fused = o.fused_quant if not callable_mask else None
        prefix, native = self.joined_prefix, self.native_prefix
        # v is quantized before k is projected (unless one module made both): one of them in 16 bits at a time
        k, v = self.values(group, last, k_later=True)
        settings = core.settings((s.batch, s.q_tokens, len(group.q), s.head_dim),
                                 (s.batch, prefix_tokens(prefix) + s.kv_tokens, len(group.kv), s.head_dim),
                                 v.dtype, v.device, o.softmax_scale, masked=mask is not None,
                                 native_prefix=None if native is None else core.prefix_heads(native, group.kv))
        quantized_v = core.staged_quantize_v([v], settings)
        del v
        if k is None:
            k = s.project_k(group, last, v_later=False)
        quantized_k = None
        if fused is not None and prefix is None and self.capture is None:
            quantized_k = fused(None, k, group, core, settings)
        if quantized_k is None:
            if self.norm_rope is not None:
                self.norm_rope(None, k, group)
            self.capture_keys(k, group)   # before the core smooths or quantizes them in place
            k = join_prefix(prefix, "k", k, group.kv, s.batch)
            if callable_mask:
                mask(None, k, group)
            quantized_k = core.staged_quantize_k([k], settings)
        del k
        q = out[:, :, group.q.start:group.q.stop] if q_in_out else s.project("q", group.q, last)
        quantized_q = fused(q, None, group, core, settings) if fused is not None and not q_normed else None
        mask_of_group = group_mask(mask, s.heads, group)
        if quantized_q is None:
            if self.norm_rope is not None and not q_normed:
                self.norm_rope(q, None, group)
            if callable_mask:
                mask_of_group = mask(q, None, group)
            quantized_q = core.staged_quantize_q([q], settings)
        del q
        core.staged_attention(out[:, :, group.q.start:group.q.stop], (quantized_q, quantized_k, quantized_v),
                              settings, mask=mask_of_group)
