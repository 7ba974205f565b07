"""Llama backbone: a hand-written decoder-only transformer over semantic-ID tokens (SPEC §2).

One sequence per target is history tokens then the target's codes. ``encode`` runs the
history once and keeps every layer's keys (after RoPE) and values; ``decode`` runs only the
C candidates' prefix tokens, each attending to its row's shared history cache and causally to
its own earlier prefix tokens, in one softmax over both key sets. The history cache is read
by the row's C*t stacked queries, never copied per candidate.

Positions: rows are left-padded, so a token's RoPE position is cumsum(mask) - 1 (each row's
first real token is position 0) and the prefix continues at the row's number of real tokens.
Dropout (default 0) acts on attention probabilities only, as HF's ``attention_dropout``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import Backbone, DecodeCache, drop_history_eos
from .packing import PackedHistory, attend_in_buckets


@dataclass
class LlamaContext:
    """The history's cache; built once per batch by :meth:`LlamaBackbone.encode`.

    Attributes:
        keys: per layer, (B, heads, L, head_dim) history keys after RoPE.
        values: per layer, (B, heads, L, head_dim) history values.
        key_mask: (B, L) bool, True on real history tokens.
        next_position: (B,) int64 RoPE position of the first prefix token (= real tokens).
        last_hidden: (B, d_model) final-normed hidden state of the last history token (EOS).
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    key_mask: torch.Tensor
    next_position: torch.Tensor
    last_hidden: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.key_mask.shape[0]

    def select_rows(self, rows: torch.Tensor) -> "LlamaContext":
        """The context of a subset (or reordering) of the B rows; ``rows`` is (B',) int64."""
        return LlamaContext(tuple(k[rows] for k in self.keys), tuple(v[rows] for v in self.values),
                            self.key_mask[rows], self.next_position[rows], self.last_hidden[rows])


def softmax_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half-precision scores (they must normalise exactly), else x's own dtype."""
    return torch.promote_types(x.dtype, torch.float32)


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Full-sequence attention of (B, S, d); returns output and the (B, H, S, dh) K, V.

        Args:
            cos, sin: (B, 1, S, dh) rotary tables.
            allowed: (B, 1, S, S) bool, True where a query may attend to a key.
        """
        batch, seq_len, _ = x.shape
        q, k, v = (p(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))            # (B, H, S, dh)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1)), k, v

    def forward_packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packing: PackedHistory,
                       allowed: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward` on packed (N, d) tokens, attending within each bucket of rows.

        Args:
            cos, sin: (N, 1, dh) rotary tables of the tokens' positions.
            allowed: per bucket, (b, 1, l, l) bool, True where a query may attend to a key.

        Returns:
            (N, d) output and the packed (N, H, dh) keys (after RoPE) and values.
        """
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])  # (3*inner, d)
        q, k, v = F.linear(x, weight).view(-1, 3, self.num_heads, self.head_dim).unbind(1)  # (N, H, dh)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        dropout = self.dropout if self.training else 0.0
        out = attend_in_buckets(packing, torch.stack([q, k, v], dim=1).flatten(1), self.num_heads, self.head_dim,
                                lambda index, qb, kb, vb: F.scaled_dot_product_attention(
                                    qb, kb, vb, attn_mask=allowed[index], dropout_p=dropout))
        return self.o_proj(out), k, v

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """Prefix attention: C candidates per row against the row's history cache and themselves.

        Args:
            x: (B, C, t, d) prefix states.
            cos, sin: (B, 1, 1, t, dh) rotary tables of the prefix positions.
            keys, values: (B, H, L, dh) history cache; key_mask: (B, L) bool.

        Returns:
            (B, C, t, d) attention output.
        """
        batch, num_candidates, prefix_len, _ = x.shape
        heads, head_dim = self.num_heads, self.head_dim
        q, k, v = (p(x).view(batch, num_candidates, prefix_len, heads, head_dim).permute(0, 3, 1, 2, 4)
                   for p in (self.q_proj, self.k_proj, self.v_proj))            # (B, H, C, t, dh)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        scale = head_dim ** -0.5
        q_rows = q.reshape(batch, heads, num_candidates * prefix_len, head_dim)  # (B, H, C*t, dh)
        history_scores = (q_rows @ keys.transpose(-1, -2)) * scale              # (B, H, C*t, L)
        history_scores = history_scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        own_scores = (q @ k.transpose(-1, -2)) * scale                          # (B, H, C, t, t)
        causal = torch.ones(prefix_len, prefix_len, dtype=torch.bool, device=x.device).tril()
        own_scores = own_scores.masked_fill(~causal, float("-inf"))
        own_scores = own_scores.reshape(batch, heads, num_candidates * prefix_len, prefix_len)
        # one softmax over history and own keys; at least float32 so bf16 scores normalise exactly
        probs = torch.cat([history_scores, own_scores], dim=-1).to(softmax_dtype(v)).softmax(dim=-1).to(v.dtype)
        probs = F.dropout(probs, self.dropout, self.training)
        history_probs, own_probs = probs.split([keys.shape[2], prefix_len], dim=-1)
        out = history_probs @ values                                             # (B, H, C*t, dh)
        own_probs = own_probs.view(batch, heads, num_candidates, prefix_len, prefix_len)
        out = out.view_as(q) + own_probs @ v                                     # (B, H, C, t, dh)
        out = out.permute(0, 2, 3, 1, 4).reshape(batch, num_candidates, prefix_len, heads * head_dim)
        return self.o_proj(out)


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


