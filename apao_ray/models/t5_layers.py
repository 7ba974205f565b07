"""T5 (v1.0) building blocks of the TIGER backbone: attention, feed-forward, layers, position buckets.

T5's math: RMS layer norm without bias, pre-norm residual blocks, unscaled dot-product attention
(T5 folds 1/sqrt(d) into the initialisation), relative position buckets shared by every layer of a
stack. :mod:`.tiger` wires them into the encoder-decoder and its shared-encoder decoding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .dropout import Dropout, attention, relu_dropout
from .packing import PackedHistory, attend_in_buckets, in_row_groups


def relative_position_bucket(relative_position: torch.Tensor, *, is_bidirectional: bool,
                             num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each (key - query) offset: exact below num_buckets/4, log-spaced above.

    Args:
        relative_position: (Q, K) int64 key position minus query position.

    Returns:
        (Q, K) int64 bucket ids in [0, num_buckets).
    """
    buckets = torch.zeros_like(relative_position)
    if is_bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        # future keys collapse into bucket 0; the causal mask hides them anyway
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    # clamp(min=1) only avoids log(0) on entries that the torch.where below discards
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


def padding_bias(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool mask -> (B, 1, 1, L) additive float bias: 0 on real tokens, float32 min on PAD."""
    bias = torch.zeros(mask.shape[0], 1, 1, mask.shape[1], device=mask.device)
    return bias.masked_fill(~mask[:, None, None, :], torch.finfo(bias.dtype).min)


@dataclass
class CrossSource:
    """What one decoder layer's cross-attention reads of a batch's encoder output.

    Either that layer's projected keys and values (``keys``/``values``), or the encoder output itself
    (``memory``), which the attention then reads through its weights (:meth:`Attention.cross`).

    Attributes:
        key_bias: (B, 1, 1, L) padding bias.
        keys, values: (B, H, L, dh), or None.
        memory: (B, L, d_model) encoder output, zeros on PAD; read when ``keys`` is None.
        row_groups: from :func:`.packing.row_groups`, or None: attend over all L columns in one product.
    """

    key_bias: torch.Tensor
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    memory: torch.Tensor | None = None
    row_groups: tuple[tuple[int, int, int], ...] | None = None


def absorbed_cost(num_rows: int, queries_per_row: int, num_tokens: int, key_len: int, d_model: int,
                  num_heads: int, head_dim: int) -> tuple[int, int]:
    """Multiply-adds of one layer's cross-attention forward: (projected keys/values, absorbed).

    Projected: keys and values of the ``num_tokens`` real history tokens (2 N d I), then per query
    its projection, scores, weighted values and output (2 I (L + d)); I = heads * head_dim. Absorbed:
    the per-head weight products once per batch (2 I d^2), then per query scores and weighted sums
    over the d-wide encoder output for every head (2 H d (L + d)). Few decoder queries per history
    (teacher-forced CE and APAO-pointwise: 4-5) favour absorbing; the pairwise loss's 1 + N
    candidates do not.
    """
    inner = num_heads * head_dim
    projected = 2 * num_tokens * d_model * inner + 2 * num_rows * queries_per_row * inner * (key_len + d_model)
    absorbed = 2 * inner * d_model ** 2 + 2 * num_rows * queries_per_row * num_heads * d_model * (key_len + d_model)
    return projected, absorbed


class RelativePositionBias(nn.Module):
    """One learned scalar per (bucket, head); computed once per stack and shared by its layers."""

    def __init__(self, num_heads: int, num_buckets: int, max_distance: int, is_bidirectional: bool):
        super().__init__()
        self.embedding = nn.Embedding(num_buckets, num_heads)
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.is_bidirectional = is_bidirectional

    def forward(self, query_len: int, key_len: int) -> torch.Tensor:
        """Returns the (1, heads, query_len, key_len) additive attention bias."""
        device = self.embedding.weight.device
        offset = torch.arange(key_len, device=device)[None, :] - torch.arange(query_len, device=device)[:, None]
        buckets = relative_position_bucket(offset, is_bidirectional=self.is_bidirectional,
                                           num_buckets=self.num_buckets, max_distance=self.max_distance)
        return self.embedding(buckets).permute(2, 0, 1).unsqueeze(0)           # (1, H, Q, K)


class Attention(nn.Module):
    """T5 multi-head attention: no biases, no 1/sqrt(d) scaling, inner size heads*head_dim."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, dropout: float):
        super().__init__()
        inner = num_heads * head_dim
        self.q, self.k, self.v = (nn.Linear(d_model, inner, bias=False) for _ in range(3))
        self.o = nn.Linear(inner, d_model, bias=False)
        self.num_heads, self.head_dim, self.dropout = num_heads, head_dim, dropout

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], self.num_heads, self.head_dim).transpose(1, 2)  # (N, H, S, dh)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # the additive bias must share q's dtype under autocast; -inf-like entries stay -inf
        return attention(q, k, v, bias.to(q.dtype), self.dropout, self.training)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Self-attention of (N, S, d_model) under a bias broadcastable to (N, H, S, S)."""
        q, k, v = (self.split_heads(proj(x)) for proj in (self.q, self.k, self.v))
        out = self.attend(q, k, v, bias)                                        # (N, H, S, dh)
        return self.o(out.transpose(1, 2).reshape(*x.shape[:2], -1))

    def forward_cached(self, x: torch.Tensor, bias: torch.Tensor, past_keys: torch.Tensor | None,
                       past_values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Self-attention of S new positions (N, S, d) against cached earlier ones and themselves.

        Args:
            bias: (1, H, S, t + S) the new queries' bias over all t + S positions (causal).
            past_keys, past_values: (N, H, t, dh) or None when t = 0.

        Returns:
            (N, S, d) output, and the (N, H, t + S, dh) keys and values including the new ones.
        """
        q, k, v = (self.split_heads(proj(x)) for proj in (self.q, self.k, self.v))   # (N, H, S, dh)
        if past_keys is not None:
            k, v = torch.cat([past_keys, k], dim=2), torch.cat([past_values, v], dim=2)
        out = self.attend(q, k, v, bias)                                        # (N, H, S, dh)
        return self.o(out.transpose(1, 2).reshape(*x.shape[:2], -1)), k, v

    def packed_self_attention(self, x: torch.Tensor, packing: PackedHistory,
                              biases: list[torch.Tensor]) -> torch.Tensor:
        """Self-attention of packed (N, d_model) tokens, attending within each bucket of rows.

        Args:
            biases: per bucket, the (b, H, l, l) additive bias (positions + key padding).
        """
        weight = torch.cat([self.q.weight, self.k.weight, self.v.weight])       # (3*inner, d)
        qkv = F.linear(x, weight)                                               # (N, 3*inner)
        out = attend_in_buckets(packing, qkv, self.num_heads, self.head_dim,
                                lambda index, q, k, v: self.attend(q, k, v, biases[index]))
        return self.o(out)                                                      # (N, d)

    def cross(self, x: torch.Tensor, source: CrossSource) -> torch.Tensor:
        """Cross-attention of the B*C candidates against their row's encoder output.

        Args:
            x: (B*C, S, d_model) decoder states, candidates of a row contiguous.
            source: the row's projected keys/values (B, H, L, dh), or its encoder output (absorbed).
        """
        if source.keys is None:
            return self.cross_absorbed(x, source.memory, source.key_bias, source.row_groups)
        num_rows = source.keys.shape[0]
        num_seqs, seq_len, _ = x.shape
        q = self.q(x).view(num_rows, -1, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, C*S, dh)
        keys, values, bias = source.keys, source.values, source.key_bias
        out = in_row_groups(source.row_groups, num_rows, lambda start, end, first: self.attend(
            q[start:end], keys[start:end, :, first:], values[start:end, :, first:], bias[start:end, ..., first:]))
        return self.o(out.transpose(1, 2).reshape(num_seqs, seq_len, -1))       # (B*C, S, d)

    def cross_absorbed(self, x: torch.Tensor, memory: torch.Tensor, key_bias: torch.Tensor,
                       groups: tuple[tuple[int, int, int], ...] | None = None) -> torch.Tensor:
        """:meth:`cross` reading the (B, L, d) encoder output itself: no keys or values are projected.

        Head h's scores are (x Wq_h^T)(m Wk_h^T)^T = (x Wq_h^T Wk_h) m^T and its contribution to the
        output (p m Wv_h^T) Wo_h^T = (p m)(Wo_h Wv_h)^T, so the two per-head weight products (d x d
        each) stand in for the keys and values: every head's queries attend over the encoder output
        as one d-wide head. The same function as the projected form (tests/test_packing.py); cheaper
        when a row has few queries (:func:`absorbed_cost`).
        """
        num_rows, key_len, d_model = memory.shape
        num_seqs, seq_len, _ = x.shape
        heads, head_dim = self.num_heads, self.head_dim
        with torch.autocast(x.device.type, enabled=False):  # the weight products in the weights' precision
            query_key = torch.einsum("hef,hei->hfi", self.k.weight.view(heads, head_dim, d_model),
                                     self.q.weight.view(heads, head_dim, d_model))  # (H, d, d): Wk_h^T Wq_h
            value_out = torch.einsum("ohe,hef->ohf", self.o.weight.view(d_model, heads, head_dim),
                                     self.v.weight.view(heads, head_dim, d_model))  # (d, H, d): Wo_h Wv_h
        # (B*C, S, H*d) -> (B, 1, C*S*H, d): a row's queries of every head as one head over the memory
        q = F.linear(x, query_key.reshape(heads * d_model, d_model)).view(num_rows, 1, -1, d_model)
        memory = memory.unsqueeze(1)                                            # (B, 1, L, d)
        out = in_row_groups(groups, num_rows, lambda start, end, first: self.attend(
            q[start:end], memory[start:end, :, first:], memory[start:end, :, first:],
            key_bias[start:end, ..., first:]))                                 # (B, 1, C*S*H, d)
        return F.linear(out.view(num_seqs, seq_len, heads * d_model), value_out.reshape(d_model, heads * d_model))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(relu_dropout(self.wi(x), self.dropout.p, self.training))


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int, head_dim: int, d_ff: int, dropout: float):
        super().__init__()
        self.attn_norm, self.ff_norm = nn.RMSNorm(d_model, eps=1e-6), nn.RMSNorm(d_model, eps=1e-6)
        self.attn = Attention(d_model, num_heads, head_dim, dropout)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), bias))
        return x + self.dropout(self.ff(self.ff_norm(x)))

    def forward_packed(self, x: torch.Tensor, packing: PackedHistory, biases: list[torch.Tensor]) -> torch.Tensor:
        """The same layer on packed (N, d) tokens; token-wise parts never see padding."""
        x = x + self.dropout(self.attn.packed_self_attention(self.attn_norm(x), packing, biases))
        return x + self.dropout(self.ff(self.ff_norm(x)))


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int, head_dim: int, d_ff: int, dropout: float):
        super().__init__()
        self.self_norm, self.cross_norm, self.ff_norm = (nn.RMSNorm(d_model, eps=1e-6) for _ in range(3))
        self.self_attn = Attention(d_model, num_heads, head_dim, dropout)
        self.cross_attn = Attention(d_model, num_heads, head_dim, dropout)
        self.ff = FeedForward(d_model, d_ff, dropout)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, self_bias: torch.Tensor, source: CrossSource) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.self_norm(x), self_bias))
        return self.cross_and_feed_forward(x, source)

    def step(self, x: torch.Tensor, self_bias: torch.Tensor, past_keys: torch.Tensor | None,
             past_values: torch.Tensor | None, source: CrossSource) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer on new positions only (N, S, d), reading the earlier ones' key/value cache."""
        out, self_keys, self_values = self.self_attn.forward_cached(self.self_norm(x), self_bias,
                                                                    past_keys, past_values)
        return self.cross_and_feed_forward(x + self.dropout(out), source), self_keys, self_values

    def cross_and_feed_forward(self, x: torch.Tensor, source: CrossSource) -> torch.Tensor:
        x = x + self.dropout(self.cross_attn.cross(self.cross_norm(x), source))
        return x + self.dropout(self.ff(self.ff_norm(x)))
