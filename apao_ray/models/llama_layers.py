"""Llama building blocks: rotary position embedding, attention over a shared history cache, the MLP.

``Attention`` has three paths over the same weights: the full causal sequence (and its packed
form), and prefix decoding where C candidates per row attend to the row's history cache and
causally to their own tokens in one softmax. :mod:`.llama` wires them into the backbone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .dropout import attention
from .packing import PackedHistory, attend_in_buckets, in_row_groups


def softmax_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half-precision scores (they must normalise exactly), else x's own dtype."""
    return torch.promote_types(x.dtype, torch.float32)


def allowed_bias(allowed: torch.Tensor) -> torch.Tensor:
    """A bool mask (True where a query may attend to a key) -> the additive float32 bias
    :func:`.dropout.attention` takes: 0 where allowed, float32's minimum elsewhere."""
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Rotary(nn.Module):
    """RoPE tables for arbitrary integer positions (HF Llama's rotate-half convention)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # not a parameter: DDP ignores it

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(...) int64 positions -> cos, sin of shape (..., head_dim), float32."""
        angles = positions.float()[..., None] * self.inv_freq.float()           # (..., dh/2)
        angles = torch.cat([angles, angles], dim=-1)                             # (..., dh)
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # rotate in float32 (bf16 angles lose the low frequencies), return in x's dtype
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, head_dim: int, dropout: float):
        super().__init__()
        inner = num_heads * head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_model, inner, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(inner, d_model, bias=False)
        self.num_heads, self.head_dim, self.dropout = num_heads, head_dim, dropout

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # the additive bias must share q's dtype under autocast (SDPA on a GPU)
        return attention(q, k, v, bias.to(q.dtype), self.dropout, self.training, scale=self.head_dim ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full-sequence attention of (B, S, d); returns output and the (B, H, S, dh) K, V.

        Args:
            cos, sin: (B, 1, S, dh) rotary tables.
            bias: (B, 1, S, S) :func:`allowed_bias` of where a query may attend to a key.
        """
        batch, seq_len, _ = x.shape
        q, k, v = (p(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))            # (B, H, S, dh)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attend(q, k, v, bias)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1)), k, v

    def forward_packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packing: PackedHistory,
                       biases: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward` on packed (N, d) tokens, attending within each bucket of rows.

        Args:
            cos, sin: (N, 1, dh) rotary tables of the tokens' positions.
            biases: per bucket, (b, 1, l, l) :func:`allowed_bias` of where a query may attend to a key.

        Returns:
            (N, d) output and the packed (N, H, dh) keys (after RoPE) and values.
        """
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])  # (3*inner, d)
        q, k, v = F.linear(x, weight).view(-1, 3, self.num_heads, self.head_dim).unbind(1)  # (N, H, dh)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend_in_buckets(packing, torch.stack([q, k, v], dim=1).flatten(1), self.num_heads, self.head_dim,
                                lambda index, qb, kb, vb: self.attend(qb, kb, vb, biases[index]))
        return self.o_proj(out), k, v

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, key_mask: torch.Tensor,
               groups: tuple[tuple[int, int, int], ...] | None = None) -> torch.Tensor:
        """Prefix attention: C candidates per row against the row's history cache and themselves.

        Args:
            x: (B, C, t, d) prefix states.
            cos, sin: (B, 1, 1, t, dh) rotary tables of the prefix positions.
            keys, values: (B, H, L, dh) history cache; key_mask: (B, L) bool.
            groups: :func:`.packing.row_groups` of the rows (each group reads only its history columns), or None.

        Returns:
            (B, C, t, d) attention output.
        """
        batch, num_candidates, prefix_len, _ = x.shape
        heads, head_dim = self.num_heads, self.head_dim
        q, k, v = (p(x).view(batch, num_candidates, prefix_len, heads, head_dim).permute(0, 3, 1, 2, 4)
                   for p in (self.q_proj, self.k_proj, self.v_proj))            # (B, H, C, t, dh)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        causal = torch.ones(prefix_len, prefix_len, dtype=torch.bool, device=x.device).tril()
        out = in_row_groups(groups, batch, lambda start, end, first: self._prefix_attention(
            q[start:end], k[start:end], v[start:end], keys[start:end, :, first:], values[start:end, :, first:],
            key_mask[start:end, first:], causal))                               # (B, H, C, t, dh)
        out = out.permute(0, 2, 3, 1, 4).reshape(batch, num_candidates, prefix_len, heads * head_dim)
        return self.o_proj(out)

    def _prefix_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor, key_mask: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        """:meth:`decode`'s attention of (b, H, C, t, dh) prefix queries over (b, H, l, dh) history keys and their
        own (causal) keys in one softmax: (b, H, C, t, dh)."""
        rows, heads, num_candidates, prefix_len, head_dim = q.shape
        scale = head_dim ** -0.5
        q_rows = q.reshape(rows, heads, num_candidates * prefix_len, head_dim)   # (b, H, C*t, dh)
        history_scores = (q_rows @ keys.transpose(-1, -2)) * scale              # (b, H, C*t, l)
        history_scores = history_scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        own_scores = (q @ k.transpose(-1, -2)) * scale                          # (b, H, C, t, t)
        own_scores = own_scores.masked_fill(~causal, float("-inf"))
        own_scores = own_scores.reshape(rows, heads, num_candidates * prefix_len, prefix_len)
        # one softmax over history and own keys; at least float32 so bf16 scores normalise exactly
        probs = torch.cat([history_scores, own_scores], dim=-1).to(softmax_dtype(v)).softmax(dim=-1).to(v.dtype)
        probs = F.dropout(probs, self.dropout, self.training)
        history_probs, own_probs = probs.split([keys.shape[2], prefix_len], dim=-1)
        out = history_probs @ values                                             # (b, H, C*t, dh)
        own_probs = own_probs.view(rows, heads, num_candidates, prefix_len, prefix_len)
        return out.view_as(q) + own_probs @ v                                    # (b, H, C, t, dh)

    def decode_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, key_mask: torch.Tensor, past_keys: torch.Tensor | None,
                    past_values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The newest prefix token of C candidates per row against history + own earlier tokens.

        Args:
            x: (B, C, d) the newest token's states; cos, sin: (B, 1, 1, dh) its rotary tables.
            keys, values: (B, H, L, dh) history cache; key_mask: (B, L) bool.
            past_keys, past_values: (B, C, H, t, dh) earlier prefix tokens (after RoPE), or None.

        Returns:
            (B, C, d) output and the (B, C, H, t + 1, dh) own keys and values.
        """
        batch, num_candidates, _ = x.shape
        q, k, v = (p(x).view(batch, num_candidates, self.num_heads, self.head_dim)
                   for p in (self.q_proj, self.k_proj, self.v_proj))           # (B, C, H, dh)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k, v = k.unsqueeze(3), v.unsqueeze(3)                                   # (B, C, H, 1, dh)
        if past_keys is not None:
            k, v = torch.cat([past_keys, k], dim=3), torch.cat([past_values, v], dim=3)
        scale = self.head_dim ** -0.5
        q_heads = q.transpose(1, 2)                                              # (B, H, C, dh)
        history_scores = (q_heads @ keys.transpose(-1, -2)) * scale             # (B, H, C, L)
        history_scores = history_scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        own_scores = (q.unsqueeze(3) @ k.transpose(-1, -2)).squeeze(3).transpose(1, 2) * scale  # (B, H, C, t+1)
        # one softmax over history and own keys; at least float32 so bf16 scores normalise exactly
        probs = torch.cat([history_scores, own_scores], dim=-1).to(softmax_dtype(v)).softmax(dim=-1).to(v.dtype)
        history_probs, own_probs = probs.split([keys.shape[2], own_scores.shape[-1]], dim=-1)
        out = history_probs @ values                                             # (B, H, C, dh)
        own = (own_probs.transpose(1, 2).unsqueeze(3) @ v).squeeze(3)             # (B, C, H, dh)
        out = out.transpose(1, 2) + own                                          # (B, C, H, dh)
        return self.o_proj(out.reshape(batch, num_candidates, -1)), k, v


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int, head_dim: int, d_ff: int, dropout: float, eps: float):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d_model, eps=eps), nn.RMSNorm(d_model, eps=eps)
        self.attn = Attention(d_model, num_heads, head_dim, dropout)
        self.mlp = MLP(d_model, d_ff)
