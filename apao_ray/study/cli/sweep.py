"""Argument parsing for ``studies/sweep.py`` and ``studies/best.py``."""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any
import shlex
import signal

from ...names import counted
from ...paths import absolute_data_dir_env, add_tracking_uri_argument
from ...cli.types import OneOf
from ...config import TrialConfig
from ...protocol import KNOBS, selectable_metrics
from ..spec.study import StudySpec, quick_changes
from .fields import add_field_arguments, field_values, number, registry_names
from .protocol import add_protocol_arguments
from ..api import plan_study, prepare, run_study
from ..record.outcomes import describe
from ..spec.space import knob_names
from ..cluster.interrupt import exit_code
from ...data import dataset_label

SWEEP_EPILOG = """\
defaults: TIGER with CE, APAO-pointwise and APAO-pairwise; 3 Optuna trials per tuned loss (7 trials), up to 20
epochs each (patience 5), ASHA stopping APAO trials weaker than others of their method after 5 epochs (CE runs
to the end). Before the first trial the study prints its plan: trials per method, epochs, and the wall time and
peak memory estimated from ~8 s of optimizer steps of the real model on this machine (--dry-run stops there). A
paper-size study on a full dataset takes days on 2 CPUs: give --budget (e.g. 3h) and the study is fitted to it
(every method it runs at equal epochs, at least --min-epochs; a method that cannot reach them is deferred with
what it needs; --dry-run --json prints the plan as JSON), or run it on GPUs (--gpus-per-trial 0.5 shares one GPU
between two trials). Measured on 2 vCPUs: --dataset grocery --budget 3h ran CE and APAO-pointwise 16 epochs each
in 2h42m (APAO-pairwise deferred: ~2.6 h per epoch there). On one H200, --gpus-per-trial 0.5 --cpus-per-trial 8
took an Office TIGER CE + APAO-pointwise study at the paper's full protocol to early stopping in 6.3 min (3.3 s
per epoch each; APAO-pairwise ~10 s of training per epoch). --quick finishes in a few minutes
on 2 CPUs (tiny model, 2048-sample subset, 2 epochs, 4 trials): a check, not a result. These schedules are not
the paper's (200 epochs, patience 20; --epochs 200 --patience 20): the results table says whether its test
columns compare with paper Table 1. --protocol reference trains as the authors' released code does
(docs/PROTOCOLS.md); eta stays searched under both protocols.

examples (./apao runs apao_ray in the repo's .venv; python -m apao_ray and studies/sweep.py take the same flags):
  ./apao sweep --dataset grocery --dry-run    # the plan and its cost, then exit
  ./apao sweep --dataset grocery --budget 3h
  ./apao sweep --dataset office --quick
  ./apao sweep --dataset beauty --backbones tiger,llama --losses ce,apao_pairwise --num-samples 10
  ./apao sweep --dataset office --address auto --gpus-per-trial 0.25 --max-concurrent 8
  ./apao sweep --dataset grocery --resume     # after Ctrl-C or a lost driver: continue the study
then: ./apao best --dataset grocery           # the answer again; a study's end prints its MLflow UI and
                                              # optuna-dashboard commands, runnable from any directory

exit codes: 0 the study ran and at least one trial finished (failed trials are counted and listed, each with its
reason); 1 no trial finished (its table and that list say why); 2 input refused before anything ran; 130 / 143
stopped by SIGINT (Ctrl-C) / SIGTERM, its state saved for --resume
"""


def build_parser(prog: str = "studies/sweep.py") -> argparse.ArgumentParser:
    """Every ``StudySpec`` field's flag from its table (``spec/fields.py``), then the flags of the command itself."""
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SWEEP_EPILOG,
        description="Hyperparameter study: Ray Tune + Optuna TPE over beta, eta and negatives for each "
                    "(backbone, loss), every trial recorded in MLflow. The Python API is apao_ray.run_study("
                    "apao_ray.StudySpec(...)), whose fields are these flags.")
    add_field_arguments(parser, StudySpec)
    add_tracking_uri_argument(parser, "MLflow store the study records to")
    command = parser.add_argument_group("this command")
    command.add_argument("--smoke", action="store_true", help="tiny synthetic study on CPU (what the tests run)")
    command.add_argument("--quick", action="store_true", help="a few minutes on 2 CPUs: tiny model, data subset, 2 "
                         "epochs, 4 trials, no ASHA stopping")
    command.add_argument("--dry-run", action="store_true", help="print the plan (trials, epochs, estimated time and "
                         "memory from a short probe on this machine) and exit without training")
    command.add_argument("--json", action="store_true", help="with --dry-run: print the plan as one JSON object on "
                         "stdout (the plan's text goes to stderr)")
    command.add_argument("--reprobe", action="store_true", help="measure the plan's timing probe again instead of "
                         "reading ~/.cache/apao_ray/probes.json (after a change of hardware load or code)")
    command.add_argument("--time-budget", type=number(0, integer=False, above=True), default=None, metavar="SECONDS",
                         help="deprecated: --budget SECONDS")
    add_protocol_arguments(parser, with_eta=False)
    return parser


