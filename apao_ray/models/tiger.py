"""TIGER backbone: a hand-written T5 (v1.0) encoder-decoder over semantic-ID tokens (SPEC §2).

Written by hand rather than taken from ``transformers`` because the C candidates of a row
(1 + N negatives, K beams, every catalog item) share one encoder pass: each decoder layer's
cross-attention keys/values are computed once in ``encode`` and read by the row's C*(t+1)
stacked queries, so the encoder output is never copied per candidate; with few queries per row
(teacher-forced CE) the cross-attention reads the encoder output through its weights instead and
no keys or values are projected at all (:meth:`t5_layers.Attention.cross_absorbed`). The math is T5's:
RMS layer norm without bias, pre-norm residual blocks, unscaled dot-product attention (T5
folds 1/sqrt(d) into the initialisation), relative position buckets shared by every layer of
a stack, and a tied LM head on the decoder output scaled by d_model**-0.5.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..data.catalog import BOS_TOKEN
from .base import Backbone, DecodeCache
from .dropout import Dropout
from .packing import PackedHistory, row_groups
from .t5_layers import (Attention, CrossSource, DecoderLayer, EncoderLayer, FeedForward, RelativePositionBias,
                        absorbed_cost, padding_bias)


@dataclass
class TigerContext:
    """What the decoder reads; built once per batch by :meth:`TigerBackbone.encode`.

    Attributes:
        key_bias: (B, 1, 1, L) float, 0 on real history tokens, -inf-like on PAD.
        memory: (B, L, d_model) the encoder output, zeros on PAD.
        cross_keys: per decoder layer, (B, heads, L, head_dim) cross-attention keys; empty when the
            cross-attention reads ``memory`` through its weights instead (absorbed, see ``encode``).
        cross_values: per decoder layer, (B, heads, L, head_dim) cross-attention values, or empty.
        row_groups: :func:`.packing.row_groups` of the rows, for the cross-attention; None: all columns.
    """

    key_bias: torch.Tensor
    memory: torch.Tensor
    cross_keys: tuple[torch.Tensor, ...] = ()
    cross_values: tuple[torch.Tensor, ...] = ()
    row_groups: tuple[tuple[int, int, int], ...] | None = None

    @property
    def num_rows(self) -> int:
        return self.key_bias.shape[0]

    def source(self, layer: int) -> CrossSource:
        """What decoder layer ``layer``'s cross-attention reads."""
        if not self.cross_keys:
            return CrossSource(self.key_bias, memory=self.memory, row_groups=self.row_groups)
        return CrossSource(self.key_bias, self.cross_keys[layer], self.cross_values[layer], row_groups=self.row_groups)

    def select_rows(self, rows: torch.Tensor) -> "TigerContext":
        """The context of a subset (or reordering) of the B rows; ``rows`` is (B',) int64 (no row groups:
        the rows' lengths are no longer in order)."""
        return TigerContext(self.key_bias[rows], self.memory[rows], tuple(k[rows] for k in self.cross_keys),
                            tuple(v[rows] for v in self.cross_values))


