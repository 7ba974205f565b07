"""A study's fixed trials as fused cohorts (``--cohort-size K``): the repeat phase's trials (the best
configuration of every method on every other seed) train K at a time as one batched model
(training/cohort.py), while every member stays a Tune trial of its own, so that its MLflow child run, its row in
the table, the export and a resume are exactly a solo trial's.

Each cohort has a leader (its first member) and followers. Every member's Tune trial registers its run directory
and config in the cohort's directory (``<train_root>/cohorts/<id>/``); the leader waits for all of them, then
trains the whole cohort in its own actor, writing each member's checkpoints and reports into that member's run
directory. A follower holds a sliver of a CPU and relays its run directory's reports to Tune as they appear,
ending with its member's final report. The leader reserves the cohort's CPUs and GPUs (the followers' slivers
taken off) and K times the per-trial memory cap.

Failures: a failure a restart would meet again (non-finite loss, out of memory) fails every member with the
reason; any other ends the leader's attempt, Tune retries it (``--max-failures``) and the cohort resumes every
member from its own checkpoint while the followers wait. A follower whose leader was alive and then fell silent
for ``LEADER_SILENT_S`` fails, naming it (Tune retries it, and a resume runs it again).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ...config import TrialConfig
from ...names import REPORTS_FILE, remove_scratch
from ..spec import space
from ..spec.space import COHORT_KEY, MEMBER_KEY, SIZE_KEY
from dataclasses import replace

COHORTS_DIR = "cohorts"
FOLLOWER_CPUS = 0.01  # a follower only reads a file and relays it to Tune
HEARTBEAT_FILE, HEARTBEAT_S = "leader_alive", 5.0
LEADER_SILENT_S = 600.0  # a leader silent this long after it was seen alive has died (Tune gave up on it)
RELAYED_FILE = "relayed_reports"  # in a follower's run dir: the bytes of its reports passed to Tune (a restart goes on)
POLL_S = 0.5


def assign_cohorts(configs: list[dict[str, Any]], base: TrialConfig, size: int, prefix: str) -> list[dict[str, Any]]:
    """``configs`` (Tune configs of fixed trials) with cohort keys added to the members of cohorts of up to
    ``size``: consecutive trials of one backbone that may train together (training/cohort.check_cohort; a
    two-stage loss trains alone). Trials left alone keep their config. Members are listed together, the leader
    first, so that a cohort's trials start side by side. ``prefix`` makes the ids unique in the study."""
    from ...training.cohort import check_cohort

    if size <= 1:
        return list(configs)
    groups: dict[str, list[dict[str, Any]]] = {}
    alone = []
    for config in configs:
        try:
            check_cohort([space.trial_config(base, config)])
        except ValueError:
            alone.append(config)
            continue
        groups.setdefault(config["backbone"], []).append(config)
    out: list[dict[str, Any]] = []
    chunks = [members[start:start + size] for members in groups.values() for start in range(0, len(members), size)]
    for chunk in chunks:
        if len(chunk) == 1:
            out.append(chunk[0])
            continue
        cohort = f"{prefix}{cohorts_in(out)}"
        out += [{**config, COHORT_KEY: cohort, MEMBER_KEY: index, SIZE_KEY: len(chunk)}
                for index, config in enumerate(chunk)]
    return out + alone


def cohorts_in(configs: list[dict[str, Any]]) -> int:
    return len({config[COHORT_KEY] for config in configs if is_member(config)})


def is_member(config: dict[str, Any]) -> bool:
    return config.get(COHORT_KEY) is not None


def is_leader(config: dict[str, Any]) -> bool:
    return is_member(config) and int(config[MEMBER_KEY]) == 0


def cohort_dir(train_root: str | Path, config: dict[str, Any]) -> Path:
    return Path(train_root) / COHORTS_DIR / str(config[COHORT_KEY])


def tune_resources(config: dict[str, Any], trial: dict[str, float]) -> dict[str, float]:
    """A trial's Tune reservation, from the solo trial's (``trial``): a follower's sliver of a CPU; a leader's the
    cohort's: the CPUs less its followers' slivers, the GPUs, K times the memory cap."""
    if not is_member(config):
        return trial
    if not is_leader(config):
        return {"cpu": FOLLOWER_CPUS}
    size = int(config[SIZE_KEY])
    leader = {**trial, "cpu": max(FOLLOWER_CPUS, trial.get("cpu", 1.0) - (size - 1) * FOLLOWER_CPUS)}
    if trial.get("memory"):
        leader["memory"] = trial["memory"] * size
    return leader


def register(config: dict[str, Any], train_root: str | Path, run_dir: Path, label: str) -> None:
    """Leaves this member's run directory, config and progress label where its leader finds them."""
    directory = cohort_dir(train_root, config)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"run_dir": str(run_dir), "config": config, "label": label}
    temporary = directory / f".member_{config[MEMBER_KEY]}.tmp"
    temporary.write_text(json.dumps(record))
    temporary.replace(directory / f"member_{config[MEMBER_KEY]}.json")  # whole or not at all for the leader


