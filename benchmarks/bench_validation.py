"""One validation pass as a trial runs it (``evaluate_split``: beam search K = 20, prefix recall, validation CE)
over a whole split, optionally A/B against an earlier git revision, or profiled.

Models are randomly initialised at the paper's size (speed does not depend on the weights). Each measurement runs
in a fresh subprocess on the memory allocator a trial's worker gets (training/memory.py) with ``--threads``
threads; the code under test is this tree or, with ``--baseline-rev REV``, the tree at REV (a temporary git
worktree), alternating over ``--repeats`` rounds; medians and the median of per-round ratios are reported.

    python benchmarks/bench_validation.py --backbones tiger --baseline-rev 51b0c0c
    python benchmarks/bench_validation.py --backbones tiger --profile 12   # which ops take the time
    python benchmarks/bench_validation.py --backbones tiger --profile 12 --baseline-rev 128b81d   # ... at 128b81d
    python benchmarks/bench_validation.py --backbones tiger --loss apao_pointwise   # + the validation-loss pass

``--loss`` also times the pass a trial adds every epoch for the validation-loss selection rule
(``training.selection.validation_loss`` of that loss over the same split), beside the beam pass.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(args: argparse.Namespace) -> dict:
    """Seconds of one ``evaluate_split`` over ``args.split`` (in this process, with whatever apao_ray is first on
    the path), and its loss_ce / NDCG@10 (the two trees must agree up to the precision's rounding)."""
    import torch

    import apao_ray
    from apao_ray.config import ModelConfig, TrainConfig
    from apao_ray.data import load_dataset
    from apao_ray.models import build_model
    from apao_ray.training.evaluation import evaluate_split

    torch.set_num_threads(args.threads)
    dataset = load_dataset(args.dataset, args.data_dir, allow_download=False)
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=args.backbone), dataset.catalog.vocab_size, dataset.catalog.num_levels)
    device = torch.device("cpu")
    tensors = dataset.catalog.tensors(device)
    train = TrainConfig(precision=args.precision, retention_users=0)
    prefix = "val" if args.split == "valid" else args.split
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            evaluate_split(model, dataset, args.split, tensors, train, device, None)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile,
                                            max_name_column_width=48), file=sys.stderr)
    start = time.perf_counter()
    metrics = evaluate_split(model, dataset, args.split, tensors, train, device, None)
    seconds = time.perf_counter() - start
    loss_seconds = None
    if args.loss:
        from apao_ray.config import DataConfig, LossConfig, TrialConfig
        from apao_ray.losses import build_loss
        from apao_ray.training.selection import validation_loss
        from apao_ray.training.steps import EpochRunner

        config = TrialConfig(DataConfig(dataset=args.dataset, data_dir=args.data_dir), ModelConfig(backbone=args.backbone),
                             LossConfig(name=args.loss), train)
        loss_fn = build_loss(config.loss, tensors)
        start = time.perf_counter()
        validation_loss(model, loss_fn, EpochRunner(config, dataset, tensors, device), dataset, None,
                        train.eval_batch_size)
        loss_seconds = time.perf_counter() - start
    return {"seconds": seconds, "loss_seconds": loss_seconds, "loss_ce": metrics[f"{prefix}/loss_ce"],
            "ndcg_at_10": metrics[f"{prefix}/ndcg_at_10"], "users": len(dataset.splits[args.split]),
            "code": str(Path(apao_ray.__file__).parents[1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", str(ROOT.parent / "shared" / "datasets")))
    parser.add_argument("--dataset", default="office")
    parser.add_argument("--split", default="valid", choices=("valid", "test"))
    parser.add_argument("--backbones", default="tiger,llama", help="comma list (default %(default)s)")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"), help="(default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="(default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, trees alternating (default %(default)s)")
    parser.add_argument("--allocator", default="auto", help="a trial worker's allocator (default %(default)s)")
    parser.add_argument("--baseline-rev", help="also time this git revision's code, interleaved")
    parser.add_argument("--profile", type=int, metavar="ROWS",
                        help="profile one pass of the first backbone (this tree's code, or --baseline-rev's) and list "
                             "the top ROWS ops")
    parser.add_argument("--loss", help="also time the validation-loss pass of this loss (the selection rule every "
                        "trial records)")
    parser.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "validation.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # apao_ray from $PYTHONPATH: this tree or the baseline's
        args.backbone = args.one
        print(json.dumps(measure(args)))
        return 0
    sys.path.insert(0, str(ROOT))
    from apao_ray.hardware import cpu_description
    from apao_ray.training.memory import allocator_env

    forwarded = ["--data-dir", args.data_dir, "--dataset", args.dataset, "--split", args.split,
                 "--precision", args.precision, "--threads", str(args.threads), *(["--loss", args.loss] if args.loss else [])]
    env = {**os.environ, **allocator_env(args.allocator)}

    def run(tree: Path, backbone: str, extra: list[str] = ()) -> dict:
        done = subprocess.run([sys.executable, __file__, "--one", backbone, *forwarded, *extra], capture_output=True,
                              text=True, env={**env, "PYTHONPATH": str(tree)})
        if done.returncode != 0:
            raise RuntimeError(f"{backbone} at {tree} failed:\n{done.stderr[-3000:]}")
        if extra:
            print(done.stderr[-6000:], file=sys.stderr)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if Path(result["code"]).resolve() != tree.resolve():
            raise RuntimeError(f"measured the code at {result['code']}, not {tree}")
        return result

    baseline = None
    if args.baseline_rev:
        from bench_training import Baseline

        baseline = Baseline(args.baseline_rev)
    if args.profile:  # of the baseline's code when one is named
        try:
            run(baseline.path if baseline else ROOT, args.backbones.split(",")[0], ["--profile", str(args.profile)])
        finally:
            if baseline:
                baseline.close()
        return 0
    trees = {"this tree": ROOT, **({f"@{args.baseline_rev}": baseline.path} if baseline else {})}
    load = os.getloadavg()[0]
    rows = []
    try:
        for backbone in args.backbones.split(","):
            runs: dict[str, list[dict]] = {label: [] for label in trees}
            for round_index in range(args.repeats):
                order = list(trees) if round_index % 2 == 0 else list(trees)[::-1]
                for label in order:
                    runs[label].append(run(trees[label], backbone))
                    print(f"{backbone} round {round_index + 1} {label}: {runs[label][-1]['seconds']:.1f} s",
                          file=sys.stderr, flush=True)
            for label, measured in runs.items():
                seconds = [m["seconds"] for m in measured]
                row = {"backbone": backbone, "code": label, "seconds": statistics.median(seconds), "runs": seconds,
                       "users_per_second": measured[0]["users"] / statistics.median(seconds),
                       "loss_ce": measured[0]["loss_ce"], "ndcg_at_10": measured[0]["ndcg_at_10"]}
                if args.loss:
                    row["loss_pass_seconds"] = statistics.median(m["loss_seconds"] for m in measured)
                    row["loss_pass_share"] = row["loss_pass_seconds"] / row["seconds"]
                if baseline and label == "this tree":
                    old = [m["seconds"] for m in runs[f"@{args.baseline_rev}"]]
                    row["speedup_vs_baseline"] = statistics.median(o / n for o, n in zip(old, seconds))
                rows.append(row)
    finally:
        if baseline:
            baseline.close()
    print(f"{cpu_description()}, {args.threads} threads, {args.precision}, {args.dataset}/{args.split}, "
          f"allocator {args.allocator} (load {load:.1f} at start)")
    print(f"{'backbone':<9}{'code':<16}{'median s':>10}{'users/s':>9}{'x baseline':>12}  runs s")
    for row in rows:
        ratio = f"{row['speedup_vs_baseline']:.2f}" if "speedup_vs_baseline" in row else "-"
        print(f"{row['backbone']:<9}{row['code']:<16}{row['seconds']:>10.1f}{row['users_per_second']:>9.0f}"
              f"{ratio:>12}  {' / '.join(f'{s:.1f}' for s in row['runs'])}")
        if "loss_pass_seconds" in row:
            print(f"  + {args.loss} validation-loss pass: {row['loss_pass_seconds']:.1f} s "
                  f"({row['loss_pass_share']:.0%} of the beam pass)")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"cpu": cpu_description(), "load_average_at_start": load,
                                               "args": {k: v for k, v in vars(args).items() if k != "one"},
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
