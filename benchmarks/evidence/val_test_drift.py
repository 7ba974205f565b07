"""Why APAO leads CE on validation and ties on test, the part the data can answer: do the validation and test targets differ in popularity,
and does APAO's difference to CE on test depend on how popular a user's test target is?

APAO leads CE on validation at nearly every epoch of every Office/TIGER seed and ties on test. Validation and
test are computed alike (one function, ``training.evaluation.evaluate_split_per_user``, on split ``valid`` or
``test``: the same checkpoint, beam and metric code; the test history is the validation history plus the
validation item, ``data.splits.build_splits``, tested in tests/test_splits.py). What differs is the
target: each user's second-to-last item (validation) against the last (test). This script measures, with no
model:

* the targets' popularity (how often the item is a training target) in each split, and the popularity
  baseline's NDCG@10 (the 10 most frequent training targets for everyone) on each: drift between the splits
  shows as a different baseline score and a different mix of head and tail targets;
* from the committed per-user test tables of the given study exports (best trial per method, every seed):
  APAO - CE test NDCG@10 per third of the users by their test target's training count (head, middle, tail),
  per seed and averaged over seeds.

* where an export holds the kept models' per-user validation tables (trials since aceadec): APAO - CE
  validation NDCG@10 in the same popularity bands (the test split's edges), each split's share of users per
  band, and the validation difference re-weighted to the test split's band shares: if the validation lead
  shrinks to the test difference once validation has test's mix of popular targets, the drift explains it;
* over the seeds with both methods' per-user test tables: is the validation difference different from the test
  difference at all, beyond training randomness? Per seed, APAO - CE on validation at the kept epochs (each
  trial's ``best/val/<metric>``) and averaged over the epochs around them (both kept epochs +/- ``--window``),
  against test at the kept epochs; their spread over seeds, and the paired validation - test difference with a
  t interval over the seeds (the seed is the unit: four seeds give 3 degrees of freedom);
* where an export's trials logged test after every epoch (``sweep --test-every-epoch``, diagnosis only): the
  per-epoch APAO - CE difference on validation and on test side by side, how often each is positive, and the
  correlation of the two across epochs (does the test gap follow the validation gap, and from which epoch on
  do they part?). A study still running can be exported and read: its curves so far.

    python benchmarks/evidence/val_test_drift.py --exports benchmarks/results/office-full-tiger-seed{0,1,2,3,4} \\
        --json benchmarks/results/val_test_drift_office.json
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
from scipy.stats import t as student_t

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from apao_ray.analysis.export import load_export as _load_export  # noqa: E402
from apao_ray.analysis.heuristics import heuristic_per_user  # noqa: E402
from apao_ray.analysis.results import finished_trials, group_methods, unfinished_trials  # noqa: E402
from apao_ray.names import DIAGNOSIS_PREFIX  # noqa: E402
from apao_ray.data import load_dataset  # noqa: E402

BANDS = ("head", "middle", "tail")
load_export = functools.lru_cache(maxsize=None)(_load_export)  # each export read once, whichever analysis asks


def split_popularity(dataset) -> dict:
    """Per split: the targets' mean log training count, the share never a training target, and the
    popularity baseline's NDCG@10 (valid and test)."""
    splits = dataset.splits
    counts = np.bincount(splits["train"].targets, minlength=dataset.catalog.num_items)
    out = {}
    for name in ("valid", "test"):
        targets = splits[name].targets
        baseline = heuristic_per_user(dataset, "popularity", name)["ndcg_at_10"].to_numpy(float)
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


def _bands(dataset, split: str, edges: np.ndarray | None = None) -> tuple[dict[str, int], np.ndarray]:
    """Per user of ``split`` (by external id): its band, 0 (tail) .. 2 (head), by its target's training count
    against ``edges`` (default: the thirds of this split's users); and the edges."""
    counts = np.bincount(dataset.splits["train"].targets, minlength=dataset.catalog.num_items)
    part = dataset.splits[split]
    target_count = counts[part.targets]
    edges = np.quantile(target_count, [1 / 3, 2 / 3]) if edges is None else edges
    bands = np.digitize(target_count, edges, right=True)
    return {dataset.user_ids[u]: int(b) for u, b in zip(part.users, bands)}, edges