class TigerBackbone(Backbone):
    """T5-style encoder-decoder; defaults are the paper's size (4.59M parameters at V=1027).

    ``pack_histories`` (:class:`.base.Backbone`; default: on a CPU) runs the history pass on its real tokens
    only (:mod:`.packing`); False runs the padded reference path, the same function at more cost.
    """

    cross_attention: str = "auto"  # "auto" (by cost, see encode), "projected" or "absorbed"

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

    def candidate_logits(self, history_ids: torch.Tensor, history_mask: torch.Tensor,
                         candidates: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits of full candidates: (B, C, T) tokens -> (B, C, T, V); the encoder knows
        the decoder's C * T queries per row, so it can choose how the cross-attention reads it."""
        context = self.encode(history_ids, history_mask, queries_per_row=candidates.shape[1] * candidates.shape[2])
        return self.decode(context, candidates[..., :-1])

    def encode(self, history_ids: torch.Tensor, history_mask: torch.Tensor,
               queries_per_row: int | None = None) -> TigerContext:
        """Runs the encoder once and, unless the cross-attention absorbs them, every decoder layer's
        cross-attention K/V projection.

        Args:
            history_ids: (B, L) tokens, left-padded with PAD, ending with EOS.
            history_mask: (B, L) bool, True on real tokens.
            queries_per_row: the decoder positions per row this context will serve, when known (teacher
                forcing); where reading the encoder output through the attention weights costs fewer
                multiply-adds than projecting keys and values (:func:`absorbed_cost`: CE's and
                APAO-pointwise's 4-5 queries per row, not the pairwise loss's 1 + N candidates), no
                keys or values are projected. None (decoding: beams and full sorting reuse them) projects.
        """
        key_bias = padding_bias(history_mask)                                  # (B, 1, 1, L)
        if self.packs(history_mask.device):
            packing = PackedHistory.from_mask(history_mask)
            biases = [self.encoder_bias(b.length, b.length) + padding_bias(b.key_mask) for b in packing.buckets]
            x = self.dropout(self.embedding(packing.pack(history_ids)))          # (N, d)
            for layer in self.encoder_layers:
                x = layer.forward_packed(x, packing, biases)
            x = self.dropout(self.encoder_norm(x))                              # (N, d)
            memory, num_tokens = packing.unpack(x), packing.num_tokens
        else:
            length = history_ids.shape[1]
            # relative offsets are unchanged by left padding, so column indices serve as positions
            bias = self.encoder_bias(length, length) + key_bias                 # (B, H, L, L)
            x = self.dropout(self.embedding(history_ids))                       # (B, L, d)
            for layer in self.encoder_layers:
                x = layer(x, bias)
            x = memory = self.dropout(self.encoder_norm(x))                     # (B, L, d)
            num_tokens = x.shape[0] * x.shape[1]
        context = TigerContext(key_bias, memory, row_groups=row_groups(history_mask))
        if queries_per_row is not None and self.absorbs(history_ids.shape[0], queries_per_row, num_tokens,
                                                        history_ids.shape[1]):
            return context
        # every decoder layer's cross K and V in one matmul (on the packed tokens): (B, L, layers*2*inner)
        weight = torch.cat([w for layer in self.decoder_layers
                            for w in (layer.cross_attn.k.weight, layer.cross_attn.v.weight)])
        projected = F.linear(x, weight)
        if self.packs(history_mask.device):
            projected = packing.unpack(projected)
        projected = projected.chunk(2 * len(self.decoder_layers), dim=-1)
        split = self.decoder_layers[0].cross_attn.split_heads
        return self._evaluated(TigerContext(key_bias, memory, tuple(split(p) for p in projected[0::2]),
                                            tuple(split(p) for p in projected[1::2]),  # K/V: (B, H, L, dh)
                                            context.row_groups))

    def absorbs(self, num_rows: int, queries_per_row: int, num_tokens: int, key_len: int) -> bool:
        """Whether the cross-attention should read the encoder output directly (:func:`absorbed_cost`);
        ``cross_attention`` = "projected" or "absorbed" forces a form (tests, benchmarks)."""
        if self.cross_attention != "auto":
            return self.cross_attention == "absorbed"
        attention = self.decoder_layers[0].cross_attn
        projected, absorbed = absorbed_cost(num_rows, queries_per_row, num_tokens, key_len, self.d_model,
                                            attention.num_heads, attention.head_dim)
        return absorbed < projected

    def _evaluated(self, context: TigerContext) -> TigerContext:
        """In bf16 evaluation on a CPU, the cross-attention keys in float32, once per batch: the attention
        takes its scores in float32 (models/dropout.attention), and a beam's every decoder step reads them."""
        keys = context.cross_keys
        if self.training or keys[0].device.type != "cpu" or keys[0].dtype != torch.bfloat16:
            return context
        return TigerContext(context.key_bias, context.memory, tuple(k.float() for k in keys), context.cross_values,
                            context.row_groups)

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
        for index, layer in enumerate(self.decoder_layers):
            x = layer(x, self_bias, context.source(index))
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
            x, _, _ = layer.step(x, bias, *shared, context.source(index))
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
            x, keys, values = layer.step(x, self_bias, past_keys, past_values, context.source(index))
            new_keys.append(keys.unflatten(0, (num_rows, num_candidates)))     # (B, C, H, t+1, dh)
            new_values.append(values.unflatten(0, (num_rows, num_candidates)))
        logits = self.lm_head(x).view(num_rows, num_candidates, self.vocab_size)  # (B, C, V)
        return logits, DecodeCache(prefix, tuple(new_keys), tuple(new_values))
