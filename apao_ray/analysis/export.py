"""``python -m apao_ray export-study``: a study's results as a few small files that the report can be
rebuilt from alone (committed under ``benchmarks/results/<study>/``: a long run's results outlive its machine).

Layout of an export directory:
    study.json       the study's parent run and, per trial (child run): name, status, tags, params
                     (backbone, loss, seed, protocol, precision, knobs), last value of every metric
                     (test metrics, per-prefix recall, retention, cost), and where its per-user table is
    epochs.csv.gz    every per-epoch metric of every trial, long format: run_id, key, step, value
                     (train/val metrics, adaptive weights, learning rate, seconds per epoch)
    per_user/<run_id>.csv.gz   the trial's per-user test table (user, rank, Recall/NDCG@10/20, prefix hits)
    per_user_valid/<run_id>.csv.gz   the kept model's per-user validation table, where the trial logged one

A SQLite store is read from a snapshot copy (the live file of a running study is never opened).
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import shutil
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pandas as pd

from ..cli.types import positive_int
from ..paths import add_tracking_uri_argument
from ..names import PER_USER_VALID_FILE, SUMMED, counted
from ..protocol import Selection, recorded_selection
from .per_user import PER_USER_FILE, read_per_user, recompute_per_user
from .. import storage
from ..training.checkpoint import DamagedCheckpointError, check_checkpoint

STUDY_FILE = "study.json"
EPOCHS_FILE = "epochs.csv.gz"
PER_USER_DIR = "per_user"
PER_USER_VALID_DIR = "per_user_valid"
FORMAT_VERSION = 1
_SKIPPED_TAGS = ("mlflow.log-model.history", "mlflow.source.", "mlflow.user")


@contextlib.contextmanager
def snapshot(tracking_uri: str) -> Iterator[str]:
    """A read-only view of the store: a SQLite database is copied (sqlite's online backup, consistent
    while a study writes to it) into a temporary directory; other URIs are used as they are."""
    from ..tracking import check_tracking_uri, resolve_tracking_uri  # lazy: mlflow, only when the store is read: not for --help or a report from exports

    uri = resolve_tracking_uri(tracking_uri)
    if not uri.startswith("sqlite:///"):
        check_tracking_uri(uri)  # a server that does not answer: one line now, not MLflow's retries
        yield uri
        return
    source = Path(uri[len("sqlite:///"):])
    if not source.exists():
        raise FileNotFoundError(f"tracking URI {uri!r}: database {source} does not exist; pass --tracking-uri or set $MLFLOW_TRACKING_URI")
    with tempfile.TemporaryDirectory(prefix="apao-export-") as tmp:
        copy = Path(tmp) / "mlflow.db"
        with contextlib.closing(sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=60)) as src, \
                contextlib.closing(sqlite3.connect(copy)) as dst:
            src.backup(dst)
        yield f"sqlite:///{copy}"


def sole_study(tracking_uri: str | None) -> str:
    """The store's one study, for a command given no --study; where it holds none or several, an error naming them."""
    from ..tracking import redact, resolve_tracking_uri, studies_in  # lazy: mlflow, as in snapshot

    with snapshot(tracking_uri) as uri:  # a copy of a SQLite store: its name is not the one to print
        names = studies_in(uri)
    if len(names) != 1:
        raise ValueError(f"--study NAME is needed: {redact(resolve_tracking_uri(tracking_uri))} holds {len(names)} "
                         f"studies {names}")
    return names[0]


def _tags(tags: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(tags.items()) if not k.startswith(_SKIPPED_TAGS)}


def trial_record(run: Any) -> dict[str, Any]:
    return {"run_id": run.info.run_id, "name": run.info.run_name, "status": run.info.status,
            "start_time": run.info.start_time, "end_time": run.info.end_time,
            "tags": _tags(run.data.tags), "params": dict(sorted(run.data.params.items())),
            "metrics": dict(sorted(run.data.metrics.items()))}


