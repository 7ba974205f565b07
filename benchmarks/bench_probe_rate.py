"""How fast the plan's probe trains, by its length and by the thread it runs in (RESULTS.md, 2026-11-23, night).

Runs ``apao_ray.study.plan.probe.run_probe`` (the plan's own probe code) on Office, TIGER, CE at the sweep's
defaults, in this process's main thread or in a ``threading.Thread`` as Ray Train runs a trial's loop,
for a given number of timed optimizer steps (no time floor), and prints samples/s and the peak RSS.
Run one measurement per process, so each peak is its own:

    for m in main thread main thread; do .venv/bin/python benchmarks/bench_probe_rate.py --where $m --steps 24; done
    .venv/bin/python benchmarks/bench_probe_rate.py --where main --steps 96
"""
from __future__ import annotations

import argparse
import json
import os
import threading


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--where", choices=("main", "thread"), default="main")
    parser.add_argument("--steps", type=int, default=24, help="timed optimizer steps (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import apao_ray
    from apao_ray.study.plan.plan import method_config
    from apao_ray.study.plan.probe_cache import hardware_key
    from apao_ray.study.plan.probe import run_probe

    spec = apao_ray.StudySpec(dataset="office", backbones=("tiger",), losses=("ce",), epochs=2,
                              cpus_per_trial=args.threads)
    config = method_config(apao_ray.prepare(spec).base, "tiger", "ce")
    results = []

    def measure() -> None:
        results.append(run_probe(config, args.threads, steps=args.steps, min_seconds=0.0, max_seconds=1e9))

    if args.where == "main":
        measure()
    else:
        worker = threading.Thread(target=measure)
        worker.start()
        worker.join()
    result = results[0]
    print(json.dumps({"cpu": hardware_key(args.threads, False)["cpu"], "load_1min": round(os.getloadavg()[0], 1),
                      "where": args.where, "steps": args.steps,
                      "threads": args.threads, "samples_per_second": round(1 / result["train_s_per_sample"], 1),
                      "peak_gib": round(result["peak_bytes"] / 2**30, 2), "timed_samples": result["timed_samples"]}))


if __name__ == "__main__":
    main()
