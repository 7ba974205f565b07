"""Padding-free histories: token-wise layers on the real tokens, attention per length bucket.

A random batch of Office histories pads every row to the longest (~81 tokens) while the mean
is ~33, so a padded encoder spends most of its projections and feed-forward FLOPs on PAD.
:class:`PackedHistory` holds the batch's real tokens as one ``(N, d)`` matrix (N = real
tokens in the batch) for every token-wise layer (embedding, projections, feed-forward,
norms), and unpacks them only where tokens interact: attention runs on buckets of rows of
similar length, each bucket padded to its own longest row (rows sorted by length, then cut
every ``bucket_rows`` rows). The packed order is bucket order, so a bucket's tokens are one
contiguous slice of the packed matrix.

Left padding is kept inside each bucket (a row's last real token in the bucket's last
column), so relative offsets, causal masks and RoPE positions are exactly those of the
padded layout: the packed path computes the same function (``tests/test_packing.py``
compares both in float64).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .fused import fused_active

# Rows per attention bucket on a CPU: 32 rows of a sorted batch of 128-256 pad to within a
# few tokens of their own length. Accelerators take the batch in one bucket (one kernel).
CPU_BUCKET_ROWS = 32
# Under bf16 autocast on a CPU the packed token count is rounded up to a multiple of this with spare
# rows that no real token sees: oneDNN (torch's bf16 CPU kernels) builds and caches one primitive per
# op and shape, up to 1024, and every random batch's own token count filled that cache with ~0.5 GiB
# of primitives never used again. Rounded (<= 3% more token-wise work at micro-batch 128), Office TIGER
# CE bf16 at 1 thread: peak RSS 1.95 -> 1.27 GiB, an epoch 0.97x the time. In fp32 (no such cache)
# rounding gave nothing (epoch 1.01x at 256, same memory), so it is not done (RESULTS.md, 2026-11-26).
CPU_TOKEN_MULTIPLE = 128


def default_token_multiple(device: torch.device) -> int:
    """``CPU_TOKEN_MULTIPLE`` on a CPU under bf16 autocast, else 1 (no rounding)."""
    if device.type == "cpu" and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
        return CPU_TOKEN_MULTIPLE
    return 1


@dataclass(frozen=True)
class Bucket:
    """Rows of similar length, padded (on the left) to the longest of them.

    Attributes:
        start, end: the bucket's slice of the packed tokens.
        num_rows: rows in the bucket; length: the bucket's padded length.
        scatter: (end - start,) int64 position of each packed token in the bucket's
            flattened (num_rows * length) padded layout.
        key_mask: (num_rows, length) bool, True on real tokens.
    """

    start: int
    end: int
    num_rows: int
    length: int
    scatter: torch.Tensor
    key_mask: torch.Tensor

    def unpack(self, part: torch.Tensor) -> torch.Tensor:
        """The bucket's (end - start, ...) packed rows -> (num_rows, length, ...) with zeros on padding."""
        # in place into fresh zeros: the out-of-place index_copy would clone them first
        padded = part.new_zeros((self.num_rows * self.length, *part.shape[1:])).index_copy_(0, self.scatter, part)
        return padded.view(self.num_rows, self.length, *part.shape[1:])

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(num_rows, length, ...) -> (end - start, ...), the real tokens in packed order."""
        return padded.reshape(self.num_rows * self.length, *padded.shape[2:]).index_select(0, self.scatter)


@dataclass(frozen=True)
class PackedHistory:
    """The real tokens of a left-padded (B, L) batch and the maps back to padded layouts.

    The packed matrices may end with ``spare`` rows after the N real tokens (``CPU_TOKEN_MULTIPLE``):
    token-wise layers run on them, attention leaves them out (their output is zero) and :meth:`unpack`
    drops them, so no real token depends on them.

    Attributes:
        token_index: (N + spare,) int64 flat index into the (B * L) padded batch of each packed token
            (a spare row reads index 0).
        positions: (N + spare,) int64 position of each token within its row (0 = the row's first real
            token), i.e. the RoPE position of the padded layout (0 on spare rows).
        last_token: (B,) int64 packed index of each row's last real token (its EOS), in the
            batch's row order.
        buckets: the attention buckets, in packed order.
        num_rows, length: the padded batch's B and L.
    """

    token_index: torch.Tensor
    positions: torch.Tensor
    last_token: torch.Tensor
    buckets: tuple[Bucket, ...]
    num_rows: int
    length: int
    spare: int = 0

    @classmethod
    def from_mask(cls, history_mask: torch.Tensor, bucket_rows: int | None = None,
                  token_multiple: int | None = None) -> "PackedHistory":
        """Builds the packing of a left-padded batch.

        Args:
            history_mask: (B, L) bool, True on real tokens; real tokens are right-aligned.
            bucket_rows: rows per attention bucket; default ``CPU_BUCKET_ROWS`` on CPU and
                the whole batch elsewhere.
            token_multiple: the packed rows are rounded up to a multiple of it with spare rows;
                default :func:`default_token_multiple`.
        """
        num_rows, length = history_mask.shape
        device = history_mask.device
        if bucket_rows is None:
            bucket_rows = CPU_BUCKET_ROWS if device.type == "cpu" else max(1, num_rows)
        if token_multiple is None:
            token_multiple = default_token_multiple(device)
        lengths = history_mask.sum(dim=1)                                      # (B,)
        order = lengths.argsort(descending=True, stable=True)                  # (B,) longest first
        sorted_lengths = lengths[order]
        host_lengths = sorted_lengths.tolist()  # host sync: bucket sizes decide tensor shapes
        num_tokens = sum(host_lengths)
        # token j of sorted row i: its row, its position within the row, its padded column
        row_of_token = torch.repeat_interleave(torch.arange(num_rows, device=device), sorted_lengths)  # (N,)
        row_start = torch.cumsum(sorted_lengths, 0) - sorted_lengths             # (B,) packed offset
        positions = torch.arange(num_tokens, device=device) - row_start[row_of_token]           # (N,)
        token_length = sorted_lengths[row_of_token]                              # (N,)
        token_index = order[row_of_token] * length + (length - token_length) + positions
        last_token = torch.empty_like(order)
        last_token[order] = row_start + sorted_lengths - 1
        offsets = list(itertools.accumulate(host_lengths, initial=0))  # offsets[i]: first token of sorted row i
        buckets = []
        for first in range(0, num_rows, bucket_rows):
            last = min(first + bucket_rows, num_rows)
            start, end = offsets[first], offsets[last]
            bucket_length = max(1, host_lengths[first])  # rows are sorted: the first is the longest
            local_row = row_of_token[start:end] - first
            local_length = token_length[start:end]
            scatter = local_row * bucket_length + (bucket_length - local_length) + positions[start:end]
            columns = torch.arange(bucket_length, device=device)
            key_mask = columns[None, :] >= bucket_length - sorted_lengths[first:last, None]   # (b, l)
            buckets.append(Bucket(start, end, last - first, bucket_length, scatter, key_mask))
        spare = -num_tokens % token_multiple
        if spare:
            token_index = torch.cat([token_index, token_index.new_zeros(spare)])
            positions = torch.cat([positions, positions.new_zeros(spare)])
        return cls(token_index, positions, last_token, tuple(buckets), num_rows, length, spare)

    @property
    def num_tokens(self) -> int:
        """N, the real tokens (the packed matrices have ``spare`` more rows)."""
        return self.token_index.shape[0] - self.spare

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) in the batch's padded layout -> (N + spare, ...) real tokens in packed order."""
        return padded.reshape(self.num_rows * self.length, *padded.shape[2:]).index_select(0, self.token_index)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(N + spare, ...) -> (B, L, ...) in the batch's padded layout, zeros on PAD (spare rows dropped)."""
        real = self.num_tokens
        padded = packed.new_zeros((self.num_rows * self.length, *packed.shape[1:])).index_copy_(
            0, self.token_index[:real], packed[:real])
        return padded.view(self.num_rows, self.length, *packed.shape[1:])


