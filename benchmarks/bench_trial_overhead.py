"""What a study pays per trial before any training: Ray Tune trials that each run a Ray Train ``TorchTrainer``
(how apao_ray runs a trial today) against the same loop run in Tune's own trial actor.

Each study runs ``--trials`` trials, ``--concurrent`` at a time, on a fresh local Ray of ``--cpus`` CPUs; a
trial imports torch and reports ``--epochs`` epochs of ``--epoch-seconds`` of sleep, so the wall time beyond
that is the trial machinery: the TorchTrainer path starts a Train controller, a worker, a placement-group
cleaner, a synchronization actor, a dataset manager and Tune's report queue per trial (7 processes; the
preemption watcher is off as in apao_ray's local Ray), the direct path one actor. The two kinds alternate
over ``--repeats`` rounds; medians are reported.

    python benchmarks/bench_trial_overhead.py --trials 4 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("trainer", "direct")


def run_study(kind: str, args: argparse.Namespace) -> float:
    """Wall seconds of one study of ``args.trials`` trials of this kind, in this process."""
    from apao_ray.study.cluster.ray_cluster import init_ray

    import ray
    import ray.train
    from ray import tune

    epochs, pause = args.epochs, args.epoch_seconds

    def epochs_of(config):
        import torch  # noqa: F401  (what a real trial imports)

        for epoch in range(1, epochs + 1):
            time.sleep(pause)
            yield {"epoch": epoch, "score": config["x"] * epoch}

    def worker_loop(config):
        for metrics in epochs_of(config):
            ray.train.report(metrics)

    storage = tempfile.mkdtemp(prefix="apao-overhead-")

    def trial_with_trainer(config):
        from ray.train.torch import TorchTrainer
        from ray.tune.integration.ray_train import TuneReportCallback

        TorchTrainer(worker_loop, train_loop_config=config,
                     scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": args.cpus_per_trial}),
                     run_config=ray.train.RunConfig(name=f"train-{tune.get_context().get_trial_id()}", storage_path=storage,
                                                    callbacks=[TuneReportCallback()])).fit()

    def trial_direct(config):
        for metrics in epochs_of(config):
            tune.report(metrics)

    trainable = (tune.with_resources(trial_with_trainer, {"cpu": 0.01}) if kind == "trainer"
                 else tune.with_resources(trial_direct, {"cpu": args.cpus_per_trial}))
    start = time.perf_counter()
    init_ray(num_cpus=args.cpus)  # as a study starts its local Ray (dashboard on: Ray Train's cleaner needs it)
    try:
        results = tune.Tuner(trainable, param_space={"x": tune.grid_search(list(range(args.trials)))},
                             tune_config=tune.TuneConfig(max_concurrent_trials=args.concurrent),
                             run_config=tune.RunConfig(storage_path=storage, name="study", verbose=0)).fit()
        if any(r.error for r in results) or any(r.metrics.get("epoch") != epochs for r in results):
            raise RuntimeError(f"{kind}: a trial failed: {[r.error for r in results if r.error]}")
        return time.perf_counter() - start
    finally:
        ray.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=4, help="trials per study (default %(default)s)")
    parser.add_argument("--concurrent", type=int, default=2, help="trials at once (default %(default)s)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray (default %(default)s)")
    parser.add_argument("--cpus-per-trial", type=float, default=0.9, help="(default %(default)s)")
    parser.add_argument("--epochs", type=int, default=2, help="reports per trial (default %(default)s)")
    parser.add_argument("--epoch-seconds", type=float, default=0.5, help="sleep per epoch (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds, kinds alternating (default %(default)s)")
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "trial_overhead.json"))
    args = parser.parse_args()
    if args.one:  # a study in a process of its own: Ray starts fresh each time
        print(json.dumps({"seconds": run_study(args.one, args)}))
        return 0
    from apao_ray.hardware import cpu_description

    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("one", "json_out", "repeats")]
    runs: dict[str, list[float]] = {kind: [] for kind in KINDS}
    load = os.getloadavg()[0]
    for round_index in range(args.repeats):
        for kind in KINDS if round_index % 2 == 0 else KINDS[::-1]:
            done = subprocess.run([sys.executable, __file__, "--one", kind, *forwarded], capture_output=True, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
            if done.returncode != 0:
                raise RuntimeError(f"{kind} study failed:\n{done.stderr[-3000:]}")
            runs[kind].append(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])
            print(f"round {round_index + 1}: {kind} {runs[kind][-1]:.1f} s", file=sys.stderr, flush=True)
    floor = args.epochs * args.epoch_seconds * -(-args.trials // args.concurrent)  # the sleeping itself
    rows = [{"kind": kind, "study_seconds": statistics.median(times), "runs": times,
             "overhead_per_trial_seconds": (statistics.median(times) - floor) * args.concurrent / args.trials}
            for kind, times in runs.items()]
    print(f"{cpu_description()}, local Ray of {args.cpus} CPUs, {args.trials} trials, {args.concurrent} at a time "
          f"(load {load:.1f} at start)")
    print(f"{'trial runs':<34}{'study s':>9}{'per trial s':>13}  (per trial: beyond the sleeping, Ray's start included)")
    for row in rows:
        label = "a TorchTrainer (today)" if row["kind"] == "trainer" else "in Tune's trial actor"
        print(f"{label:<34}{row['study_seconds']:>9.1f}{row['overhead_per_trial_seconds']:>13.1f}")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"cpu": cpu_description(), "load_average_at_start": load,
                                               "args": {k: v for k, v in vars(args).items() if k != "one"},
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
