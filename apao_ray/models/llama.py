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
from .llama_layers import Block, Rotary, allowed_bias
from .packing import PackedHistory, row_groups


@dataclass
class LlamaContext:
    """The history's cache; built once per batch by :meth:`LlamaBackbone.encode`.

    Attributes:
        keys: per layer, (B, heads, L, head_dim) history keys after RoPE.
        values: per layer, (B, heads, L, head_dim) history values.
        key_mask: (B, L) bool, True on real history tokens.
        next_position: (B,) int64 RoPE position of the first prefix token (= real tokens).
        last_hidden: (B, d_model) final-normed hidden state of the last history token (EOS).
        row_groups: :func:`.packing.row_groups` of the rows, for the prefix attention; None: all columns.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    key_mask: torch.Tensor
    next_position: torch.Tensor
    last_hidden: torch.Tensor
    row_groups: tuple[tuple[int, int, int], ...] | None = None

    @property
    def num_rows(self) -> int:
        return self.key_mask.shape[0]

    def select_rows(self, rows: torch.Tensor) -> "LlamaContext":
        """The context of a subset (or reordering) of the B rows; ``rows`` is (B',) int64 (no row groups:
        the rows' lengths are no longer in order)."""
        return LlamaContext(tuple(k[rows] for k in self.keys), tuple(v[rows] for v in self.values),
                            self.key_mask[rows], self.next_position[rows], self.last_hidden[rows])


class LlamaBackbone(Backbone):
    """Decoder-only Llama; defaults are the paper's size (3.80M parameters at V=1027).

    ``pack_histories`` (:class:`.base.Backbone`; default: on a CPU) runs the history pass on its real tokens
    only (:mod:`.packing`); False runs the padded reference path, the same function at more cost.
    """


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
        bias = allowed_bias(causal & (attention_mask[:, None, None, :] | torch.eye(seq_len, dtype=torch.bool,
                                                                                   device=input_ids.device)))
        x = self.embedding(input_ids)                                           # (B, S, d)
        keys, values = [], []
        for block in self.blocks:
            out, k, v = block.attn(block.attn_norm(x), cos, sin, bias)
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
        if self.packs(history_mask.device):
            return self._encode_packed(history_ids, history_mask)
        hidden, keys, values = self._run(history_ids, history_mask)
        return LlamaContext(keys, values, history_mask, history_mask.long().sum(dim=1),
                            hidden[:, -1], row_groups(history_mask))             # EOS is column L-1

    def _encode_packed(self, history_ids: torch.Tensor, history_mask: torch.Tensor) -> LlamaContext:
        """:meth:`encode` on the real tokens only; the K/V cache is unpacked to (B, H, L, dh)."""
        packing = PackedHistory.from_mask(history_mask)
        cos, sin = (t.unsqueeze(1) for t in self.rotary(packing.positions))    # (N, 1, dh)
        biases = []
        for bucket in packing.buckets:
            eye = torch.eye(bucket.length, dtype=torch.bool, device=history_mask.device)
            causal = torch.ones_like(eye).tril()
            # a PAD query also sees itself, so its softmax row is never empty (no NaN to leak)
            biases.append(allowed_bias(causal & (bucket.key_mask[:, None, None, :] | eye)))  # (b, 1, l, l)
        x = self.embedding(packing.pack(history_ids))                           # (N, d)
        keys, values = [], []
        for block in self.blocks:
            out, k, v = block.attn.forward_packed(block.attn_norm(x), cos, sin, packing, biases)
            x = x + out
            x = x + block.mlp(block.mlp_norm(x))
            keys.append(packing.unpack(k).transpose(1, 2))                       # (B, H, L, dh)
            values.append(packing.unpack(v).transpose(1, 2))
        last_hidden = self.norm(x[packing.last_token])                          # (B, d) each row's EOS
        return LlamaContext(tuple(keys), tuple(values), history_mask, history_mask.long().sum(dim=1), last_hidden,
                            row_groups(history_mask))

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
        # row groups where a row has many candidates (the pairwise loss: 1.11x a step); CE's 4 queries per row
        # make scores too small for the groups' extra ops to pay (0.97x, RESULTS.md 2026-11-27)
        groups = context.row_groups if num_candidates > 1 else None
        for block, keys, values in zip(self.blocks, context.keys, context.values):
            x = x + block.attn.decode(block.attn_norm(x), cos, sin, keys, values, context.key_mask, groups)
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
