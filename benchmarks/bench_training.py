"""Training throughput per (backbone, loss, variant, micro-batch) on Office, through the real epoch loop,
optionally A/B against the code of an earlier git revision.

Each measurement runs in a fresh subprocess (so peak RSS is per configuration) that trains
``--steps`` optimizer steps of ``--effective-batch-size`` real Office samples (micro-batches of
``--batch-size``, gradient accumulation) with ``EpochRunner`` after one warm-up micro-batch.
Configurations are interleaved across ``--repeats`` rounds in alternating order and medians
reported, each with its ratio to the first variant's CE of the same backbone in the same rounds.

Variants: ``default`` (what a user gets: precision auto, random batches), ``fp32``, ``bf16``,
``grouped`` (--group-by-length, fp32), ``bf16+grouped``. ``--baseline-rev REV`` also runs the
tree at REV (a temporary git worktree) with its own copy of this script: its ``fp32`` random
batches were the default before the speed work; rows are labelled ``@REV`` and run on the same
allocators (and micro-batches, where its script accumulates gradients) as the new rows. ``--allocators``
runs each configuration under each memory allocator (``system,auto`` is the A/B of the allocator
a trial's worker gets, training/memory.py).

    python benchmarks/bench_training.py --backbones tiger --losses ce --baseline-rev 0e64951
    python benchmarks/bench_training.py --backbones tiger --losses ce,apao_pairwise --allocators system,auto
    python benchmarks/bench_training.py --epoch   # one full epoch + validation at the defaults
    python benchmarks/bench_training.py --profile tiger apao_pairwise default --batch-size 128 --steps 1
        # which ops take the time: torch.profiler over the measured steps, top ops by self CPU time
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from apao_ray.hardware import cpu_description
from apao_ray.training.memory import ALLOCATORS, allocator_env, allocator_in_use

ROOT = Path(__file__).resolve().parents[1]
PAPER_A100_SECONDS = {"ce": 15, "apao_pointwise": 15, "apao_pairwise": 163}  # SPEC §6, TIGER on Office
REFERENCE_SAMPLES_PER_SECOND = 41.0  # the authors' code, TIGER CE on Office, 2 CPUs (PERFORMANCE_TARGETS.md)
VARIANTS = {"default": ("auto", False), "fp32": ("fp32", False), "bf16": ("bf16", False),
            "grouped": ("fp32", True), "bf16+grouped": ("bf16", True)}



def measure(args: argparse.Namespace) -> dict:
    """One configuration, in this process: samples/s of ``args.steps`` optimizer steps."""
    import torch

    sys.path.insert(0, str(ROOT))
    from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
    from apao_ray.data import load_dataset
    from apao_ray.losses import build_loss
    from apao_ray.models import build_model
    from apao_ray.training.trial_setup import build_optimizer, warmup_cosine
    from apao_ray.training.precision import resolve_precision
    from apao_ray.training.steps import EpochRunner

    torch.set_num_threads(args.threads)
    device = torch.device(getattr(args, "device", "cpu"))
    precision, grouped = VARIANTS[args.variant]
    dataset = load_dataset(args.dataset, args.data_dir)
    config = TrialConfig(DataConfig(dataset=args.dataset), ModelConfig(backbone=args.backbone),
                         LossConfig(name=args.loss, num_negatives=args.num_negatives, beta=0.2, eta=3e-5),
                         TrainConfig(batch_size=args.batch_size, effective_batch_size=args.effective_batch_size,
                                     seed=args.seed, max_train_samples=args.effective_batch_size * args.steps,
                                     precision=resolve_precision(precision, device), group_by_length=grouped))
    model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels).to(device)
    tensors = dataset.catalog.tensors(device)
    loss = build_loss(config.loss, tensors)
    optimizer = build_optimizer(model, 5e-4, 0.01)
    scheduler = warmup_cosine(optimizer, 10 * args.steps, 0.01)
    warmup = config.train.replace(max_train_samples=args.batch_size, effective_batch_size=args.batch_size)
    EpochRunner(config.replace(train=warmup), dataset, tensors, device).train_epoch(
        1, model, loss, optimizer, scheduler, None)
    runner = EpochRunner(config, dataset, tensors, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                      record_shapes=args.profile_shapes) if args.profile else None
    start = time.perf_counter()
    with profiler or contextlib.nullcontext():
        metrics = runner.train_epoch(2, model, loss, optimizer, scheduler, None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    result = {"samples_per_second": metrics["train/num_samples"] / seconds, "seconds": seconds,
              "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
              "precision": config.train.precision, "num_train_samples": len(dataset.splits["train"]),
              "allocator": allocator_in_use()}
    if device.type == "cuda":
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if profiler:
        averages = profiler.key_averages(group_by_input_shape=args.profile_shapes)
        events = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) or 1
        result["top_ops"] = [{"op": e.key, "self_cpu_share": e.self_cpu_time_total / total, "calls": e.count,
                              "self_cpu_seconds": e.self_cpu_time_total / 1e6,
                              "input_shapes": str(e.input_shapes) if args.profile_shapes else ""}
                             for e in events[:args.profile_rows]]
    return result


def measure_epoch(args: argparse.Namespace) -> dict:
    """One full epoch of TIGER CE at the trial defaults through ``run_trial``, validation included."""
    import torch

    sys.path.insert(0, str(ROOT))
    from apao_ray.config import DataConfig, ModelConfig, TrainConfig, TrialConfig
    from apao_ray.training.hooks import TrainingHooks
    from apao_ray.training.loop import run_trial

    torch.set_num_threads(args.threads)
    config = TrialConfig(DataConfig(dataset=args.dataset, data_dir=args.data_dir),
                         ModelConfig(backbone=args.backbones.split(",")[0]),
                         train=TrainConfig(epochs=1, retention_users=0))
    with tempfile.TemporaryDirectory() as directory:
        hooks = TrainingHooks(directory, verbose=True)
        run_trial(config, hooks)
    epoch = hooks.reports[0]
    return {"epoch_seconds": epoch["perf/epoch_seconds"], "train_seconds": epoch["perf/train_seconds"],
            "validation_seconds": epoch["perf/epoch_seconds"] - epoch["perf/train_seconds"],
            "samples_per_second": epoch["perf/samples_per_second"], "precision": epoch["precision"],
            "val_users": epoch["val/num_users_evaluated"],
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "allocator": allocator_in_use()}


class Baseline:
    """The tree at an earlier revision, checked out into a temporary git worktree."""

    def __init__(self, rev: str) -> None:
        self.rev = rev
        self.path = Path(tempfile.mkdtemp(prefix="apao-baseline-")) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(self.path), rev],
                       check=True, capture_output=True)
        # scripts before gradient accumulation took --batch-size as the whole optimizer step
        self.accumulates = "--effective-batch-size" in (self.path / "benchmarks" / "bench_training.py").read_text()

    def close(self) -> None:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(self.path)], capture_output=True)


def run_one(script: Path, backbone: str, loss: str, variant: str, batch_size: int, allocator: str,
            args: argparse.Namespace, old_script: bool) -> dict:
    common = ["--data-dir", args.data_dir, "--dataset", args.dataset, "--threads", str(args.threads),
              "--num-negatives", str(args.num_negatives), "--seed", str(args.seed)]
    if old_script:  # --batch-size is the whole optimizer step, no accumulation
        extra = ["--batch-size", str(batch_size), "--steps", str(args.steps * args.effective_batch_size // batch_size)]
    else:
        extra = ["--batch-size", str(batch_size), "--effective-batch-size", str(args.effective_batch_size),
                 "--steps", str(args.steps)]
    # the allocator a trial's Ray worker gets (training/memory.py), set by the environment alone, so an old
    # revision's rows run on the same allocator as the new ones
    env = {**os.environ, **allocator_env(allocator), "PYTHONPATH": str(script.parents[1])}
    done = subprocess.run([sys.executable, str(script), "--one", backbone, loss, variant, *common, *extra],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{script} {backbone} {loss} {variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", str(ROOT.parent / "shared" / "datasets")))
    parser.add_argument("--dataset", default="office")
    parser.add_argument("--backbones", default="tiger,llama")
    parser.add_argument("--losses", default="ce,apao_pointwise,apao_pairwise")
    parser.add_argument("--batch-sizes", default="256", help="comma list of micro-batch sizes (default 256)")
    parser.add_argument("--effective-batch-size", type=int, default=1024, help="samples per optimizer step")
    parser.add_argument("--num-negatives", type=int, default=100)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps measured per run (default 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default="default", help=f"comma list from {list(VARIANTS)} (default: default)")
    parser.add_argument("--allocators", default="auto",
                        help=f"comma list from {list(ALLOCATORS)}: the memory allocator of each measured process, as "
                             "$APAO_RAY_ALLOCATOR gives a trial's worker (default: auto); the baseline runs on system")
    parser.add_argument("--baseline-rev", help="also run this git revision's code (A/B interleaved), e.g. 0e64951")
    parser.add_argument("--baseline-variants", default="fp32", help="variants for the baseline (default fp32)")
    parser.add_argument("--epoch", action="store_true", help="time one full epoch + validation at the defaults instead")
    parser.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "training.json"))
    parser.add_argument("--profile", nargs=3, metavar=("BACKBONE", "LOSS", "VARIANT"),
                        help="profile one configuration in this process (micro-batch --batch-size, --steps optimizer "
                             "steps) and print its top ops by self CPU time instead of the table")
    parser.add_argument("--profile-rows", type=int, default=25, help="ops listed by --profile (default 25)")
    parser.add_argument("--profile-shapes", action="store_true",
                        help="with --profile: one row per (op, input shapes), the shapes printed after the row")
    parser.add_argument("--one", nargs=3, metavar=("BACKBONE", "LOSS", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=256,
                        help="micro-batch of --profile (default 256; the table uses --batch-sizes)")
    args = parser.parse_args()
    if args.profile:
        args.backbone, args.loss, args.variant = args.profile
        result = measure(args)
        print(f"{cpu_description()}, {args.threads} threads, {args.backbone}/{args.loss} {args.variant} micro-batch "
              f"{args.batch_size}: {result['samples_per_second']:.1f} samples/s under the profiler, "
              f"peak RSS {result['peak_rss_gib']:.2f} GiB")
        print(f"{'op':<44}{'self CPU %':>11}{'seconds':>9}{'calls':>8}")
        for op in result["top_ops"]:
            print(f"{op['op'][:43]:<44}{100 * op['self_cpu_share']:>10.1f}%{op['self_cpu_seconds']:>9.2f}{op['calls']:>8}"
                  + (f"  {op['input_shapes'][:150]}" if op["input_shapes"] else ""))
        return 0
    if args.one:
        args.backbone, args.loss, args.variant = args.one
        print(json.dumps(measure(args)))
        return 0
    header = {"cpu": cpu_description(), "threads": args.threads, "date": time.strftime("%Y-%m-%d"),
              "load_average_at_start": os.getloadavg()[0]}
    if args.epoch:
        result = {**header, **measure_epoch(args)}
        print(json.dumps(result, indent=2))
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2))
        return 0
    # SIGTERM (timeout, kill) unwinds through `finally`, so the baseline worktree is removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    baseline = Baseline(args.baseline_rev) if args.baseline_rev else None
    allocators = args.allocators.split(",")
    for allocator in allocators:
        allocator_env(allocator)  # an unknown or missing allocator fails here, naming it
    configs = [(b, l, v, int(s), a, False) for b in args.backbones.split(",") for l in args.losses.split(",")
               for v in args.variants.split(",") for s in args.batch_sizes.split(",") for a in allocators]
    if baseline:
        # an old script without accumulation measures micro-batch 128 steps (what it was compared at)
        sizes = args.batch_sizes.split(",") if baseline.accumulates else ["128"]
        configs += [(b, l, v, int(s), a, True) for b in args.backbones.split(",") for l in args.losses.split(",")
                    for v in args.baseline_variants.split(",") for s in sizes for a in allocators]

    def label(backbone: str, loss: str, variant: str, batch_size: int, allocator: str, is_baseline: bool) -> str:
        suffix = f" b{batch_size}" + (f"@{args.baseline_rev}" if is_baseline else "")
        return f"{backbone}/{loss} {variant}{suffix}" + (f" {allocator}" if len(allocators) > 1 else "")

    runs: dict[str, list[dict]] = {label(*c): [] for c in configs}
    try:
        for round_index in range(args.repeats):
            order = configs if round_index % 2 == 0 else configs[::-1]  # A/B interleaved, alternating order
            for config in order:
                script = (baseline.path if config[5] else ROOT) / "benchmarks" / "bench_training.py"
                runs[label(*config)].append(run_one(script, *config[:5], args, config[5] and not baseline.accumulates))
                print(f"round {round_index + 1}: {label(*config)} {runs[label(*config)][-1]['samples_per_second']:.1f} "
                      f"samples/s (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    finally:
        if baseline:
            baseline.close()
    rows = []
    first = configs[0]
    for config in configs:
        key = label(*config)
        reference_key = label(config[0], "ce", first[2], first[3], first[4], False)
        speeds = [r["samples_per_second"] for r in runs[key]]
        ratios = [r["samples_per_second"] / c["samples_per_second"] for r, c in zip(runs[key], runs.get(reference_key, []))]
        median = statistics.median(speeds)
        old = runs.get(label(*config[:5], True), []) if not config[5] else []  # the same configuration at REV
        to_old = [r["samples_per_second"] / o["samples_per_second"] for r, o in zip(runs[key], old)]
        rows.append({"label": key, "backbone": config[0], "loss": config[1], "variant": config[2],
                     "batch_size": config[3], "baseline": config[5], "precision": runs[key][0].get("precision", "fp32"),
                     "allocator": runs[key][0].get("allocator", "system"),
                     "samples_per_second": median, "ratio_to_first_ce": statistics.median(ratios) if ratios else None,
                     "ratio_to_reference_code": median / REFERENCE_SAMPLES_PER_SECOND,
                     "ratio_to_baseline_rev": statistics.median(to_old) if to_old else None,
                     "epoch_minutes": runs[key][0]["num_train_samples"] / median / 60,
                     "peak_rss_gib": max(r["peak_rss_gib"] for r in runs[key]),
                     "paper_a100_epoch_seconds": PAPER_A100_SECONDS.get(config[1]) if config[0] == "tiger" else None,
                     "runs": speeds})
    print(f"{header['cpu']}, {args.threads} threads, effective batch {args.effective_batch_size}")
    print(f"{'configuration':<48}{'samples/s':>10}{'x first CE':>11}{'x ref 41':>9}{'x @REV':>7}{'epoch min':>10}"
          f"{'RSS GiB':>9}")
    for row in rows:
        ratio, to_old = (f"{row[k]:.2f}" if row[k] is not None else "-" for k in ("ratio_to_first_ce", "ratio_to_baseline_rev"))
        print(f"{row['label']:<48}{row['samples_per_second']:>10.1f}{ratio:>11}{row['ratio_to_reference_code']:>9.2f}"
              f"{to_old:>7}{row['epoch_minutes']:>10.1f}{row['peak_rss_gib']:>9.2f}")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({**header, "args": {k: v for k, v in vars(args).items() if k != "one"},
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
