"""Argument parsing for ``studies/sweep.py`` and ``studies/best.py``."""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from ...config import BACKBONE_NAMES
from ...paths import absolute_data_dir_env, add_tracking_uri_argument
from ...protocol import KNOBS
from .protocol import add_protocol_arguments
from .train import add_common_arguments
from ...cli_types import non_negative_float, non_negative_int, positive_int
from ..spec.duration import parse_duration
from ..spec.study import QUICK_SETTINGS, StudySpec, quick_negatives

SWEEP_EPILOG = """\
defaults: TIGER with CE, APAO-pointwise and APAO-pairwise; 3 Optuna trials per tuned loss (7 trials), up to 20
epochs each (patience 5), ASHA stopping APAO trials weaker than others of their method after 5 epochs (CE runs
to the end). Before the first trial the study prints its plan: trials per method, epochs, and the wall time and
peak memory estimated from ~8 s of optimizer steps of the real model on this machine (--dry-run stops there). A
paper-size study on a full dataset takes days on 2 CPUs: give --budget (e.g. 3h) and the study is fitted to it
(every method it runs at equal epochs, at least --min-epochs; a method that cannot reach them is deferred with
what it needs; --dry-run --json prints the plan as JSON), or run it on GPUs (--gpus-per-trial 0.25 runs four trials per GPU). Measured
on 2 vCPUs: --dataset grocery --budget 2h gave each method 1 epoch on a 48,128-sample subset and took 66.5 min
(a check of the pipeline, not a result: APAO-pairwise costs ~12x a CE epoch). On one H200 an Office TIGER CE
epoch with validation took 2.1 s and APAO-pairwise ~10 s of training (the study itself not yet timed there). --quick finishes in a few minutes
on 2 CPUs (tiny model, 2048-sample subset, 2 epochs, 4 trials): a check, not a result. These schedules are not
the paper's (200 epochs, patience 20; --epochs 200 --patience 20): the results table says whether its test
columns compare with paper Table 1. --protocol reference trains as the authors' released code does
(docs/PROTOCOLS.md); eta stays searched under both protocols.

examples:
  python -m apao_ray sweep --dataset grocery --dry-run    # the plan and its cost, then exit
  python -m apao_ray sweep --dataset grocery --budget 3h
  python -m apao_ray sweep --dataset office --quick
  python -m apao_ray sweep --dataset beauty --backbones tiger,llama --losses ce,apao_pairwise --num-samples 10
  python -m apao_ray sweep --dataset office --address auto --gpus-per-trial 0.25 --max-concurrent 8
  python -m apao_ray sweep --dataset grocery --resume     # after Ctrl-C or a lost driver: continue the study
then: python -m apao_ray best --dataset grocery ;  mlflow ui --backend-store-uri sqlite:///$PWD/mlflow.db
(studies/sweep.py and ./apao sweep take the same flags)

exit codes: 0 the study ran and at least one trial finished (failed trials are counted and listed, each with its
reason); 1 no trial finished (its table and that list say why); 2 input refused before anything ran; 130 / 143
stopped by SIGINT (Ctrl-C) / SIGTERM, its state saved for --resume
"""
DEFAULTS = {f.name: f.default for f in fields(StudySpec)}