def _pairs(trials: list) -> list[tuple]:
    """(seed, APAO-pointwise trial, CE trial) for every seed where both methods have a trial."""
    methods = group_methods(trials)
    ce = next((m for m in methods if m.loss == "ce"), None)
    apao = next((m for m in methods if m.loss == "apao_pointwise"), None)
    if ce is None or apao is None:
        return []
    return [(a.seed, a, c) for a in apao.trials for c in [next((t for t in ce.trials if t.seed == a.seed), None)]
            if c is not None]


def _band_differences(dataset, trials: list, split: str, edges: np.ndarray, metric: str) -> list[dict]:
    """APAO - CE per-user ``metric`` on ``split`` per band (``edges``: training counts), per seed."""
    band, _ = _bands(dataset, split, edges)
    rows = []
    for seed, a, c in _pairs(trials):
        ta, tc = a.per_user(split), c.per_user(split)
        if ta is None or tc is None:
            continue
        ta, tc = ta.set_index("user"), tc.set_index("user")
        users = ta.index.intersection(tc.index)
        diff = ta.loc[users, metric].to_numpy(float) - tc.loc[users, metric].to_numpy(float)
        user_band = np.array([band[u] for u in users])
        row = {"seed": seed, "all": float(diff.mean())}
        for index, name in zip((2, 1, 0), BANDS):               # highest counts = head
            part = diff[user_band == index]
            row[name] = float(part.mean())
            row[f"{name}_se"] = float(part.std(ddof=1) / math.sqrt(len(part)))
            row[f"{name}_users"] = int(len(part))
        rows.append(row)
    return rows


def by_band(dataset, exports: list[str], metric: str = "ndcg_at_10") -> dict:
    """APAO - CE per-user test ``metric`` by third of users (test target's training count), per seed; where the
    exports hold per-user validation tables, the same on validation in the test split's bands, and validation
    re-weighted to test's band shares."""
    band, edges = _bands(dataset, "test")
    trials = finished_trials([load_export(e) for e in exports])
    rows = _band_differences(dataset, trials, "test", edges, metric)
    mean = {name: float(np.mean([r[name] for r in rows])) for name in ("all", *BANDS)} if rows else {}
    result = {"metric": metric, "band_edges_train_count": edges.tolist(), "per_seed": rows, "mean_over_seeds": mean}
    valid_rows = _band_differences(dataset, trials, "valid", edges, metric)
    if valid_rows:
        valid_band, _ = _bands(dataset, "valid", edges)
        shares = {split: {name: float(np.mean([b == index for b in bands.values()]))
                          for index, name in zip((2, 1, 0), BANDS)}
                  for split, bands in (("valid", valid_band), ("test", band))}
        for row in valid_rows:
            row["reweighted_to_test"] = float(sum(row[name] * shares["test"][name] for name in BANDS))
        result["valid"] = {"band_shares": shares, "per_seed": valid_rows}
    return result


def paired_variance_test(first: np.ndarray, second: np.ndarray) -> dict:
    """Is ``second`` more spread than ``first``, the two paired (one pair per seed)? Not an F test, which takes
    them as independent: Pitman-Morgan's, the correlation of the pairs' sums and differences (0 exactly when the
    variances are equal), t on n - 2 degrees of freedom, one- and two-sided."""
    r = float(np.corrcoef(second + first, second - first)[0, 1])
    statistic = r * math.sqrt((len(first) - 2) / max(1.0 - r * r, 1e-300))
    return {"ratio": float(np.var(second, ddof=1) / np.var(first, ddof=1)), "paired_correlation": r,
            "p_one_sided": float(student_t.sf(statistic, len(first) - 2)),
            "p_two_sided": float(2 * student_t.sf(abs(statistic), len(first) - 2))}


def _at_lowest_loss(trial, metric: str) -> float:
    """Validation ``metric`` at the trial's lowest validation CE loss (``val/loss_ce``, which every trial logs
    whatever its training loss: one definition for every seed), NaN without it."""
    loss = trial.history("val/loss_ce").dropna()
    return float(trial.history(f"val/{metric}")[int(loss.idxmin())]) if not loss.empty else float("nan")