class _Unwritten(list):
    """The value of every destination before :func:`given_flags`' second parse: a list, since an ``append``
    option (``--knob``) copies its destination's value and appends to the copy (a new object, so it counts as
    written like any other option)."""


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the options written on the command line, however written (``--x v``, ``--x=v``,
    an abbreviation such as ``--epo 3``): argparse fills in a default only where the namespace it is
    given lacks the attribute, so a second parse into a namespace pre-filled with a marker leaves the
    marker exactly on the options not written."""
    marker = _Unwritten()
    dests = vars(parser.parse_args(argv))
    written = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, marker)))
    return {dest for dest, value in vars(written).items() if value is not marker}


def apply_quick(args: argparse.Namespace, given: set[str]) -> None:
    """--quick / --smoke settings (``spec.study.quick_changes``), except for the options written explicitly."""
    if args.quick or args.smoke:
        for name, value in quick_changes(vars(args), given).items():
            setattr(args, name, value)
    if args.smoke:
        args.dataset = "synthetic"


def spec_from_args(args: argparse.Namespace) -> StudySpec:
    """The StudySpec the flags describe (its construction checks every input)."""
    if args.time_budget is not None:
        print("warning: --time-budget is deprecated; use --budget (it also fits the study to the budget)",
              file=sys.stderr)
    knobs = {knob: getattr(args, knob, None) for knob in KNOBS if knob != "eta"}
    values = field_values(args, StudySpec)
    values.update(budget=args.budget if args.budget is not None else args.time_budget,
                  tracking_uri=args.tracking_uri, protocol_knobs={k: v for k, v in knobs.items() if v is not None})
    return StudySpec(**values)


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
    if args.smoke and "dataset" in given and args.dataset.lower() != "synthetic":
        parser.error(f"--smoke runs on the built-in synthetic dataset, not --dataset {args.dataset}; a small study of "
                     f"it: --quick --dataset {args.dataset}")
    apply_quick(args, given)
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
    print(f"study {result.study_name}: {counted(len(result.trials), 'trial')} ({failed} failed); best per (backbone, loss) "
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
    failed = [row for row in table_records(trials) if str(row.get("status")).startswith("failed")]
    if failed:
        print(f"failed trials ({len(failed)}):", file=sys.stderr)
    choices = {"backbone", "loss", *knob_names()}  # the row's other columns are results, not the trial's name
    for row in failed:
        name = describe({key: value for key, value in row.items() if key in choices and value is not None})
        print(f"  {name}: {row['status']}", file=sys.stderr)


def table_records(table: Any) -> list[dict[str, Any]]:
    """A result DataFrame back to row dicts, NaN (a missing value) as None."""
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            for row in table.to_dict("records")]


def report_interrupted(result: Any, argv: list[str]) -> int:
    """Tells what an interrupted study kept and how to continue it; returns the exit code
    (128 + the signal: 130 for SIGINT / Ctrl-C, 143 for SIGTERM)."""
    done = sum(status != "stopped" for status in result.trials.get("status", []))
    num_trials, study_name = result.plan.num_trials, result.study_name
    script = [sys.argv[0]] if sys.argv[0].endswith("sweep.py") else ["-m", "apao_ray", "sweep"]
    command = shlex.join([sys.executable, *script, *argv])
    cause = signal.Signals(result.stop_signal).name if result.stop_signal else "an interrupt"
    print(f"study {study_name} stopped by {cause} with {done} of {num_trials} trials ended; its state is saved: "
          f"re-run the same command (or add --resume) to continue:\n  {command}", file=sys.stderr)
    return exit_code(result.stop_signal or signal.SIGINT)


SHOWN_METRICS = tuple(name for name in selectable_metrics(TrialConfig()) if not name.startswith("loss"))


def shown_metric(text: str) -> str:
    """``--metric``: a validation metric the trials report (its cutoffs may differ from the default's), or
    ``best/val/<name>``; a name of no registered metric is refused, naming the metrics."""
    name = text.removeprefix("best/val/")
    if re.sub(r"\d+", "K", name) not in {re.sub(r"\d+", "K", known) for known in SHOWN_METRICS}:
        raise argparse.ArgumentTypeError(f"{text!r} is not a validation metric; choose from {', '.join(SHOWN_METRICS)}")
    return text


def build_best_parser(prog: str = "studies/best.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Best trial per (backbone, loss) of a "
                                     "dataset's studies, chosen by the selection each study recorded (its validation "
                                     "metric at the epoch its rule keeps: TrainConfig.metric and --select-by), read "
                                     "from MLflow alone (no Ray): the same trial as the study's own table, its MLflow "
                                     "page, `report` and the registered @best model; with --seeds studies, mean and std "
                                     "over its seeds and the paired significance against the baseline.")
    parser.add_argument("--dataset", help="dataset whose experiment (apao-<dataset>) to read (default: the store's "
                        "only one; required where it holds several)")
    parser.add_argument("--study-name", help="only this study (default: every study of the dataset)")
    parser.add_argument("--metric", type=shown_metric, help="a validation metric to show as a column too, one of "
                        f"{', '.join(SHOWN_METRICS)} (named at the default --beam-size; best/val/<name> alike), whose "
                        "test metric --baseline then compares; it never changes which trial is best: the study's "
                        "selection does (default: the selection's metric)")
    parser.add_argument("--baseline", default="ce", action=OneOf, names=lambda: registry_names("losses"),
                        help="loss every method is compared with, one of %(names)s, per user on the test metric of "
                        "--metric: over seeds and users with a Holm-corrected p where it has >= 2 seeds, "
                        "users only and no verdict with 1 (default %(default)s)")
    parser.add_argument("--format", choices=("markdown", "csv", "json"), default="markdown", help="default %(default)s")
    add_tracking_uri_argument(parser)
    parser.add_argument("--no-register", action="store_true", help="do not register/alias the best models")
    return parser


def best_main(argv: list[str] | None = None, prog: str = "studies/best.py") -> int:
    parser = build_best_parser(prog)
    args = parser.parse_args(argv)
    from ...tracking import Tracker, check_tracking_uri, experiment_name, resolve_tracking_uri
    from ..record.answer import register_best
    from ..record.report import format_rows, study_selection, table_rows

    try:
        uri = resolve_tracking_uri(args.tracking_uri)
        check_tracking_uri(uri)
        if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
            raise ValueError(f"no MLflow database at {uri}; run a study first or pass --tracking-uri")
        from ...tracking import experiment_names
        from ...tracking.store import EXPERIMENT_PREFIX

        if args.dataset is None:  # the store's only study experiment
            studies = [name for name in experiment_names(uri) if name.startswith(EXPERIMENT_PREFIX)]
            if len(studies) != 1:
                raise ValueError(f"--dataset is needed: {uri} holds {len(studies)} study experiments {studies}")
            args.dataset = studies[0][len(EXPERIMENT_PREFIX):]
        experiment = experiment_name(args.dataset.lower())
        tracker = Tracker.existing(uri, experiment)  # never creates the experiment it reads
        if tracker is None:
            raise ValueError(f"--dataset {args.dataset}: no experiment {experiment!r} in {uri}; experiments there: "
                             f"{experiment_names(uri)}")
        selection = study_selection(tracker, args.study_name)  # studies that select differently: one line here
    except (ValueError, ConnectionError) as error:
        parser.error(str(error))
    rows = table_rows(tracker, args.metric, args.study_name, args.baseline)
    if not rows:
        print(f"no finished trials for dataset {args.dataset!r} in {uri}", file=sys.stderr)
        return 1
    shown = f"; --metric {args.metric} is shown beside it, it does not choose" if args.metric else ""
    print(f"best trial per (backbone, loss) by the study's selection: {selection.text()}{shown}", file=sys.stderr)
    if not args.no_register:
        for row, registered in zip(rows, register_best(tracker, rows, dataset_label(args.dataset))):
            if registered:
                row["registered_model"], version, is_new = registered
                print(f"{row['registered_model']}: version {version} "
                      f"{'registered' if is_new else 'unchanged (already this run)'}", file=sys.stderr)
    print(format_rows(rows, args.format))
    return 0
