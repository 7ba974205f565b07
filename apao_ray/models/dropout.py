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
        return x.mul(scale).masked_fill_(dropped, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (dropped,) = ctx.saved_tensors
        return grad.mul(ctx.scale).masked_fill_(dropped, 0), None


class Dropout(nn.Module):
    """``nn.Dropout`` by :func:`drop_mask` on CPU tensors (no parameters, the same state dict)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability {p} must be between 0 and 1")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu" or self.p >= 1.0:
            return F.dropout(x, self.p, True)
        return _Dropout.apply(x, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"
