"""The training step on one CUDA GPU: this tree against a copy of an earlier one, A/B interleaved.

Each row trains whole Office epochs through the product's ``EpochRunner`` (micro-batch ``--batch-size``,
effective batch 1024, the precision a trial gets there) after a warm-up epoch of ``--warmup-samples``, one
process per tree and round (``PYTHONPATH`` at that tree) running its rows in turn; it reports samples/s,
seconds per epoch, the peak GPU memory and the achieved TFLOP/s (the step's floating-point operations on the
row's own path, packed or padded, counted by ``torch.utils.flop_counter`` on one micro-batch, per sample,
times the epoch's samples, over the time: a padded row counts the padding's arithmetic too). Rows:
every ``--configs`` entry ``BACKBONE/LOSS[/PACK]`` on this tree, PACK one of ``default`` (the tree's own
choice), ``packed`` or ``padded`` (the history pass; models/base.py ``pack_histories``), and those without
PACK on the baseline. Rounds alternate the trees' order; the table gives medians and each new row's ratio
to the baseline's row of the same BACKBONE/LOSS.

Needs torch with CUDA and the datasets only (no Ray, MLflow or Optuna). The baseline is a folder holding an
earlier revision's ``apao_ray`` package, e.g. made here with ``git archive REV apao_ray | tar -x -C .old``.

    python benchmarks/gpu/step_ab.py --baseline .old --data-dir datasets --json-out gpu_out/step_ab.json
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

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIGS = "tiger/ce,tiger/ce/packed,tiger/apao_pointwise,llama/ce"


def one(args: argparse.Namespace, row: str) -> dict:
    """One row in this process (its tree is the first ``apao_ray`` on ``sys.path``)."""
    import numpy as np
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
    from apao_ray.data import load_dataset
    from apao_ray.losses import LOSSES, build_loss
    from apao_ray.models import build_model
    from apao_ray.training.trial_setup import build_optimizer, warmup_cosine
    from apao_ray.training.precision import resolve_precision
    from apao_ray.training.steps import EpochRunner

    backbone, loss_name, pack = (row.split("/") + ["default"])[:3]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dataset = load_dataset("office", args.data_dir)
    knobs = LOSSES[loss_name].paper_point(backbone, "office")
    config = TrialConfig(DataConfig(dataset="office"), ModelConfig(backbone=backbone),
                         LossConfig(name=loss_name, **knobs),
                         TrainConfig(batch_size=args.batch_size, effective_batch_size=1024, seed=0,
                                     max_train_samples=args.max_train_samples,
                                     precision=resolve_precision("auto", device)))
    torch.manual_seed(0)  # the same initial weights in every row of a backbone
    model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels).to(device)
    if pack != "default":
        model.pack_histories = pack == "packed"
    tensors = dataset.catalog.tensors(device)
    loss = build_loss(config.loss, tensors)
    optimizer = build_optimizer(model, 5e-4, 0.01)
    scheduler = warmup_cosine(optimizer, 10_000, 0.01)
    warmup = config.train.replace(max_train_samples=args.warmup_samples)
    EpochRunner(config.replace(train=warmup), dataset, tensors, device).train_epoch(
        1, model, loss, optimizer, scheduler, None)
    runner = EpochRunner(config, dataset, tensors, device)
    # the step's operations on this row's path (packed or padded), counted on one micro-batch (either tree)
    from apao_ray.data import collate
    from apao_ray.losses.base import LossInputs
    from apao_ray.training.precision import autocast

    split = dataset.splits["train"]
    chunk = runner.epoch_order(2)[:args.batch_size]
    chunk = chunk[np.argsort(split.history_lengths[chunk], kind="stable")]
    batch = collate(dataset.catalog, split, chunk).to(device)
    generator = torch.Generator().manual_seed(0)
    if hasattr(runner, "candidates_of"):  # this tree; a baseline tree before 2026-11-28 has _candidates
        from apao_ray.losses import sample_negatives
        negatives = sample_negatives(batch.target_sem.cpu(), len(runner.sem_tokens), loss.num_negatives,
                                     generator) if loss.num_negatives else None
        candidates, nodes = runner.candidates_of(batch, negatives)
    else:
        candidates, nodes = runner._candidates(batch, loss.num_negatives, generator)
    counter = FlopCounterMode(display=False)
    with counter:
        with autocast(config.train.precision, device):
            logits = model(batch.history_ids, batch.history_mask, candidates)
        loss(LossInputs(logits, candidates, nodes, None)).loss.backward()
    optimizer.zero_grad(set_to_none=True)
    flops_per_sample = counter.get_total_flops() / len(chunk)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if args.profile:
        return profile_epoch(runner, model, loss, optimizer, scheduler, row, cuda)
    seconds = []
    for epoch in range(2, 2 + args.epochs):
        start = time.perf_counter()
        metrics = runner.train_epoch(epoch, model, loss, optimizer, scheduler, None)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    samples = metrics["train/num_samples"]
    epoch_seconds = statistics.median(seconds)
    return {"row": row, "tree": args.tree_label, "epoch_seconds": epoch_seconds, "epoch_runs": seconds,
            "samples_per_second": samples / epoch_seconds, "samples": samples,
            "flops_per_sample": flops_per_sample,
            "tflops": flops_per_sample * samples / epoch_seconds / 1e12,
            "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
            "precision": config.train.precision, "train_loss": metrics["train/loss"], "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if cuda else "none"}


def profile_epoch(runner, model, loss, optimizer, scheduler, row: str, cuda: bool) -> dict:
    """One epoch under torch.profiler: the device's busy time against the wall time, kernels per optimizer
    step, and the kernels that take the most device time (where an epoch goes once the host keeps up)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        runner.train_epoch(2, model, loss, optimizer, scheduler, None)
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    averages = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA),
                      key=lambda e: e.device_time_total, reverse=True)
    steps = runner.optimizer_steps_per_epoch
    return {"row": row, "tree": "new", "profile": True, "wall_seconds": wall, "device_busy_seconds": busy,
            "kernels_per_step": len(kernels) / steps, "optimizer_steps": steps,
            "top": [{"name": e.key[:80], "device_seconds": e.device_time_total / 1e6, "calls": e.count}
                    for e in averages[:15]]}