def attend_in_buckets(packing: PackedHistory, qkv: torch.Tensor, num_heads: int, head_dim: int,
                      attend) -> torch.Tensor:
    """Runs attention bucket by bucket on packed query/key/value projections.

    Args:
        packing: the batch's packing.
        qkv: (N, 3 * num_heads * head_dim) packed [q | k | v] projections.
        attend: ``attend(bucket_index, q, k, v) -> out``, all (b, heads, l, head_dim) for the
            bucket's b rows padded to length l; padding queries' outputs are dropped.

    Returns:
        (N + spare, num_heads * head_dim) attention outputs in packed order (zeros on spare rows).
    """
    outputs = []
    # one split, not a slice per bucket: a slice's backward writes its gradient into zeros of the whole
    # (N, 3 * inner) input, so k buckets cost k full-size fills and k - 1 full-size additions (~10% of a
    # CE training step with 8 buckets); the split's backward concatenates the buckets' gradients once
    parts = qkv.split([bucket.end - bucket.start for bucket in packing.buckets] + [packing.spare])
    for index, (bucket, part) in enumerate(zip(packing.buckets, parts)):
        shape = (bucket.num_rows, bucket.length, 3, num_heads, head_dim)
        q, k, v = bucket.unpack(part).view(shape).permute(2, 0, 3, 1, 4).unbind(0)   # (b, H, l, dh) each
        out = attend(index, q, k, v)                                                  # (b, H, l, dh)
        outputs.append(bucket.pack(out.transpose(1, 2).reshape(bucket.num_rows, bucket.length, -1)))
    if packing.spare:
        outputs.append(outputs[-1].new_zeros((packing.spare, num_heads * head_dim)))
    return torch.cat(outputs)                                                         # (N + spare, H*dh)