def cost_totals(records: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (backbone, loss), every run's ``cost/*`` (finished, pruned or failed: all cost): wall and CPU
    seconds and energy summed, the largest peak memory."""
    totals: dict[tuple[str, str], dict[str, float]] = {}
    for record in records:
        method = (record["tags"].get("backbone", "?"), record["tags"].get("loss", "?"))
        for key, value in record["metrics"].items():
            if key.startswith("cost/"):
                sums = totals.setdefault(method, {})
                sums[key] = sums.get(key, 0.0) + value if key in SUMMED else max(sums.get(key, 0.0), value)
    return totals


def _epoch_rows(client: Any, run: Any) -> list[tuple[str, str, int, float]]:
    """Every step of every metric of a run (a final-only metric such as test/* has one step)."""
    rows = []
    for key in sorted(run.data.metrics):
        for metric in client.get_metric_history(run.info.run_id, key):
            rows.append((run.info.run_id, key, int(metric.step), float(metric.value)))
    return rows


def _download_per_user(client: Any, run_id: str, destination: Path, name: str = PER_USER_FILE) -> bool:
    names = {artifact.path for artifact in client.list_artifacts(run_id)}
    if name not in names:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        local = client.download_artifacts(run_id, name, tmp)
        shutil.copyfile(local, destination)
    return True


def _checkpoint_for(run: Any) -> str | None:
    """The trial's final checkpoint: the location tagged at its end (a local directory or a URI, ``storage``) when
    it loads (a local one is checked here, a remote one where its local copy is loaded; a damaged one is said, in
    one line), else the logged model's copy."""
    tagged = run.data.tags.get("apao.checkpoint")
    with contextlib.suppress(Exception):  # a store that does not answer: the logged model's copy will do
        if tagged and storage.is_dir(tagged):
            if storage.is_remote(tagged):
                return tagged
            try:
                check_checkpoint(tagged)
                return tagged
            except DamagedCheckpointError as error:
                print(f"{error}; reading the logged model's copy instead", file=sys.stderr)
    model_uri = run.data.tags.get("apao.model_uri")
    if model_uri:
        from ..tracking import load_checkpoint_dir_from_model  # lazy: mlflow, as in snapshot

        with contextlib.suppress(Exception):  # an unreadable model: reported as "no per-user table"
            return load_checkpoint_dir_from_model(model_uri)
    return None


def _recompute(run: Any, destination: Path, num_threads: int) -> str:
    """Writes the per-user table recomputed from the run's checkpoint; returns how it went (a sentence)."""
    from ..training.evaluation import write_per_user  # lazy: torch, only when a table is recomputed

    checkpoint = _checkpoint_for(run)
    if checkpoint is None:
        return "no per-user table: no checkpoint or logged model to recompute it from"
    with storage.local_copy(checkpoint) as directory:
        metrics, table = recompute_per_user(directory, num_threads)
    write_per_user(destination, table)
    logged = run.data.metrics.get("test/ndcg_at_10")
    again = metrics.get("test/ndcg_at_10")
    agreement = "" if logged is None else (
        f"; its mean NDCG@10 {again:.6f} {'equals' if abs(again - logged) < 1e-6 else 'DIFFERS from'} "
        f"the logged {logged:.6f}")
    return f"recomputed from {checkpoint}{agreement}"


def export_study(tracking_uri: str, study: str, to_dir: str | Path, recompute_per_user: bool = False,
                 num_threads: int = 1) -> dict[str, Any]:
    """Writes ``study.json``, ``epochs.csv.gz`` and ``per_user/`` for one study; returns the study record.

    Args:
        tracking_uri: the MLflow store (a SQLite file is read from a snapshot copy).
        study: the study name (``--study-name`` of the sweep; tag ``apao.study``).
        to_dir: the export directory (created; files of an earlier export there are replaced).
        recompute_per_user: for finished trials without a logged per-user table, test their best
            checkpoint again (minutes per trial on Office on a CPU) and export the recomputed table.
        num_threads: torch threads for that recomputation.

    Raises:
        ValueError: no study of that name in the store (the message lists those that exist).
    """
    # lazy: mlflow, as in snapshot
    from ..tracking import Tracker, quiet_mlflow, redact, resolve_tracking_uri, studies_in, study_experiment

    to_dir, tracking_uri = Path(to_dir), resolve_tracking_uri(tracking_uri)
    with snapshot(tracking_uri) as uri, quiet_mlflow():  # one download bar per trial otherwise
        experiment = study_experiment(uri, study)
        if experiment is None:
            raise ValueError(f"no study {study!r} in {redact(tracking_uri)!r}; studies there: {studies_in(uri)}")
        tracker = Tracker(uri, experiment)
        client = tracker.client
        parents = client.search_runs([tracker.experiment_id], f"tags.`apao.study` = '{study}' and "
                                     "tags.`apao.role` = 'study'", order_by=["attributes.start_time ASC"])
        children = [run for parent in parents for run in tracker.child_runs(parent.info.run_id)]
        children.sort(key=lambda run: (run.info.start_time or 0, run.info.run_id))
        (to_dir / PER_USER_DIR).mkdir(parents=True, exist_ok=True)
        (to_dir / PER_USER_VALID_DIR).mkdir(parents=True, exist_ok=True)
        trials, rows = [], []
        for run in children:
            record = trial_record(run)
            destination = to_dir / PER_USER_DIR / f"{run.info.run_id}.csv.gz"
            destination.unlink(missing_ok=True)
            if _download_per_user(client, run.info.run_id, destination):
                record["per_user"], record["per_user_source"] = f"{PER_USER_DIR}/{destination.name}", "logged by the trial"
            elif recompute_per_user and run.info.status == "FINISHED":
                record["per_user_source"] = _recompute(run, destination, num_threads)
                record["per_user"] = f"{PER_USER_DIR}/{destination.name}" if destination.exists() else None
            else:
                record["per_user"], record["per_user_source"] = None, (
                    "none logged (add --recompute-per-user to recompute it from the checkpoint)"
                    if run.info.status == "FINISHED" else f"none: the trial ended {run.info.status}")
            valid = to_dir / PER_USER_VALID_DIR / f"{run.info.run_id}.csv.gz"
            valid.unlink(missing_ok=True)
            record["per_user_valid"] = (f"{PER_USER_VALID_DIR}/{valid.name}" if _download_per_user(
                client, run.info.run_id, valid, PER_USER_VALID_FILE) else None)
            trials.append(record)
            rows.extend(_epoch_rows(client, run))
    with contextlib.suppress(OSError):  # no trial logged a validation table (runs from before they existed)
        (to_dir / PER_USER_VALID_DIR).rmdir()
    record = {"format_version": FORMAT_VERSION, "study": study, "experiment": experiment,
              "tracking_uri": redact(tracking_uri), "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "parents": [trial_record(parent) for parent in parents], "trials": trials}
    (to_dir / STUDY_FILE).write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    epochs = pd.DataFrame(rows, columns=["run_id", "key", "step", "value"])
    with gzip.open(to_dir / EPOCHS_FILE, "wt", compresslevel=9, newline="") as handle:
        epochs.to_csv(handle, index=False, float_format="%.7g")
    return record


@dataclass
class StudyExport:
    """A study read back from an export directory (what the report works from)."""

    directory: Path
    record: dict[str, Any]
    epochs: pd.DataFrame  # run_id, key, step, value

    @property
    def name(self) -> str:
        return self.record["study"]

    @property
    def trials(self) -> list[dict[str, Any]]:
        return self.record["trials"]

    @property
    def selection(self) -> Selection:
        """The study's ``protocol.Selection``, as its parent run recorded it."""
        return recorded_selection((parent.get("tags", {}), parent.get("params", {}))
                                  for parent in self.record.get("parents", []))

    def per_user(self, trial: dict[str, Any], split: str = "test") -> pd.DataFrame | None:
        """The trial's per-user table of ``split`` (``test``, or ``valid``: the kept model's validation), if any."""
        key = {"test": "per_user", "valid": "per_user_valid"}[split]
        return read_per_user(self.directory / trial[key]) if trial.get(key) else None

    def history(self, run_id: str, key: str) -> pd.Series:
        """(step -> value) of one metric of one trial, sorted by step."""
        rows = self.epochs[(self.epochs.run_id == run_id) & (self.epochs.key == key)]
        return rows.set_index("step")["value"].sort_index()


def load_export(directory: str | Path) -> StudyExport:
    directory = Path(directory)
    if not (directory / STUDY_FILE).exists():
        raise FileNotFoundError(f"{directory} is not a study export: it has no {STUDY_FILE} "
                                "(write one with `python -m apao_ray export-study`)")
    record = json.loads((directory / STUDY_FILE).read_text())
    if record.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory / STUDY_FILE}: format_version {record.get('format_version')!r}, this code reads "
                         f"{FORMAT_VERSION}")
    epochs = pd.read_csv(directory / EPOCHS_FILE, dtype={"run_id": str, "key": str})
    return StudyExport(directory, record, epochs)


def _main(args: argparse.Namespace) -> int:
    record = export_study(args.tracking_uri, args.study, args.to, args.recompute_per_user, args.threads)
    sizes = sum(path.stat().st_size for path in Path(args.to).rglob("*") if path.is_file())
    with_table = sum(1 for trial in record["trials"] if trial.get("per_user"))
    print(f"exported study {args.study!r}: {counted(len(record['trials']), 'trial')} ({with_table} with a per-user test "
          f"table) to {args.to} ({sizes / 1024:.0f} KB)")
    for trial in record["trials"]:
        if trial.get("per_user_source", "").startswith(("recomputed", "no per-user")):
            print(f"  {trial['name']}: {trial['per_user_source']}")
    return 0


def register(subparsers: Any) -> None:
    """Adds ``export-study`` to ``python -m apao_ray``."""
    parser = subparsers.add_parser("export-study", help="write a study's results as small files (for benchmarks/results/)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", required=True, help="study name (the sweep's --study-name)")
    add_tracking_uri_argument(parser, "MLflow store to read (a SQLite file is read from a snapshot copy)")
    parser.add_argument("--to", required=True, help="export directory, e.g. benchmarks/results/<study>/")
    parser.add_argument("--recompute-per-user", action="store_true",
                        help="for finished trials that logged no per-user test table (runs made before it existed), "
                             "test their best checkpoint again (default: off)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads for --recompute-per-user (default 1)")
    parser.set_defaults(handler=_main)