def parse_range(text: str, cast: type = float) -> tuple:
    """'LOW:HIGH' (or one value) -> (low, high)."""
    parts = text.split(":")
    try:
        values = tuple(cast(float(p)) if cast is int else cast(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW:HIGH numbers") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"{text!r} must be LOW:HIGH")
    return values


def comma_list(text: str) -> tuple[str, ...]:
    items = tuple(t.strip() for t in text.split(",") if t.strip())
    if not items:
        raise argparse.ArgumentTypeError("give at least one name")
    return items


def seed_list(text: str) -> tuple[int, ...]:
    """'0,1,2' -> (0, 1, 2)."""
    try:
        return tuple(int(t) for t in comma_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integer seeds, e.g. 0,1,2") from None


def duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser(prog: str = "studies/sweep.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SWEEP_EPILOG,
        description="Hyperparameter study: Ray Tune + Optuna TPE over beta, eta and negatives for each "
                    "(backbone, loss), every trial recorded in MLflow. The Python API is apao_ray.run_study("
                    "apao_ray.StudySpec(...)).")
    add_common_arguments(parser)
    parser.set_defaults(epochs=DEFAULTS["epochs"], patience=DEFAULTS["patience"])  # %(default)s shows these
    parser.add_argument("--backbones", type=comma_list, default=DEFAULTS["backbones"],
                        help=f"comma list of {list(BACKBONE_NAMES)} (default tiger)")
    parser.add_argument("--losses", type=comma_list, default=DEFAULTS["losses"],
                        help="comma list from apao_ray.losses.LOSSES (default ce,apao_pointwise,apao_pairwise); "
                             "losses with nothing to tune are baselines and run once per backbone")
    parser.add_argument("--num-samples", type=positive_int, default=DEFAULTS["num_samples"],
                        help="Optuna trials per tuned (backbone, loss) (default %(default)s)")
    parser.add_argument("--beta", type=parse_range, default=DEFAULTS["beta"], help="LOW:HIGH (default 0.05:0.4, paper grid)")
    parser.add_argument("--eta", type=parse_range, default=DEFAULTS["eta"], help="LOW:HIGH, log scale (default 5e-6:5e-4)")
    parser.add_argument("--negatives", type=lambda t: parse_range(t, int), default=None,
                        help="LOW:HIGH negatives for pairwise losses, log scale (default 10:200; 10:20 with --quick)")
    parser.add_argument("--knob", dest="knob_ranges", type=parse_knob_range, action="append", default=[],
                        metavar="NAME=LOW:HIGH", help="search range of another knob a loss declares (Loss.knobs; "
                        "repeatable; default: the knob's own range; docs/own-loss.md)")
    parser.add_argument("--pretrain-ce-epochs", type=non_negative_int, default=None,
                        help="CE epochs before a preference loss (dpo/dmpo/sdpo; default half the epochs)")
    parser.add_argument("--max-concurrent", type=positive_int, default=None, help="trials at once (default: the cluster's CPUs // cpus-per-trial)")
    parser.add_argument("--workers-per-trial", type=positive_int, default=DEFAULTS["workers_per_trial"],
                        help="data-parallel Ray Train workers per trial (DDP; each with --cpus-per-trial CPUs and "
                             "--gpus-per-trial GPUs); refused when the cluster cannot place them all "
                             "(default %(default)s: the trial trains in its Tune actor; docs/parallelism.md)")
    parser.add_argument("--cpus-per-trial", type=positive_float, default=DEFAULTS["cpus_per_trial"],
                        help="CPUs (and torch threads) per trial, per worker with --workers-per-trial; 0.5 packs two "
                             "trials per CPU, each on 1 thread "
                             "(default: this machine's CPUs shared by the trials that run at once, at least 1 each and "
                             "no more than the CPUs not busy at the start: a lone trial on an idle 2-CPU machine "
                             "gets 2; 1 on a cluster)")
    parser.add_argument("--gpus-per-trial", type=non_negative_float, default=DEFAULTS["gpus_per_trial"],
                        help="GPUs per trial; fractions share a GPU (0.25) (default %(default)s)")
    parser.add_argument("--budget", type=duration, default=None, metavar="DURATION",
                        help="wall-clock budget, e.g. 3h, 90m, 1h30m or seconds: the study is fitted to it (fewer "
                             "epochs, then fewer trials; methods whose trial of --min-epochs does not fit are deferred; ASHA "
                             "rungs from the epochs) and stopped at it (default: none)")
    parser.add_argument("--time-budget", type=positive_float, default=None, metavar="SECONDS",
                        help="deprecated: --budget SECONDS")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (trials, epochs, estimated time and "
                        "memory from a short probe on this machine) and exit without training")
    parser.add_argument("--json", action="store_true", help="with --dry-run: print the plan as one JSON object on "
                        "stdout (the plan's text goes to stderr)")
    parser.add_argument("--min-epochs", type=positive_int, default=DEFAULTS["min_epochs"],
                        help="the fewest epochs --budget may cut a trial to; a method whose one trial of them does not "
                             "fit is deferred: a table row without trials, saying what it needs (default %(default)s)")
    parser.add_argument("--reprobe", action="store_true", help="measure the plan's timing probe again instead of "
                        "reading ~/.cache/apao_ray/probes.json (after a change of hardware load or code)")
    parser.add_argument("--ray-dashboard", action="store_true",
                        help="start the dashboard of the local Ray this study starts (off by default: it holds ~1.1 GiB "
                             "of memory in 12 processes; the progress lines, MLflow and optuna-dashboard show the "
                             "study); a cluster given by --address keeps its own")
    parser.add_argument("--max-failures", type=non_negative_int, default=DEFAULTS["max_failures"],
                        help="restarts of a failed trial from its checkpoint (default %(default)s)")
    parser.add_argument("--memory-per-trial", type=positive_float, metavar="GIB",
                        help="memory cap per trial in GiB, counting what the trial itself allocates: the memory its "
                             "worker maps past what it mapped when the trial started, torch and Ray loaded (0.5-2.5 GiB, "
                             "by allocator; not counted), whether touched yet or not; the same under every allocator "
                             "(APAO_RAY_ALLOCATOR). A trial that needs more fails as 'out of memory', naming the cap "
                             "and what it held, instead of the node's OOM killer taking processes; Ray reserves the "
                             "cap for the trial's scheduling (default: no cap)")
    parser.add_argument("--asha-grace-period", type=positive_int, default=DEFAULTS["asha_grace_period"],
                        help="epochs before ASHA may stop a trial (default %(default)s; a quarter of the epochs "
                             "when --budget shortens them); a trial is only compared with trials "
                             "of its own (backbone, loss), baselines are never stopped, and a pruned trial is tested "
                             "on its best checkpoint")
    parser.add_argument("--seeds", type=seed_list, default=DEFAULTS["seeds"], metavar="S,S,...",
                        help="seeds as a study dimension, e.g. 0,1,2: the search runs on the first; then the best "
                             "configuration of every (backbone, loss) trains again on each other seed (trials of the "
                             "same study, resumable) and the table shows mean, std and significance over the seeds; "
                             "not with --seed (default: --seed alone)")
    parser.add_argument("--study-name", help="default <dataset>-study; re-running the same name resumes it")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted study (refused when there is "
                        "none); re-running the same command does the same")
    parser.add_argument("--retry-failed", action="store_true", help="on a resume, also run again the trials that "
                        "failed (e.g. killed for memory), each from its last epoch checkpoint; without it they stay "
                        "failed")
    parser.add_argument("--overwrite", action="store_true", help="start the study again from scratch")
    add_tracking_uri_argument(parser, "MLflow store the study records to")
    parser.add_argument("--optuna-storage", metavar="URL",
                        help="SQLAlchemy URL (or SQLite file path) of the searcher's Optuna study (default: optuna.db "
                             "beside a SQLite MLflow database, else in --output-dir); open it with optuna-dashboard URL")
    parser.add_argument("--enqueue-paper-setting", action=argparse.BooleanOptionalAction, default=True,
                        help="each tuned (backbone, loss) starts with the paper's setting (Table 5), clipped to the "
                             "ranges (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="a few minutes on 2 CPUs: tiny model, data subset, 2 epochs, "
                        "4 trials, no ASHA stopping")
    add_protocol_arguments(parser, with_eta=False)
    return parser


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a number > 0")
    return value


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the options written on the command line, however written (``--x v``, ``--x=v``,
    an abbreviation such as ``--epo 3``): argparse fills in a default only where the namespace it is
    given lacks the attribute, so a second parse into a namespace pre-filled with a marker leaves the
    marker exactly on the options not written."""
    marker = object()
    dests = vars(parser.parse_args(argv))
    written = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, marker)))
    return {dest for dest, value in vars(written).items() if value is not marker}


def apply_quick(args: argparse.Namespace, given: set[str]) -> None:
    """--quick / --smoke settings, except for the options written explicitly."""
    if args.quick or args.smoke:
        for name, value in {**QUICK_SETTINGS, "num_samples": min(args.num_samples, 3)}.items():
            if name not in given:
                setattr(args, name, value)
        # grace past the last epoch: 2 epochs leave ASHA nothing to compare, every trial reaches its test
        if "patience" not in given:
            args.patience = args.epochs
        if "asha_grace_period" not in given:
            args.asha_grace_period = args.epochs + 1
        if "negatives" not in given:
            args.negatives = quick_negatives(args.losses)
    if args.smoke:
        args.dataset = "synthetic"


def spec_from_args(args: argparse.Namespace) -> StudySpec:
    """The StudySpec the flags describe (its construction checks every input)."""
    if args.time_budget is not None:
        print("warning: --time-budget is deprecated; use --budget (it also fits the study to the budget)",
              file=sys.stderr)
    knobs = {knob: getattr(args, knob, None) for knob in KNOBS if knob != "eta"}
    values = {name: getattr(args, name) for name in DEFAULTS if hasattr(args, name) and name != "budget"}
    values.update(budget=args.budget if args.budget is not None else args.time_budget,
                  memory_per_trial_gib=args.memory_per_trial,
                  protocol_knobs={k: v for k, v in knobs.items() if v is not None},
                  knob_ranges=dict(args.knob_ranges),
                  retention_users=32 if args.quick or args.smoke else DEFAULTS["retention_users"])
    return StudySpec(**values)


def parse_knob_range(text: str) -> tuple[str, tuple[float, float]]:
    """'NAME=LOW:HIGH' (or NAME=VALUE) -> (name, (low, high)); the knob and its scale are checked by the spec."""
    name, equals, bounds = text.partition("=")
    if not equals or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r} must be NAME=LOW:HIGH, e.g. gamma=0.01:0.3")
    return name.strip(), parse_range(bounds)


def main(argv: list[str] | None = None, prog: str = "studies/sweep.py") -> int:
    parser = build_parser(prog)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    absolute_data_dir_env()  # the trials and the plan's probes run in other working directories
    given = given_flags(parser, argv)
    if {"seed", "seeds"} <= given:
        parser.error(f"--seed {args.seed} and --seeds {','.join(map(str, args.seeds))} were both given; give --seeds "
                     "alone (the search runs on its first seed) or --seed alone")
    if args.json and not args.dry_run:
        parser.error("--json prints the plan: give it with --dry-run")
    apply_quick(args, given)
    from ..api import plan_study, prepare, run_study
    from ..record.report import format_rows

    try:
        spec = spec_from_args(args)
        setup = prepare(spec)  # the files, MLflow, Ray and a resumed study's records, before the probe
        plan = plan_study(spec, setup, use_cache=not args.reprobe)  # a budget too small for one epoch is refused
    except (ValueError, FileNotFoundError, ConnectionError, RuntimeError) as error:
        parser.error(str(error))
    print(plan.text(), file=sys.stderr)
    if args.dry_run:
        if args.json:
            print(json.dumps(plan.to_dict()))
        return 0
    result = run_study(spec, plan=plan, setup=setup)
    if result.interrupted:
        return report_interrupted(result, argv)
    failed = sum(str(status).startswith("failed") for status in result.trials.get("status", []))
    print(f"study {result.study_name}: {len(result.trials)} trials ({failed} failed); best per (backbone, loss) "
          "by validation:", file=sys.stderr)
    none_finished = failed == len(result.trials)  # every trial failed (or none ran)
    print(format_rows(table_records(result.table), "markdown"))
    print(result.cost_summary, file=sys.stderr)
    if result.optuna_summary:
        print(result.optuna_summary)
    from ...mlflow_ui import ui_hint, view_key
    from ...tracking import Tracker, experiment_name

    tracker = Tracker(result.tracking_uri, experiment_name(setup.base.data.dataset))
    print(ui_hint(result.tracking_uri, tracker.experiment_id, view_key(result.study_name)))
    print_failures(result.trials)
    if none_finished:
        print(f"study {result.study_name}: no trial finished ({failed} failed; why: the status column above); "
              "exit code 1", file=sys.stderr)
    return 1 if none_finished else 0


def print_failures(trials: Any) -> None:
    """Each failed trial and why, one line each (the table keeps one reason per method)."""
    from ..record.outcomes import describe

    failed = [row for row in table_records(trials) if str(row.get("status")).startswith("failed")]
    if failed:
        print(f"failed trials ({len(failed)}):", file=sys.stderr)
    for row in failed:
        name = describe({key: value for key, value in row.items() if value is not None})
        print(f"  {name}: {row['status']}", file=sys.stderr)


def table_records(table: Any) -> list[dict[str, Any]]:
    """A result DataFrame back to row dicts, NaN (a missing value) as None."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in table.to_dict("records")]


def report_interrupted(result: Any, argv: list[str]) -> int:
    """Tells what an interrupted study kept and how to continue it; returns the exit code
    (128 + the signal: 130 for SIGINT / Ctrl-C, 143 for SIGTERM)."""
    import shlex
    import signal

    from ..run.interrupt import exit_code

    done = sum(status != "stopped" for status in result.trials.get("status", []))
    num_trials, study_name = result.plan.num_trials, result.study_name
    script = [sys.argv[0]] if sys.argv[0].endswith("sweep.py") else ["-m", "apao_ray", "sweep"]
    command = shlex.join([sys.executable, *script, *argv])
    cause = signal.Signals(result.stop_signal).name if result.stop_signal else "an interrupt"
    print(f"study {study_name} stopped by {cause} with {done} of {num_trials} trials ended; its state is saved: "
          f"re-run the same command (or add --resume) to continue:\n  {command}", file=sys.stderr)
    return exit_code(result.stop_signal or signal.SIGINT)


def build_best_parser(prog: str = "studies/best.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Best trial per (backbone, loss) of a "
                                     "dataset's studies, chosen by validation, read from MLflow alone (no Ray); with "
                                     "--seeds studies, mean and std over its seeds and the paired significance against "
                                     "the baseline.")
    parser.add_argument("--dataset", required=True, help="dataset whose experiment (apao-<dataset>) to read")
    parser.add_argument("--study-name", help="only this study (default: every study of the dataset)")
    parser.add_argument("--metric", default="best/val/ndcg_at_10", help="validation metric that picks the best trial (default %(default)s)")
    parser.add_argument("--baseline", default="ce", help="loss every method is compared with, per user on the test "
                        "metric of --metric, seeds pooled, Holm-corrected (default %(default)s)")
    parser.add_argument("--format", choices=("markdown", "csv", "json"), default="markdown", help="default %(default)s")
    add_tracking_uri_argument(parser)
    parser.add_argument("--no-register", action="store_true", help="do not register/alias the best models")
    return parser


def best_main(argv: list[str] | None = None, prog: str = "studies/best.py") -> int:
    parser = build_best_parser(prog)
    args = parser.parse_args(argv)
    from ...tracking import Tracker, check_tracking_uri, experiment_name, resolve_tracking_uri
    from ...data import dataset_label
    from ..record.report import format_rows, register_best, table_rows

    try:
        uri = resolve_tracking_uri(args.tracking_uri)
        check_tracking_uri(uri)
        if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
            raise ValueError(f"no MLflow database at {uri}; run a study first or pass --tracking-uri")
        experiment = experiment_name(args.dataset.lower())
        tracker = Tracker.existing(uri, experiment)  # never creates the experiment it reads
        if tracker is None:
            from ...tracking import experiment_names

            raise ValueError(f"--dataset {args.dataset}: no experiment {experiment!r} in {uri}; experiments there: "
                             f"{experiment_names(uri)}")
    except (ValueError, ConnectionError) as error:
        parser.error(str(error))
    rows = table_rows(tracker, args.metric, args.study_name, args.baseline)
    if not rows:
        print(f"no finished trials for dataset {args.dataset!r} in {uri}", file=sys.stderr)
        return 1
    if not args.no_register:
        for row, registered in zip(rows, register_best(tracker, rows, dataset_label(args.dataset))):
            if registered:
                row["registered_model"], version, is_new = registered
                print(f"{row['registered_model']}: version {version} "
                      f"{'registered' if is_new else 'unchanged (already this run)'}", file=sys.stderr)
    print(format_rows(rows, args.format))
    return 0