def seed_level(exports: list[str], metric: str = "ndcg_at_10", window: int = 10) -> dict:
    """Per seed: APAO - CE on validation at the kept epochs and over the epochs around them, and on test at the
    kept epochs (per-user mean); over seeds: each one's mean and sd, and validation - test with a t interval."""
    rows = []
    for seed, a, c in _pairs(finished_trials([load_export(e) for e in exports])):
        ta, tc = a.per_user("test"), c.per_user("test")
        if ta is None or tc is None:
            continue
        ta, tc = ta.set_index("user"), tc.set_index("user")
        users = ta.index.intersection(tc.index)
        test = float((ta.loc[users, metric].to_numpy(float) - tc.loc[users, metric].to_numpy(float)).mean())
        kept = sorted(int(t.metrics["best/epoch"]) for t in (a, c))
        gap = (a.history(f"val/{metric}") - c.history(f"val/{metric}")).dropna()
        around = gap[(gap.index >= kept[0] - window) & (gap.index <= kept[1] + window)]
        rows.append({"seed": seed, "kept_epochs": {"apao_pointwise": int(a.metrics["best/epoch"]),
                                                   "ce": int(c.metrics["best/epoch"])},
                     "valid_kept": float(a.metrics[f"best/val/{metric}"] - c.metrics[f"best/val/{metric}"]),
                     "valid_around": float(around.mean()), "valid_around_epochs": int(len(around)), "test": test,
                     "valid_lowest_loss": _at_lowest_loss(a, metric) - _at_lowest_loss(c, metric)})
    result = {"metric": metric, "window": window, "per_seed": rows}
    if len(rows) < 2:
        return result
    for key in ("valid_kept", "valid_around", "test"):
        values = np.array([r[key] for r in rows])
        result[key] = {"mean": float(values.mean()), "sd_over_seeds": float(values.std(ddof=1))}
    if result["valid_kept"]["sd_over_seeds"] > 0 and len(rows) > 2:  # does test spread over seeds more than validation?
        result["test_over_valid_kept_variance"] = paired_variance_test(
            np.array([r["valid_kept"] for r in rows]), np.array([r["test"] for r in rows]))
    for key in ("valid_kept", "valid_around"):
        d = np.array([r[key] - r["test"] for r in rows])
        se = d.std(ddof=1) / math.sqrt(len(d))
        low, high = student_t.interval(0.95, len(d) - 1, loc=d.mean(), scale=se)
        result[f"{key}_minus_test"] = {"mean": float(d.mean()), "ci95": [float(low), float(high)],
                                       "p": float(2 * student_t.sf(abs(d.mean() / se), len(d) - 1)), "seeds": len(d)}
    return result


