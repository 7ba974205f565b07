"""The evidence queue on a GPU machine reached through a job system (one job at a time, each of at most 10 minutes,
its input a copy of the checkout of at most 64 MiB, its output a folder copied back): which queued study fits one
job next and the commands for it, and, after the job, the study's files landed as a committed export and the
Table 1 grid rebuilt.

    python benchmarks/gpu/next_job.py              # the next unfinished (item, seed) that fits a job, and the job
    python benchmarks/gpu/next_job.py --land gpu_out --study NAME   # after it: its output folder -> benchmarks/results

The queue is benchmarks/evidence/queue.json (what `report --grid` reads); a study is done when
benchmarks/results/<study>/study.json holds a finished trial of each of its losses. Names and flags are
office_full.sh's, so a study started on a CPU and one run here are the same study. One job holds one study
(benchmarks/gpu/study.sh) of at most ~8 minutes: its trials share the GPU (two already fill an H200: 2026-11-27,
3.30 s per Office TIGER epoch each, 1.27x one trial's throughput), and nothing takes a study's checkpoints from
one job to the next (a TIGER trial's are ~100 MB, more than a job's 64 MiB input), so a study that does not fit
one job waits for a machine that runs longer jobs (the listing says what it needs).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
QUEUE = ROOT / "benchmarks" / "evidence" / "queue.json"
RESULTS = ROOT / "benchmarks" / "results"
STUDY_LIMIT_S = 485  # study.sh's interrupt: a 600-s job less the install (~20 s), the export and the margin
SHARED_SLOWDOWN = 2 / 1.27  # n trials at once on one H200: each ~n / 1.27 x slower than alone (n = 2, 2026-11-27)
PROBE_S = 45  # Ray's start, the plan's probe and the test of the last trial


def study_name(dataset: str, backbone: str, losses: tuple[str, ...], protocol: str, seed: int) -> str:
    """office_full.sh's name for the study."""
    suffix = "" if losses == ("ce", "apao_pointwise") else "-" + "_".join(losses)
    if protocol != "paper":
        suffix = f"-{protocol}{suffix}"
    return f"{dataset}-full-{backbone}{suffix}-seed{seed}"


def sweep_flags(dataset: str, backbone: str, losses: tuple[str, ...], protocol: str, seed: int) -> str:
    """office_full.sh's sweep flags: one trial per loss at its paper Table 5 setting, the full protocol."""
    knobs = " --beta 0.3 --eta 1e-4" if (dataset, backbone, protocol, losses) == (
        "office", "tiger", "paper", ("ce", "apao_pointwise")) else ""
    return (f"--backbones {backbone} --losses {','.join(losses)} --num-samples 1{knobs} --epochs 200 --patience 20 "
            f"--asha-grace-period 200 --protocol {protocol} --seed {seed} --max-concurrent {len(losses)}")


def is_done(study: str, losses: tuple[str, ...]) -> bool:
    path = RESULTS / study / "study.json"
    if not path.exists():
        return False
    trials = json.loads(path.read_text())["trials"]
    finished = {t["tags"].get("loss") for t in trials if t["status"] == "FINISHED" and "test/ndcg_at_10" in t["metrics"]}
    return set(losses) <= finished


def pending() -> list[dict]:
    """Every (queue item, seed) not done yet, in queue order, with its estimated minutes on one H200."""
    from apao_ray.analysis.grid import load_queue

    rows = []
    for item in load_queue(QUEUE):
        for seed in item.seeds:
            study = study_name(item.dataset, item.backbone, item.losses, item.protocol, seed)
            if is_done(study, item.losses):
                continue
            alone = max(item.gpu_minutes.values())
            minutes = alone * (SHARED_SLOWDOWN * len(item.losses) / 2 if len(item.losses) > 1 else 1) + PROBE_S / 60
            rows.append({"study": study, "dataset": item.dataset, "minutes": minutes, "fits": minutes * 60 <= STUDY_LIMIT_S,
                         "flags": sweep_flags(item.dataset, item.backbone, item.losses, item.protocol, seed),
                         "losses": item.losses, "seed": seed, "fallback_flags": f"--dataset {item.dataset} --backbone "
                         f"{item.backbone} --protocol {item.protocol} --losses {','.join(item.losses)}"})
    return rows


def job_for(row: dict) -> str:
    n = len(row["losses"])
    env = (f"BUDGET= STUDY={row['study']} DATASET={row['dataset']} GPUS_PER_TRIAL={1 / n:.3g} "
           f"CPUS_PER_TRIAL={16 // n} STUDY_LIMIT={STUDY_LIMIT_S} FALLBACK_SEEDS={row['seed']} "
           f"SWEEP_FLAGS=\"{row['flags']}\" FALLBACK_FLAGS=\"{row['fallback_flags']}\"")
    return (f"# first, where a package registry is reachable:\n"
            f"python benchmarks/gpu/wheelset.py --python-version 3.12 --datasets {row['dataset']}\n"
            f"# then copy the checkout with .gpu/wheels-cp312 and .gpu/datasets to the GPU machine and run there,\n"
            f"# as one job of at most 10 minutes:\nOUT=gpu_out {env} bash benchmarks/gpu/study.sh\n"
            f"# then, with gpu_out copied back here:\n"
            f"python benchmarks/gpu/next_job.py --land gpu_out --study {row['study']}")


def land(out_dir: Path, study: str, results: Path = RESULTS,
         grid_out: Path = ROOT / "benchmarks" / "evidence" / "grid") -> Path:
    """The export in a job's output folder (study.sh's OUT) unpacked as <results>/<study> (with the GPU's log and
    nvidia-smi samples), then the grid rebuilt from every export in ``results``; returns the export's folder."""
    target = results / study
    if target.exists():
        raise SystemExit(f"{target} exists: move it away first (a finished study is not overwritten)")
    with tarfile.open(out_dir / "export.tar.gz") as archive:
        archive.extractall(out_dir / "unpacked", filter="data")
    shutil.copytree(out_dir / "unpacked" / "export", target)
    for name, as_name in (("gpu.csv", "gpu_h200.csv"), ("runner.log", "gpu_runner.log"), ("summary.json", "gpu_summary.json")):
        if (out_dir / name).exists():
            shutil.copy(out_dir / name, target / as_name)
    subprocess.run([sys.executable, "-m", "apao_ray", "report", "--grid", "--exports", str(results), "--out",
                    str(grid_out), "--queue", str(QUEUE)], check=True)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--land", type=Path, metavar="OUT_DIR", help="a finished job's output folder (study.sh's OUT)")
    parser.add_argument("--study", help="with --land: the study's name (the listing's)")
    parser.add_argument("--json", action="store_true", help="the pending list as JSON")
    args = parser.parse_args()
    if args.land:
        if not args.study:
            parser.error("--land needs --study NAME (the name the job ran)")
        print(f"landed {land(args.land, args.study)}; commit it with benchmarks/evidence/grid/grid.md")
        return 0
    rows = pending()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for row in rows:
        print(f"{row['study']:<48} ~{row['minutes']:5.1f} min on one H200  "
              f"{'fits one job' if row['fits'] else 'needs a longer job than the 10-minute limit'}")
    ready = next((row for row in rows if row["fits"]), None)
    print("\nnext job:\n" + job_for(ready) if ready else "\nnothing queued fits one job")
    return 0


if __name__ == "__main__":
    sys.exit(main())