def check_loss_watch() -> dict:
    """On the GPU: a non-finite loss stops training one loss later, or at the epoch's end (``flush``)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from apao_ray.training.loss_watch import LossWatch, NonFiniteLossError

    outcome = {}
    for case in ("next", "flush"):
        watch = LossWatch(torch.device("cuda"))
        watch.push(torch.tensor(1.0, device="cuda"), str)
        watch.push(torch.tensor(float("nan"), device="cuda"), lambda value: f"stopped at {value}")
        try:
            if case == "next":
                watch.push(torch.tensor(2.0, device="cuda"), str)
            else:
                watch.flush()
            outcome[case] = "not stopped"
        except NonFiniteLossError as error:
            outcome[case] = str(error)
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="folder holding an earlier tree's apao_ray (none: this tree only)")
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", str(ROOT.parent / "shared" / "datasets")))
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list of BACKBONE/LOSS[/PACK] "
                                                                     "(default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=1024, help="micro-batch (default %(default)s)")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per row (default %(default)s)")
    parser.add_argument("--warmup-samples", type=int, default=4096, help="(default %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds (default %(default)s)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the script (default %(default)s)")
    parser.add_argument("--max-train-samples", type=int, help="a short epoch (to try the script)")
    parser.add_argument("--json-out", required=True)
    parser.add_argument("--profile", action="store_true",
                        help="profile one epoch of each --configs row on this tree instead (device busy time, "
                             "kernels per step, top kernels)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--tree-label", default="new", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        for row in args.one.split(","):
            try:
                print(json.dumps(one(args, row)), flush=True)
            except Exception as error:  # noqa: BLE001 - the row's failure is reported, the next runs
                print(json.dumps({"row": row, "tree": args.tree_label, "error": f"{type(error).__name__}: {error}"}),
                      flush=True)
        return 0
    if args.profile:
        done = subprocess.run([sys.executable, __file__, "--one", args.configs, "--profile", "--data-dir", args.data_dir,
                               "--batch-size", str(args.batch_size), "--warmup-samples", str(args.warmup_samples),
                               "--device", args.device, "--json-out", "-",
                               *(["--max-train-samples", str(args.max_train_samples)] if args.max_train_samples
                                 else [])], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
        for row in rows:
            if "error" in row:
                print(row["row"], row["error"])
                continue
            print(f"{row['row']}: wall {row['wall_seconds']:.2f} s, device busy {row['device_busy_seconds']:.2f} s, "
                  f"{row['kernels_per_step']:.0f} kernels per optimizer step")
            for kernel in row["top"]:
                print(f"  {kernel['device_seconds']:7.3f} s {kernel['calls']:6d}x  {kernel['name']}")
        print(done.stderr[-1500:] if done.returncode else "")
        return done.returncode
    trees = {"new": ROOT, **({"old": Path(args.baseline).resolve()} if args.baseline else {})}
    configs = {"new": args.configs.split(","), "old": [c for c in args.configs.split(",") if c.count("/") == 1]}
    results: dict[tuple[str, str], list[dict]] = {(label, c): [] for label in trees for c in configs[label]}
    result: dict = {"args": vars(args), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        result["loss_watch"] = check_loss_watch() if args.device == "cuda" else "not checked off a GPU"
    except Exception as error:  # noqa: BLE001 - reported, the timings still run
        result["loss_watch"] = f"{type(error).__name__}: {error}"
    print("loss watch:", result["loss_watch"], flush=True)
    for round_index in range(args.repeats):
        for label in list(trees) if round_index % 2 == 0 else list(trees)[::-1]:
            env = {**os.environ, "PYTHONPATH": str(trees[label])}
            done = subprocess.run([sys.executable, __file__, "--one", ",".join(configs[label]), "--tree-label", label,
                                   "--data-dir", args.data_dir, "--batch-size", str(args.batch_size),
                                   "--epochs", str(args.epochs), "--warmup-samples", str(args.warmup_samples),
                                   "--device", args.device, "--json-out", "-",
                                   *(["--max-train-samples", str(args.max_train_samples)] if args.max_train_samples
                                     else [])], capture_output=True, text=True, env=env)
            lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or len(lines) < len(configs[label]):
                print(f"{label} failed (exit {done.returncode}):\n{done.stderr[-2000:]}", flush=True)
            for row in lines:
                results[(label, row["row"])].append(row)
                text = row.get("error") or (f"{row['epoch_seconds']:7.2f} s/epoch {row['samples_per_second']:9.0f} "
                                            "samples/s")
                print(f"round {round_index + 1} {label:<4}{row['row']:<28}{text}", flush=True)
            result["rows"] = [{"tree": l, "config": c, "runs": r} for (l, c), r in results.items()]
            Path(args.json_out).write_text(json.dumps(result, indent=1))
    print(f"{'tree':<5}{'row':<28}{'s/epoch':>8}{'samples/s':>10}{'TFLOP/s':>8}{'GiB':>6}{'x old':>7}")
    for (label, config), runs in results.items():
        good = [r for r in runs if "error" not in r]
        if not good:
            continue
        median = statistics.median(r["epoch_seconds"] for r in good)
        old = [r["epoch_seconds"] for r in results.get(("old", "/".join(config.split("/")[:2])), [])
               if "error" not in r] if label == "new" else []
        ratio = f"{statistics.median(old) / median:.2f}" if old else "-"
        print(f"{label:<5}{config:<28}{median:8.2f}{good[0]['samples'] / median:10.0f}"
              f"{good[0]['flops_per_sample'] * good[0]['samples'] / median / 1e12:8.1f}"
              f"{max(r['peak_gpu_gib'] for r in good):6.1f}{ratio:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
