"""What the driver's terminal shows of the output of Ray's worker processes (trial actors, Train workers).

Ray streams every worker's stdout and stderr to the driver (``log_to_driver``): a trial's own errors belong
there. A trial actor that Tune ends after its trial finished may print a traceback ending in ``SystemExit: 1``
as its process is torn down, which reached the terminal just before the study's result table although the
study succeeded. Such a traceback goes to a file among the Ray session's logs instead; the worker's own log
file (``worker-*.err`` there) has it too.
"""
from __future__ import annotations

from typing import Any, Callable

PRINT_HANDLER = "ray_print_logs"  # Ray's name for its printer; ray.shutdown removes the handler by this name
EXIT_LINE = "SystemExit"


def is_exit_traceback(lines: list[str]) -> bool:
    """Whether a batch of a worker's lines holds a traceback of a process exiting (``SystemExit: <code>``)."""
    return any(line.startswith(EXIT_LINE) for line in lines) and any("Traceback (most recent call last)" in line
                                                                      for line in lines)


def exit_tracebacks_to_log(log_path_of_session: Callable[[], str | None]) -> bool:
    """Wraps Ray's printer of worker output (once per ``ray.init``): a batch of lines that is an exiting process's
    traceback is appended to ``log_path_of_session()`` instead of the terminal; everything else prints as before.
    Returns whether it was installed (not without a Ray that prints worker output, nor twice)."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # another Ray: its output prints as it does
        return False
    printers = [handler for name, handler in dispatcher.handlers if name == PRINT_HANDLER]
    if len(printers) != 1 or getattr(printers[0], "diverts_exit_tracebacks", False):
        return False
    printer = printers[0]

    def print_or_log(data: dict[str, Any]) -> None:
        lines = data.get("lines") or []
        path = log_path_of_session() if is_exit_traceback(lines) else None
        if path is None:
            return printer(data)
        who = f"{data.get('actor_name') or data.get('task_name') or 'worker'} pid={data.get('pid')}"
        with open(path, "a") as log:
            log.writelines(f"({who}) {line}\n" for line in lines)

    print_or_log.diverts_exit_tracebacks = True  # type: ignore[attr-defined]
    dispatcher.remove_handler(PRINT_HANDLER)
    dispatcher.add_handler(PRINT_HANDLER, print_or_log)  # Ray's name: ray.shutdown removes it with the printer
    return True
