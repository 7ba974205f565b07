"""``python -m apao_ray {sweep,train,best,data,serve,...}``: the one command line.

Each subcommand is one line of ``COMMANDS``: ``sweep``, ``train`` and ``best`` hand their
arguments to their own parser (``python -m apao_ray sweep --help``); a module with
``register(subparsers)`` adds its own subcommand (a parser with ``handler=`` set).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from .types import int_at_least, positive_int
from ..data import known_dataset_names, load_dataset
from ..paths import absolute_data_dir_env

# name -> ("module:function", help): a pass-through main(argv, prog=...) with its own --help
PASS_THROUGH = {
    "sweep": ("apao_ray.study.cli.sweep:main", "the main job: a hyperparameter study (plan, then Ray Tune + Optuna + MLflow)"),
    "train": ("apao_ray.study.cli.train:main", "train one trial on Ray Train and print its final metrics"),
    "best": ("apao_ray.study.cli.sweep:best_main", "best trial per (backbone, loss) from MLflow alone"),
}
# modules with register(subparsers): one line each
REGISTERED = [
    "apao_ray.cli.commands",      # data stats
    "apao_ray.semantic_ids",      # tokenize
    "apao_ray.serving.export_command",  # export --format hf
    "apao_ray.analysis.export",   # export-study
    "apao_ray.analysis.report",   # report
    "apao_ray.serving.serve",     # serve MODEL_URI
]

_ORDER = ["users", "items", "interactions", "density", "distinct_semantic_ids", "colliding_semantic_ids",
          "items_in_collisions", "codes_per_level", "train_samples", "valid_samples", "test_samples"]


def _data_stats(args: argparse.Namespace) -> int:
    stats = load_dataset(args.dataset, data_dir=args.data_dir, max_history=args.max_history,
                         min_interactions=args.min_interactions).stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(f"dataset {stats['dataset']}")
    for key in [*_ORDER, *(k for k in stats if k not in _ORDER and k != "dataset")]:  # + a directory's notes
        value = stats[key]
        text = f"{value:.6f}" if isinstance(value, float) else (f"{value:,}" if isinstance(value, int) else str(value))
        print(f"  {key.replace('_', ' '):<24}{text}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """``data stats``: dataset figures."""
    data = commands.add_parser("data", help="dataset utilities").add_subparsers(dest="data_command", required=True)
    stats = data.add_parser("stats", help="users, items, interactions, semantic IDs, collisions, split sizes")
    stats.add_argument("--dataset", required=True, help=f"one of {known_dataset_names()} (any case), or a "
                       "directory path (./mydata) with <Name>.inter.json or an interactions table")
    stats.add_argument("--data-dir", help="directory holding <Name>/<Name>.inter.json (default: $APAO_DATA_DIR, "
                                          "./data, then the user cache; downloaded if absent)")
    stats.add_argument("--max-history", type=positive_int, default=20, help="history truncation (default %(default)s)")
    stats.add_argument("--min-interactions", type=int_at_least(3), help="k of the k-core filter on an interactions table "
                       "(default: what tokenize recorded, else 5, the paper's five-core)")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(handler=_data_stats)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m apao_ray", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (_, text) in PASS_THROUGH.items():
        commands.add_parser(name, help=text, add_help=False)
    for module in REGISTERED:
        importlib.import_module(module).register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    absolute_data_dir_env()  # here, where the command starts: what it starts runs in other directories
    if argv and argv[0] in PASS_THROUGH:  # the subcommand's own parser reads the rest (and its --help)
        target, _ = PASS_THROUGH[argv[0]]
        module, function = target.split(":")
        return getattr(importlib.import_module(module), function)(argv[1:], prog=f"python -m apao_ray {argv[0]}")
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, ConnectionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
