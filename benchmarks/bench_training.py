"""Training throughput per (backbone, loss) on Office-sized batches, through the real epoch loop.

Each measurement runs in a fresh subprocess (so peak RSS is per configuration) that trains
``--steps`` optimizer steps of ``--batch-size`` real Office samples with ``EpochRunner`` after one
warm-up step; configurations are interleaved across ``--repeats`` rounds and medians reported, with
each configuration's ratio to fp32 CE of the same backbone, measured in the same rounds. Prints a table, writes JSON.

    python benchmarks/bench_training.py --data-dir ../shared/datasets
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAPER_A100_SECONDS = {"ce": 15, "apao_pointwise": 15, "apao_pairwise": 163}  # SPEC §6, TIGER on Office


def measure(args: argparse.Namespace) -> dict:
    """One configuration, in this process: samples/s of ``args.steps`` optimizer steps."""
    import torch

    sys.path.insert(0, str(ROOT))
    from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
    from apao_ray.data import load_dataset
    from apao_ray.losses import build_loss
    from apao_ray.training.loop import _optimizer, _schedule
    from apao_ray.training.steps import EpochRunner

    torch.set_num_threads(args.threads)
    dataset = load_dataset(args.dataset, args.data_dir)
    config = TrialConfig(DataConfig(dataset=args.dataset), ModelConfig(backbone=args.backbone),
                         LossConfig(name=args.loss, num_negatives=args.num_negatives, beta=0.2, eta=3e-5),
                         TrainConfig(batch_size=args.batch_size, effective_batch_size=args.batch_size, seed=args.seed,
                                     max_train_samples=args.batch_size * args.steps,
                                     precision="bf16" if "bf16" in args.variant else "fp32", group_by_length="grouped" in args.variant))
    from apao_ray.models import build_model

    model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels)
    tensors = dataset.catalog.tensors()
    loss = build_loss(config.loss, tensors)
    optimizer = _optimizer(model, 5e-4, 0.01)
    scheduler = _schedule(optimizer, 10 * args.steps, 0.01)
    warmup = EpochRunner(config.replace(train=config.train.replace(max_train_samples=args.batch_size)),
                         dataset, tensors, torch.device("cpu"))
    warmup.train_epoch(1, model, loss, optimizer, scheduler, None)
    runner = EpochRunner(config, dataset, tensors, torch.device("cpu"))
    start = time.perf_counter()
    metrics = runner.train_epoch(2, model, loss, optimizer, scheduler, None)
    seconds = time.perf_counter() - start
    return {"samples_per_second": metrics["train/num_samples"] / seconds, "seconds": seconds,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "num_train_samples": len(dataset.splits["train"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", str(ROOT.parent / "shared" / "datasets")))
    parser.add_argument("--dataset", default="office")
    parser.add_argument("--backbones", default="tiger,llama")
    parser.add_argument("--losses", default="ce,apao_pointwise,apao_pairwise")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--num-negatives", type=int, default=100)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps measured per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default="fp32", help="comma list, interleaved with the rest: fp32; bf16 (bf16 "
                        "autocast, AMX on recent x86 CPUs); grouped (--group-by-length); bf16+grouped")
    parser.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "training.json"))
    parser.add_argument("--one", nargs=3, metavar=("BACKBONE", "LOSS", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.backbone, args.loss, args.variant = args.one
        print(json.dumps(measure(args)))
        return 0
    configs = [(b, l, p) for b in args.backbones.split(",") for l in args.losses.split(",")
               for p in args.variants.split(",")]

    def label(backbone: str, loss: str, variant: str) -> str:
        return f"{backbone}/{loss}" + ("" if variant == "fp32" else f" {variant}")

    runs: dict[str, list[dict]] = {label(*c): [] for c in configs}
    for round_index in range(args.repeats):
        order = configs if round_index % 2 == 0 else configs[::-1]  # A/B interleaved, alternating order
        for config in order:
            command = [sys.executable, __file__, "--one", *config, *sys.argv[1:]]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            runs[label(*config)].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {round_index + 1}: {label(*config)} {runs[label(*config)][-1]['samples_per_second']:.1f} "
                  "samples/s", file=sys.stderr, flush=True)
    rows = []
    for backbone, loss, variant in configs:
        key, ce_key = label(backbone, loss, variant), label(backbone, "ce", "fp32")
        speeds = [r["samples_per_second"] for r in runs[key]]
        ratios = [r["samples_per_second"] / c["samples_per_second"] for r, c in zip(runs[key], runs.get(ce_key, []))]
        median = statistics.median(speeds)
        rows.append({"backbone": backbone, "loss": loss, "variant": variant, "samples_per_second": median,
                     "ratio_to_ce": statistics.median(ratios) if ratios else None,
                     "epoch_minutes": runs[key][0]["num_train_samples"] / median / 60,
                     "peak_rss_gib": max(r["peak_rss_gib"] for r in runs[key]),
                     "paper_a100_epoch_seconds": PAPER_A100_SECONDS.get(loss) if backbone == "tiger" else None,
                     "runs": speeds})
    print(f"{'backbone/loss':<30}{'samples/s':>10}{'x CE':>7}{'epoch min':>11}{'RSS GiB':>9}{'A100 s':>8}")
    for row in rows:
        ratio = f"{row['ratio_to_ce']:.2f}" if row["ratio_to_ce"] is not None else "-"
        print(f"{label(row['backbone'], row['loss'], row['variant']):<30}{row['samples_per_second']:>10.1f}{ratio:>7}"
              f"{row['epoch_minutes']:>11.1f}{row['peak_rss_gib']:>9.2f}{row['paper_a100_epoch_seconds'] or '-':>8}")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "one"},
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
