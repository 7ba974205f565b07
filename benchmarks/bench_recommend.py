"""Users per second of ``Recommender.recommend``: many histories in one call (batched beam search,
vectorised history and result handling) against one call per user, paper-size TIGER (random
weights: speed does not depend on training), Office's catalog and test histories, CPU.

    .venv/bin/python benchmarks/bench_recommend.py [--users 1024] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
from apao_ray.data import load_dataset
from apao_ray.reuse.inference import Recommender
from apao_ray.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="office")
    parser.add_argument("--users", type=int, default=1024)
    parser.add_argument("--one-by-one-users", type=int, default=64, help="users timed with one call each")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json-out", default="benchmarks/results/recommend.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dataset = load_dataset(args.dataset)
    config = TrialConfig(DataConfig(dataset=args.dataset), ModelConfig(backbone="tiger"), LossConfig(name="ce"),
                         TrainConfig(precision="fp32"))
    model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels)
    recommender = Recommender(model, dataset.catalog, config)
    split = dataset.splits["test"]
    histories = [[dataset.catalog.item_ids[i] for i in row if i >= 0] for row in split.histories[:args.users]]
    rows = {}
    for name, run, count in [
        ("one call, batch_size=256", lambda: recommender.recommend(histories, k=10), len(histories)),
        ("one call per user", lambda: [recommender.recommend([h], k=10) for h in histories[:args.one_by_one_users]],
         args.one_by_one_users),
    ]:
        cpu, wall = time.process_time(), time.perf_counter()
        run()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        rows[name] = {"users": count, "cpu_seconds": cpu, "wall_seconds": wall, "users_per_cpu_second": count / cpu,
                      "users_per_wall_second": count / wall}
    print(f"recommend k=10, beam {config.train.beam_size}, paper-size TIGER, {args.dataset}, {args.threads} threads, "
          f"1-min load average {os.getloadavg()[0]:.1f}")
    print("| mode | users | users / CPU s | users / wall s |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['users']} | {row['users_per_cpu_second']:.0f} | {row['users_per_wall_second']:.0f} |")
    path = Path(args.json_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"threads": args.threads, "load_average": os.getloadavg()[0], "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
