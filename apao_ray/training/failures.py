"""Why a trial stops for good: running out of memory (named with what the trial was doing) or a non-finite loss;
the reason left where the trial's driver finds it, and raised once as ``TrialFailedError``."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .. import storage
from ..config import TrialConfig
from .loss_watch import NonFiniteLossError
from .memory import MemoryCap, allocator_in_use


class TrialFailedError(RuntimeError):
    """A trial stopped for a reason a restart from its checkpoint cannot fix (non-finite loss,
    out of memory); raised once by the trial's driver, never retried by Ray Train."""


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


def stops_for_good(error: BaseException) -> bool:
    """A failure a restart from the checkpoint would meet again: a non-finite loss, an allocation failure."""
    return isinstance(error, NonFiniteLossError) or is_out_of_memory(error)


def leave_failure(loop_config: dict[str, Any], error: BaseException, cap: MemoryCap | None = None) -> str:
    """Writes why a trial failed for a reason a restart from its checkpoint would meet again (non-finite loss,
    out of memory; with the cap and what the trial held of it) where its driver finds it, and returns that reason."""
    reason = f"{type(error).__name__}: {error}"
    if is_out_of_memory(error):
        message = str(error) if isinstance(error, TrialOutOfMemoryError) else \
            "out of memory outside an epoch's training and validation: " + (str(error).strip().splitlines() or [""])[0][:300]
        # the cap first: a table shows a failure's first 200 characters. The allocator too: what a trial holds of
        # the cap depends on it, and a trial that fails before its first report has no allocator tag
        noted = (f"out of memory ({cap.describe()}; allocator {allocator_in_use()})" if cap is not None
                 else "out of memory")
        reason = f"{TrialOutOfMemoryError.__name__}: {noted}{message.removeprefix('out of memory')}"
    storage.write_text(loop_config["failure_file"], reason)
    return reason


@contextlib.contextmanager
def failures_left(loop_configs: list[dict[str, Any]], cap: MemoryCap | None) -> Iterator[None]:
    """Re-raises a failure a restart would meet again (``stops_for_good``) as TrialFailedError, its reason left in
    the failure file of every trial in ``loop_configs``; any other as it is (Tune retries the trial)."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - re-raised unless a restart would meet it again
        if not stops_for_good(error):
            raise
        reasons = [leave_failure(loop_config, error, cap) for loop_config in loop_configs]
        raise TrialFailedError(reasons[0]) from None
