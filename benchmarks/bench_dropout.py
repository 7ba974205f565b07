"""TIGER's dropout (``apao_ray.models.dropout.Dropout``) against ``torch.nn.functional.dropout`` and
against its 2026-11-25 form (the same draws kept as a bool mask, applied by ``torch.where``) on bf16
activations, forward and forward + backward (RESULTS.md, 2026-11-25 and 2026-11-27). Rounds alternate the order;
medians are printed and written as JSON:

    .venv/bin/python benchmarks/bench_dropout.py --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from apao_ray.models.dropout import Dropout, drop_mask
from apao_ray.hardware import cpu_description


class _BoolMaskDropout(torch.autograd.Function):
    """The 2026-11-25 dropout: a bool mask of the same draws, ``where`` forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        dropped = drop_mask(x.shape, p)
        ctx.save_for_backward(dropped)
        ctx.scale = 65536 / (65536 - round(p * 65536))
        return torch.where(dropped, 0.0, x).mul_(ctx.scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (dropped,) = ctx.saved_tensors
        return torch.where(dropped, 0.0, grad).mul_(ctx.scale), None


def timed(fn, x: torch.Tensor) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of one call."""
    start = time.perf_counter()
    y = fn(x)
    middle = time.perf_counter()
    y.backward(torch.ones_like(y))
    end = time.perf_counter()
    x.grad = None
    return (middle - start) * 1e3, (end - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--elements", type=int, default=12_900_000, help="elements per tensor (%(default)s)")
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    fast = Dropout(args.p)
    variants = [("F.dropout", lambda t: F.dropout(t, args.p, True)),
                ("bool mask", lambda t: _BoolMaskDropout.apply(t, args.p)), ("Dropout", fast)]
    times: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for round_index in range(args.rounds):
        for width in (128, 1024):
            x = torch.randn(args.elements // width, width, dtype=torch.bfloat16, requires_grad=True)
            for name, fn in variants if round_index % 2 == 0 else variants[::-1]:
                times.setdefault((width, name), []).append(timed(fn, x))
    print(f"{cpu_description()}, {args.threads} threads, load {os.getloadavg()[0]:.1f}, bf16, "
          f"{args.elements:,} elements, p = {args.p}, medians of {args.rounds} rounds (ms)")
    print(f"{'shape':<12}{'op':<12}{'forward':>10}{'fwd+bwd':>10}")
    rows = []
    for (width, name), values in times.items():
        forward, both = (statistics.median(v[i] for v in values) for i in (0, 1))
        print(f"{'(n, ' + str(width) + ')':<12}{name:<12}{forward:>10.1f}{both:>10.1f}")
        rows.append({"width": width, "op": name, "forward_ms": forward, "forward_backward_ms": both, "rounds": values})
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"cpu": cpu_description(), "threads": args.threads, "elements": args.elements, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