class LlamaBackbone(Backbone):
    """Decoder-only Llama; defaults are the paper's size (3.80M parameters at V=1027).

    ``pack_histories`` (default True) runs the history pass on its real tokens only
    (:mod:`.packing`); False runs the padded reference path, the same function at more cost.
    """

    pack_histories: bool = True

    def __init__(self, vocab_size: int, num_levels: int, d_model: int = 128, num_layers: int = 8,
                 num_heads: int = 8, head_dim: int = 16, d_ff: int = 1024, dropout: float = 0.0,
                 rope_theta: float = 500000.0, norm_eps: float = 1e-5, history_eos: bool = True):
        super().__init__()
        self.vocab_size, self.num_levels = vocab_size, num_levels
        self.history_eos = history_eos  # False: the released code's layout, target right after the history
        self.embedding = nn.Embedding(vocab_size, d_model)  # tied with the LM head
        self.blocks = nn.ModuleList(Block(d_model, num_heads, head_dim, d_ff, dropout, norm_eps)
                                    for _ in range(num_layers))
        self.norm = nn.RMSNorm(d_model, eps=norm_eps)
        self.rotary = Rotary(head_dim, rope_theta)
        for name, param in self.named_parameters():
            if not name.endswith("norm.weight"):
                nn.init.normal_(param, std=0.02)  # HF Llama's initializer_range

    def forward(self, history_ids: torch.Tensor, history_mask: torch.Tensor,
                candidates: torch.Tensor) -> torch.Tensor:
        """``candidate_logits`` as ``forward``, so DDP's gradient hooks see the call."""
        return self.candidate_logits(history_ids, history_mask, candidates)

    def _run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """Causal pass over left-padded (B, S) tokens -> final-normed (B, S, d), per-layer K, V."""
        seq_len = input_ids.shape[1]
        positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)     # (B, S)
        cos, sin = (t.unsqueeze(1) for t in self.rotary(positions))             # (B, 1, S, dh)
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=input_ids.device).tril()
        # a PAD query also sees itself, so its softmax row is never empty (no NaN to leak)
        allowed = causal & (attention_mask[:, None, None, :] | torch.eye(seq_len, dtype=torch.bool,
                                                                         device=input_ids.device))
        x = self.embedding(input_ids)                                           # (B, S, d)
        keys, values = [], []
        for block in self.blocks:
            out, k, v = block.attn(block.attn_norm(x), cos, sin, allowed)
            x = x + out
            x = x + block.mlp(block.mlp_norm(x))
            keys.append(k)
            values.append(v)
        return self.norm(x), tuple(keys), tuple(values)

    def forward_full(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Reference path (tests only): plain causal LM logits (B, S, V) of a left-padded sequence."""
        hidden, _, _ = self._run(input_ids, attention_mask)
        return F.linear(hidden, self.embedding.weight)

    def encode(self, history_ids: torch.Tensor, history_mask: torch.Tensor) -> LlamaContext:
        """Runs the history once and keeps its K/V cache.

        Args:
            history_ids: (B, L) tokens, left-padded with PAD, ending with EOS.
            history_mask: (B, L) bool, True on real tokens.
        """
        if not self.history_eos:
            history_ids, history_mask = drop_history_eos(history_ids, history_mask)
        if self.pack_histories:
            return self._encode_packed(history_ids, history_mask)
        hidden, keys, values = self._run(history_ids, history_mask)
        return LlamaContext(keys, values, history_mask, history_mask.long().sum(dim=1),
                            hidden[:, -1])                                       # EOS is column L-1

    def _encode_packed(self, history_ids: torch.Tensor, history_mask: torch.Tensor) -> LlamaContext:
        """:meth:`encode` on the real tokens only; the K/V cache is unpacked to (B, H, L, dh)."""
        packing = PackedHistory.from_mask(history_mask)
        cos, sin = (t.unsqueeze(1) for t in self.rotary(packing.positions))    # (N, 1, dh)
        allowed = []
        for bucket in packing.buckets:
            eye = torch.eye(bucket.length, dtype=torch.bool, device=history_mask.device)
            causal = torch.ones_like(eye).tril()
            # a PAD query also sees itself, so its softmax row is never empty (no NaN to leak)
            allowed.append(causal & (bucket.key_mask[:, None, None, :] | eye))  # (b, 1, l, l)
        x = self.embedding(packing.pack(history_ids))                           # (N, d)
        keys, values = [], []
        for block in self.blocks:
            out, k, v = block.attn.forward_packed(block.attn_norm(x), cos, sin, packing, allowed)
            x = x + out
            x = x + block.mlp(block.mlp_norm(x))
            keys.append(packing.unpack(k).transpose(1, 2))                       # (B, H, L, dh)
            values.append(packing.unpack(v).transpose(1, 2))
        last_hidden = self.norm(x[packing.last_token])                          # (B, d) each row's EOS
        return LlamaContext(tuple(keys), tuple(values), history_mask, history_mask.long().sum(dim=1), last_hidden)

    def decode(self, context: LlamaContext, prefix: torch.Tensor) -> torch.Tensor:
        """Logits for C candidate prefixes per row sharing the row's history cache.

        Args:
            context: from :meth:`encode` on the same B rows.
            prefix: (B, C, t) code tokens, t >= 0.

        Returns:
            (B, C, t + 1, V) logits; position 0 comes from the history's last hidden state,
            position j > 0 from prefix token j-1.
        """
        batch, num_candidates, prefix_len = prefix.shape
        first = F.linear(context.last_hidden, self.embedding.weight)            # (B, V)
        first = first[:, None, None, :].expand(batch, num_candidates, 1, self.vocab_size)
        if prefix_len == 0:
            return first.contiguous()  # callers may write into logits (masking); no shared storage
        positions = context.next_position[:, None] + torch.arange(prefix_len, device=prefix.device)
        cos, sin = (t[:, None, None] for t in self.rotary(positions))           # (B, 1, 1, t, dh)
        x = self.embedding(prefix)                                              # (B, C, t, d)
        for block, keys, values in zip(self.blocks, context.keys, context.values):
            x = x + block.attn.decode(block.attn_norm(x), cos, sin, keys, values, context.key_mask)
            x = x + block.mlp(block.mlp_norm(x))
        rest = F.linear(self.norm(x), self.embedding.weight)                    # (B, C, t, V)
        return torch.cat([first.to(rest.dtype), rest], dim=2)                   # (B, C, t+1, V)

    def decode_step(self, context: LlamaContext, cache: DecodeCache | None) -> tuple[torch.Tensor, DecodeCache]:
        """:meth:`Backbone.decode_step` with a per-candidate key/value cache of prefix tokens.

        Position 0 reads the history's last hidden state; position t >= 1 runs only prefix
        token t-1 (the newest in ``cache.prefix``), at RoPE position ``next_position + t - 1``.
        """
        if cache is None:
            prefix = torch.empty(context.num_rows, 1, 0, dtype=torch.long, device=context.key_mask.device)
            return F.linear(context.last_hidden, self.embedding.weight)[:, None], DecodeCache(prefix)
        prefix = cache.prefix
        position = context.next_position + prefix.shape[2] - 1                  # (B,)
        cos, sin = (t[:, None, None, :] for t in self.rotary(position))         # (B, 1, 1, dh)
        x = self.embedding(prefix[..., -1])                                     # (B, C, d)
        new_keys, new_values = [], []
        for index, (block, keys, values) in enumerate(zip(self.blocks, context.keys, context.values)):
            past_keys = cache.keys[index] if cache.keys else None
            past_values = cache.values[index] if cache.values else None
            out, own_keys, own_values = block.attn.decode_step(block.attn_norm(x), cos, sin, keys, values,
                                                               context.key_mask, past_keys, past_values)
            x = x + out
            x = x + block.mlp(block.mlp_norm(x))
            new_keys.append(own_keys)
            new_values.append(own_values)
        logits = F.linear(self.norm(x), self.embedding.weight)                  # (B, C, V)
        return logits, DecodeCache(prefix, tuple(new_keys), tuple(new_values))
