"""Names the training side writes and the study side reads: result keys, file names, run and scratch
directory names.

One place for each, imported by both sides. It imports neither torch nor Ray, so the study's driver
(its MLflow and progress callbacks, the report) reads a trial's results without loading what trains it.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any
from . import storage

# modules that define losses outside the package (comma-separated), imported by apao_ray.losses in the
# driver and in every Ray worker (the study passes it through Ray's runtime_env)
PLUGINS_ENV = "APAO_PLUGINS"
# keys in a trial's reports (one per epoch, then the final one)
RESUMED_HISTORY_KEY = "resumed_history"  # per-epoch metrics so far, in the first report after a resume
PRECISION_KEY = "precision"  # the resolved precision (fp32/bf16), in every report
WORKER_NODE_KEY = "worker_node_id"  # the Ray node the trial trained on
ALLOCATOR_KEY = "allocator"  # the memory allocator the worker runs on (training/memory.allocator_in_use)
ENERGY_METHOD_KEY = "energy_method"  # a sentence in the final report (MLflow tag apao.energy_method)
# a trial's cost, in its final report (training/cost.CostMeter); summed over a method's trials, the rest maxed
WALL, CPU, RSS, GPU_MEMORY, ENERGY = ("cost/wall_seconds", "cost/cpu_seconds", "cost/peak_rss_mb",
                                      "cost/peak_gpu_memory_mb", "cost/energy_kwh")
SUMMED = (WALL, CPU, ENERGY)

# MLflow tags of a study's child runs that the record, the table and the report read
SEED_TAG = "apao.seed"  # on every child run: the seed it trained on
REPEATS_TAG = "apao.repeats"  # on a repeat: the run id of the search trial whose configuration it repeats
COHORT_TAG = "apao.cohort"  # on a repeat trained in a fused cohort (--cohort-size): "<id>: member m of K"
# on a finished trial: its method's convergence verdict as the study's end computed it (with the popularity check,
# which needs the dataset): `best` and `report`, reading MLflow or an export alone, say the same
CONVERGED_TAG = "apao.converged"
PLAN_TAG = "apao.plan"  # on a study's parent run: what its plan answers, its budget protocol, its deferred methods

# on a study's parent run: its selection (protocol.Selection, as JSON), the one rule every surface names its best by
SELECTION_TAG = "apao.selection"
# on every child run: how it ended (a sentence: "finished", "pruned at epoch 3", "out of memory", ...); a failed run's error
OUTCOME_TAG, ERROR_TAG = "apao.outcome", "apao.error"
PRUNED = "pruned at epoch"  # + the epoch; the trial is then tested on its best checkpoint (study/run/pruned.py)

# the metric a trial logs once it has tested its kept model: its presence is what "the trial reached its test" means
TESTED_KEY = "test/ndcg_at_10"


def reached_test(metrics: Any) -> bool:
    """Whether a trial's metrics (a dict, MLflow's ``run.data.metrics``, an export's record) include its test: the
    one reading of "finished with a result" the table, the report, the seeds, the pruned trials' tests and the
    API share."""
    return TESTED_KEY in metrics


# every report of a trial, one JSON line each, appended across restarts, in its run directory
REPORTS_FILE = "metrics.jsonl"

# a finished trial's test metrics at the epoch each selection rule keeps: test_by/<rule>/<metric> (training/selection.py)
TEST_BY = "test_by"
# TrainConfig.test_every_epoch: the test split after every epoch, diagnosis/test/<metric>; no selection reads it
DIAGNOSIS_PREFIX = "diagnosis/"

# the epoch rules every trial follows besides its own (training/selection.py): the lowest validation loss, the last epoch
LOSS_RULE, LAST_RULE = "loss", "last"


def rule_name(rule: str) -> str:
    """``val_ndcg_at_10``, ``val_loss``, ``last``: a rule as metric names and per-user columns spell it."""
    return rule if rule == LAST_RULE else f"val_{rule}"


def test_by_key(rule: str, metric: str) -> str:
    """``test_by/val_loss/ndcg_at_10``: a test metric (``test/`` or not) at the epoch ``rule`` keeps."""
    return f"{TEST_BY}/{rule_name(rule)}/{metric.removeprefix('test/')}"


# files of a finished trial's final checkpoint
PER_USER_FILE = "per_user_test.csv.gz"  # beside final_metrics.json; an MLflow artifact of every finished trial
# the kept model's validation, per user (the validation users of the selection): to compare validation with test
PER_USER_VALID_FILE = "per_user_valid.csv.gz"

SCRATCH_PREFIX = "apao-worker-"  # + the run's name and directory (scratch_prefix): a worker's scratch in the system temp dir


def counted(number: float, noun: str, plural: str | None = None) -> str:
    """``1 trial``, ``2 trials``, ``1 study``/``2 studies`` (``plural`` given): a count with its noun in the number
    it needs (every layer's messages). A whole float (a count read back from a DataFrame column that also holds
    a missing value) is written as the integer it is: ``1 seed``, never ``1.0 seed``."""
    number = int(number) if isinstance(number, float) and number.is_integer() else number
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


KNOB_DIGITS, METRIC_DECIMALS = 3, 4  # how a knob and a metric are shown (params, run names, descriptions)


def shown_knob(value: Any) -> Any:
    """A knob as the MLflow UI shows it: a float to ``KNOB_DIGITS`` significant digits (``0.203`` for
    0.20259821574970133), anything else as it is; the trial trains on its exact value (``trial_config.json``)."""
    return float(f"{value:.{KNOB_DIGITS}g}") if isinstance(value, float) else value


def shown_metric(value: float | None) -> str:
    """A metric as text: ``METRIC_DECIMALS`` decimals (``0.0257``), ``-`` for none; the metric keeps every digit."""
    return "-" if value is None else f"{value:.{METRIC_DECIMALS}f}"


def train_run_name(trial_id: str) -> str:
    """A trial's Train run name, from the Tune trial id and no timestamp: a restored trial finds its checkpoints."""
    return f"train-trial_id={trial_id}"


def read_reports(train_root: str | Path, trial_id: str) -> list[dict]:
    """The reports a trial's runs have written so far under ``train_root`` (none if it never ran), oldest first."""
    text = storage.read_text(storage.join(train_root, train_run_name(trial_id), REPORTS_FILE))
    return [json.loads(line) for line in (text or "").splitlines() if line.strip()]


def scratch_prefix(run_dir: str | Path) -> str:
    """The prefix of a run's scratch directories: its name and a digest of its absolute directory, so that two
    runs of one name in different output directories (two checkouts trained side by side) never share one. A
    run on an object store (a URI) is named by its URI, the same in every process."""
    location = storage.absolute(run_dir)
    digest = hashlib.sha1(location.encode()).hexdigest()[:10]
    return f"{SCRATCH_PREFIX}{storage.name(location).replace('=', '_')}-{digest}-"


def remove_scratch(run_dir: str | Path) -> None:
    """Removes the scratch directories of the run in ``run_dir`` on this node, e.g. those of workers that were
    killed (a trial that the scheduler stopped) before they could remove their own; another run's, of the same
    name or not, stay."""
    for path in Path(tempfile.gettempdir()).glob(scratch_prefix(run_dir) + "*"):
        shutil.rmtree(path, ignore_errors=True)
