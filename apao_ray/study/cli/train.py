"""Argument parsing and the run for ``studies/train.py`` (one trial on Ray Train)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ...cli_types import non_negative_float, non_negative_int, positive_int
from ...config import (BACKBONE_NAMES, PRECISIONS, TINY_MODEL, DataConfig, LossConfig, ModelConfig, TrainConfig,
                      TrialConfig)
from ...data import canonical_dataset, dataset_label, known_dataset_names
from ...paths import absolute_data_dir_env
from ...protocol import check_select_by, protocol_tag, resolved_knobs
from .protocol import add_protocol_arguments, apply_protocol_arguments



def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's or taskset's), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by train.py and sweep.py: data, compute, Ray."""
    parser.add_argument("--dataset", default="synthetic", help=f"one of {known_dataset_names()} (any case), or a "
                        "dataset directory path such as ./mydata (docs/own-data.md); default synthetic (no files needed)")
    parser.add_argument("--data-dir", help="directory with <Name>/<Name>.inter.json (default: $APAO_DATA_DIR, "
                        "./data, then the user cache; downloaded when absent)")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="Ray cluster to join, e.g. 'auto' or ray://host:10001 (default: $RAY_ADDRESS, "
                             "else a local Ray on this machine)")
    parser.add_argument("--output-dir", default="apao_runs", help="where runs and checkpoints are stored "
                        "(default ./%(default)s; must be shared storage on a multi-node cluster)")
    parser.add_argument("--max-train-samples", type=positive_int, help="train on a fixed random subset (quick runs)")
    parser.add_argument("--eval-max-users", type=positive_int, help="validate on a fixed random subset of users")
    parser.add_argument("--epochs", type=positive_int, default=200, help="maximum epochs (default %(default)s; the paper: 200, SPEC §5)")
    parser.add_argument("--patience", type=positive_int, default=20, help="early-stopping patience (default %(default)s; the paper: 20)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="micro-batch size, of each worker when data parallel (default: 128 on CPU, 1024 with a "
                             "GPU, the fastest measured on each at "
                             "effective batch 1024: benchmarks/RESULTS.md); the optimizer step stays --effective-batch-size")
    parser.add_argument("--effective-batch-size", type=positive_int, default=1024,
                        help="samples per optimizer step via gradient accumulation (default %(default)s)")
    parser.add_argument("--lr", type=non_negative_float, default=5e-4, help="AdamW learning rate (default %(default)s)")
    parser.add_argument("--beam-size", type=positive_int, default=20, help="beam size for evaluation (default %(default)s)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed for init, data order and negatives (default %(default)s)")
    parser.add_argument("--model-size", choices=("paper", "tiny"), default="paper",
                        help="paper: SPEC §2 sizes (~0.005B); tiny: a small model for smoke runs (default %(default)s)")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="auto (default): bf16 autocast on GPUs and on CPUs with native bf16 (AVX512-BF16 or "
                             "AMX), fp32 elsewhere; weights, optimizer and log-softmax normalisers stay float32. "
                             "The resolved precision is recorded in the checkpoint and MLflow (apao.precision)")
    parser.add_argument("--group-by-length", action="store_true",
                        help="batch histories of similar length: less padding, faster epochs (Office: see "
                             "benchmarks/RESULTS.md); the paper's runs used random batches")
    parser.add_argument("--smoke", action="store_true", help="tiny synthetic run on CPU (what the tests run)")


