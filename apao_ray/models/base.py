"""The backbone interface every model implements, and what decoding and losses rely on.

A backbone reads a history once (``encode``) and then scores any number of short candidate
code sequences against it (``decode``): the C candidates of a row share that row's history
encoding, so the pairwise loss (1 + N candidates), beam search (K beams) and full sorting
(every semantic ID) never copy the history per candidate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .fused import fused_active

# an opaque per-backbone object (TIGER: encoder output + mask; Llama: the history's key/value
# cache + positions); only the backbone that made it reads it.
Context = Any


@dataclass
class DecodeCache:
    """What incremental decoding keeps between steps for C candidates per row.

    Attributes:
        prefix: (B, C, t) the code tokens decoded so far (t = positions already run minus 1).
        keys, values: per decoder layer, (B, C, H, t + 1, dh) self-attention keys/values of
            the positions already run; empty for a backbone that recomputes its prefix.
    """

    prefix: torch.Tensor
    keys: tuple[torch.Tensor, ...] = ()
    values: tuple[torch.Tensor, ...] = ()

    def select(self, parent: torch.Tensor, tokens: torch.Tensor) -> "DecodeCache":
        """The cache of C' new candidates, candidate j extending old candidate ``parent[:, j]``.

        Args:
            parent: (B, C') int64 index of each new candidate's parent among the C old ones.
            tokens: (B, C') the code token each new candidate appends.
        """
        def rows(cached: torch.Tensor) -> torch.Tensor:                     # (B, C, ...) -> (B, C', ...)
            index = parent.view(*parent.shape, *([1] * (cached.dim() - 2))).expand(-1, -1, *cached.shape[2:])
            return cached.gather(1, index)

        prefix = torch.cat([rows(self.prefix), tokens.unsqueeze(-1)], dim=2)   # (B, C', t+1)
        return DecodeCache(prefix, tuple(rows(k) for k in self.keys), tuple(rows(v) for v in self.values))


class Backbone(nn.Module):
    """Base class. Subclasses set ``vocab_size`` and ``num_levels`` and implement encode/decode."""

    vocab_size: int
    num_levels: int
    # True: the history pass runs on the histories' real tokens only (models/packing), False: on the padded
    # batch (the same function at more arithmetic); None: packed on a CPU, padded elsewhere. Packing sizes its
    # tensors by the rows' lengths, which an accelerator holds: reading them stalls its queue once per forward,
    # and there the arithmetic packing saves matters less than the stall.
    pack_histories: bool | None = None

    def packs(self, device: torch.device) -> bool:
        """Whether the history pass on ``device`` runs packed (``pack_histories``)."""
        if fused_active():  # a fused cohort (models/fused.py): packing sizes tensors by data, which vmap cannot
            return False
        return device.type == "cpu" if self.pack_histories is None else self.pack_histories

    def encode(self, history_ids: torch.Tensor, history_mask: torch.Tensor) -> Context:
        """Encodes the histories once.

        Args:
            history_ids: (B, L) token ids, left-padded with PAD, ending with EOS.
            history_mask: (B, L) bool, True on real tokens.
        """
        raise NotImplementedError

    def decode(self, context: Context, prefix: torch.Tensor) -> torch.Tensor:
        """Next-token logits for C candidate prefixes per row, sharing the row's context.

        Args:
            context: what ``encode`` returned for the same B rows.
            prefix: (B, C, t) code token ids already generated (t may be 0).

        Returns:
            (B, C, t + 1, V) logits; position j is the distribution of the (j+1)-th code given
            the history and ``prefix[..., :j]``.
        """
        raise NotImplementedError

    def decode_step(self, context: Context, cache: DecodeCache | None) -> tuple[torch.Tensor, DecodeCache]:
        """Next-token logits of the last position of each candidate, reusing earlier positions.

        The incremental form of :meth:`decode` for beam search: with ``cache=None`` it runs
        position 0 of one candidate per row; otherwise it runs only the newest position of
        ``cache.prefix`` (after :meth:`DecodeCache.select`). This default recomputes the
        whole prefix; backbones override it with a key/value cache.

        Returns:
            (B, C, V) logits of the next code, and the cache to ``select`` from.
        """
        if cache is None:
            num_rows = context.num_rows
            device = next(self.parameters()).device
            cache = DecodeCache(torch.empty(num_rows, 1, 0, dtype=torch.long, device=device))
        return self.decode(context, cache.prefix)[:, :, -1], cache

    def candidate_logits(self, history_ids: torch.Tensor, history_mask: torch.Tensor,
                         candidates: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits of full candidates: (B, C, T) tokens -> (B, C, T, V)."""
        context = self.encode(history_ids, history_mask)
        return self.decode(context, candidates[..., :-1])

    def forward(self, history_ids: torch.Tensor, history_mask: torch.Tensor,
                candidates: torch.Tensor) -> torch.Tensor:
        """Training entry point (what DDP wraps): same as :meth:`candidate_logits`."""
        return self.candidate_logits(history_ids, history_mask, candidates)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def drop_history_eos(history_ids: torch.Tensor, history_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The history without its closing EOS (the released code's decoder-only layout).

    Args:
        history_ids, history_mask: (B, L) left-padded, every row ending with EOS at column L-1.

    Returns:
        (B, L-1) ids and mask whose last column is each row's last history token; a row with
        an empty history keeps its EOS there, so it still has one token to read.
    """
    if history_ids.shape[1] < 2:  # no row has a history: nothing to drop
        return history_ids, history_mask
    is_empty = ~history_mask[:, -2]                                            # (B,)
    ids = torch.cat([history_ids[:, :-2], torch.where(is_empty, history_ids[:, -1], history_ids[:, -2])[:, None]], 1)
    mask = torch.cat([history_mask[:, :-2], (history_mask[:, -2] | is_empty)[:, None]], 1)
    return ids, mask                                                            # (B, L-1)


# rows of (R, V) logits upcast at a time by label_log_probs on a CPU: ~4 MiB of float32, so the
# upcast copy stays in cache instead of a second full (R, V) tensor in memory
CPU_CHUNK_ELEMENTS = 2**20


class _LabelLogProbs(torch.autograd.Function):
    """log_softmax(logits)[label] per row of (R, V) logits, in at least float32, chunked over rows.

    Forward keeps only the logits (in their own dtype) and the (R,) normalisers; backward forms
    softmax - onehot chunk by chunk and writes the gradient in the logits' dtype, which is what
    autograd would cast it to anyway. No (R, V) float32 tensor is ever materialised.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)   # (R,)
        picked = logits.gather(-1, labels[:, None]).squeeze(-1).to(dtype)       # (R,)
        for start in range(0, logits.shape[0], chunk_rows):
            torch.logsumexp(logits[start:start + chunk_rows].to(dtype), dim=-1, out=lse[start:start + chunk_rows])
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_rows = chunk_rows
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, labels, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)                                    # (R, V) logits' dtype
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            end = start + ctx.chunk_rows
            g = grad[start:end, None].to(lse.dtype)                               # (r, 1)
            part = (logits[start:end].to(lse.dtype) - lse[start:end, None]).exp_().mul_(-g)  # -g * softmax
            part.scatter_add_(-1, labels[start:end, None], g)                     # + g at the label
            grad_logits[start:end] = part
        return grad_logits, None, None


def label_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(..., T, V) logits and (..., T) labels -> (..., T) log-softmax of each label token.

    Computed as ``logit[label] - logsumexp(logits)`` in at least float32 whatever the logits'
    dtype (bf16 log-probs are off by ~1e-2, too coarse for losses and prefix weights), a chunk
    of rows at a time on a CPU, so neither a float32 copy nor a log-prob tensor of the logits'
    size is kept for backward: only the logits themselves and one normaliser per row.
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)                                          # (R, V)
    chunk_rows = max(1, CPU_CHUNK_ELEMENTS // vocab) if logits.device.type == "cpu" else max(1, flat.shape[0])
    out = _LabelLogProbs.apply(flat, labels.reshape(-1), chunk_rows)          # (R,)
    return out.view(labels.shape)