def wait_for_members(config: dict[str, Any], train_root: str | Path) -> list[dict[str, Any]]:
    """The registrations of every member of the leader's cohort, in member order, once all have registered (a
    member that finished before an interruption is registered from then)."""
    directory, size = cohort_dir(train_root, config), int(config[SIZE_KEY])
    paths = [directory / f"member_{index}.json" for index in range(size)]
    while not all(path.exists() for path in paths):
        time.sleep(POLL_S)
    return [json.loads(path.read_text()) for path in paths]


class Heartbeat:
    """The leader's sign of life for its followers: a file touched every ``HEARTBEAT_S`` while it trains."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / HEARTBEAT_FILE
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self._stop.is_set():
            self.path.touch()
            self._stop.wait(HEARTBEAT_S)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def relay(run_dir: Path, directory: Path, report: Callable[[dict[str, Any]], None], failure_file: Path,
          silent_s: float = LEADER_SILENT_S) -> None:
    """A follower's work: passes each report the leader appends to ``run_dir``'s reports file to ``report``, from
    where an earlier attempt of this follower stopped, and returns after the final one (``done``).

    Raises:
        TrialFailedError: the leader left this member a failure (the cohort failed for good).
        RuntimeError: the leader has started once (its heartbeat exists) and nothing was heard of it for
            ``silent_s``, counted from this follower's start (a restarted leader beats again at once).
    """
    from ...training.failures import TrialFailedError

    cursor_path, reports = run_dir / RELAYED_FILE, run_dir / REPORTS_FILE
    relayed = int(cursor_path.read_text()) if cursor_path.exists() else 0  # bytes: only what is new is read
    started = time.time()
    while True:
        fresh = b""
        if reports.exists():
            with open(reports, "rb") as handle:
                handle.seek(relayed)
                fresh = handle.read()
        for line in fresh[:fresh.rfind(b"\n") + 1].splitlines(keepends=True):  # whole lines only
            metrics = json.loads(line) if line.strip() else {}
            if metrics:
                report(metrics)
            relayed += len(line)  # after the report: one killed while reporting reports it again
            cursor_path.write_text(str(relayed))
            if metrics.get("done"):
                return
        if failure_file.exists():
            raise TrialFailedError(failure_file.read_text())
        heartbeat = directory / HEARTBEAT_FILE
        if heartbeat.exists():  # a leader that never started yet (waiting for a slot) has left none
            silent = time.time() - max(heartbeat.stat().st_mtime, started)
            if silent > silent_s:
                raise RuntimeError(f"the leader of cohort {directory.name} (its member 0) has been silent for "
                                   f"{silent:.0f} s since this member started or last heard it: it failed or was "
                                   "stopped; this member waits for it again on a retry or a resume")
        time.sleep(POLL_S)


def run_member(config: dict[str, Any], base: TrialConfig, *, name: str, train_root: str, resources: Any,
               label: str, dataset_files: Any = None) -> None:
    """A cohort member's Tune trial (``name``: its run's name under ``train_root``): registers, then the leader
    trains the whole cohort (``resources``: a solo trial's, as the driver has them; ``dataset_files``: the
    dataset's files the driver shipped, if any) and a follower relays."""
    from .trial import FAILURE_FILE

    run_dir = Path(train_root).resolve() / name
    register(config, train_root, run_dir, label)
    directory = cohort_dir(train_root, config)
    if not is_leader(config):
        from ray import tune

        relay(run_dir, directory, tune.report, run_dir / FAILURE_FILE)
        return
    with Heartbeat(directory):  # while it waits for its members too
        _lead(config, base, train_root, resources, wait_for_members(config, train_root), dataset_files)


def _lead(config: dict[str, Any], base: TrialConfig, train_root: str, resources: Any,
          members: list[dict[str, Any]], dataset_files: Any = None) -> None:
    """The leader's training of its registered ``members``."""
    from ...training.worker import train_cohort_in_tune_actor
    from .trial import make_loop_config

    size = len(members)
    cohort_label = f"[cohort {config[COHORT_KEY]} of {size}: {', '.join(m['label'].strip(' []') for m in members)}] "
    loop_configs = [make_loop_config(space.trial_config(base, member["config"]), name=Path(member["run_dir"]).name,
                                     storage_path=train_root, verbose=False, progress_label=cohort_label,
                                     dataset_files=dataset_files, resources=resources if index else replace(
                                         resources, memory_bytes=resources.memory_bytes and resources.memory_bytes * size))
                    for index, member in enumerate(members)]
    try:
        train_cohort_in_tune_actor(loop_configs)
    finally:  # what an earlier attempt, killed mid-way, left in the system temp directory
        for loop_config in loop_configs:
            remove_scratch(loop_config["output_dir"])
