"""How far bf16 CPU attention lands from float64, per way of computing it, as the scores spread.

T5 (TIGER) does not scale its attention scores, so their spread is not bounded near 1. For a beam's
cross-attention shape (20 queries over 81 keys) and a training decoder's (5 queries over 81 keys), with
q scaled so that the scores' standard deviation is ``spread``, prints the largest absolute error against
float64 (from the same bf16 inputs) of: SDPA in bf16, all in float32 between bf16 input and output, scores
rounded to bf16 (the evaluation path of 6375eef, 2026-11-25), and ``models/dropout.attention`` as it is (evaluation).

    python benchmarks/bench_attention_precision.py
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from apao_ray.models.dropout import attention  # noqa: E402


def variants(q, k, v, bias):
    with torch.autocast("cpu", enabled=False):
        bf16_scores = torch.softmax(torch.matmul(q, k.transpose(-2, -1)).float() + bias.float(), dim=-1)
        all_float32 = torch.softmax(q.float() @ k.float().transpose(-2, -1) + bias.float(), dim=-1) @ v.float()
        return {"sdpa bf16": F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0),
                "all float32": all_float32.bfloat16(),
                "bf16 scores": torch.matmul(bf16_scores, v.float()).bfloat16(),
                "attention()": attention(q, k, v, bias, 0.1, training=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spreads", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for queries, keys in ((20, 81), (5, 81)):
        for spread in args.spreads:
            generator = torch.Generator().manual_seed(2)
            q = torch.randn(64, 6, queries, 64, generator=generator, dtype=torch.float64) * spread / 8
            k, v = (torch.randn(64, 6, keys, 64, generator=generator, dtype=torch.float64) for _ in range(2))
            bias = torch.randn(1, 6, 1, keys, generator=generator, dtype=torch.float64)
            bias[..., :1] = float("-inf")  # a masked key
            q, k, v, bias = (t.bfloat16() for t in (q, k, v, bias))
            exact = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=bias.double(), scale=1.0)
            errors = {name: (out.double() - exact).abs().max().item() for name, out in variants(q, k, v, bias).items()}
            rows.append({"queries": queries, "keys": keys, "spread": spread, **errors})
    names = list(rows[0])[3:]
    print("queries x keys  spread  " + "  ".join(f"{n:>12}" for n in names))
    for row in rows:
        print(f"{row['queries']:>7} x {row['keys']:<4} {row['spread']:>7g}  " + "  ".join(f"{row[n]:12.2e}" for n in names))
    if args.json_out:
        args.json_out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
