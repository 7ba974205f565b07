"""Dropout for CPU training at the speed of the matmuls around it.

``torch.nn.functional.dropout`` on a CPU draws one Bernoulli variable per element through a slow
generic path: in a bf16 TIGER pairwise training step it took a sixth of the time (benchmarks/RESULTS.md,
2026-11-25). :class:`Dropout` draws one 64-bit random word per four elements instead and compares each
16-bit quarter of it with a threshold: the same inverted dropout (each element kept with probability
``1 - p``, independently, kept ones scaled by ``1 / (1 - p)``), with ``p`` rounded to a multiple of
2^-16 (0.1 -> 0.100006), from the same seeded torch generator, 2-3x faster forward
(``benchmarks/bench_dropout.py``). The mask is kept as 1.0 / 0.0 in the input's dtype, made by int16
arithmetic (:func:`keep_mask`), so forward and backward are plain multiplies: a bool mask's
``torch.where`` is not vectorised on a CPU and took 15% of a bf16 TIGER CE step (RESULTS.md, 2026-11-27).
On other devices (CUDA's dropout is a fused kernel already) and
outside training it is ``F.dropout``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused import fused_active

_LANES = 4  # 16-bit lanes per 64-bit random word
_LEVELS = 1 << 16
# the 16 bits of 1.0 in the 16-bit float types: an int16 0 / 1 mask times these, viewed as the type, is 0.0 / 1.0
# in place (the int16 -> bf16 conversion took as long as drawing and thresholding the lanes)
_ONE_BITS = {torch.bfloat16: 0x3F80, torch.float16: 0x3C00}
# the random words are scratch: one buffer, grown to the largest mask drawn, is reused, because a fresh
# allocation of this size is a fresh mmap whose page faults cost more than drawing the numbers
_scratch: list[torch.Tensor] = []


def _lanes(shape: torch.Size) -> torch.Tensor:
    """Uniform int16 in [-2^15, 2^15) of ``shape``: four 16-bit lanes per 64-bit draw of the CPU generator,
    in a scratch buffer that the next call overwrites."""
    count = shape.numel()
    size = (count + _LANES - 1) // _LANES
    if not _scratch or _scratch[0].numel() < size:
        _scratch[:] = [torch.empty(size, dtype=torch.int64)]
    words = _scratch[0][:size]
    words.random_(-(1 << 63), None)  # all 64 bits uniform (the default range leaves the top one 0)
    return words.view(torch.int16)[:count].view(shape)


def drop_mask(shape: torch.Size, p: float) -> torch.Tensor:
    """A bool tensor of ``shape``, True (dropped) with probability ``round(p * 2^16) / 2^16`` each,
    independently: four 16-bit uniforms per 64-bit draw of the CPU generator."""
    dropped = int(round(p * _LEVELS))
    if dropped == _LEVELS:  # the threshold would leave int16 (and wrap to -2^15: nothing dropped)
        return torch.ones(shape, dtype=torch.bool)
    return _lanes(shape) < dropped - (_LEVELS >> 1)


def keep_mask(shape: torch.Size, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``~drop_mask(shape, p)`` from the same draws, as 1.0 / 0.0 in ``dtype``.

    Made by int16 arithmetic (a lane is kept iff it is >= the threshold: clamped to {threshold - 1,
    threshold} and shifted to {0, 1}) and one int16 -> float conversion, which are vectorised; the bool
    comparison, ``torch.where`` on it and its conversion to a float are not (5-8x slower per element).
    """
    dropped = int(round(p * _LEVELS))
    if dropped in (0, _LEVELS):  # the clamp's bounds would leave int16
        return torch.full(shape, float(dropped == 0), dtype=dtype)
    threshold = dropped - (_LEVELS >> 1)
    kept = torch.clamp(_lanes(shape), threshold - 1, threshold).sub_(threshold - 1)  # int16 0 / 1
    if dtype in _ONE_BITS:  # 0 / 1 times the bit pattern of 1.0 is 0.0 / 1.0: no conversion pass
        return kept.mul_(_ONE_BITS[dtype]).view(dtype)
    return kept.to(dtype)


