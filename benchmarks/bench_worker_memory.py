"""A training worker's memory and speed under oneDNN primitive cache capacities and packed-token roundings.

A study trial's worker held 2.28 GB resident mid-epoch (Office, paper-size TIGER CE, bf16, 1 thread) against
a 2 GiB target, and a plain process training the same way climbs from 1.5 to 2.0 GiB over its first epochs.
Each (capacity, multiple) of ``--capacities`` x ``--token-multiples`` runs in a fresh subprocess
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; ``default`` leaves it unset: oneDNN keeps 1024 primitives; the multiple
is ``models/packing.CPU_TOKEN_MULTIPLE``, the packed token count's rounding, applied under bf16 autocast only)
on the allocator a trial's worker gets (training/memory.py):
``--epochs`` short epochs of ``--steps`` optimizer steps (micro-batch 128, effective batch 1024, ``--precision``,
random batches: every batch's packed shapes differ), then validation on ``--valid-users`` users. Per
run: seconds per epoch (median), validation seconds, resident size after the last epoch, the process's peak
(VmHWM) and, under tcmalloc, the peak of live allocated bytes (sampled every 2 ms). Capacities alternate
over ``--repeats`` rounds; medians reported, each with its ratio to the first configuration in the same rounds.

    python benchmarks/bench_worker_memory.py --capacities default,64 --repeats 2
    python benchmarks/bench_worker_memory.py --capacities default --token-multiples 1,64,256
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAPACITY_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def status_gib() -> tuple[float, float]:
    """(resident, peak resident) of this process, GiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return tuple(int(fields[name].split()[0]) / 2**20 for name in ("VmRSS", "VmHWM"))


def live_bytes_sampler():
    """A function returning the peak of tcmalloc's allocated bytes since its last call, or None without tcmalloc."""
    import ctypes

    try:
        get = ctypes.CDLL(None).MallocExtension_GetNumericProperty
    except AttributeError:
        return None
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
    peak = [0]

    def sample() -> None:
        value = ctypes.c_size_t()
        while True:
            get(b"generic.current_allocated_bytes", ctypes.byref(value))
            peak[0] = max(peak[0], value.value)
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()

    def read_and_reset() -> float:
        value, peak[0] = peak[0], 0
        return value / 2**30

    return read_and_reset


def measure(args: argparse.Namespace) -> dict:
    """One capacity, in this process."""
    import torch

    sys.path.insert(0, str(ROOT))
    from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
    from apao_ray.data import load_dataset
    from apao_ray.losses import build_loss
    from apao_ray.models import build_model, packing
    from apao_ray.training.evaluation import evaluate_split, select_users
    from apao_ray.training.trial_setup import build_optimizer, warmup_cosine
    from apao_ray.training.memory import allocator_in_use
    from apao_ray.training.precision import resolve_precision
    from apao_ray.training.steps import EpochRunner

    torch.set_num_threads(args.threads)
    packing.CPU_TOKEN_MULTIPLE = args.token_multiple
    live_peak = live_bytes_sampler()
    dataset = load_dataset("office", args.data_dir)
    train = TrainConfig(batch_size=128, effective_batch_size=1024, max_train_samples=1024 * args.steps,
                        precision=resolve_precision(args.precision, "cpu"))
    config = TrialConfig(DataConfig(dataset="office"), ModelConfig(backbone="tiger"), LossConfig(name="ce"), train)
    model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels)
    tensors = dataset.catalog.tensors()
    loss = build_loss(config.loss, tensors)
    optimizer = build_optimizer(model, 5e-4, 0.01)
    scheduler = warmup_cosine(optimizer, 10 * args.epochs * args.steps, 0.01)
    runner = EpochRunner(config, dataset, tensors, torch.device("cpu"))
    epochs = []
    for epoch in range(1, args.epochs + 1):
        start = time.perf_counter()
        runner.train_epoch(epoch, model, loss, optimizer, scheduler, None)
        epochs.append(time.perf_counter() - start)
    rss_after_training = status_gib()[0]
    live_training = live_peak() if live_peak else None
    users = select_users(len(dataset.splits["valid"]), args.valid_users, 0)
    start = time.perf_counter()
    evaluate_split(model.eval(), dataset, "valid", tensors, train, torch.device("cpu"), users)
    validation = time.perf_counter() - start
    rss, peak = status_gib()
    return {"epoch_seconds": epochs, "epoch_seconds_median": statistics.median(epochs),
            "validation_seconds": validation, "rss_after_training_gib": rss_after_training, "rss_end_gib": rss,
            "peak_rss_gib": peak, "live_peak_training_gib": live_training,
            "live_peak_validation_gib": live_peak() if live_peak else None, "allocator": allocator_in_use(),
            "precision": train.precision, "capacity": os.environ.get(CAPACITY_ENV, "default"),
            "token_multiple": args.token_multiple}


