"""Stop signals to the study driver. SIGINT (Ctrl-C, ``kill -INT``) and SIGTERM (``timeout``, a batch
scheduler, a supervisor) end a study the same way: Tune saves its state, the unfinished trials are
recorded as interrupted, and the exit code says which signal came (128 + its number).

Tune's own SIGINT handler cannot tell a stop signal from a trial that the scheduler cut (both leave
the trial TERMINATED), and Ray's SIGTERM handler exits mid-loop, leaving MLflow runs RUNNING. So the
driver installs one handler for both that remembers the signal, then asks Tune to stop through the
interrupt handler Tune installs for SIGUSR1 while it runs (``ray/tune/tune.py``).
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from contextlib import contextmanager, suppress
from typing import Any, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_DISABLE_TUNE_SIGINT = "TUNE_DISABLE_SIGINT_HANDLER"  # else Tune replaces our SIGINT handler while it runs

_received: int | None = None
_is_tune_running = False


def received() -> int | None:
    """The stop signal this study received, if any (SIGINT or SIGTERM)."""
    return _received


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


def _on_stop_signal(signum: int, frame: Any) -> None:
    global _received
    if _received is not None:  # already stopping: let the trials be recorded and the state saved
        print(f"{signal.Signals(signum).name} again: the study is already stopping and saving its state",
              file=sys.stderr, flush=True)
        return
    _received = signum
    tune_interrupt = signal.getsignal(signal.SIGUSR1) if _is_tune_running else None
    if callable(tune_interrupt):
        tune_interrupt(signum, frame)  # Tune saves the experiment state, stops the trials, returns from fit
    else:  # before or after Tune's loop: unwind; the caller records the study as interrupted
        raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def stop_signals() -> Iterator[None]:
    """Routes SIGINT and SIGTERM to :func:`_on_stop_signal` for the duration of a study (main thread only)."""
    global _received
    _received = None
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    previous_env = os.environ.get(_DISABLE_TUNE_SIGINT)
    os.environ[_DISABLE_TUNE_SIGINT] = "1"
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_stop_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if previous_env is None:
            os.environ.pop(_DISABLE_TUNE_SIGINT, None)
        else:
            os.environ[_DISABLE_TUNE_SIGINT] = previous_env


@contextmanager
def tune_running() -> Iterator[None]:
    """Marks the span of ``Tuner.fit``: a stop signal inside it goes to Tune's interrupt handler."""
    global _is_tune_running
    _is_tune_running = True
    try:
        yield
    finally:
        _is_tune_running = False


class RunInterrupted(Exception):
    """A stop signal ended a ``train`` run before its last epoch; its checkpoints stay for ``--resume``."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(signal.Signals(signum).name)


@contextmanager
def stop_signals_end_the_run() -> Iterator[None]:
    """Around a Ray Train ``fit`` in the main thread (``train``): SIGINT and SIGTERM end it as
    :class:`RunInterrupted`.

    Ray handles both, and a stopped run would exit as if it had failed: Ray Train's ``fit`` installs its own
    SIGINT handler, which aborts the run's workers and exits (``ray.get`` then raises ``SystemExit(1)``), and
    ``ray.init``'s SIGTERM handler calls ``sys.exit(15)``. Ray's graceful SIGINT stays; SIGTERM unwinds the
    driver (the run's controller and workers are its actors and end with it). Which signal came is read from
    the wakeup file descriptor that Python writes every signal's number to, whatever handler runs.
    """
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread alone
        yield
        return
    reader, writer = socket.socketpair()
    for end in (reader, writer):
        end.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous_sigterm = signal.signal(signal.SIGTERM, _unwind)  # Ray's exits with 15; this unwinds as Ctrl-C does
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as stop:
        came = _signals_written(reader)
        stop_signal = next((signum for signum in (signal.SIGTERM, signal.SIGINT) if signum in came), None)
        if stop_signal is None:
            raise  # an exit of another cause
        raise RunInterrupted(stop_signal) from stop
    finally:
        if previous_sigterm is not None:  # None: a handler set outside Python, which cannot be put back from here
            signal.signal(signal.SIGTERM, previous_sigterm)
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()


def _unwind(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _signals_written(reader: socket.socket) -> set[int]:
    """The signal numbers written to a wakeup descriptor's other end so far."""
    came: set[int] = set()
    with suppress(BlockingIOError):
        while chunk := reader.recv(256):
            came.update(chunk)
    return came
