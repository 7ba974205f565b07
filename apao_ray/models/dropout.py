"""Dropout for CPU training at the speed of the matmuls around it.

``torch.nn.functional.dropout`` on a CPU draws one Bernoulli variable per element through a slow
generic path: in a bf16 TIGER pairwise training step it took a sixth of the time (benchmarks/RESULTS.md,
session 10). :class:`Dropout` draws one 64-bit random word per four elements instead and compares each
16-bit quarter of it with a threshold: the same inverted dropout (each element kept with probability
``1 - p``, independently, kept ones scaled by ``1 / (1 - p)``), with ``p`` rounded to a multiple of
2^-16 (0.1 -> 0.100006), from the same seeded torch generator, 2-3x faster forward
(``benchmarks/bench_dropout.py``). On other devices (CUDA's dropout is a fused kernel already) and
outside training it is ``F.dropout``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LANES = 4  # 16-bit lanes per 64-bit random word
_LEVELS = 1 << 16
# the random words are scratch: one buffer, grown to the largest mask drawn, is reused, because a fresh
# allocation of this size is a fresh mmap whose page faults cost more than drawing the numbers
_scratch: list[torch.Tensor] = []


def drop_mask(shape: torch.Size, p: float) -> torch.Tensor:
    """A bool tensor of ``shape``, True (dropped) with probability ``round(p * 2^16) / 2^16`` each,
    independently: four 16-bit uniforms per 64-bit draw of the CPU generator."""
    count = shape.numel()
    size = (count + _LANES - 1) // _LANES
    if not _scratch or _scratch[0].numel() < size:
        _scratch[:] = [torch.empty(size, dtype=torch.int64)]
    words = _scratch[0][:size]
    words.random_(-(1 << 63), None)  # all 64 bits uniform (the default range leaves the top one 0)
    lanes = words.view(torch.int16)[:count].view(shape)    # uniform over [-2^15, 2^15)
    return lanes < int(round(p * _LEVELS)) - (_LEVELS >> 1)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        dropped = drop_mask(x.shape, p)
        scale = _LEVELS / (_LEVELS - round(p * _LEVELS))  # 1 / (1 - p) for the rounded p actually used
        ctx.save_for_backward(dropped)
        ctx.scale = scale
        return torch.where(dropped, 0.0, x).mul_(scale)  # 1.3x faster than x.mul(scale).masked_fill_(dropped, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (dropped,) = ctx.saved_tensors
        return torch.where(dropped, 0.0, grad).mul_(ctx.scale), None


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout`` by :func:`drop_mask` on CPU tensors in training (``F.dropout`` elsewhere)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, True)
    return _Dropout.apply(x, p)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, p: float,
              training: bool) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0, dropout_p=p if training else 0)``.

    With dropout on a CPU, SDPA falls back to its unfused path and draws the attention dropout with
    ``bernoulli_`` (10% of a TIGER pairwise decoder step): there the same unfused attention is computed
    here with :func:`dropout` on the probabilities. In evaluation on a CPU in bf16, the unfused products
    too (faster than SDPA's kernel for these small problems); elsewhere SDPA itself.
    Every query row must see at least one key (SDPA would give a fully masked row zeros, this NaN).
    """
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0, dropout_p=p if training else 0.0)
    dropping = training and p > 0.0
    if not dropping and q.dtype != torch.bfloat16:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
    # Unfused. In bf16 evaluation too: SDPA's fused CPU kernel pays a fixed cost per (row, head), on a
    # beam's decoder steps (one query per beam over <= 5 cached keys, 20 over the history) 2-4x the work
    # itself (RESULTS.md, session 14). The scores, softmax and dropout in at least float32 (T5 does not scale
    # its scores: rounded to bf16 they were 6-15x SDPA's error at spreads 4-16, session 15), the product with
    # v in v's dtype: in bf16 no float32 copy of the padded cross-attention values (or, in training, of
    # their gradients). tests/test_models.py bounds the error against float64.
    with torch.autocast("cpu", enabled=False):
        wide = torch.promote_types(q.dtype, torch.float32)
        scores = torch.matmul(q.to(wide), k.to(wide).transpose(-2, -1))                 # (..., S, L)
        probs = torch.softmax(scores + bias.to(wide), dim=-1)
        return torch.matmul((dropout(probs, p) if dropping else probs).to(v.dtype), v)


class Dropout(nn.Module):
    """``nn.Dropout`` by :func:`drop_mask` on CPU tensors (no parameters, the same state dict)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability {p} must be between 0 and 1")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
