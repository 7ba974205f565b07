"""Why a finished study's APAO does (not) beat CE, from its own checkpoints.

Evaluates each trial of a study twice over: the weights it selected (best validation NDCG@10, what its test
metrics came from) and the weights of its last epoch, each in bf16 and fp32 beam search, on the validation and
the test split (every user, beam 20). Prints one table of metrics and one of paired differences against the
baseline loss (bootstrap CI over users, Wilcoxon p), and writes both as JSON. Nothing is selected on the test
split: the selected epoch stays the one validation chose; the last epoch and fp32 are shown to see whether the
test result hangs on that choice or on the precision.

    python benchmarks/evidence/diagnose_full.py --study-dir ~/apao_evidence/runs/office-full-tiger-seed0 \\
        --json benchmarks/results/diagnose_office-full-tiger-seed0.json

With ``--export`` (the study's committed export) it also says which epoch selection by validation loss would
have kept (the lowest ``val/loss_ce``, the mean target-token CE every trial logs; the released code keeps the
epoch of the lowest validation loss) and the validation metrics there, next to the NDCG@10-selected epoch's:
this part needs no checkpoints (``--study-dir`` may then be left out).

    python benchmarks/evidence/diagnose_full.py --export benchmarks/results/office-full-tiger-seed0

It reads every ``checkpoints/`` folder under ``--study-dir`` (a sweep's ``<output-dir>/<study>/train_runs/*/``,
or ``gpu_full_protocol.py``'s ``--work``): the ``*_final`` directory (selected weights, config, catalog) and the
newest epoch checkpoint (last weights).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from apao_ray.analysis.stats import paired_comparison
from apao_ray.data import load_dataset
from apao_ray.hardware import cpu_description
from apao_ray.reuse.inference import Recommender
from apao_ray.protocol import decoding_scoring
from apao_ray.rank_metrics import PER_USER_METRICS
from apao_ray.training.checkpoint import CONFIG_FILE, FINAL_METRICS_FILE, STATE_FILE
from apao_ray.training.evaluation import evaluate_split_per_user

METRICS = PER_USER_METRICS  # every registered metric at the per-user tables' cutoffs


def trial_checkpoints(study_dir: Path) -> dict[str, tuple[Path, Path]]:
    """loss name -> (final directory, newest epoch checkpoint directory), one trial per loss."""
    found: dict[str, tuple[Path, Path]] = {}
    for checkpoints in sorted(study_dir.glob("**/checkpoints")):
        finals = sorted(checkpoints.glob("*_final"))
        epochs = sorted(p for p in checkpoints.iterdir() if p.is_dir() and not p.name.endswith("_final"))
        if not finals or not epochs:
            continue  # a trial that has not ended
        loss = json.loads((finals[-1] / CONFIG_FILE).read_text())["loss"]["name"]
        if loss in found:
            raise SystemExit(f"two finished trials of loss {loss!r} under {study_dir}: this script compares one each")
        found[loss] = (finals[-1], epochs[-1])
    return found


def evaluate(recommender: Recommender, dataset, split: str, precision: str) -> tuple[dict[str, float], dict]:
    config = recommender.config
    train = config.train.replace(precision=precision, retention_users=0)
    tensors = recommender.catalog.tensors(recommender.device)
    metrics, table = evaluate_split_per_user(recommender.model, dataset, split, tensors, train, recommender.device,
                                             None, decoding_scoring(config))
    return metrics, table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study-dir", type=Path, help="the study's folder (its trials' checkpoints "
                        "are found below it)")
    parser.add_argument("--baseline", default="ce", help="the loss the others are compared with (default ce)")
    parser.add_argument("--precisions", default="bf16,fp32", help="beam-search precisions (default bf16,fp32)")
    parser.add_argument("--splits", default="valid,test", help="splits to evaluate (default valid,test)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--export", type=Path, help="the study's export (export-study): also the epochs that "
                        "selection by validation loss would keep")
    parser.add_argument("--json", type=Path, help="write the tables here")
    return parser


def main(argv: list[str] | None = None) -> dict:
    """Prints the tables; returns what ``--json`` writes."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.study_dir is None and args.export is None:
        parser.error("give --study-dir (checkpoints to re-evaluate), --export (selection by loss) or both")
    result = {"cpu": cpu_description(), "threads": torch.get_num_threads()}
    if args.export:
        result["selection"] = selection_by_loss(args.export)
    if args.study_dir:
        result.update(study_dir=str(args.study_dir), **re_evaluate(args))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


