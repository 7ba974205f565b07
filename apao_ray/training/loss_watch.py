"""The training loss watched for NaN and infinity without a host sync per step: the trial stops with
``NonFiniteLossError`` before its epoch's checkpoint."""
from __future__ import annotations

import collections
import math
from typing import Any, Callable

import torch


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the trial stops with this reason."""


class LossWatch:
    """Stops training at a non-finite loss without reading each loss as it is computed.

    On a CPU each loss is checked at once. On a CUDA device reading a loss waits for the device to finish
    all the work queued before it, so the host would stop preparing the next step while the device runs this
    one: there each loss is copied to the host asynchronously and read one loss later (when the next one is
    queued), and the last at the epoch's end (``flush``). A non-finite loss then stops the trial one
    optimizer step later than it arose; the weights of that epoch are discarded all the same (the trial keeps
    the checkpoint of an earlier epoch).
    """

    def __init__(self, device: torch.device) -> None:
        self.deferred = device.type == "cuda"
        self.pending: collections.deque[tuple[torch.Tensor, Any, Callable[[float], str]]] = collections.deque()

    def push(self, loss: torch.Tensor, describe: Callable[[float], str]) -> None:
        """Checks ``loss`` (a scalar), now or after the next push; ``describe(value)`` is the error's text."""
        if not self.deferred:
            self._check(float(loss.detach()), describe)
            return
        host = loss.detach().to("cpu", non_blocking=True)  # into pinned memory, ordered on the stream
        done = torch.cuda.Event()
        done.record()
        self.pending.append((host, done, describe))
        while len(self.pending) > 1:
            self._read(*self.pending.popleft())

    def flush(self) -> None:
        """Checks every loss not read yet."""
        while self.pending:
            self._read(*self.pending.popleft())

    def _read(self, host: torch.Tensor, done: Any, describe: Callable[[float], str]) -> None:
        done.synchronize()  # waits for this loss alone, not for the work queued after it
        self._check(float(host), describe)

    @staticmethod
    def _check(value: float, describe: Callable[[float], str]) -> None:
        if not math.isfinite(value):
            raise NonFiniteLossError(describe(value))
