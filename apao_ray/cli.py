"""``python -m apao_ray``: small utilities (dataset statistics). Studies live in ``studies/``."""
from __future__ import annotations

import argparse
import json
import sys

from . import export, semantic_ids
from .data import known_dataset_names, load_dataset

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m apao_ray", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data", help="dataset utilities").add_subparsers(dest="data_command", required=True)
    stats = data.add_parser("stats", help="users, items, interactions, semantic IDs, collisions, split sizes")
    stats.add_argument("--dataset", required=True, help=f"one of {known_dataset_names()} (any case), or a "
                       "directory path (./mydata) with <Name>.inter.json or an interactions table")
    stats.add_argument("--data-dir", help="directory holding <Name>/<Name>.inter.json (default: $APAO_DATA_DIR, "
                                          "./data, then the user cache; downloaded if absent)")
    stats.add_argument("--max-history", type=int, default=20, help="history truncation (default 20)")
    stats.add_argument("--min-interactions", type=int, help="k of the k-core filter on an interactions table "
                       "(default: what tokenize recorded, else 5, the paper's five-core)")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(handler=_data_stats)
    semantic_ids.register(commands)  # tokenize
    export.register(commands)  # export (--format hf)
    from .analysis import export as analysis_export, report as analysis_report  # noqa: E402 - pandas/matplotlib: only here

    analysis_export.register(commands)  # export-study
    analysis_report.register(commands)  # report
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, ConnectionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