def selection_by_loss(export_dir: Path) -> list[dict]:
    """Per trial: the epoch of the lowest ``val/loss_ce`` and the one of the best ``val/ndcg_at_10``, with the
    validation NDCG@10 / Recall@10 at each; printed as a table."""
    from apao_ray.analysis.export import load_export

    export, rows = load_export(export_dir), []
    for trial in export.trials:
        run = trial["run_id"]
        loss_ce, ndcg, recall = (export.history(run, f"val/{key}") for key in ("loss_ce", "ndcg_at_10", "recall_at_10"))
        by_loss, by_ndcg = int(loss_ce.idxmin()), int(ndcg.idxmax())
        rows.append({"loss": trial["params"].get("loss"), "epochs": int(ndcg.index.max()),
                     "loss_epoch": by_loss, "loss_ce": float(loss_ce[by_loss]), "loss_ndcg_at_10": float(ndcg[by_loss]),
                     "loss_recall_at_10": float(recall[by_loss]), "ndcg_epoch": by_ndcg,
                     "ndcg_at_10": float(ndcg[by_ndcg]), "recall_at_10": float(recall[by_ndcg])})
    print("| loss | epochs | lowest val loss_ce: epoch | loss_ce | val N@10 | val R@10 | best val N@10: epoch | "
          "val N@10 | val R@10 | N@10 lost by loss selection |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: str(r["loss"])):
        print(f"| {r['loss']} | {r['epochs']} | {r['loss_epoch']} | {r['loss_ce']:.3f} | {r['loss_ndcg_at_10']:.4f} | "
              f"{r['loss_recall_at_10']:.4f} | {r['ndcg_epoch']} | {r['ndcg_at_10']:.4f} | {r['recall_at_10']:.4f} | "
              f"{1 - r['loss_ndcg_at_10'] / r['ndcg_at_10']:.0%} |")
    return rows


def re_evaluate(args: argparse.Namespace) -> dict:
    """The selected and last weights of each trial under ``args.study_dir``, re-evaluated; printed as tables."""
    if args.threads:
        torch.set_num_threads(args.threads)
    trials = trial_checkpoints(args.study_dir.expanduser())
    if args.baseline not in trials:
        raise SystemExit(f"no finished {args.baseline!r} trial under {args.study_dir} (found {sorted(trials)})")
    precisions, splits = args.precisions.split(","), args.splits.split(",")
    rows, tables, dataset = [], {}, None
    for loss, (final_dir, last_dir) in sorted(trials.items()):
        recommender = Recommender.from_checkpoint(final_dir, precision="fp32")
        data = recommender.config.data
        dataset = dataset or load_dataset(data.dataset, data.data_dir, data.max_history, data.synthetic_seed)
        selected = {k: v.clone() for k, v in recommender.model.state_dict().items()}
        last = torch.load(last_dir / STATE_FILE, map_location="cpu", weights_only=False)
        best_epoch = json.loads((final_dir / FINAL_METRICS_FILE).read_text()).get("best/epoch")
        for weights, state, epoch in (("selected", selected, best_epoch), ("last", last["model"], last.get("epoch"))):
            recommender.model.load_state_dict(state)
            for precision in precisions:
                for split in splits:
                    start = time.perf_counter()
                    metrics, table = evaluate(recommender, dataset, split, precision)
                    prefix = "val" if split == "valid" else split
                    row = {"loss": loss, "weights": weights, "epoch": epoch, "precision": precision, "split": split,
                           **{m: metrics[f"{prefix}/{m}"] for m in METRICS}, "seconds": time.perf_counter() - start}
                    rows.append(row)
                    tables[(loss, weights, precision, split)] = table
                    print(" | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row.values()),
                          file=sys.stderr, flush=True)
    comparisons = []
    for (loss, weights, precision, split), table in sorted(tables.items()):
        if loss == args.baseline:
            continue
        base = tables[(args.baseline, weights, precision, split)]
        for metric in METRICS:
            c = paired_comparison(table[metric], base[metric])
            comparisons.append({"method": loss, "weights": weights, "precision": precision, "split": split,
                                "metric": metric, "difference": c.mean_difference, "ci_low": c.ci_low,
                                "ci_high": c.ci_high, "p_value": c.p_value, "users": c.num_users})
    print("| loss | weights | epoch | precision | split | " + " | ".join(METRICS) + " | s |")
    print("|---|---|---|---|---|" + "---|" * (len(METRICS) + 1))
    for r in rows:
        print(f"| {r['loss']} | {r['weights']} | {r['epoch']} | {r['precision']} | {r['split']} | "
              + " | ".join(f"{r[m]:.4f}" for m in METRICS) + f" | {r['seconds']:.0f} |")
    print(f"\npaired difference - {args.baseline} (95% bootstrap CI over users, Wilcoxon p)")
    print("| method | weights | precision | split | " + " | ".join(METRICS) + " |")
    print("|---|---|---|---|" + "---|" * len(METRICS))
    by_row: dict[tuple, list[str]] = {}
    for c in comparisons:
        by_row.setdefault((c["method"], c["weights"], c["precision"], c["split"]), []).append(
            f"{c['difference']:+.4f} [{c['ci_low']:.4f}, {c['ci_high']:.4f}] p={c['p_value']:.2g}")
    for key, cells in by_row.items():
        print("| " + " | ".join(key) + " | " + " | ".join(cells) + " |")
    return {"rows": rows, "comparisons": comparisons}


if __name__ == "__main__":
    main()