def row_groups(mask: torch.Tensor, rows: int = CPU_BUCKET_ROWS) -> tuple[tuple[int, int, int], ...] | None:
    """Consecutive groups of ``rows`` rows of a left-padded (B, L) mask and the first column any row of the
    group has a real token in: ``(first_row, end_row, first_column)`` each, or None where no group can skip
    a column, or off a CPU (an accelerator takes the batch in one kernel).

    The decoder's attention over a group's history needs only columns ``first_column:`` (the rest are
    padding for all of its rows): with the rows of a batch in order of history length (``training/steps.py``
    orders every micro-batch so), the groups skip most of the padding. A random Office batch of 128 pads to
    ~81 tokens while the mean is ~33 (groups of 32 compute 51% of the columns), and a pairwise decoder step's
    (B, H, (1 + N) t, L) scores are its largest tensor.
    """
    if mask.device.type != "cpu" or fused_active():  # under vmap the lengths cannot be read
        return None
    num_rows, width = mask.shape
    lengths = mask.sum(dim=1).tolist()
    groups = tuple((start, min(start + rows, num_rows), width - max(lengths[start:start + rows]))
                   for start in range(0, num_rows, rows))
    return groups if any(first > 0 for _, _, first in groups) else None


def in_row_groups(groups: tuple[tuple[int, int, int], ...] | None, num_rows: int,
                  function: Callable[[int, int, int], torch.Tensor]) -> torch.Tensor:
    """``function(first_row, end_row, first_column)`` for each of :func:`row_groups`' groups, its row-first
    outputs concatenated; for all rows and columns at once (``0, num_rows, 0``) when ``groups`` is None.
    ``function`` slices its row-first tensors to the rows and the history ones to the columns: the same
    values, without the columns every row of a group masks."""
    if groups is None:
        return function(0, num_rows, 0)
    return torch.cat([function(*group) for group in groups])
