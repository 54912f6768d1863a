"""The staged-core interface: a SageAttention core whose quantizers run apart from its attention, so the runtime
quantizes each of v, k, q as soon as it is projected (docs/design.md §2.4). Implementations: `sage.Sage1Core`,
`sage2.Sage2Core`; `backends.SageBackend` holds the one its installed SageAttention offers. A module of its own so
that the cores and the backends import it, not each other.
"""
from __future__ import annotations

from typing import Optional


class StagedCore:
    """A SageAttention core whose quantizers run apart from its attention (docs/design.md §2.4): the runtime
    quantizes each of v, k, q as soon as it is projected, so at most one of them exists in 16 bits. A
    ``fused_quant`` hook is handed the call's core and settings.

    Every tensor goes in and comes out ``(batch, tokens, heads, head_dim)`` (strided views allowed); the
    quantized forms are the core's own (int8 or fp8 values with their scales).

    Methods
    -------
    settings(q_shape, k_shape, dtype, device, softmax_scale=None, masked=False, native_prefix=None)
        The core's choices for one group's shapes: `masked` says a mask will come to `staged_attention`;
        `native_prefix` is the group's heads of a native prefix (`prefix_heads`), which the core attends in a
        pass of its own and merges by log-sum-exp.
    staged_quantize_v(v_list, settings), staged_quantize_k(k_list, settings),
    staged_quantize_q(q_list, settings)
        The quantized form of ``[tensor]``: the list is cleared and the core keeps no reference to the 16-bit
        tensor, so it is freed once the caller drops its own.
    staged_attention(out, quantized, settings, mask=None)
        The attention of ``(quantized q, quantized k, quantized v)`` written into `out` ``(batch, q tokens,
        heads of the group, head_dim)`` (a strided view of the call's output); the quantized tensors are the
        caller's to drop after.
    q_row_tile, empty_quantized_q, place_quantized_q_rows, quantized_q_heads
        q's quantized layout assembled from chunks of tokens (a call that reuses its input); optional.
    prefix_heads(prefix, heads)
        A native prefix's key/value heads in this core's layout (views); optional.

    Implementations: `sage.Sage1Core`, `sage2.Sage2Core`.
    """

    name = "staged"

    def settings(self, q_shape, k_shape, dtype, device, softmax_scale=None, masked=False,
                 native_prefix=None):  # pragma: no cover
        raise NotImplementedError

    def staged_quantize_v(self, v_list, settings):  # pragma: no cover
        raise NotImplementedError

    def staged_quantize_k(self, k_list, settings):  # pragma: no cover
        raise NotImplementedError

    def staged_quantize_q(self, q_list, settings):  # pragma: no cover
        raise NotImplementedError

    def staged_attention(self, out, quantized, settings, mask=None):  # pragma: no cover
        raise NotImplementedError

    # Quantized q assembled from chunks of tokens (a call that reuses its input quantizes q at full width, a
    # chunk of tokens at a time, before any group: input_reuse.py). A core offers it through all four.
    def q_row_tile(self, settings) -> Optional[int]:
        """Tokens a tile of q's quantized layout holds for `settings`, when that layout can be assembled from
        chunks of whole tiles (`empty_quantized_q`, `place_quantized_q_rows`, `quantized_q_heads`); else None."""
        return None

    def empty_quantized_q(self, q_shape, settings):  # pragma: no cover
        """An uninitialized quantized q of every head, `q_shape` `(B, N, heads, D)`, as `staged_quantize_q`
        returns it for `settings`' dtype and device."""
        raise NotImplementedError

    def place_quantized_q_rows(self, full, part, token_start: int) -> None:  # pragma: no cover
        """`part` (`staged_quantize_q` of the tokens from `token_start`, a multiple of `q_row_tile`, every head)
        copied into `full` (`empty_quantized_q`)."""
        raise NotImplementedError

    def quantized_q_heads(self, full, heads: range):  # pragma: no cover
        """The query heads `heads` of `full`, as `staged_attention` takes a group's quantized q."""
        raise NotImplementedError

    def prefix_heads(self, prefix, heads: range):
        """The key/value heads `heads` of a native prefix in this core's layout (views), for `settings`."""
        raise ValueError(f"the {self.name} core keeps no native prefixes: cache the prefix with native=False (q8)")
