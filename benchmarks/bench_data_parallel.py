"""One trial on 2 data-parallel workers against two 1-worker trials side by side, on the same CPUs.

Both ways run ``apao train`` (Ray Train, ``--cpus-per-worker 1``, one torch thread per worker) for one epoch on a
fixed training subset: (a) one trial with ``--num-workers 2``; (b) two trials at once, ``--num-workers 1`` each
(seeds 0 and 1, each its own local Ray). Reported per trial: training samples/s of the epoch
(``perf/samples_per_second``: all of a trial's workers, validation and start-up excluded) and the process's wall
time; per machine: the sum over the trials running at once.

    APAO_DATA_DIR=../shared/datasets python benchmarks/bench_data_parallel.py --dataset office --samples 8192
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from apao_ray.hardware import cpu_description  # noqa: E402


def start(args: argparse.Namespace, directory: Path, name: str, num_workers: int, seed: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "apao_ray", "train", "--dataset", args.dataset, "--backbone", "tiger",
               "--loss", "ce", "--epochs", "1", "--max-train-samples", str(args.samples), "--eval-max-users", "32",
               "--batch-size", str(args.batch_size), "--effective-batch-size", str(args.effective_batch_size),
               "--num-workers", str(num_workers), "--cpus-per-worker", "1", "--seed", str(seed), "--quiet",
               "--output-dir", str(directory / "runs"), "--run-name", name, "--json-out", str(directory / f"{name}.json")]
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(processes: dict[str, subprocess.Popen], directory: Path, started: float) -> list[dict]:
    """Waits for the runs (by run name) and reads their final metrics."""
    rows = []
    for name, process in processes.items():
        _, stderr = process.communicate()
        if process.returncode:
            raise RuntimeError(f"{name} failed: {stderr[-2000:]}")
        metrics = json.loads((directory / f"{name}.json").read_text())
        rows.append({"trial": name, "samples_per_s": metrics["perf/samples_per_second"],
                     "train_s": metrics["perf/train_seconds"], "wall_s": time.perf_counter() - started,
                     "train_samples": metrics["train/num_samples"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="office")
    parser.add_argument("--samples", type=int, default=8192, help="training samples of the epoch")
    parser.add_argument("--batch-size", type=int, default=128, help="micro-batch per worker")
    parser.add_argument("--effective-batch-size", type=int, default=1024)
    parser.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "data_parallel_office.json"))
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="apao-bench-dp-"))
    started = time.perf_counter()
    data_parallel = finish({"two-workers": start(args, directory, "two-workers", 2, 0)}, directory, started)
    started = time.perf_counter()
    side_by_side = finish({f"one-worker-seed{seed}": start(args, directory, f"one-worker-seed{seed}", 1, seed)
                           for seed in (0, 1)}, directory, started)
    result = {"cpu": cpu_description(), "cpus": os.cpu_count(), "args": vars(args),
              "one_trial_on_2_workers": data_parallel, "two_trials_on_1_worker": side_by_side,
              "machine_samples_per_s": {"one_trial_on_2_workers": data_parallel[0]["samples_per_s"],
                                        "two_trials_on_1_worker": sum(r["samples_per_s"] for r in side_by_side)}}
    print(f"{'run':<28} {'samples/s':>10} {'train s':>8} {'wall s':>7}")
    for row in data_parallel + side_by_side:
        print(f"{row['trial']:<28} {row['samples_per_s']:>10.1f} {row['train_s']:>8.1f} {row['wall_s']:>7.1f}")
    for kind, rate in result["machine_samples_per_s"].items():
        print(f"machine, {kind}: {rate:.1f} samples/s")
    Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
