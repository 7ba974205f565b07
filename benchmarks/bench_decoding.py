"""Constrained beam search (K = 20) and full sorting speed on Office test users, CPU.

Target (PERFORMANCE_TARGETS.md): >= 140 test users/s at K = 20 on 2 CPUs, peak RSS <= 3 GiB
at test batch 256. Models are randomly initialised at the paper's size (speed does not depend
on the weights). For each backbone and precision (fp32; bf16 = ``torch.autocast``):

* beam users/s over a fixed random subset of test users, median of ``--repeats`` runs, with
  users in split order ("given") and sorted by history length ("by_length": batches of
  similar length pad less; metrics do not depend on the order). Besides wall time the script
  records process CPU time: users / (CPU s / threads) is what an otherwise idle machine would
  give, and stays meaningful when other jobs share the CPUs (check ``ps`` / load average);
* the full test split decoded once through ``evaluate`` (by length, collation included);
* one batch broken down (fp32): encode, each decode step, and an estimate for a decoder that
  computes one new position per beam per step (a prefix key/value cache) instead of the
  whole prefix;
* full sorting (every semantic ID scored exactly) for the first ``--full-sort-users``;
* peak RSS of each variant (VmHWM, reset before it; model and dataset included) and of the
  whole process (``resource.getrusage``).

    .venv/bin/python benchmarks/bench_decoding.py [--data-dir DIR] [--batch-size 256]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from apao_ray.config import ModelConfig
from apao_ray.data import iter_batches, load_dataset
from apao_ray.decoding import beam_search, evaluate, full_sort
from apao_ray.decoding.beam import CPU_ROW_CHUNK
from apao_ray.models import build_model

RESULTS = Path(__file__).resolve().parent / "results" / "decoding.json"
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {message}", file=sys.stderr, flush=True)


def peak_rss_gib() -> float:
    """Peak RSS since the last :func:`reset_peak_rss` (VmHWM), else of the whole process."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def reset_peak_rss() -> None:
    """Restarts the peak-RSS count at the current RSS (Linux >= 4.0), so each variant's peak
    is its own and not that of an earlier, hungrier one (full sorting, unchunked batches)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def precision(dtype: torch.dtype | None):
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


@torch.inference_mode()
def breakdown(model, batch, catalog, beam_size: int, repeats: int) -> dict[str, float]:
    """Median wall seconds of one fp32 batch: the beam, encode, each step's decode.

    ``incremental_estimate_s``: encode + step 0 + for t >= 1 decode(K_t, prefix 1) -
    decode(K_t, prefix 0), the cost of ONE position for both backbones (TIGER decodes BOS +
    prefix; Llama takes position 0 from the history's cache). It ignores a cache's
    reordering copies, so it is a lower bound for an incremental decoder.
    """
    rows, token = batch.history_ids.shape[0], int(catalog.token_offsets[0])
    context = model.encode(batch.history_ids, batch.history_mask)

    def median_s(fn) -> float:
        return statistics.median(timed(fn)[0] for _ in range(repeats))

    def decode_s(width: int, length: int) -> float:
        prefix = torch.full((rows, width, length), token)                              # (B, K_t, t)
        return median_s(lambda: model.decode(context, prefix))

    ids, mask = batch.history_ids, batch.history_mask
    times = {"history_len": ids.shape[1],
             "beam_s": median_s(lambda: beam_search(model, ids, mask, catalog, beam_size)),
             "encode_s": median_s(lambda: model.encode(ids, mask))}
    incremental, width = times["encode_s"], 1
    for t, size in enumerate(catalog.level_sizes):
        times[f"decode_step{t}_s"] = decode_s(width, t)
        one_position = decode_s(width, 1) - decode_s(width, 0)
        incremental += times[f"decode_step{t}_s"] if t == 0 else max(0.0, one_position)
        width = min(beam_size, width * size)
    times["incremental_estimate_s"] = incremental
    return times


def bench_variant(name: str, model, catalog, test, orders, label: str, chunk: int, args) -> dict[str, object]:
    """Beam users/s of one (precision, row chunk) over the subset in both orders; the full
    test split once through ``evaluate`` for the default chunk."""
    tensors, threads, dtype = catalog.tensors(), torch.get_num_threads(), PRECISIONS[label]
    row: dict[str, object] = {"backbone": name, "precision": label, "row_chunk": chunk,
                              "parameters": model.num_parameters(), "users": len(orders["given"]),
                              "batch_size": args.batch_size}
    reset_peak_rss()
    for order, indices in orders.items():
        batches = list(iter_batches(catalog, test, args.batch_size, indices=indices))

        def one_pass(batches=batches) -> None:
            with precision(dtype):
                for batch in batches:
                    beam_search(model, batch.history_ids, batch.history_mask, tensors, args.beam_size, chunk)

        timed(lambda: one_pass(batches[:1]))  # warm-up
        runs = [timed(one_pass) for _ in range(args.repeats)]
        row[f"beam_users_per_s_{order}"] = len(indices) / statistics.median(r[0] for r in runs)
        row[f"beam_users_per_cpu_s_{order}"] = len(indices) / (statistics.median(r[1] for r in runs) / threads)
        row[f"beam_runs_{order}"] = [[round(w, 3), round(c, 3)] for w, c in runs]
        log(f"{name} {label} chunk {chunk} {order}: (wall s, cpu s) {row[f'beam_runs_{order}']}")
    if not args.skip_full_test and chunk == CPU_ROW_CHUNK:
        indices = np.argsort(test.history_lengths, kind="stable")
        wall, cpu = timed(lambda: evaluate(model, iter_batches(catalog, test, args.batch_size, indices=indices),
                                           tensors, beam_size=args.beam_size, amp_dtype=dtype))
        row.update(full_test_users=len(test), full_test_s=wall, full_test_cpu_s=cpu)
        log(f"{name} {label} full test: {wall:.1f} s wall, {cpu:.1f} s cpu")
    row["peak_rss_gib"] = peak_rss_gib()  # model, dataset and this variant's beams
    return row


def bench_backbone(name: str, dataset, args) -> list[dict[str, object]]:
    catalog, test = dataset.catalog, dataset.splits["test"]
    tensors, threads = catalog.tensors(), torch.get_num_threads()
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=name), catalog.vocab_size, catalog.num_levels).eval()
    subset = np.sort(np.random.default_rng(0).permutation(len(test))[:args.num_users])
    orders = {"given": subset, "by_length": subset[np.argsort(test.history_lengths[subset], kind="stable")]}
    rows = []
    for label in args.precisions:
        for chunk in args.row_chunks:
            rows.append(bench_variant(name, model, catalog, test, orders, label, chunk, args))
    # one CPU_ROW_CHUNK batch in split order: what one chunk of the default search costs
    rows[0]["breakdown_one_batch"] = breakdown(
        model, next(iter_batches(catalog, test, CPU_ROW_CHUNK, indices=subset)), tensors, args.beam_size,
        args.repeats)
    if args.full_sort_users:
        reset_peak_rss()
        users = subset[:args.full_sort_users]
        batch = next(iter_batches(catalog, test, len(users), indices=users))
        wall, cpu = timed(lambda: full_sort(model, batch.history_ids, batch.history_mask, tensors))
        rows[0].update(full_sort_users=len(users), full_sort_users_per_s=len(users) / wall,
                       full_sort_users_per_cpu_s=len(users) / (cpu / threads), full_sort_peak_rss_gib=peak_rss_gib())
        log(f"{name} full sort: {wall:.1f} s wall for {len(users)} users")
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    header = ("backbone", "prec", "rows/chunk", "u/s given", "u/s by_len", "u/cpu-s by_len", "full test s",
              "full sort u/s", "peak RSS GiB")
    print(" | ".join(header))
    for row in rows:
        nan = float("nan")
        cells = (row["backbone"], row["precision"], str(row["row_chunk"]), f"{row['beam_users_per_s_given']:.1f}",
                 f"{row['beam_users_per_s_by_length']:.1f}", f"{row['beam_users_per_cpu_s_by_length']:.1f}",
                 f"{row.get('full_test_s', nan):.1f}", f"{row.get('full_sort_users_per_s', nan):.2f}",
                 f"{row['peak_rss_gib']:.2f}")
        print(" | ".join(cells))
    for row in rows:
        if "breakdown_one_batch" in row:
            parts = row["breakdown_one_batch"]
            speedup = parts["beam_s"] / parts["incremental_estimate_s"]
            print(f"{row['backbone']} one fp32 batch (s):", {k: round(v, 3) for k, v in parts.items()},
                  f"-> incremental decoding would be ~{speedup:.2f}x faster")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", "../shared/datasets"))
    parser.add_argument("--dataset", default="office")
    parser.add_argument("--backbones", nargs="+", default=["tiger", "llama"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=sorted(PRECISIONS))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-users", type=int, default=1024)
    parser.add_argument("--beam-size", type=int, default=20)
    parser.add_argument("--row-chunks", type=int, nargs="+", default=None,
                        help=f"beam_search row_chunk_size values (default: {CPU_ROW_CHUNK} and the batch size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--full-sort-users", type=int, default=16, help="0 skips full sorting")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--skip-full-test", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.row_chunks = args.row_chunks or sorted({CPU_ROW_CHUNK, args.batch_size})
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = load_dataset(args.dataset, args.data_dir)
    load_before = os.getloadavg()
    rows = [row for name in args.backbones for row in bench_backbone(name, dataset, args)]
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "load_average_before_after": [load_before, os.getloadavg()],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "process_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "dataset": args.dataset, "beam_size": args.beam_size, "rows": rows,
    }
    print_table(rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
