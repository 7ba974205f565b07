"""How fast training could go on this machine: FLOPs per sample of each (backbone, loss) against the
machine's matrix-product ceiling for the model's own layer shapes, and, given a ``bench_training.py``
JSON, how close the measured throughput sits to that ceiling.

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` (matrix products and attention,
forward and backward) over one real Office micro-batch through the training loop (``EpochRunner``),
so every position the loss decodes is counted: APAO-pairwise's 1 + N candidates included. The
ceiling times forward + backward (y = x W^T, dx, dW: 6 M n k FLOP) of every distinct linear shape in
the model, M = ``--rows`` rows, in each precision this CPU runs natively (bf16 only with AVX512-BF16 or
AMX), and combines them as total FLOP / total time. Samples/s at the ceiling = ceiling / FLOP per
sample: an upper bound, as the element-wise work between the products is not counted.

    python benchmarks/bench_roofline.py --training-json benchmarks/results/allocators.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig  # noqa: E402
from apao_ray.data import load_dataset  # noqa: E402
from apao_ray.losses import build_loss  # noqa: E402
from apao_ray.models import build_model  # noqa: E402
from apao_ray.hardware import cpu_description  # noqa: E402
from apao_ray.training.trial_setup import build_optimizer, warmup_cosine  # noqa: E402
from apao_ray.training.precision import autocast, cpu_has_native_bf16  # noqa: E402
from apao_ray.training.steps import EpochRunner  # noqa: E402


def flops_per_sample(dataset, backbone: str, loss_name: str, num_negatives: int, samples: int) -> float:
    """Matrix-product FLOPs of one training step (forward + backward) per sample, fp32, real Office rows."""
    config = TrialConfig(DataConfig(dataset=dataset.name), ModelConfig(backbone=backbone),
                         LossConfig(name=loss_name, num_negatives=num_negatives, beta=0.2, eta=3e-5),
                         TrainConfig(batch_size=samples, effective_batch_size=samples, seed=0,
                                     max_train_samples=samples, precision="fp32"))
    model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels)
    tensors = dataset.catalog.tensors()
    loss = build_loss(config.loss, tensors)
    optimizer = build_optimizer(model, 5e-4, 0.01)
    counter = FlopCounterMode(display=False)
    with counter:
        EpochRunner(config, dataset, tensors, torch.device("cpu")).train_epoch(
            1, model, loss, optimizer, warmup_cosine(optimizer, 10, 0.01), None)
    return counter.get_total_flops() / samples


def linear_shapes(dataset, backbone: str) -> list[tuple[int, int]]:
    """Distinct (in, out) shapes of the model's linear layers and its tied output head."""
    model = build_model(ModelConfig(backbone=backbone), dataset.catalog.vocab_size, dataset.catalog.num_levels)
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)}
    # the token embedding doubles as the output head (d -> V); the other embeddings are lookups
    shapes |= {(m.embedding_dim, m.num_embeddings) for m in model.modules()
               if isinstance(m, nn.Embedding) and m.num_embeddings == dataset.catalog.vocab_size}
    return sorted(shapes)


def matmul_rate(rows: int, shape: tuple[int, int], precision: str, repeats: int, seconds: float) -> float:
    """GFLOP/s of forward + backward of ``x @ W^T`` (M x in by in -> out), median of ``repeats`` timings."""
    fan_in, fan_out = shape
    x = torch.randn(rows, fan_in, requires_grad=True)
    weight = torch.randn(fan_out, fan_in, requires_grad=True)
    grad = torch.randn(rows, fan_out)

    def step() -> None:
        with autocast(precision, "cpu"):
            y = F.linear(x, weight)
        y.backward(grad.to(y.dtype))

    step()
    timings = []
    for _ in range(repeats):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            step()
            count += 1
        timings.append((time.perf_counter() - start) / count)
    return 6 * rows * fan_in * fan_out / statistics.median(timings) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="office")
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "datasets"))
    parser.add_argument("--backbones", default="tiger,llama")
    parser.add_argument("--losses", default="ce,apao_pairwise")
    parser.add_argument("--num-negatives", type=int, default=100, help="pairwise negatives N (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    parser.add_argument("--rows", type=int, default=4096, help="rows M of the timed products (default %(default)s)")
    parser.add_argument("--count-samples", type=int, default=64,
                        help="micro-batch whose FLOPs are counted (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per shape, median kept (default %(default)s)")
    parser.add_argument("--training-json", action="append", default=[],
                        help="a bench_training.py JSON whose measured samples/s to place against the ceiling (repeatable)")
    parser.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "roofline.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    precisions = ["fp32", "bf16"] if cpu_has_native_bf16() else ["fp32"]
    dataset = load_dataset(args.dataset, args.data_dir)
    backbones, losses = args.backbones.split(","), args.losses.split(",")
    print(f"{cpu_description()}, {args.threads} threads, torch {torch.__version__}, native bf16: {cpu_has_native_bf16()}")

    ceilings: dict[str, dict[str, float]] = {}  # backbone -> precision -> GFLOP/s over its shapes
    shape_rates = []
    for backbone in backbones:
        for precision in precisions:
            flop = seconds = 0.0
            for shape in linear_shapes(dataset, backbone):
                rate = matmul_rate(args.rows, shape, precision, args.repeats, 0.3)
                shape_rates.append({"backbone": backbone, "precision": precision, "shape": shape, "gflop_per_s": rate})
                print(f"  {backbone} {precision} ({args.rows}x{shape[0]}) @ ({shape[0]}x{shape[1]}) fwd+bwd: {rate:.1f} GFLOP/s",
                      flush=True)
                work = 6 * args.rows * shape[0] * shape[1] / 1e9
                flop, seconds = flop + work, seconds + work / rate
            ceilings.setdefault(backbone, {})[precision] = flop / seconds

    measured = [row for path in args.training_json for row in json.loads(Path(path).read_text())["rows"]]
    rows = []
    print(f"\n{'backbone/loss':<22}{'GFLOP/sample':>13}{'precision':>10}{'ceiling GFLOP/s':>16}"
          f"{'samples/s at ceiling':>21}")
    for backbone in backbones:
        for loss_name in losses:
            gflop = flops_per_sample(dataset, backbone, loss_name, args.num_negatives, args.count_samples) / 1e9
            for precision, ceiling in ceilings[backbone].items():
                row = {"backbone": backbone, "loss": loss_name, "gflop_per_sample": gflop, "precision": precision,
                       "ceiling_gflop_per_s": ceiling, "samples_per_s_at_ceiling": ceiling / gflop, "measured": []}
                print(f"{backbone + '/' + loss_name:<22}{gflop:>13.3f}{precision:>10}{ceiling:>16.1f}{ceiling / gflop:>21.1f}")
                for m in measured:
                    if (m["backbone"], m["loss"], m.get("precision")) == (backbone, loss_name, precision):
                        achieved = m["samples_per_second"] * gflop
                        row["measured"].append({"label": m["label"], "samples_per_second": m["samples_per_second"],
                                                "gflop_per_s": achieved, "share_of_ceiling": achieved / ceiling})
                        print(f"    measured {m['label']}: {m['samples_per_second']:.1f} samples/s = {achieved:.1f} GFLOP/s, "
                              f"{100 * achieved / ceiling:.0f}% of the ceiling")
                rows.append(row)
    result = {"cpu": cpu_description(), "threads": args.threads, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "args": vars(args), "shapes": shape_rates, "rows": rows}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
