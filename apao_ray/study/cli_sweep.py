"""Argument parsing for ``studies/sweep.py`` and ``studies/best.py``."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from ..config import BACKBONE_NAMES, DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
from ..paths import check_plain_name
from ..protocol import check_select_by
from .cli_protocol import add_protocol_arguments, apply_protocol_arguments
from .cli_train import TINY_MODEL, add_common_arguments, check_against_catalog, train_config_from_args
from .cli_types import non_negative_float, non_negative_int, positive_int

SWEEP_EPILOG = """\
defaults: TIGER with CE, APAO-pointwise and APAO-pairwise; 3 Optuna trials per tuned loss (7 trials), up to
20 epochs each (patience 5), ASHA stopping APAO trials weaker than others of their method after 5 epochs (CE
runs to the end). An Office epoch of the paper-size model takes minutes on a CPU (benchmarks/RESULTS.md has
this machine's figures), so the defaults are an evening on a laptop and far less on a GPU (--gpus-per-trial 0.25 runs four trials per GPU). --quick finishes
in a few minutes on 2 CPUs (tiny model, 2048-sample subset, 2 epochs, 4 trials): a check, not a result.
These schedules are not the paper's (200 epochs, patience 20; --epochs 200 --patience 20): the results
table says whether its test columns compare with paper Table 1. --protocol reference trains as the authors'
released code does (docs/PROTOCOLS.md); eta stays searched under both protocols.

examples:
  python studies/sweep.py --dataset grocery
  python studies/sweep.py --dataset office --quick
  python studies/sweep.py --dataset beauty --backbones tiger,llama --losses ce,apao_pairwise --num-samples 10
  python studies/sweep.py --dataset office --address auto --gpus-per-trial 0.25 --max-concurrent 8
  python studies/sweep.py --dataset grocery --resume      # after Ctrl-C or a lost driver: continue the study
then: python studies/best.py --dataset grocery ;  mlflow ui --backend-store-uri sqlite:///$PWD/mlflow.db
"""


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="studies/sweep.py", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SWEEP_EPILOG,
        description="Hyperparameter study: Ray Tune + Optuna TPE over beta, eta and negatives for each "
                    "(backbone, loss), every trial recorded in MLflow.")
    add_common_arguments(parser)
    parser.set_defaults(epochs=20, patience=5)
    parser.add_argument("--backbones", type=comma_list, default=("tiger",), help=f"comma list of {list(BACKBONE_NAMES)}")
    parser.add_argument("--losses", type=comma_list, default=("ce", "apao_pointwise", "apao_pairwise"),
                        help="comma list from apao_ray.losses.LOSSES (default ce,apao_pointwise,apao_pairwise); "
                             "losses with nothing to tune are baselines and run once per backbone")
    parser.add_argument("--num-samples", type=positive_int, default=3, help="Optuna trials per tuned (backbone, loss) (default 3)")
    parser.add_argument("--beta", type=parse_range, default=(0.05, 0.4), help="LOW:HIGH (default 0.05:0.4, paper grid)")
    parser.add_argument("--eta", type=parse_range, default=(5e-6, 5e-4), help="LOW:HIGH, log scale (default 5e-6:5e-4)")
    parser.add_argument("--negatives", type=lambda t: parse_range(t, int), default=None,
                        help="LOW:HIGH negatives for pairwise losses, log scale (default 10:200)")
    parser.add_argument("--pretrain-ce-epochs", type=non_negative_int, default=None,
                        help="CE epochs before a preference loss (dpo/dmpo/sdpo; default half the epochs)")
    parser.add_argument("--max-concurrent", type=positive_int, default=None, help="trials at once (default: the cluster's CPUs // cpus-per-trial)")
    parser.add_argument("--cpus-per-trial", type=positive_float, default=1.0,
                        help="CPUs per trial (default 1; 0.5 packs two trials per CPU, each on 1 thread)")
    parser.add_argument("--gpus-per-trial", type=non_negative_float, default=0.0, help="GPUs per trial; fractions share a GPU (0.25)")
    parser.add_argument("--time-budget", type=positive_float, default=None, help="stop starting trials after this many seconds")
    parser.add_argument("--max-failures", type=non_negative_int, default=1, help="restarts of a failed trial from its checkpoint")
    parser.add_argument("--memory-per-trial", type=positive_float, metavar="GIB",
                        help="memory cap per trial in GiB: reserved in Ray and enforced in the worker, so a trial "
                             "that needs more fails as 'out of memory' instead of taking the node down "
                             "(a worker with torch loaded already maps ~1.5 GiB)")
    parser.add_argument("--asha-grace-period", type=positive_int, default=5,
                        help="epochs before ASHA may stop a trial (default 5); a trial is only compared with trials "
                             "of its own (backbone, loss), baselines are never stopped, and a pruned trial is tested "
                             "on its best checkpoint")
    parser.add_argument("--study-name", help="default <dataset>-study; re-running the same name resumes it")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted study (refused when there is "
                        "none); re-running the same command does the same")
    parser.add_argument("--retry-failed", action="store_true", help="on a resume, also run again the trials that "
                        "failed (e.g. killed for memory), each from its last epoch checkpoint; without it they stay "
                        "failed")
    parser.add_argument("--overwrite", action="store_true", help="start the study again from scratch")
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                        help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///$PWD/mlflow.db)")
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
    """Destinations of the options written on the command line (``--x v`` or ``--x=v``)."""
    written = {arg.split("=", 1)[0] for arg in argv if arg.startswith("-")}
    return {action.dest for action in parser._actions if written & set(action.option_strings)}


def apply_quick(args: argparse.Namespace, given: set[str]) -> None:
    """--quick / --smoke settings, except for the options written explicitly."""
    if args.quick or args.smoke:
        settings = {"model_size": "tiny", "epochs": 2, "max_train_samples": 2048, "eval_max_users": 256,
                    "batch_size": 128, "effective_batch_size": 256, "num_samples": min(args.num_samples, 3),
                    "losses": ("ce", "apao_pointwise")}
        for name, value in settings.items():
            if name not in given:
                setattr(args, name, value)
        # grace past the last epoch: 2 epochs leave ASHA nothing to compare, every trial reaches its test
        if "patience" not in given:
            args.patience = args.epochs
        if "asha_grace_period" not in given:
            args.asha_grace_period = args.epochs + 1
        args.default_negatives = (10, 20)
    if args.smoke:
        args.dataset = "synthetic"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    apply_quick(args, given_flags(parser, argv))
    try:
        from ..data import load_dataset
        from ..losses import LOSSES
        from ..tracking import check_tracking_uri, resolve_tracking_uri
        from .space import SearchSpec
        from .mlflow_callback import dataset_record_of
        from .optuna_storage import resolve_storage_url
        from .sweep import StudyOptions, check_resumable, study_state_exists

        unknown = [b for b in args.backbones if b not in BACKBONE_NAMES]
        if unknown:
            raise ValueError(f"unknown backbone(s) {unknown}; choose from {list(BACKBONE_NAMES)}")
        unknown = [name for name in args.losses if name not in LOSSES]
        if unknown:
            raise ValueError(f"unknown loss(es) {unknown}; choose from {sorted(LOSSES)}")
        from .space import TUNED_KNOBS

        if args.negatives is not None and not any("num_negatives" in TUNED_KNOBS.get(n, ()) for n in args.losses):
            raise ValueError(f"--negatives was given, but none of the losses {list(args.losses)} uses negatives; "
                             "add apao_pairwise, dmpo, sdpo or ce_sdpo")
        negatives = args.negatives or getattr(args, "default_negatives", (10, 200))
        spec = SearchSpec(tuple(args.backbones), tuple(args.losses), args.beta, args.eta, negatives, args.num_samples)
        from ..data import canonical_dataset, dataset_label, is_dataset_path

        if not is_dataset_path(args.dataset):
            check_plain_name("dataset", args.dataset)  # before the default study name is made from it
        study_name = check_plain_name("study", args.study_name or f"{dataset_label(args.dataset)}-study")
        dataset = load_dataset(args.dataset, args.data_dir, allow_download=not args.data_dir)  # --data-dir: it is there
        pretrain = args.pretrain_ce_epochs if args.pretrain_ce_epochs is not None else max(1, args.epochs // 2)
        needs_stage = any(name in ("dpo", "dmpo", "sdpo") for name in args.losses)
        base = TrialConfig(
            DataConfig(dataset=canonical_dataset(args.dataset), data_dir=str(Path(args.data_dir).resolve()) if args.data_dir else None),
            ModelConfig(**(TINY_MODEL if args.model_size == "tiny" else {})),
            LossConfig(num_negatives=negatives[1], pretrain_ce_epochs=pretrain if needs_stage else 0),
            TrainConfig(**train_config_from_args(args, use_gpu=args.gpus_per_trial > 0,
                                                 retention_users=32 if args.quick or args.smoke else 128)))
        # eta stays searched under every protocol; the preset's weighting and other knobs hold for all trials
        base = apply_protocol_arguments(base, args, with_eta=False)
        for name in args.losses:  # every loss against the catalog, with the most negatives asked for
            check_against_catalog(base.replace(loss=base.loss.replace(name=name).to_dict()), dataset.catalog)
        tracking_uri = resolve_tracking_uri(args.tracking_uri)
        check_tracking_uri(tracking_uri)
        if args.cpus_per_trial <= 0.05:
            raise ValueError(f"--cpus-per-trial {args.cpus_per_trial} leaves the trial's worker nothing; give more than 0.05")
        if args.resume and args.overwrite:
            raise ValueError("--resume and --overwrite contradict each other; give one")
        memory = int(args.memory_per_trial * 2**30) if args.memory_per_trial else None
        options = StudyOptions(base=base, spec=spec, study_name=study_name, output_dir=Path(args.output_dir).resolve(),
                               tracking_uri=tracking_uri, address=args.address, max_concurrent=args.max_concurrent or 1,
                               cpus_per_trial=args.cpus_per_trial, gpus_per_trial=args.gpus_per_trial,
                               time_budget_s=args.time_budget, max_failures=args.max_failures,
                               memory_per_trial_bytes=memory, asha_grace_period=args.asha_grace_period,
                               seed=args.seed, overwrite=args.overwrite, retry_failed=args.retry_failed,
                               enqueue_paper_setting=args.enqueue_paper_setting,
                               optuna_storage=resolve_storage_url(args.optuna_storage, tracking_uri,
                                                                  Path(args.output_dir).resolve()),
                               dataset_record=dataset_record_of(dataset, args.data_dir))
        if args.resume and not study_state_exists(options):
            raise ValueError(f"--resume: no study {study_name!r} to resume under {options.output_dir}; "
                             "check --study-name and --output-dir, or drop --resume to start it")
        if args.retry_failed and not study_state_exists(options):
            raise ValueError(f"--retry-failed: no study {study_name!r} under {options.output_dir} whose failed "
                             "trials could run again; check --study-name and --output-dir")
        check_resumable(tracking_uri, options, dataset.checksums)
        # after the checks on the data: a changed dataset is the first thing to say on a resume
        check_select_by(base)  # e.g. ndcg_at_10 with --beam-size 2 names the metrics there are
        from .runner import cluster_cpus, init_ray

        init_ray(args.address)  # an unreachable cluster is refused here, before any trial
        if args.max_concurrent is None:  # as many as the cluster (or this machine) has CPUs for
            options = dataclasses.replace(options, max_concurrent=max(1, int(cluster_cpus() // args.cpus_per_trial)))
    except (ValueError, FileNotFoundError, ConnectionError) as error:
        parser.error(str(error))
    from .report import format_rows, table_rows
    from .sweep import StudyOutcome, run_study
    from ..tracking import Tracker, experiment_name

    train_split = dataset.splits["train"]
    example = [dataset.catalog.item_ids[i] for i in train_split.histories[0] if i >= 0]
    if study_state_exists(options) and not args.overwrite:
        print(f"resuming study {study_name} from {options.output_dir / study_name}", file=sys.stderr)
    try:
        outcome = run_study(options, dataset.checksums, example)
    except KeyboardInterrupt:  # outside Tune's own handler (start-up, figures): the saved state still holds
        outcome = StudyOutcome([], interrupted=True)
    rows = outcome.rows
    if outcome.interrupted:
        return report_interrupted(outcome, study_name, spec.num_trials, argv)
    failed = sum(1 for row in rows if row["error"])
    print(f"study {study_name}: {len(rows)} trials ({failed} failed); best per (backbone, loss) by validation:",
          file=sys.stderr)
    table_tracker = Tracker(tracking_uri, experiment_name(base.data.dataset))
    table = table_rows(table_tracker, study=study_name)
    print(format_rows(table, "markdown"))
    print(outcome.optuna_summary)
    from ..tracking import ui_hint

    print(ui_hint(tracking_uri, table_tracker.experiment_id))
    return 0


def report_interrupted(outcome: "StudyOutcome", study_name: str, num_trials: int, argv: list[str]) -> int:
    """Tells what an interrupted study kept and how to continue it; returns the exit code
    (128 + the signal: 130 for SIGINT / Ctrl-C, 143 for SIGTERM)."""
    import shlex
    import signal

    from .interrupt import exit_code

    done = sum(1 for row in outcome.rows if row["metrics"].get("done") or row["error"])
    script = sys.argv[0] if sys.argv[0].endswith("sweep.py") else "studies/sweep.py"
    command = shlex.join([sys.executable, script, *argv])
    cause = signal.Signals(outcome.stop_signal).name if outcome.stop_signal else "an interrupt"
    print(f"study {study_name} stopped by {cause} with {done} of {num_trials} trials ended; its state is saved: "
          f"re-run the same command (or add --resume) to continue:\n  {command}", file=sys.stderr)
    return exit_code(outcome.stop_signal or signal.SIGINT)


def build_best_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="studies/best.py", description="Best trial per (backbone, loss) of a "
                                     "dataset's studies, chosen by validation, read from MLflow alone (no Ray).")
    parser.add_argument("--dataset", required=True, help="dataset whose experiment (apao-<dataset>) to read")
    parser.add_argument("--study-name", help="only this study (default: every study of the dataset)")
    parser.add_argument("--metric", default="best/val/ndcg_at_10", help="validation metric that picks the best trial")
    parser.add_argument("--format", choices=("markdown", "csv", "json"), default="markdown")
    parser.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                        help="default $MLFLOW_TRACKING_URI, else sqlite:///$PWD/mlflow.db")
    parser.add_argument("--no-register", action="store_true", help="do not register/alias the best models")
    return parser


def best_main(argv: list[str] | None = None) -> int:
    parser = build_best_parser()
    args = parser.parse_args(argv)
    from ..tracking import Tracker, check_tracking_uri, experiment_name, resolve_tracking_uri
    from ..data import dataset_label
    from .report import format_rows, register_best, table_rows

    try:
        uri = resolve_tracking_uri(args.tracking_uri)
        check_tracking_uri(uri)
        if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
            raise ValueError(f"no MLflow database at {uri}; run a study first or pass --tracking-uri")
    except (ValueError, ConnectionError) as error:
        parser.error(str(error))
    tracker = Tracker(uri, experiment_name(args.dataset.lower()))
    rows = table_rows(tracker, args.metric, args.study_name)
    if not rows:
        print(f"no finished trials for dataset {args.dataset!r} in {uri}", file=sys.stderr)
        return 1
    if not args.no_register:
        for row, name in zip(rows, register_best(tracker, rows, dataset_label(args.dataset))):
            if name:
                row["registered_model"] = name
    print(format_rows(rows, args.format))
    return 0
