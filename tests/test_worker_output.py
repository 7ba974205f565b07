"""study/cluster/worker_output.py: an exiting trial actor's traceback goes to the Ray session's log, everything else
a worker prints reaches the terminal, through Ray's own dispatcher of worker output (no Ray started: the lines are
what Ray's log monitor hands it)."""
from __future__ import annotations

import pytest

from apao_ray.study.cluster import worker_output

TEARDOWN = ["Traceback (most recent call last):", '  File "python/ray/_raylet.pyx", line 1890, in ray._raylet.execute_task',
            "  File \".../ray/air/_internal/util.py\", line 118, in run", "SystemExit: 1"]
FAILURE = ["Traceback (most recent call last):", '  File "apao_ray/training/loop.py", line 90, in run_trial',
           "RuntimeError: the trial's own error"]


@pytest.fixture
def dispatcher():
    """Ray's dispatcher of worker output with a printer that records, as ray.init installs it; restored after."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    before = list(dispatcher.handlers)
    printed: list[list[str]] = []
    dispatcher.remove_handler(worker_output.PRINT_HANDLER)
    dispatcher.add_handler(worker_output.PRINT_HANDLER, lambda data: printed.append(data["lines"]))
    yield dispatcher, printed
    dispatcher.handlers = before


def test_an_exit_traceback_goes_to_the_session_log_and_every_other_line_is_printed(dispatcher, tmp_path):
    dispatcher, printed = dispatcher
    log = tmp_path / "apao_driver.log"
    assert worker_output.exit_tracebacks_to_log(lambda: str(log))
    assert not worker_output.exit_tracebacks_to_log(lambda: str(log))  # once: a second call wraps nothing
    progress = ["[apao] epoch 1: best/val/ndcg_at_10 0.0142"]
    for lines in (progress, TEARDOWN, FAILURE):
        dispatcher.emit({"lines": lines, "pid": 42, "actor_name": "ImplicitFunc", "is_err": True})
    assert printed == [progress, FAILURE]  # a trial's own error still shows
    assert log.read_text().splitlines() == [f"(ImplicitFunc pid=42) {line}" for line in TEARDOWN]
    # ray.shutdown removes Ray's printer by its name: the wrapper goes with it, and a next ray.init's is wrapped again
    dispatcher.remove_handler(worker_output.PRINT_HANDLER)
    assert not any(name == worker_output.PRINT_HANDLER for name, _ in dispatcher.handlers)
