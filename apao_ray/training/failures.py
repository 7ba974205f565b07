"""Why a trial stops for good: running out of memory, named with what the trial was doing."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..config import TrialConfig


class TrialOutOfMemoryError(MemoryError):
    """The trial could not allocate memory (host RAM, its memory cap, or GPU memory)."""


def is_out_of_memory(error: BaseException) -> bool:
    """torch's CPU/GPU allocator failures and Python's MemoryError (a memory cap reached)."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


@contextlib.contextmanager
def memory_errors_named(config: TrialConfig, doing: str, epoch: int, num_negatives: int) -> Iterator[None]:
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised unchanged unless it is an allocation failure
        if not is_out_of_memory(error):
            raise
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise TrialOutOfMemoryError(
            f"out of memory while {doing} in epoch {epoch} (backbone {config.model.backbone!r}, loss "
            f"{config.loss.name!r}, batch_size={config.train.batch_size}, num_negatives={num_negatives}): "
            f"{first_line}; lower --batch-size or the negatives, or give the trial more memory") from None
