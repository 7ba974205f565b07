"""Issue #47 item 4, the part the data can answer: do the validation and test targets differ in popularity,
and does APAO's difference to CE on test depend on how popular a user's test target is?

APAO leads CE on validation at nearly every epoch of every Office/TIGER seed and ties on test. Validation and
test are computed alike (one function, ``training.evaluation.evaluate_split_per_user``, on split ``valid`` or
``test``: the same checkpoint, beam and metric code; the test history is the validation history plus the
validation item, ``data.splits.build_splits``, tested in tests/test_splits_batches.py). What differs is the
target: each user's second-to-last item (validation) against the last (test). This script measures, with no
model:

* the targets' popularity (how often the item is a training target) in each split, and the popularity
  baseline's NDCG@10 (the 10 most frequent training targets for everyone) on each: drift between the splits
  shows as a different baseline score and a different mix of head and tail targets;
* from the committed per-user test tables of the given study exports (best trial per method, every seed):
  APAO - CE test NDCG@10 per third of the users by their test target's training count (head, middle, tail),
  per seed and averaged over seeds.

    python benchmarks/evidence/val_test_drift.py --exports benchmarks/results/office-full-tiger-seed{0,1,2,4} \\
        --json benchmarks/results/val_test_drift_office.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from apao_ray.analysis.export import load_export  # noqa: E402
from apao_ray.analysis.results import finished_trials, group_methods, popularity_ndcg  # noqa: E402
from apao_ray.data import load_dataset  # noqa: E402

BANDS = ("head", "middle", "tail")


def split_popularity(dataset) -> dict:
    """Per split: the targets' mean log training count, the share never a training target, and the
    popularity baseline's NDCG@10 (valid and test)."""
    splits = dataset.splits
    counts = np.bincount(splits["train"].targets, minlength=dataset.catalog.num_items)
    out = {}
    for name in ("valid", "test"):
        targets = splits[name].targets
        baseline = popularity_ndcg(dataset, name)
        out[name] = {"mean_log1p_train_count": float(np.log1p(counts[targets]).mean()),
                     "median_train_count": float(np.median(counts[targets])),
                     "share_never_a_train_target": float((counts[targets] == 0).mean()),
                     "popularity_ndcg_at_10": float(baseline.mean())}
    valid, test = splits["valid"].targets, splits["test"].targets
    p = np.bincount(valid, minlength=len(counts)) / len(valid)
    q = np.bincount(test, minlength=len(counts)) / len(test)
    m = (p + q) / 2
    js = 0.5 * sum(float(np.sum(a[a > 0] * np.log2(a[a > 0] / m[a > 0]))) for a in (p, q))
    out["js_divergence_valid_test_bits"] = js
    out["share_test_target_equals_valid_target"] = float((valid == test).mean())
    return out


def by_band(dataset, exports: list[str], metric: str = "ndcg_at_10") -> dict:
    """APAO - CE per-user test ``metric`` by third of users (test target's training count), per seed."""
    counts = np.bincount(dataset.splits["train"].targets, minlength=dataset.catalog.num_items)
    test = dataset.splits["test"]
    target_count = counts[test.targets]                         # (users,) in test order = user index order
    edges = np.quantile(target_count, [1 / 3, 2 / 3])
    band = np.digitize(target_count, edges, right=True)         # 0: the lowest counts (tail), 2: head
    methods = group_methods(finished_trials([load_export(e) for e in exports]))
    ce = next(m for m in methods if m.loss == "ce")
    apao = next(m for m in methods if m.loss == "apao_pointwise")
    rows = []
    for a in apao.trials:
        c = next((t for t in ce.trials if t.seed == a.seed), None)
        if c is None or a.per_user() is None or c.per_user() is None:
            continue
        ta, tc = a.per_user().set_index("user"), c.per_user().set_index("user")
        users = ta.index.intersection(tc.index)
        diff = ta.loc[users, metric].to_numpy(float) - tc.loc[users, metric].to_numpy(float)
        user_band = band[users.to_numpy().astype(np.int64)]
        row = {"seed": a.seed, "all": float(diff.mean())}
        for index, name in zip((2, 1, 0), BANDS):               # highest counts = head
            part = diff[user_band == index]
            row[name] = float(part.mean())
            row[f"{name}_se"] = float(part.std(ddof=1) / math.sqrt(len(part)))
            row[f"{name}_users"] = int(len(part))
        rows.append(row)
    mean = {name: float(np.mean([r[name] for r in rows])) for name in ("all", *BANDS)} if rows else {}
    return {"metric": metric, "band_edges_train_count": edges.tolist(), "per_seed": rows, "mean_over_seeds": mean}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="office", help="(default %(default)s)")
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", str(ROOT.parent / "shared" / "datasets")))
    parser.add_argument("--exports", nargs="*", default=[], help="study exports with per-user test tables")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    dataset = load_dataset(args.dataset, args.data_dir, allow_download=False)
    result = {"dataset": args.dataset, "splits": split_popularity(dataset)}
    print(f"{'split':<7}{'mean log(1+count)':>18}{'median count':>13}{'never trained':>14}{'popularity N@10':>16}")
    for name in ("valid", "test"):
        s = result["splits"][name]
        print(f"{name:<7}{s['mean_log1p_train_count']:>18.3f}{s['median_train_count']:>13.0f}"
              f"{s['share_never_a_train_target']:>14.3f}{s['popularity_ndcg_at_10']:>16.4f}")
    print(f"JS divergence of the valid and test target distributions: {result['splits']['js_divergence_valid_test_bits']:.3f} "
          f"bits; test target = valid target for {result['splits']['share_test_target_equals_valid_target']:.1%} of users")
    if args.exports:
        result["apao_minus_ce_by_band"] = bands = by_band(dataset, args.exports)
        print(f"APAO - CE test {bands['metric']} by the test target's training count "
              f"(thirds of users, edges {bands['band_edges_train_count']}):")
        print(f"{'seed':<6}{'all':>9}" + "".join(f"{name:>18}" for name in BANDS))
        for row in bands["per_seed"]:
            print(f"{row['seed']:<6}{row['all']:>+9.4f}" + "".join(
                f"{row[name]:>+10.4f} ±{row[name + '_se']:.4f}" for name in BANDS))
        print(f"{'mean':<6}{bands['mean_over_seeds']['all']:>+9.4f}" + "".join(
            f"{bands['mean_over_seeds'][name]:>+18.4f}" for name in BANDS))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
