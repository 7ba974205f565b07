"""Peak resident memory of a trial's test evaluation, phase by phase.

A study trial's worker recorded a peak RSS of 4.1-4.4 GB (its ``cost/peak_rss_mb``) against a
2 GiB target; this measures how much of that the final test evaluation can explain. Office,
paper-size TIGER (random weights: memory does not depend on them), the trial's own
``evaluate_split`` at the training precision, one thread. Before each phase the process's
high-water mark is reset (``/proc/self/clear_refs`` = 5) after ``gc`` and ``malloc_trim``, so
each row is that phase's own peak (model and dataset included).

    .venv/bin/python benchmarks/bench_eval_memory.py [--data-dir DIR] [--json-out PATH]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import time
from pathlib import Path

import torch

from apao_ray.config import ModelConfig, TrainConfig
from apao_ray.data import load_dataset
from apao_ray.models import build_model
from apao_ray.training.evaluation import evaluate_split
from apao_ray.hardware import cpu_description
from apao_ray.training.precision import resolve_precision

full_sort = importlib.import_module("apao_ray.decoding.full_sort")  # the module (the package exports its function)


def memory_gib() -> tuple[float, float]:
    """(current RSS, high-water mark since the last reset) of this process, GiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return tuple(int(fields[name].split()[0]) / 2**20 for name in ("VmRSS", "VmHWM"))


def reset_peak() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=None, help="datasets directory (default: the usual search)")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"), help="(default %(default)s)")
    parser.add_argument("--retention-users", type=int, default=128, help="full-sort users (default %(default)s)")
    parser.add_argument("--max-logit-elements", type=int, default=full_sort.MAX_LOGIT_ELEMENTS,
                        help="the full sort's chunk bound, logits per chunk (default %(default)s; 67108864 before "
                             "2026-11-26)")
    parser.add_argument("--json-out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    full_sort.MAX_LOGIT_ELEMENTS = args.max_logit_elements
    torch.set_num_threads(1)
    device = torch.device("cpu")
    dataset = load_dataset("office", args.data_dir)
    tensors = dataset.catalog.tensors(device)
    model = build_model(ModelConfig(backbone="tiger"), dataset.catalog.vocab_size, dataset.catalog.num_levels).eval()
    precision = resolve_precision(args.precision, device)
    rows = [{"phase": "model + dataset loaded", "seconds": 0.0, "rss_gib": memory_gib()[0], "peak_gib": memory_gib()[1]}]
    for phase, retention in (("test: beam search + CE", 0), (f"test: + retention ({args.retention_users} users full sort)",
                                                            args.retention_users)):
        reset_peak()
        start = time.perf_counter()
        evaluate_split(model, dataset, "test", tensors, TrainConfig(precision=precision, retention_users=retention),
                       device, None)
        rss, peak = memory_gib()
        rows.append({"phase": phase, "seconds": time.perf_counter() - start, "rss_gib": rss, "peak_gib": peak})
    print(f"Office, TIGER paper size, precision {precision}, 1 thread, full-sort chunks of <= "
          f"{args.max_logit_elements} logits, {cpu_description()}")
    print("| phase | s | RSS after GiB | peak GiB |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['phase']} | {row['seconds']:.0f} | {row['rss_gib']:.2f} | {row['peak_gib']:.2f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"cpu": cpu_description(), "precision": precision, "torch": torch.__version__,
                                                   "max_logit_elements": args.max_logit_elements,
                                                   "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
