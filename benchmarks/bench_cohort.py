"""A fused cohort (training/cohort.py) against the same members trained as separate trials, on Office.

For each (backbone, loss, K): K members of seeds 0..K-1, each with its own EpochRunner (its own sample order
and negatives), AdamW and schedule, train ``--steps`` optimizer steps of ``--effective-batch-size`` real
Office samples through the product's epoch loop (training/steps.train_members): once one member after
another (``separate``: what a study runs when its trials queue for the same cores), once as one fused model
(``fused``). The two are interleaved over ``--repeats`` rounds after a warm-up round; medians reported, and
the fused/separate ratio of samples/s within each round (>1: the cohort is faster). Both use every thread
of this process (``--threads``). Prints a table and writes JSON.

    python benchmarks/bench_cohort.py                                  # TIGER and Llama, CE and APAO, K = 2, 4
    python benchmarks/bench_cohort.py --backbones tiger --losses ce --cohorts 2 --steps 1 --repeats 1  # try it
    python benchmarks/bench_cohort.py --backbones tiger --losses ce --cohorts 2 --padded --threads 1   # where it goes
    python benchmarks/bench_cohort.py --device cuda --cohorts 1,4,10,20 --effective-batch-size 1024 --steps 5 \\
        --data-dir .gpu/datasets --json-out gpu_out/cohort.json   # on a GPU (K = 1: the fused path alone)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig, default_micro_batch  # noqa: E402
from apao_ray.data import load_dataset  # noqa: E402
from apao_ray.hardware import cpu_description  # noqa: E402
from apao_ray.losses import build_loss  # noqa: E402
from apao_ray.models import build_model  # noqa: E402
from apao_ray.models.fused import FusedModels  # noqa: E402
from apao_ray.training.trial_setup import build_optimizer, warmup_cosine  # noqa: E402
from apao_ray.training.precision import resolve_precision  # noqa: E402
from apao_ray.training.steps import EpochMember, EpochRunner, train_members  # noqa: E402
from bench_roofline import flops_per_sample  # noqa: E402 - benchmarks/, this script's own folder

PAPER_KNOBS = {"apao_pointwise": {"beta": 0.3, "eta": 1e-4}}  # the paper's Table 5 (Office TIGER)


def members(dataset, backbone: str, loss: str, k: int, args: argparse.Namespace,
            device: torch.device) -> list[EpochMember]:
    result = []
    for seed in range(k):
        micro = args.batch_size or min(default_micro_batch(device.type == "cuda"), args.effective_batch_size)
        config = TrialConfig(
            data=DataConfig(dataset="office"), model=ModelConfig(backbone=backbone),
            loss=LossConfig(name=loss, **PAPER_KNOBS.get(loss, {})),
            train=TrainConfig(seed=seed, batch_size=micro, effective_batch_size=args.effective_batch_size,
                              max_train_samples=args.steps * args.effective_batch_size,
                              precision=resolve_precision(args.precision, device)))
        torch.manual_seed(seed)
        tensors = dataset.catalog.tensors(device)
        model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels).to(device)
        runner = EpochRunner(config, dataset, tensors, device)
        optimizer = build_optimizer(model, config.train.lr, config.train.weight_decay)
        scheduler = warmup_cosine(optimizer, 1000, 0.0)
        result.append(EpochMember(runner, model, build_loss(config.loss, tensors), optimizer, scheduler))
    return result


def timed(function) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(dataset, backbone: str, loss: str, k: int, args: argparse.Namespace, device: torch.device) -> dict:
    cohort = members(dataset, backbone, loss, k, args, device)
    fused = FusedModels([member.model for member in cohort])
    samples = k * args.steps * args.effective_batch_size
    rounds = []
    for epoch in range(args.repeats + 1):  # round 0 warms up both
        order = ["separate", "fused"] + (["separate_padded"] if args.padded else [])
        order = order if epoch % 2 == 0 else order[::-1]
        seconds = {}
        for arm in order:
            if arm.startswith("separate"):
                for member in cohort:  # None: the device's default (packed on a CPU); False: padded, as fused
                    member.model.pack_histories = False if arm == "separate_padded" else None
                seconds[arm] = timed(lambda: [train_members(epoch + 1, [member], None) for member in cohort])
            else:
                seconds[arm] = timed(lambda: train_members(epoch + 1, cohort, fused))
        if epoch:
            rounds.append(seconds)
    separate = statistics.median(r["separate"] for r in rounds)
    fused_seconds = statistics.median(r["fused"] for r in rounds)
    # matrix-product FLOPs per training sample (forward + backward, counted on 64 real rows): the achieved rate
    flop = flops_per_sample(dataset, backbone, loss, cohort[0].loss_fn.num_negatives or 100, 64)  # unused at 0
    return {"backbone": backbone, "loss": loss, "members": k, "samples": samples, "flop_per_sample": flop,
            "separate_samples_per_second": samples / separate, "fused_samples_per_second": samples / fused_seconds,
            "fused_tflop_per_second": samples / fused_seconds * flop / 1e12,
            "fused_over_separate": statistics.median(r["separate"] / r["fused"] for r in rounds),
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
            **({"separate_padded_samples_per_second": samples / statistics.median(r["separate_padded"] for r in rounds)}
               if args.padded else {}),
            "rounds": rounds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", str(ROOT.parent / "shared" / "datasets")))
    parser.add_argument("--backbones", default="tiger,llama")
    parser.add_argument("--losses", default="ce,apao_pointwise")
    parser.add_argument("--cohorts", default="2,4", help="members per cohort (default %(default)s)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per member per round (default %(default)s)")
    parser.add_argument("--effective-batch-size", type=int, default=256, help="samples per optimizer step")
    parser.add_argument("--batch-size", type=int, default=None, help="micro-batch (default: the product's for the device)")
    parser.add_argument("--precision", default="auto", help="auto, fp32 or bf16 (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every usable CPU)")
    parser.add_argument("--padded", action="store_true",
                        help="also time the separate trials with the padded history pass the fused model runs")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "bench_cohort.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dataset = load_dataset("office", args.data_dir, allow_download=False)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{cpu_description()}, {torch.get_num_threads()} threads"
    result = {"device": where, "torch": torch.__version__, "args": vars(args), "rows": []}
    print(f"{where}; torch {torch.__version__}; precision {resolve_precision(args.precision, device)}")
    print(f"{'backbone':<8} {'loss':<15} {'K':>3} {'separate/s':>11} {'fused/s':>9} {'fused/sep':>9} "
          f"{'TFLOP/s':>8} {'GiB':>5}")
    for backbone in args.backbones.split(","):
        for loss in args.losses.split(","):
            for k in (int(value) for value in args.cohorts.split(",")):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                try:
                    row = measure(dataset, backbone, loss, k, args, device)
                except torch.OutOfMemoryError as error:  # a large K on a small card: reported, the next runs
                    print(f"{backbone:<8} {loss:<15} {k:>3} out of memory: {str(error)[:120]}", flush=True)
                    continue
                result["rows"].append(row)
                Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json_out).write_text(json.dumps(result, indent=1))
                print(f"{backbone:<8} {loss:<15} {k:>3} {row['separate_samples_per_second']:>11.0f} "
                      f"{row['fused_samples_per_second']:>9.0f} {row['fused_over_separate']:>9.2f} "
                      f"{row['fused_tflop_per_second']:>8.3f} {row['peak_gpu_gib']:>5.1f}"
                      + (f"  padded separate/s {row['separate_padded_samples_per_second']:.0f}" if args.padded else ""),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
