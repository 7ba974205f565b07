"""Which float precision a trial computes in: bf16 autocast where the hardware has it natively.

``auto`` resolves per device when the trial starts (a study's workers may sit on different
machines): bf16 on CUDA devices that support it and on CPUs with native bf16 instructions
(AVX512-BF16 or AMX), fp32 elsewhere, where emulated bf16 is slower than fp32. Weights, the
optimizer and the log-softmax normalisers stay float32 either way.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..config import PRECISIONS

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of native bf16 instructions


def cpu_has_native_bf16() -> bool:
    """True on CPUs with AVX512-BF16 or AMX tiles (asked of torch, else of /proc/cpuinfo)."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    answers = [bool(probe()) for probe in probes if probe is not None]
    if answers:
        return any(answers)
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in CPU_BF16_FLAGS)


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """``auto`` -> ``bf16`` or ``fp32`` for ``device``; ``fp32``/``bf16`` pass unchanged.

    Raises:
        ValueError: an unknown precision name.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {list(PRECISIONS)}")
    if precision != "auto":
        return precision
    device = torch.device(device)
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if device.type == "cpu":
        return "bf16" if cpu_has_native_bf16() else "fp32"
    return "fp32"


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved precision (None: no autocast)."""
    if precision == "auto":
        raise ValueError("resolve 'auto' with resolve_precision(precision, device) first")
    return torch.bfloat16 if precision == "bf16" else None


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``precision`` on ``device`` (a no-op for fp32; ``auto`` resolved for ``device``)."""
    dtype = autocast_dtype(resolve_precision(precision, device))
    return torch.autocast(torch.device(device).type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)