def train_config_from_args(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    one_step = (args.batch_size or 0) * getattr(args, "num_workers", 1)  # a micro-batch on every worker
    values = dict(epochs=args.epochs, patience=args.patience, batch_size=args.batch_size,
                  effective_batch_size=max(args.effective_batch_size, one_step), lr=args.lr, beam_size=args.beam_size,
                  seed=args.seed, max_train_samples=args.max_train_samples,
                  eval_max_users=args.eval_max_users, precision=args.precision, group_by_length=args.group_by_length)
    values.update(overrides)
    return values


def apply_smoke(args: argparse.Namespace) -> None:
    """--smoke: synthetic data, tiny model, a few epochs — seconds of training on CPU."""
    if args.smoke:
        args.dataset, args.model_size = "synthetic", "tiny"
        args.epochs = min(args.epochs, 3)
        # one optimizer step of 128 samples, whatever the workers
        args.batch_size, args.effective_batch_size = max(1, 128 // getattr(args, "num_workers", 1)), 128


def build_parser(prog: str = "studies/train.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Train one trial (dataset x backbone x "
                                     "loss) on Ray Train; prints the final metrics as JSON.")
    add_common_arguments(parser)
    parser.add_argument("--backbone", choices=BACKBONE_NAMES, default="tiger", help="default %(default)s")
    parser.add_argument("--loss", default="ce", help="a name from apao_ray.losses.LOSSES (default %(default)s)")
    parser.add_argument("--beta", type=non_negative_float, default=0.1, help="weight of the prefix loss (default %(default)s)")
    parser.add_argument("--num-negatives", type=positive_int, default=None,
                        help="negatives for apao_pairwise/dmpo/sdpo/ce_sdpo (default 100; refused for other losses)")
    parser.add_argument("--pretrain-ce-epochs", type=non_negative_int, default=0, help="two-stage: CE epochs before the loss (default %(default)s)")
    parser.add_argument("--num-workers", type=positive_int, default=1, help="data-parallel workers (default %(default)s)")
    parser.add_argument("--cpus-per-worker", type=positive_int, default=available_cpus(),
                        help="CPUs reserved per worker, used as its torch threads (default: all of this "
                             "machine's, %(default)s here)")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--max-failures", type=non_negative_int, default=0, help="worker restarts from the last checkpoint (default %(default)s)")
    parser.add_argument("--run-name", help="name of the run under --output-dir (default from the flags)")
    parser.add_argument("--resume", action="store_true", help="continue the run of the same name from its checkpoint")
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
    model = ModelConfig(backbone=args.backbone, **(TINY_MODEL if args.model_size == "tiny" else {}))
    loss = LossConfig(name=args.loss, beta=args.beta, num_negatives=args.num_negatives or 100,
                      pretrain_ce_epochs=args.pretrain_ce_epochs)
    train = TrainConfig(**train_config_from_args(args, num_workers=args.num_workers, use_gpu=args.use_gpu))
    config = TrialConfig(DataConfig(dataset=canonical_dataset(args.dataset), data_dir=_abs(args.data_dir)), model, loss, train)
    return apply_protocol_arguments(config, args)


def check_against_catalog(config: TrialConfig, catalog: Any, requested_negatives: int | None = None) -> None:
    """Refuses negatives or a beam the catalog cannot supply, naming the values."""
    from ...losses import LOSSES, build_loss

    num_negatives = build_loss(config.loss, catalog.tensors()).num_negatives
    if requested_negatives is not None and num_negatives == 0:
        using = sorted(name for name, loss in LOSSES.items() if loss.uses_negatives)
        raise ValueError(f"--num-negatives {requested_negatives} was given, but loss {config.loss.name!r} uses no "
                         f"negatives; use it with one of {using}")
    if num_negatives >= catalog.num_semantic_ids:
        raise ValueError(f"num_negatives={num_negatives} must be < the {catalog.num_semantic_ids} semantic IDs "
                         f"of {config.data.dataset!r}")
    if config.train.beam_size > catalog.num_semantic_ids:
        raise ValueError(f"beam_size={config.train.beam_size} exceeds the {catalog.num_semantic_ids} semantic IDs "
                         f"of {config.data.dataset!r}")


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
        from ...data import load_dataset

        # fails fast on bad data; an explicit --data-dir must hold the dataset (no download, no fall-back)
        dataset = load_dataset(config.data.dataset, config.data.data_dir, allow_download=not config.data.data_dir)
        # where the files were found: the trial's workers read them there, from any working directory
        config = config.replace(data=config.data.replace(data_dir=dataset.data_dir))
        check_against_catalog(config, dataset.catalog, args.num_negatives)
    except (ValueError, FileNotFoundError, ConnectionError) as error:
        parser.error(str(error))
    output_dir = Path(args.output_dir).resolve()
    name = args.run_name or f"train-{dataset_label(config.data.dataset)}-{args.backbone}-{args.loss}-seed{args.seed}"
    run_dir = output_dir / name
    if run_dir.exists() and not args.resume:
        if not args.overwrite:
            parser.error(f"run {name!r} already exists in {output_dir}; pass --resume to continue it, "
                         "--overwrite to start again, or --run-name for a new one")
        shutil.rmtree(run_dir)
    if not args.quiet:
        knobs = " ".join(f"{k}={v}" for k, v in resolved_knobs(config).items())
        print(f"protocol {protocol_tag(config)}: {knobs}", file=sys.stderr)
    from ..run.trial import run_single_trial

    from ...training.worker import TrialFailedError

    try:
        metrics = run_single_trial(config, name=name, storage_path=output_dir, address=args.address,
                                   cpus_per_worker=args.cpus_per_worker, max_failures=args.max_failures,
                                   verbose=not args.quiet)
    except TrialFailedError as error:
        print(f"trial {name} failed: {error}", file=sys.stderr)
        return 1
    text = json.dumps(metrics, indent=2, sort_keys=True)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return 0
