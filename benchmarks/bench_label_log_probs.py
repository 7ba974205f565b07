"""``label_log_probs`` forward + backward on bf16 logits against the plain formula (RESULTS.md, 2026-11-24).

The plain formula (``logits.float()``, gather, ``logsumexp``, autograd) is what the training step
did before 2026-11-24; the library's version upcasts chunks of rows and saves only the bf16 logits
and one normaliser per row. Rounds alternate the two; medians are printed and written as JSON:

    .venv/bin/python benchmarks/bench_label_log_probs.py --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from apao_ray.models.base import label_log_probs
from apao_ray.hardware import cpu_description


def plain(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1027, help="Office's vocabulary (%(default)s)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = {"ce (128, 1, 5)": (128, 1, 5), "pairwise (128, 101, 5)": (128, 101, 5)}
    times: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        for label, shape in shapes.items():
            logits = torch.randn(*shape, args.vocab, dtype=torch.bfloat16)
            labels = torch.randint(0, args.vocab, shape)
            order = [("plain", plain), ("library", label_log_probs)]
            for name, fn in order if round_index % 2 == 0 else order[::-1]:
                x = logits.clone().requires_grad_(True)
                repeats = 20 if shape[1] == 1 else 3
                start = time.perf_counter()
                for _ in range(repeats):
                    fn(x, labels).sum().backward()
                times.setdefault((label, name), []).append((time.perf_counter() - start) / repeats * 1e3)
    print(f"{cpu_description()}, {args.threads} threads, bf16 logits, V = {args.vocab}, medians of {args.rounds} rounds (ms)")
    print(f"{'shape':<26}{'plain':>10}{'library':>10}{'speed-up':>10}")
    rows = []
    for label in shapes:
        old, new = (statistics.median(times[(label, name)]) for name in ("plain", "library"))
        print(f"{label:<26}{old:>10.1f}{new:>10.1f}{old / new:>9.2f}x")
        rows.append({"shape": label, "plain_ms": old, "library_ms": new, "rounds": {n: times[(label, n)] for n in ("plain", "library")}})
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"cpu": cpu_description(), "threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