def _scale(p: float) -> float:
    """1 / (1 - p) for p rounded to a multiple of 2^-16 (what the masks draw); 0 if all is dropped, as F.dropout."""
    dropped = round(p * _LEVELS)
    return _LEVELS / (_LEVELS - dropped) if dropped < _LEVELS else 0.0


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        kept = keep_mask(x.shape, p, x.dtype)
        scale = _scale(p)
        ctx.save_for_backward(kept)
        ctx.scale = scale
        # x * 1.0 or 0.0, then the scale in x's arithmetic: the same values as where(dropped, 0, x) * scale
        return torch.mul(x, kept).mul_(scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (kept,) = ctx.saved_tensors
        return torch.mul(grad, kept).mul_(ctx.scale), None


class _ReluDropout(torch.autograd.Function):
    """``dropout(relu(x))`` saving only its output: where the output is non-zero, the input was positive and
    kept, so the gradient is the incoming one there times the scale (and zero elsewhere), the same values as
    relu's and dropout's backward in turn, with neither the relu output nor the mask kept for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        scale = _scale(p)
        out = torch.relu(x).mul_(keep_mask(x.shape, p, x.dtype)).mul_(scale)
        ctx.save_for_backward(out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (out,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad, out, 0).mul_(ctx.scale), None


def relu_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``dropout(relu(x), p, training)`` (T5's feed-forward), fused on CPU tensors in training: one fewer
    pass each way and half the saved activations of the widest tensor of a TIGER layer."""
    if not training or p == 0.0 or x.device.type != "cpu" or p >= 1.0 or fused_active():
        return dropout(F.relu(x), p, training)
    return _ReluDropout.apply(x, p)


class _DropoutTo(torch.autograd.Function):
    """``_Dropout`` then a cast to ``dtype``, in one pass each way: the mask holds 0 or the scale in x's dtype,
    and the product is written in ``dtype`` (backward: the incoming gradient times the mask, in x's dtype).
    The same values as dropout and the cast in turn: x * 1.0 * scale = x * scale."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
        scale = _scale(p)
        kept = keep_mask(x.shape, p, torch.int16)
        # int16 times a Python float is float32 in one pass: 0 or float32(scale), as float32's x * scale uses
        scaled = torch.mul(kept, scale) if x.dtype == torch.float32 else kept.to(x.dtype).mul_(scale)
        ctx.save_for_backward(scaled)
        return torch.mul(x, scaled, out=torch.empty(x.shape, dtype=dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (scaled,) = ctx.saved_tensors
        return torch.mul(grad, scaled), None, None


def dropout_to(x: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """``dropout(x, p).to(dtype)`` in training, fused on CPU tensors (the attention probabilities: dropout in
    float32 and the product with the values in bf16)."""
    if x.device.type != "cpu" or p >= 1.0 or p == 0.0 or x.dtype == dtype or fused_active():
        return dropout(x, p).to(dtype)
    return _DropoutTo.apply(x, p, dtype)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout`` by :func:`keep_mask` on CPU tensors in training (``F.dropout`` elsewhere)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0 or fused_active():  # a fused cohort: F.dropout batches under vmap
        return F.dropout(x, p, True)
    return _Dropout.apply(x, p)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, p: float,
              training: bool, scale: float = 1.0) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, dropout_p=p if training else 0)``.

    With dropout on a CPU, SDPA falls back to its unfused path and draws the attention dropout with
    ``bernoulli_`` (10% of a TIGER pairwise decoder step): there the same unfused attention is computed
    here with :func:`dropout` on the probabilities. In bf16 on a CPU, the unfused products too: in
    evaluation faster than SDPA's kernel for these small problems, in training its flash kernel's bf16
    backward took 4x its float32 one (Llama's history pass: 47% of a CE step; 2026-11-27); elsewhere SDPA.
    Every query row must see at least one key (SDPA would give a fully masked row zeros, this NaN).
    """
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, dropout_p=p if training else 0.0)
    dropping = training and p > 0.0
    if not dropping and q.dtype != torch.bfloat16 and not fused_active():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    # Unfused. In bf16 evaluation too: SDPA's fused CPU kernel pays a fixed cost per (row, head), on a
    # beam's decoder steps (one query per beam over <= 5 cached keys, 20 over the history) 2-4x the work
    # itself (RESULTS.md, 2026-11-25). The scores, softmax and dropout in at least float32 (T5 does not scale
    # its scores: rounded to bf16 they were 6-15x SDPA's error at spreads 4-16, 2026-11-25; dropout in bf16
    # rounds the probabilities twice, 2.7x the error), the product with v in v's dtype: in bf16 no float32
    # copy of the padded cross-attention values (or, in training, of their gradients).
    # tests/test_dropout.py bounds the error against float64.
    with torch.autocast("cpu", enabled=False):
        wide = torch.promote_types(q.dtype, torch.float32)
        scores = torch.matmul(q.to(wide), k.to(wide).transpose(-2, -1))                 # (..., S, L)
        if scale != 1.0:
            scores.mul_(scale)
        probs = torch.softmax(scores.add_(bias.to(wide)), dim=-1)
        return torch.matmul(dropout_to(probs, p, v.dtype) if dropping else probs.to(v.dtype), v)


class Dropout(nn.Module):
    """``nn.Dropout`` by :func:`keep_mask` on CPU tensors (no parameters, the same state dict)."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability {p} must be between 0 and 1")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