def per_epoch(exports: list[str], metric: str = "ndcg_at_10", tail: int = 20) -> list[dict]:
    """Per seed whose trials logged test every epoch: APAO - CE on validation and on test at each common epoch,
    the epochs each is positive, their correlation over all epochs and over the last ``tail``."""
    loaded = [load_export(e) for e in exports]
    trials = finished_trials(loaded, "all") + unfinished_trials(loaded)
    out = []
    for seed, a, c in _pairs(trials):
        curves = {}
        for split, key in (("valid", f"val/{metric}"), ("test", f"{DIAGNOSIS_PREFIX}test/{metric}")):
            ha, hc = a.history(key), c.history(key)
            curves[split] = (ha - hc).dropna()
        epochs = curves["valid"].index.intersection(curves["test"].index)
        if len(epochs) < 3:
            continue
        dv, dt = curves["valid"].loc[epochs].to_numpy(float), curves["test"].loc[epochs].to_numpy(float)
        last = slice(-min(tail, len(epochs)), None)
        out.append({"seed": seed, "epochs": [int(e) for e in epochs], "valid": dv.tolist(), "test": dt.tolist(),
                    "valid_positive": int((dv > 0).sum()), "test_positive": int((dt > 0).sum()),
                    "correlation": float(np.corrcoef(dv, dt)[0, 1]),
                    f"correlation_last_{tail}": float(np.corrcoef(dv[last], dt[last])[0, 1]),
                    f"mean_last_{tail}": {"valid": float(dv[last].mean()), "test": float(dt[last].mean())},
                    "finished": a.record["status"] == "FINISHED" and c.record["status"] == "FINISHED"})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="office", help="(default %(default)s)")
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", str(ROOT.parent / "shared" / "datasets")))
    parser.add_argument("--exports", nargs="*", default=[], help="study exports with per-user test tables")
    parser.add_argument("--window", type=int, default=10,
                        help="validation averaged over the kept epochs +/- this many (default %(default)s)")
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
        if not bands["per_seed"]:
            print("no seed with both methods' per-user test tables (a study still running has none yet)")
        else:
            print(f"APAO - CE test {bands['metric']} by the test target's training count "
                  f"(thirds of users, edges {bands['band_edges_train_count']}):")
            print(f"{'seed':<6}{'all':>9}" + "".join(f"{name:>18}" for name in BANDS))
            for row in bands["per_seed"]:
                print(f"{row['seed']:<6}{row['all']:>+9.4f}" + "".join(
                    f"{row[name]:>+10.4f} ±{row[name + '_se']:.4f}" for name in BANDS))
            print(f"{'mean':<6}{bands['mean_over_seeds']['all']:>+9.4f}" + "".join(
                f"{bands['mean_over_seeds'][name]:>+18.4f}" for name in BANDS))
        if "valid" in bands:
            shares = bands["valid"]["band_shares"]
            print("users per band, valid / test: " + ", ".join(
                f"{name} {shares['valid'][name]:.1%} / {shares['test'][name]:.1%}" for name in BANDS))
            print(f"APAO - CE validation {bands['metric']} in the same bands, and re-weighted to test's shares:")
            print(f"{'seed':<6}{'all':>9}" + "".join(f"{name:>18}" for name in BANDS) + f"{'reweighted':>12}")
            for row in bands["valid"]["per_seed"]:
                print(f"{row['seed']:<6}{row['all']:>+9.4f}" + "".join(
                    f"{row[name]:>+10.4f} ±{row[name + '_se']:.4f}" for name in BANDS)
                    + f"{row['reweighted_to_test']:>+12.4f}")
        result["seed_level"] = level = seed_level(args.exports, window=args.window)
        if "test" in level:
            print(f"APAO - CE {level['metric']} per seed at the kept epochs: validation, validation over the kept "
                  f"epochs +/- {level['window']}, test; validation at each trial's lowest val/loss_ce")
            for row in level["per_seed"]:
                print(f"  seed {row['seed']:<3}{row['valid_kept']:>+9.4f}{row['valid_around']:>+9.4f}{row['test']:>+9.4f}"
                      f"{row['valid_lowest_loss']:>+9.4f}")
            print("  mean    " + "".join(f"{level[k]['mean']:>+9.4f}" for k in ("valid_kept", "valid_around", "test")))
            print("  sd      " + "".join(f"{level[k]['sd_over_seeds']:>9.4f}" for k in ("valid_kept", "valid_around", "test")))
            spread = level.get("test_over_valid_kept_variance")
            if spread:
                print(f"  test's variance over seeds / validation's at the kept epochs: {spread['ratio']:.1f} "
                      f"(paired by seed, Pitman-Morgan t({len(level['per_seed']) - 2}) one-sided p "
                      f"{spread['p_one_sided']:.2f}, two-sided {spread['p_two_sided']:.2f})")
            for key, name in (("valid_kept", "kept epochs"), ("valid_around", "around them")):
                d = level[f"{key}_minus_test"]
                print(f"  validation ({name}) - test: {d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}], "
                      f"p {d['p']:.2f} (t over {d['seeds']} seeds)")
        result["per_epoch"] = curves = per_epoch(args.exports)
        for curve in curves:
            state = "finished" if curve["finished"] else "still running"
            print(f"seed {curve['seed']} ({state}), APAO - CE per epoch, validation / test:")
            for epoch, v, t in zip(curve["epochs"], curve["valid"], curve["test"]):
                print(f"  {epoch:>4} {v:>+8.4f} {t:>+8.4f}")
            n = len(curve["epochs"])
            print(f"  positive at {curve['valid_positive']}/{n} epochs on validation, {curve['test_positive']}/{n} "
                  f"on test; correlation {curve['correlation']:+.2f} over all, {curve['correlation_last_20']:+.2f} "
                  f"over the last 20 (means {curve['mean_last_20']['valid']:+.4f} / {curve['mean_last_20']['test']:+.4f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
