"""One CUDA GPU: training throughput, a whole paper-protocol epoch with validation, and beam search (the GPU
speed targets; docs/running.md's cost of a study on one GPU).

Needs torch with CUDA and the datasets, nothing else of the study stack (no Ray, MLflow or Optuna): it drives
the product's own training and evaluation code (``EpochRunner``, ``run_trial``, ``evaluate_split``). Sections,
each guarded (a failure is printed and the next runs) and appended to ``--json-out`` as it finishes, so a run
cut off by a time limit keeps what it measured:

* ``check``: a real Office batch through TIGER and Llama on the GPU and on the CPU in float32, same weights:
  max |logit difference| and the CE loss on each (the CUDA path computes the same function);
* ``train``: samples/s of ``--steps`` optimizer steps at effective batch 1024 (``bench_training.measure``):
  TIGER CE over micro-batches 128..1024 in bf16 and fp32, then every backbone x loss at the fastest;
* ``epoch``: ``run_trial`` of TIGER CE on Office at the trial defaults for ``--epochs`` epochs (validation by
  beam search on all 4,905 users every epoch, then the test split): seconds per epoch, train vs validation;
* ``decode``: beam search K=20 over the whole Office test split through ``evaluate_split``, users/s per
  backbone, precision and evaluation batch;
* ``compile`` (not in the default sections: on a CPU its first pass took minutes): ``torch.compile`` of the
  model for TIGER CE training, three passes of ``--steps`` optimizer steps, compiled vs eager (skipped when less
  than ``--compile-seconds`` of ``--budget`` is left).

    python benchmarks/bench_gpu.py --data-dir ../shared/datasets --json-out /tmp/gpu.json
    python benchmarks/bench_gpu.py --device cpu --threads 2 --steps 1 --sections compile --compile-seconds 0
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig  # noqa: E402
from apao_ray.data import collate, load_dataset  # noqa: E402
from apao_ray.losses import build_loss  # noqa: E402
from apao_ray.losses.base import LossInputs  # noqa: E402
from apao_ray.models import build_model  # noqa: E402
from apao_ray.protocol import with_end_token  # noqa: E402
from apao_ray.training.evaluation import evaluate_split  # noqa: E402
from apao_ray.training.hooks import TrainingHooks  # noqa: E402
from apao_ray.training.loop import run_trial  # noqa: E402

STARTED = time.perf_counter()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


class Results:
    """Sections' results, rewritten to ``path`` after each one."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path, self.data = path, {**header, "sections": {}}
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, section: str, value) -> None:
        self.data["sections"][section] = value
        self.path.write_text(json.dumps(self.data, indent=2))


def check(dataset, args) -> list[dict]:
    """GPU vs CPU float32 on one real batch, same weights: logits and the CE loss."""
    rows = []
    split = dataset.splits["train"]
    batch = collate(dataset.catalog, split, np.arange(64), dataset.catalog.item_tokens)
    sem_tokens = torch.as_tensor(dataset.catalog.sem_tokens)
    for backbone in ("tiger", "llama"):
        torch.manual_seed(0)
        model = build_model(ModelConfig(backbone=backbone), dataset.catalog.vocab_size, dataset.catalog.num_levels)
        model.eval()
        out = {}
        for device in ("cpu", args.device):
            model.to(device)
            tensors = dataset.catalog.tensors(device)
            moved = batch.to(device)
            candidates = with_end_token(sem_tokens.to(device)[moved.target_sem[:, None]], False)
            nodes = tensors.leaf_prefix_nodes[moved.target_sem[:, None]]
            with torch.no_grad():
                logits = model(moved.history_ids, moved.history_mask, candidates)
                loss = build_loss(LossConfig(name="ce"), tensors)(LossInputs(logits, candidates, nodes, None)).loss
            out[device] = (logits.double().cpu(), float(loss))
        diff = (out["cpu"][0] - out[args.device][0]).abs().max().item()
        rows.append({"backbone": backbone, "max_abs_logit_diff": diff, "ce_cpu": out["cpu"][1],
                     "ce_device": out[args.device][1]})
        log(f"check {backbone}: max |logit diff| {diff:.2e}, CE cpu {out['cpu'][1]:.6f} {args.device} "
            f"{out[args.device][1]:.6f}")
    return rows


