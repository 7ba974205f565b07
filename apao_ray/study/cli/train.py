"""Argument parsing and the run for ``studies/train.py`` (one trial on Ray Train)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ... import storage
from ...cli.types import non_negative_float, non_negative_int, positive_int
from ...config import BACKBONE_NAMES, LossConfig, TrialConfig
from ...data import dataset_label
from ...hardware import available_cpus
from ...paths import absolute_data_dir_env
from ...protocol import check_select_by, protocol_tag, resolved_knobs
from ..spec.study import StudySpec
from ..spec.trial import trial_config
from .fields import add_field_arguments, registered_names
from .protocol import add_protocol_arguments, apply_protocol_arguments
from ..cluster.interrupt import RunInterrupted, exit_code



def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags train.py shares with sweep.py (data, schedule, model, compute, Ray): StudySpec's ``trial`` group,
    each declared once there, at the paper's schedule (200 epochs, patience 20) for one trial."""
    add_field_arguments(parser, StudySpec, group="trial", defaults={"epochs": 200, "patience": 20})
    parser.add_argument("--smoke", action="store_true", help="tiny synthetic run on CPU (what the tests run)")


def apply_smoke(args: argparse.Namespace) -> None:
    """--smoke: synthetic data, tiny model, a few epochs — seconds of training on CPU."""
    if args.smoke:
        args.dataset, args.model_size = "synthetic", "tiny"
        args.epochs = min(args.epochs, 3)
        # one optimizer step of 128 samples, whatever the workers
        args.batch_size, args.effective_batch_size = max(1, 128 // getattr(args, "num_workers", 1)), 128


TRAIN_EPILOG = ("exit codes: 0 trained, its final metrics printed; 1 the run failed (the reason is printed); 2 input "
                "refused before anything ran; 130 / 143 stopped by SIGINT (Ctrl-C) / SIGTERM, its checkpoints kept "
                "for --resume")


def build_parser(prog: str = "studies/train.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Train one trial (dataset x backbone x "
                                     "loss) on Ray Train; prints the final metrics as JSON.", epilog=TRAIN_EPILOG)
    add_common_arguments(parser)
    parser.add_argument("--backbone", choices=BACKBONE_NAMES, default="tiger", help="default %(default)s")
    parser.add_argument("--loss", default="ce", help=f"one of {registered_names('losses')} (default %(default)s)")
    parser.add_argument("--knob", action="append", default=[], type=knob_value, metavar="NAME=VALUE",
                        help=f"set a knob the loss declares, built-in or plugin (Loss.knobs: {registered_names('knobs')}; "
                             "repeatable; default: the knob's default); one the loss does not declare is refused")
    parser.add_argument("--beta", type=non_negative_float, default=None,
                        help="the same as --knob beta=VALUE: weight of the prefix loss (default 0.1)")
    parser.add_argument("--num-negatives", type=positive_int, default=None,
                        help="the same as --knob num_negatives=VALUE: negatives for apao_pairwise/dmpo/sdpo/ce_sdpo "
                             "(default 100)")
    parser.add_argument("--pretrain-ce-epochs", type=non_negative_int, default=0, help="two-stage: CE epochs before the loss (default %(default)s)")
    parser.add_argument("--num-workers", type=positive_int, default=1, help="data-parallel workers (default %(default)s)")
    parser.add_argument("--cpus-per-worker", type=positive_int, default=available_cpus(),
                        help="CPUs reserved per worker, used as its torch threads (default: all of this "
                             "machine's, %(default)s here)")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--max-failures", type=non_negative_int, default=0, help="worker restarts from the last checkpoint (default %(default)s)")
    parser.add_argument("--run-name", help="name of the run under --output-dir (default from the flags)")
    parser.add_argument("--resume", action="store_true", help="continue the run of the same name from its newest "
                        "checkpoint that loads (a damaged one is set aside, saying so)")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing run of the same name first")
    parser.add_argument("--json-out", help="also write the final metrics to this JSON file")
    parser.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    parser.add_argument("--print-config", action="store_true", help="print the resolved trial config (every "
                        "protocol knob) as JSON and exit without training")
    add_protocol_arguments(parser)
    return parser


def trial_config_from_args(args: argparse.Namespace) -> TrialConfig:
    from ...losses import LOSSES

    if args.loss not in LOSSES:
        raise ValueError(f"unknown loss {args.loss!r}; choose from {sorted(LOSSES)}")
    knobs = loss_knobs(args, LOSSES[args.loss].knobs)
    if "eta" in knobs:  # a protocol knob too (--eta): the preset's value yields to it
        if args.eta is not None:
            raise ValueError(f"eta was given twice, by --eta {args.eta} and by --knob eta={knobs['eta']}; give one")
        args.eta = knobs.pop("eta")
    loss = LossConfig(name=args.loss, pretrain_ce_epochs=args.pretrain_ce_epochs).with_knobs(knobs)
    config = trial_config(args, loss, seed=args.seed, workers=args.num_workers, use_gpu=args.use_gpu,
                          data_dir=_abs(args.data_dir), backbone=args.backbone)
    return apply_protocol_arguments(config, args)


def knob_value(text: str) -> tuple[str, float]:
    """'NAME=VALUE' -> (name, value); the knob itself is checked against the loss's."""
    name, equals, value = text.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = None
    if not equals or not name.strip() or number is None:
        raise argparse.ArgumentTypeError(f"{text!r} must be NAME=VALUE with a number, e.g. beta=0.3")
    return name.strip(), number


def loss_knobs(args: argparse.Namespace, declared: tuple[Any, ...]) -> dict[str, float]:
    """The knobs given by --knob and its aliases --beta and --num-negatives, each one the loss declares (an integer
    knob as an int); a knob given twice or not the loss's is refused, naming the loss's knobs."""
    aliases = {"beta": args.beta, "num_negatives": args.num_negatives}
    given: dict[str, float] = {}
    for name, value in [*((n, v) for n, v in aliases.items() if v is not None), *args.knob]:
        if name in given:
            raise ValueError(f"knob {name!r} was given twice ({given[name]} and {value}); give it once")
        given[name] = value
    by_name = {knob.name: knob for knob in declared}
    for name in given:
        if name not in by_name:
            raise ValueError(f"loss {args.loss!r} has no knob {name!r}; its knobs: "
                             f"{sorted(by_name) or 'none (a baseline)'}")
    return {name: int(value) if by_name[name].integer else value for name, value in given.items()}


def _abs(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else None


def main(argv: list[str] | None = None, prog: str = "studies/train.py") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    absolute_data_dir_env()  # the trial's workers run in other working directories
    apply_smoke(args)
    try:
        config = trial_config_from_args(args)
        check_select_by(config)
        if args.print_config:
            print(json.dumps({"apao.protocol": protocol_tag(config), "knobs": resolved_knobs(config),
                              "config": config.to_dict()}, indent=2))
            return 0
        from ...data import load_dataset  # lazy: torch, after --print-config's early exit
        from ...training.checks import check_against_catalog

        # fails fast on bad data; an explicit --data-dir must hold the dataset (no download, no fall-back)
        dataset = load_dataset(config.data.dataset, config.data.data_dir, allow_download=not config.data.data_dir)
        # where the files were found: the trial's workers read them there, from any working directory
        config = config.replace(data=config.data.replace(data_dir=dataset.data_dir))
        check_against_catalog(config, dataset.catalog, args.num_negatives)
        from ..cluster.ray_cluster import check_ray_address

        check_ray_address(args.address)  # a head that does not answer, or refuses this machine's token, in one line
    except (ValueError, FileNotFoundError, ConnectionError) as error:
        parser.error(str(error))
    output_dir = storage.absolute(args.output_dir)  # a local directory or a URI (s3://...): Ray Train writes there
    name = args.run_name or f"train-{dataset_label(config.data.dataset)}-{args.backbone}-{args.loss}-seed{args.seed}"
    run_dir = storage.join(output_dir, name)
    if storage.exists(run_dir) and not args.resume:
        if not args.overwrite:
            parser.error(f"run {name!r} already exists in {output_dir}; pass --resume to continue it, "
                         "--overwrite to start again, or --run-name for a new one")
        storage.delete(run_dir)
    if not args.quiet:
        knobs = " ".join(f"{k}={v}" for k, v in resolved_knobs(config).items())
        print(f"protocol {protocol_tag(config)}: {knobs}", file=sys.stderr)
    from ..run.trial import run_single_trial

    from ...training.failures import TrialFailedError

    try:
        metrics = run_single_trial(config, name=name, storage_path=output_dir, address=args.address,
                                   cpus_per_worker=args.cpus_per_worker, max_failures=args.max_failures,
                                   verbose=not args.quiet)
    except TrialFailedError as error:
        print(f"trial {name} failed: {error}", file=sys.stderr)
        return 1
    except RunInterrupted as stop:
        kept = [storage.name(location) for location in storage.find(run_dir, "epoch_*")]
        print(f"run {name} stopped by {stop}: " + (f"its checkpoints are kept (the newest: {kept[-1]}); "
              if kept else "no epoch had finished; ") + "continue it with the same command and --resume",
              file=sys.stderr)
        return exit_code(stop.signum)
    text = json.dumps(metrics, indent=2, sort_keys=True)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0