def run_one(capacity: str, multiple: int, args: argparse.Namespace) -> dict:
    from apao_ray.training.memory import allocator_env

    env = {key: value for key, value in os.environ.items() if key != CAPACITY_ENV}
    env.update(allocator_env(environ=env))
    env.pop(CAPACITY_ENV, None)  # what the allocator setting gives, replaced by the capacity measured
    if capacity != "default":
        env[CAPACITY_ENV] = capacity
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, __file__, "--one", "--data-dir", args.data_dir, "--threads", str(args.threads),
                           "--epochs", str(args.epochs), "--steps", str(args.steps), "--valid-users", str(args.valid_users),
                           "--token-multiple", str(multiple), "--precision", args.precision],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"capacity {capacity}, token multiple {multiple} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", str(ROOT.parent / "shared" / "datasets")))
    parser.add_argument("--capacities", default="default,64",
                        help="oneDNN primitive cache capacities, 'default' = unset (default %(default)s)")
    parser.add_argument("--token-multiples", default="1",
                        help="packed token counts rounded up to these multiples, 1 = none (default %(default)s)")
    parser.add_argument("--token-multiple", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"), help="(default %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    parser.add_argument("--epochs", type=int, default=3, help="short epochs per run (default %(default)s)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of 1024 samples per epoch (default %(default)s)")
    parser.add_argument("--valid-users", type=int, default=1024, help="validation users (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds, alternating order (default %(default)s)")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args)))
        return 0
    from apao_ray.hardware import cpu_description

    configs = [(c.strip(), int(m)) for c in args.capacities.split(",") if c.strip()
               for m in args.token_multiples.split(",")]
    runs: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    for round_ in range(args.repeats):
        for capacity, multiple in (configs if round_ % 2 == 0 else configs[::-1]):
            result = run_one(capacity, multiple, args)
            runs[capacity, multiple].append(result)
            print(f"round {round_ + 1} capacity {capacity}, token multiple {multiple}: epoch {result['epoch_seconds_median']:.1f} s, validation "
                  f"{result['validation_seconds']:.1f} s, peak RSS {result['peak_rss_gib']:.2f} GiB", file=sys.stderr)

    def median(config: tuple[str, int], key: str) -> float | None:
        values = [r[key] for r in runs[config] if r[key] is not None]
        return statistics.median(values) if values else None

    first = configs[0]
    print(f"Office, paper-size TIGER CE, micro-batch 128 / effective 1024, {runs[first][0]['precision']}, "
          f"{args.threads} thread(s), {runs[first][0]['allocator']}, {args.epochs} epochs x {args.steps} steps, "
          f"validation {args.valid_users} users, {args.repeats} rounds; {cpu_description()}")
    print("| oneDNN cache | token multiple | epoch s | x first | validation s | x first | RSS after training GiB | peak RSS GiB | "
          "live peak training GiB | live peak validation GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for config in configs:
        ratio = statistics.median(r["epoch_seconds_median"] / b["epoch_seconds_median"]
                                  for r, b in zip(runs[config], runs[first]))
        vratio = statistics.median(r["validation_seconds"] / b["validation_seconds"]
                                   for r, b in zip(runs[config], runs[first]))
        row = {"capacity": config[0], "token_multiple": config[1],
               "epoch_seconds": median(config, "epoch_seconds_median"), "epoch_ratio": ratio,
               "validation_seconds": median(config, "validation_seconds"), "validation_ratio": vratio,
               "rss_after_training_gib": median(config, "rss_after_training_gib"),
               "peak_rss_gib": median(config, "peak_rss_gib"),
               "live_peak_training_gib": median(config, "live_peak_training_gib"),
               "live_peak_validation_gib": median(config, "live_peak_validation_gib")}
        rows.append(row)
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"| {config[0]} | {config[1]} | {row['epoch_seconds']:.1f} | {ratio:.2f} | {row['validation_seconds']:.1f} | {vratio:.2f} | "
              f"{fmt(row['rss_after_training_gib'])} | {fmt(row['peak_rss_gib'])} | {fmt(row['live_peak_training_gib'])} | "
              f"{fmt(row['live_peak_validation_gib'])} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"cpu": cpu_description(), "threads": args.threads, "epochs": args.epochs,
                                                   "steps": args.steps, "valid_users": args.valid_users,
                                                   "rows": rows, "runs": [{"capacity": c, "token_multiple": m, "runs": r}
                                                                          for (c, m), r in runs.items()]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