def train_rows(args) -> list[dict]:
    from bench_training import measure  # the CPU benchmark's measurement, on the GPU

    def one(backbone: str, loss: str, variant: str, batch_size: int) -> dict:
        ns = argparse.Namespace(threads=args.threads, variant=variant, dataset="office", data_dir=args.data_dir,
                                backbone=backbone, loss=loss, num_negatives=100, batch_size=batch_size,
                                effective_batch_size=1024, seed=0, steps=args.steps, profile=None, device=args.device)
        result = measure(ns)
        row = {"backbone": backbone, "loss": loss, "variant": variant, "batch_size": batch_size,
               "samples_per_second": result["samples_per_second"], "peak_gpu_gib": result.get("peak_gpu_gib"),
               "epoch_train_seconds": result["num_train_samples"] / result["samples_per_second"],
               "precision": result["precision"]}
        log(f"train {backbone}/{loss} {variant} micro-batch {batch_size}: {row['samples_per_second']:.0f} samples/s, "
            f"epoch {row['epoch_train_seconds']:.1f} s, peak GPU {row['peak_gpu_gib'] or 0:.2f} GiB")
        return row

    rows = []
    for variant in ("bf16", "fp32"):
        for batch_size in (128, 256, 512, 1024):
            rows.append(one("tiger", "ce", variant, batch_size))
    best = max((r for r in rows if r["variant"] == "bf16"), key=lambda r: r["samples_per_second"])["batch_size"]
    for backbone in ("tiger", "llama"):
        for loss in ("ce", "apao_pointwise", "apao_pairwise"):
            if backbone == "tiger" and loss == "ce":
                continue
            rows.append(one(backbone, loss, "bf16", best if loss != "apao_pairwise" else 256))
    return rows


def epoch_rows(dataset, args) -> dict:
    config = TrialConfig(DataConfig(dataset="office", data_dir=args.data_dir), ModelConfig(backbone="tiger"),
                         train=TrainConfig(epochs=args.epochs, batch_size=args.epoch_batch_size, use_gpu=True,
                                           max_train_samples=args.max_train_samples, eval_max_users=args.max_users))
    with tempfile.TemporaryDirectory() as directory:
        hooks = TrainingHooks(directory, device=args.device, verbose=False)
        start = time.perf_counter()
        final = run_trial(config, hooks, dataset)
        wall = time.perf_counter() - start
    epochs = [{"epoch": r["epoch"], "epoch_seconds": r["perf/epoch_seconds"], "train_seconds": r["perf/train_seconds"],
               "validation_seconds": r["perf/epoch_seconds"] - r["perf/train_seconds"],
               "samples_per_second": r["perf/samples_per_second"], "val_ndcg_at_10": r.get("val/ndcg_at_10"),
               "train_loss": r.get("train/loss")}
              for r in hooks.reports if "perf/epoch_seconds" in r and not r.get("done")]
    for e in epochs:
        log(f"epoch {e['epoch']}: {e['epoch_seconds']:.1f} s (train {e['train_seconds']:.1f}, validation "
            f"{e['validation_seconds']:.1f}), {e['samples_per_second']:.0f} samples/s, val NDCG@10 {e['val_ndcg_at_10']:.4f}")
    log(f"run_trial {args.epochs} epochs + test: {wall:.1f} s; test NDCG@10 {final.get('test/ndcg_at_10')}")
    return {"micro_batch": args.epoch_batch_size, "epochs": epochs, "run_trial_seconds": wall,
            "precision": hooks.reports[-1].get("precision"), "test_ndcg_at_10": final.get("test/ndcg_at_10")}


def decode_rows(dataset, args) -> list[dict]:
    device = torch.device(args.device)
    tensors = dataset.catalog.tensors(device)
    indices = None if args.max_users is None else np.arange(args.max_users)
    users = len(dataset.splits["test"]) if indices is None else len(indices)
    rows = []
    for backbone in ("tiger", "llama"):
        torch.manual_seed(0)
        model = build_model(ModelConfig(backbone=backbone), dataset.catalog.vocab_size,
                            dataset.catalog.num_levels).to(device).eval()
        for precision in ("bf16", "fp32"):
            for eval_batch in (256, 1024):
                train = TrainConfig(precision=precision, eval_batch_size=eval_batch, retention_users=0)
                seconds = []
                for _ in range(args.repeats + 1):  # the first is a warm-up
                    sync()
                    start = time.perf_counter()
                    metrics = evaluate_split(model, dataset, "test", tensors, train, device, indices)
                    sync()
                    seconds.append(time.perf_counter() - start)
                median = float(np.median(seconds[1:]))
                rows.append({"backbone": backbone, "precision": precision, "eval_batch_size": eval_batch,
                             "users": users, "seconds": median, "users_per_second": users / median,
                             "test_ndcg_at_10": metrics["test/ndcg_at_10"]})
                log(f"decode {backbone} {precision} eval batch {eval_batch}: {users / median:.0f} users/s "
                    f"({median:.2f} s for {users} users)")
    return rows


