"""Trained models against the last-item transition heuristic, per seed: each finished full-protocol trial's mean
per-user test NDCG@10 minus the heuristic's on the same users, and a t interval over the seed means (the heuristic
is deterministic, so the seeds carry all of the training randomness). Prints a table and writes JSON.

    python benchmarks/evidence/heuristic_gap.py --data-dir ../shared/datasets \
        --study office-full-tiger-seed0 office-full-tiger-seed1 office-full-tiger-seed2 office-full-tiger-seed4
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from apao_ray.analysis.heuristics import heuristic_per_user  # noqa: E402
from apao_ray.analysis.report import find_exports  # noqa: E402
from apao_ray.analysis.results import finished_trials, group_methods  # noqa: E402
from apao_ray.data import load_dataset  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exports", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--study", nargs="+", required=True)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--metric", default="ndcg_at_10")
    parser.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "heuristic_gap_office.json"))
    args = parser.parse_args()
    methods = group_methods(finished_trials(find_exports([args.exports], args.study), "best"))
    out = []
    for method in methods:
        heuristic = heuristic_per_user(load_dataset(method.dataset, args.data_dir), "last_item").set_index("user")
        gaps = {}
        for trial in method.trials:
            table = trial.per_user()
            if table is not None:
                table = table.set_index("user")
                gaps[trial.seed] = float((table[args.metric] - heuristic.loc[table.index, args.metric]).mean())
        values = np.array(list(gaps.values()))
        low, high = (stats.t.interval(0.95, len(values) - 1, loc=values.mean(),
                                      scale=values.std(ddof=1) / np.sqrt(len(values))) if len(values) >= 2
                     else (float("nan"), float("nan")))
        out.append({"dataset": method.dataset, "backbone": method.backbone, "method": method.label,
                    "heuristic": float(heuristic[args.metric].mean()), "per_seed": gaps,
                    "mean": float(values.mean()), "ci95_over_seeds": [float(low), float(high)]})
        print(f"{method.dataset} {method.backbone} {method.label}: heuristic {out[-1]['heuristic']:.4f}; model - "
              f"heuristic per seed {', '.join(f'{s}: {v:+.4f}' for s, v in gaps.items())}; mean {values.mean():+.4f} "
              f"[{low:+.4f}, {high:+.4f}] over {len(values)} seeds")
    Path(args.json_out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
