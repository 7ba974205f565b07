"""TIGER backbone: a hand-written T5 (v1.0) encoder-decoder over semantic-ID tokens (SPEC §2).

Written by hand rather than taken from ``transformers`` because the C candidates of a row
(1 + N negatives, K beams, every catalog item) share one encoder pass: each decoder layer's
cross-attention keys/values are computed once in ``encode`` and read by the row's C*(t+1)
stacked queries, so the encoder output is never copied per candidate. The math is T5's:
RMS layer norm without bias, pre-norm residual blocks, unscaled dot-product attention (T5
folds 1/sqrt(d) into the initialisation), relative position buckets shared by every layer of
a stack, and a tied LM head on the decoder output scaled by d_model**-0.5.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..data.catalog import BOS_TOKEN
from .base import Backbone, DecodeCache
from .dropout import Dropout, attention
from .packing import PackedHistory, attend_in_buckets


@dataclass
class TigerContext:
    """What the decoder reads; built once per batch by :meth:`TigerBackbone.encode`.

    Attributes:
        key_bias: (B, 1, 1, L) float, 0 on real history tokens, -inf-like on PAD.
        cross_keys: per decoder layer, (B, heads, L, head_dim) cross-attention keys.
        cross_values: per decoder layer, (B, heads, L, head_dim) cross-attention values.
    """

    key_bias: torch.Tensor
    cross_keys: tuple[torch.Tensor, ...]
    cross_values: tuple[torch.Tensor, ...]

    @property
    def num_rows(self) -> int:
        return self.key_bias.shape[0]

    def select_rows(self, rows: torch.Tensor) -> "TigerContext":
        """The context of a subset (or reordering) of the B rows; ``rows`` is (B',) int64."""
        return TigerContext(self.key_bias[rows], tuple(k[rows] for k in self.cross_keys),
                            tuple(v[rows] for v in self.cross_values))


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

    def cross(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        """Cross-attention of the B*C candidates against their row's cached keys/values.

        Args:
            x: (B*C, S, d_model) decoder states, candidates of a row contiguous.
            keys, values: (B, H, L, dh) from :meth:`TigerBackbone.encode`.
            key_bias: (B, 1, 1, L) padding bias.
        """
        num_rows = keys.shape[0]
        num_seqs, seq_len, _ = x.shape
        q = self.q(x).view(num_rows, -1, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, C*S, dh)
        out = self.attend(q, keys, values, key_bias)                            # (B, H, C*S, dh)
        return self.o(out.transpose(1, 2).reshape(num_seqs, seq_len, -1))       # (B*C, S, d)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.dropout(F.relu(self.wi(x))))


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

    def forward(self, x: torch.Tensor, self_bias: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.self_norm(x), self_bias))
        return self.cross_and_feed_forward(x, keys, values, key_bias)

    def step(self, x: torch.Tensor, self_bias: torch.Tensor, past_keys: torch.Tensor | None,
             past_values: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
             key_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer on new positions only (N, S, d), reading the earlier ones' key/value cache."""
        out, self_keys, self_values = self.self_attn.forward_cached(self.self_norm(x), self_bias,
                                                                    past_keys, past_values)
        return self.cross_and_feed_forward(x + self.dropout(out), keys, values, key_bias), self_keys, self_values

    def cross_and_feed_forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                               key_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.cross_attn.cross(self.cross_norm(x), keys, values, key_bias))
        return x + self.dropout(self.ff(self.ff_norm(x)))


class TigerBackbone(Backbone):
    """T5-style encoder-decoder; defaults are the paper's size (4.59M parameters at V=1027).

    ``pack_histories`` (default True) runs the encoder on the histories' real tokens only
    (:mod:`.packing`); False runs the padded reference path, the same function at more cost.
    """

    pack_histories: bool = True

    def __init__(self, vocab_size: int, num_levels: int, d_model: int = 128, num_layers: int = 4,
                 num_heads: int = 6, head_dim: int = 64, d_ff: int = 1024, dropout: float = 0.1,
                 num_buckets: int = 32, max_distance: int = 128):
        super().__init__()
        self.vocab_size, self.num_levels, self.d_model = vocab_size, num_levels, d_model
        self.embedding = nn.Embedding(vocab_size, d_model)  # encoder, decoder and LM head
        layer_args = (d_model, num_heads, head_dim, d_ff, dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(*layer_args) for _ in range(num_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(*layer_args) for _ in range(num_layers))
        self.encoder_bias = RelativePositionBias(num_heads, num_buckets, max_distance, is_bidirectional=True)
        self.decoder_bias = RelativePositionBias(num_heads, num_buckets, max_distance, is_bidirectional=False)
        self.encoder_norm, self.decoder_norm = nn.RMSNorm(d_model, eps=1e-6), nn.RMSNorm(d_model, eps=1e-6)
        self.dropout = Dropout(dropout)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """T5's initialisation (HF ``T5PreTrainedModel._init_weights``, factor 1)."""
        d = self.d_model
        if isinstance(module, Attention):
            inner = module.num_heads * module.head_dim
            nn.init.normal_(module.q.weight, std=(d * module.head_dim) ** -0.5)
            nn.init.normal_(module.k.weight, std=d ** -0.5)
            nn.init.normal_(module.v.weight, std=d ** -0.5)
            nn.init.normal_(module.o.weight, std=inner ** -0.5)
        elif isinstance(module, FeedForward):
            nn.init.normal_(module.wi.weight, std=d ** -0.5)
            nn.init.normal_(module.wo.weight, std=module.wi.out_features ** -0.5)
        elif isinstance(module, RelativePositionBias):
            nn.init.normal_(module.embedding.weight, std=d ** -0.5)
        elif module is self:
            nn.init.normal_(self.embedding.weight, std=1.0)

    def forward(self, history_ids: torch.Tensor, history_mask: torch.Tensor,
                candidates: torch.Tensor) -> torch.Tensor:
        """``candidate_logits`` as ``forward``, so DDP's gradient hooks see the call."""
        return self.candidate_logits(history_ids, history_mask, candidates)

    def encode(self, history_ids: torch.Tensor, history_mask: torch.Tensor) -> TigerContext:
        """Runs the encoder once and every decoder layer's cross-attention K/V projection.

        Args:
            history_ids: (B, L) tokens, left-padded with PAD, ending with EOS.
            history_mask: (B, L) bool, True on real tokens.
        """
        key_bias = padding_bias(history_mask)                                  # (B, 1, 1, L)
        if self.pack_histories:
            packing = PackedHistory.from_mask(history_mask)
            biases = [self.encoder_bias(b.length, b.length) + padding_bias(b.key_mask) for b in packing.buckets]
            x = self.dropout(self.embedding(packing.pack(history_ids)))          # (N, d)
            for layer in self.encoder_layers:
                x = layer.forward_packed(x, packing, biases)
            x = self.dropout(self.encoder_norm(x))
            # every decoder layer's cross K and V in one matmul, unpacked once: (B, L, layers*2*inner)
            weight = torch.cat([w for layer in self.decoder_layers
                                for w in (layer.cross_attn.k.weight, layer.cross_attn.v.weight)])
            projected = packing.unpack(F.linear(x, weight)).chunk(2 * len(self.decoder_layers), dim=-1)
            split = self.decoder_layers[0].cross_attn.split_heads
            return self._evaluated(TigerContext(key_bias, tuple(split(p) for p in projected[0::2]),
                                                tuple(split(p) for p in projected[1::2])))  # K/V: (B, H, L, dh)
        length = history_ids.shape[1]
        # relative offsets are unchanged by left padding, so column indices serve as positions
        bias = self.encoder_bias(length, length) + key_bias                     # (B, H, L, L)
        x = self.dropout(self.embedding(history_ids))                           # (B, L, d)
        for layer in self.encoder_layers:
            x = layer(x, bias)
        x = self.dropout(self.encoder_norm(x))
        keys = tuple(layer.cross_attn.split_heads(layer.cross_attn.k(x)) for layer in self.decoder_layers)
        values = tuple(layer.cross_attn.split_heads(layer.cross_attn.v(x)) for layer in self.decoder_layers)
        return self._evaluated(TigerContext(key_bias, keys, values))            # K/V: (B, H, L, dh)

    def _evaluated(self, context: TigerContext) -> TigerContext:
        """In bf16 evaluation on a CPU, the cross-attention keys in float32, once per batch: the attention
        takes its scores in float32 (models/dropout.attention), and a beam's every decoder step reads them."""
        keys = context.cross_keys
        if self.training or keys[0].device.type != "cpu" or keys[0].dtype != torch.bfloat16:
            return context
        return TigerContext(context.key_bias, tuple(k.float() for k in keys), context.cross_values)

    def decode(self, context: TigerContext, prefix: torch.Tensor) -> torch.Tensor:
        """Logits of [BOS] + prefix for C candidates per row sharing the row's context.

        Args:
            context: from :meth:`encode` on the same B rows.
            prefix: (B, C, t) code tokens, t >= 0.

        Returns:
            (B, C, t + 1, V) logits; position j predicts code j from prefix[..., :j].
        """
        num_rows, num_candidates, prefix_len = prefix.shape
        seq_len = prefix_len + 1
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=prefix.device).tril()
        self_bias = self.decoder_bias(seq_len, seq_len).masked_fill(~causal, float("-inf"))  # (1, H, t+1, t+1)
        if num_candidates > 1 and prefix_len > 0:
            return self._decode_shared_start(context, prefix, self_bias)
        bos = prefix.new_full((num_rows, num_candidates, 1), BOS_TOKEN)
        tokens = torch.cat([bos, prefix], dim=-1).view(num_rows * num_candidates, seq_len)  # (B*C, t+1)
        x = self.dropout(self.embedding(tokens))                                # (B*C, t+1, d)
        for layer, keys, values in zip(self.decoder_layers, context.cross_keys, context.cross_values):
            x = layer(x, self_bias, keys, values, context.key_bias)
        logits = self.lm_head(x)                                                # (B*C, t+1, V)
        return logits.view(num_rows, num_candidates, seq_len, self.vocab_size)

    def _decode_shared_start(self, context: TigerContext, prefix: torch.Tensor, self_bias: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` with position 0 (BOS) run once per row, not once per candidate.

        Every candidate of a row starts with the same BOS state, so it is computed for the B
        rows and its keys/values are shared by the C candidates' positions 1..t: the pairwise
        loss's decoder runs t of every t + 1 positions per candidate (and BOS's dropout mask,
        in training, is shared by a row's candidates).
        """
        num_rows, num_candidates, prefix_len = prefix.shape
        first, start = self.decode_step(context, None)                         # (B, 1, V); K/V (B, 1, H, 1, dh)
        x = self.dropout(self.embedding(prefix.reshape(num_rows * num_candidates, prefix_len)))  # (B*C, t, d)
        bias = self_bias[:, :, 1:]                                              # (1, H, t, t+1)
        for index, layer in enumerate(self.decoder_layers):
            shared = [cached.expand(-1, num_candidates, -1, -1, -1).flatten(0, 1)  # (B*C, H, 1, dh)
                      for cached in (start.keys[index], start.values[index])]
            x, _, _ = layer.step(x, bias, *shared, context.cross_keys[index], context.cross_values[index],
                                 context.key_bias)
        rest = self.lm_head(x).view(num_rows, num_candidates, prefix_len, self.vocab_size)
        first = first.unsqueeze(2).expand(-1, num_candidates, -1, -1)          # (B, C, 1, V) view
        return torch.cat([first.to(rest.dtype), rest], dim=2)                   # (B, C, t+1, V)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and the tied output projection: (..., d) -> (..., V)."""
        x = self.dropout(self.decoder_norm(x)) * self.d_model ** -0.5           # T5 v1.0 tied-head scale
        return F.linear(x, self.embedding.weight)

    def decode_step(self, context: TigerContext, cache: DecodeCache | None) -> tuple[torch.Tensor, DecodeCache]:
        """:meth:`Backbone.decode_step` with a per-candidate self-attention key/value cache.

        Runs only the newest decoder position (BOS when ``cache`` is None, else the last token
        of ``cache.prefix``) for the C candidates of every row: (B, C, V) logits.
        """
        if cache is None:
            cache = DecodeCache(torch.empty(context.num_rows, 1, 0, dtype=torch.long,
                                            device=context.key_bias.device))
        prefix = cache.prefix
        num_rows, num_candidates, position = prefix.shape                       # run position t = prefix length
        if position == 0:
            tokens = prefix.new_full((num_rows * num_candidates, 1), BOS_TOKEN)
        else:
            tokens = prefix[..., -1:].reshape(num_rows * num_candidates, 1)      # (B*C, 1)
        self_bias = self.decoder_bias(position + 1, position + 1)[:, :, -1:]  # (1, H, 1, t+1); causal: all seen
        x = self.dropout(self.embedding(tokens))                                # (B*C, 1, d)
        new_keys, new_values = [], []
        for index, layer in enumerate(self.decoder_layers):
            past_keys = cache.keys[index].flatten(0, 1) if cache.keys else None  # (B*C, H, t, dh)
            past_values = cache.values[index].flatten(0, 1) if cache.values else None
            x, keys, values = layer.step(x, self_bias, past_keys, past_values, context.cross_keys[index],
                                         context.cross_values[index], context.key_bias)
            new_keys.append(keys.unflatten(0, (num_rows, num_candidates)))     # (B, C, H, t+1, dh)
            new_values.append(values.unflatten(0, (num_rows, num_candidates)))
        logits = self.lm_head(x).view(num_rows, num_candidates, self.vocab_size)  # (B, C, V)
        return logits, DecodeCache(prefix, tuple(new_keys), tuple(new_values))