def compile_rows(args) -> dict:
    """Eager vs torch.compile(model) for TIGER CE bf16 training at micro-batch 1024."""
    from apao_ray.training.trial_setup import build_optimizer, warmup_cosine
    from apao_ray.training.steps import EpochRunner

    device = torch.device(args.device)
    dataset = load_dataset("office", args.data_dir)
    out = {}
    for mode in ("eager", "compiled"):
        config = TrialConfig(DataConfig(dataset="office"), ModelConfig(backbone="tiger"), LossConfig(name="ce"),
                             TrainConfig(batch_size=1024, effective_batch_size=1024, precision="bf16",
                                         max_train_samples=1024 * args.steps))
        tensors = dataset.catalog.tensors(device)
        torch.manual_seed(0)
        model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels).to(device)
        runner_model = torch.compile(model, dynamic=True) if mode == "compiled" else model
        loss = build_loss(config.loss, tensors)
        optimizer = build_optimizer(model, 5e-4, 0.01)
        scheduler = warmup_cosine(optimizer, 100, 0.01)
        runner = EpochRunner(config, dataset, tensors, device)
        times = []
        for epoch in range(3):  # the first includes compilation
            sync()
            start = time.perf_counter()
            metrics = runner.train_epoch(epoch + 1, runner_model, loss, optimizer, scheduler, None)
            sync()
            times.append(time.perf_counter() - start)
        out[mode] = {"first_pass_seconds": times[0], "steady_samples_per_second": metrics["train/num_samples"] / min(times[1:]),
                     "passes": times}
        log(f"compile {mode}: first pass {times[0]:.1f} s, steady {out[mode]['steady_samples_per_second']:.0f} samples/s")
    out["steady_ratio"] = out["compiled"]["steady_samples_per_second"] / out["eager"]["steady_samples_per_second"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", str(ROOT.parent / "shared" / "datasets")))
    parser.add_argument("--sections", default="check,train,epoch,decode",
                        help="comma list (default %(default)s)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps timed per training row (default %(default)s)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of the whole-epoch section (default %(default)s)")
    parser.add_argument("--epoch-batch-size", type=int, default=1024,
                        help="micro-batch of the whole-epoch section (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="timed decoding passes after a warm-up (default %(default)s)")
    parser.add_argument("--threads", type=int, default=4, help="CPU threads (default %(default)s)")
    parser.add_argument("--budget", type=float, default=420, help="seconds; later sections are skipped past it")
    parser.add_argument("--compile-seconds", type=float, default=150, help="what the compile section needs")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the script here (default %(default)s)")
    parser.add_argument("--max-train-samples", type=int, help="a short epoch (to try the script)")
    parser.add_argument("--max-users", type=int, help="validation/decoding users (to try the script)")
    parser.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "gpu.json"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    header = {"gpu": torch.cuda.get_device_name(0) if cuda else None,
              "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
              "torch": torch.__version__, "cuda": torch.version.cuda, "bf16": cuda and torch.cuda.is_bf16_supported(),
              "host": platform.processor() or platform.machine(), "cpu_threads": args.threads,
              "date": time.strftime("%Y-%m-%d")}
    log(json.dumps(header))
    results = Results(Path(args.json_out), header)
    dataset = load_dataset("office", args.data_dir)
    sections = {"check": lambda: check(dataset, args), "train": lambda: train_rows(args),
                "epoch": lambda: epoch_rows(dataset, args), "decode": lambda: decode_rows(dataset, args),
                "compile": lambda: compile_rows(args)}
    failed = 0
    for name in args.sections.split(","):
        left = args.budget - (time.perf_counter() - STARTED)
        if left <= 0 or (name == "compile" and left < args.compile_seconds):
            log(f"{name}: skipped, {left:.0f} s of the budget left")
            results.add(name, {"skipped": f"{left:.0f} s of the budget left"})
            continue
        log(f"{name}: start")
        try:
            results.add(name, sections[name]())
        except Exception as error:  # noqa: BLE001 - a section's failure must not cost the others
            failed += 1
            traceback.print_exc()
            results.add(name, {"error": f"{type(error).__name__}: {error}"})
        if cuda:
            torch.cuda.empty_cache()
    log(f"done, {failed} section(s) failed; results in {args.json_out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
