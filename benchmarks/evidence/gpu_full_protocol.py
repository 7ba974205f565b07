"""The full-protocol comparison on one CUDA GPU: Office, TIGER (or ``--backbone llama``), CE vs APAO-pointwise (or any
``--losses``, each at its paper Table 5 setting for the backbone: TIGER beta 0.3, eta 1e-4) at the full
protocol (200 epochs, patience 20) of the paper (``--protocol reference``: of the released code), several seeds
at once, through the product's own trial (``run_trial``, the config built by ``apao train``'s own parser),
without Ray, MLflow or Optuna (for a GPU machine that has none of them: ``office_full.sh`` is the same study
through ``apao sweep`` where they are).

Each (loss, seed) trains in its own process on the one GPU, all at once. One trial alone already keeps an
H200 mostly busy (an Office epoch 2.1 s; four at once 6.7 s each, benchmarks/RESULTS.md, 2026-11-26), so
give one seed per run: its two trials should reach early stopping (~85-100 epochs) within 10 minutes
(an estimate: two at once were not timed). Every trial's result goes to ``--out`` as one JSON file,
``<loss>-seed<seed>.json`` (``llama-...`` for Llama, ``...reference-<loss>...`` under ``--protocol reference``):
the resolved config, every epoch's report, the final (test) metrics and the per-user test table (what the
paired significance tests read). A trial still running at ``--deadline`` is stopped and its file keeps the
epochs it finished, marked ``"finished": false``.

    python benchmarks/evidence/gpu_full_protocol.py --data-dir ../shared/datasets --out /tmp/office-gpu \
        --seeds 0 --deadline 540
    # back here (ray, mlflow installed): the trial files as a study export, then the report
    python benchmarks/evidence/gpu_full_protocol.py --out /tmp/office-gpu --export office-full-gpu-seed0 \
        benchmarks/results/office-full-gpu-seed0
    python -m apao_ray report --exports benchmarks/results/office-full-gpu-seed0 --out /tmp/report
    # ten seeds of both losses as one fused cohort (training/cohort.py) in one process
    python benchmarks/evidence/gpu_full_protocol.py --data-dir .gpu/datasets --out /tmp/office-gpu \
        --seeds 3,4,5,6,7,8,9,10,11,12 --cohort 10 --deadline 540
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def train_args(loss: str, seed: int, args: argparse.Namespace) -> list[str]:
    """``apao train`` flags of one trial: the loss's paper Table 5 knobs for the backbone and dataset (what
    office_full.sh's sweep gives its one trial per loss with ``--num-samples 1``)."""
    from apao_ray.losses import LOSSES

    knobs = LOSSES[loss].paper_point(args.backbone, args.dataset)
    return ["--dataset", args.dataset, "--data-dir", args.data_dir, "--backbone", args.backbone, "--loss", loss,
            *(item for knob, value in knobs.items() for item in ("--knob", f"{knob}={value}")),
            "--protocol", args.protocol, "--epochs", "200", "--patience", "20",
            "--seed", str(seed), "--batch-size", str(args.batch_size),
            *(["--use-gpu"] if args.device == "cuda" else []), *args.train_flags.split()]


def trial_name(loss: str, seed: int, backbone: str, protocol: str) -> str:
    """``<loss>-seed<seed>``, after the backbone when it is not TIGER and the protocol when it is not ``paper``
    (the 2026-11-26 H200 run's files are TIGER's under ``paper``)."""
    return "-".join([*([backbone] if backbone != "tiger" else []), *([protocol] if protocol != "paper" else []),
                     loss, f"seed{seed}"])


def member(loss: str, seed: int, args: argparse.Namespace) -> tuple[Any, Any]:
    """One trial's config (``apao train``'s own parser) and hooks (checkpoints under ``--work/<trial name>``)."""
    from apao_ray.study.cli.train import build_parser, trial_config_from_args
    from apao_ray.training.hooks import TrainingHooks

    config = trial_config_from_args(build_parser("apao train").parse_args(train_args(loss, seed, args)))
    return config, TrainingHooks(Path(args.work) / trial_name(loss, seed, args.backbone, args.protocol),
                                 device=args.device, verbose=True)


def write_result(loss: str, seed: int, config: Any, hooks: Any, final: dict, args: argparse.Namespace) -> None:
    """The trial's JSON file in ``--out``: config, epochs, final metrics, per-user test and validation tables."""
    import gzip

    from apao_ray.names import PER_USER_FILE, PER_USER_VALID_FILE

    work = hooks.output_dir
    per_user = sorted(work.glob(f"checkpoints/*_final/{PER_USER_FILE}"))
    per_user_valid = sorted(work.glob(f"checkpoints/*_final/{PER_USER_VALID_FILE}"))
    result = {"loss": loss, "seed": seed, "finished": True, "config": config.to_dict(), "final": final,
              "epochs": [r for r in hooks.reports if not r.get("done")],
              "per_user_test_csv": gzip.decompress(per_user[0].read_bytes()).decode() if per_user else None,
              "per_user_valid_csv": gzip.decompress(per_user_valid[0].read_bytes()).decode() if per_user_valid else None}
    (Path(args.out) / f"{trial_name(loss, seed, args.backbone, args.protocol)}.json").write_text(json.dumps(result))


def one(loss: str, seed: int, args: argparse.Namespace) -> None:
    """One trial alone (what each trial's subprocess runs)."""
    import torch

    from apao_ray.training.loop import run_trial

    torch.set_num_threads(args.threads)
    config, hooks = member(loss, seed, args)
    write_result(loss, seed, config, hooks, run_trial(config, hooks), args)


def cohort(trials: list[tuple[str, int]], args: argparse.Namespace) -> None:
    """Every (loss, seed) of ``trials`` trained as one fused cohort (training/cohort.py), in this process."""
    import torch

    from apao_ray.training.cohort import run_cohort

    torch.set_num_threads(args.threads)
    members = [member(loss, seed, args) for loss, seed in trials]
    finals = run_cohort([config for config, _ in members], [hooks for _, hooks in members])
    for (loss, seed), (config, hooks), final in zip(trials, members, finals):
        write_result(loss, seed, config, hooks, final, args)


def partial(name: str, loss: str, seed: int, args: argparse.Namespace) -> None:
    """A stopped trial's file: the epochs it reported (hooks' metrics.jsonl), marked unfinished."""
    from apao_ray.names import REPORTS_FILE

    reports = Path(args.work) / name / REPORTS_FILE
    epochs = [json.loads(line) for line in reports.read_text().splitlines()] if reports.exists() else []
    (Path(args.out) / f"{name}.json").write_text(json.dumps({"loss": loss, "seed": seed, "finished": False,
                                                              "epochs": epochs}))


def trial_files(folder: Path) -> list[dict]:
    """The trials' JSON files in ``folder`` (``*.json``, or ``*.json.gz`` as committed), sorted by name."""
    import gzip

    files = sorted(folder.glob("*.json")) + sorted(folder.glob("*.json.gz"))
    return [json.loads(gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_text()) for f in files]


def write_export(folder: Path, study: str, to_dir: Path, args: argparse.Namespace) -> None:
    """The trials of ``folder`` as a study export (``apao_ray.analysis.export``'s layout), so that
    ``python -m apao_ray report --exports <to_dir>`` reads them as it reads a sweep's: params and tags as the
    sweep's MLflow runs carry them, per-epoch metrics, the final (test) metrics and the per-user test table of
    finished trials; a trial stopped at the deadline is KILLED with its epochs and best validation so far."""
    import csv
    import gzip
    import time

    from apao_ray.analysis.export import EPOCHS_FILE, FORMAT_VERSION, PER_USER_DIR, PER_USER_VALID_DIR, STUDY_FILE
    from apao_ray.config import TrialConfig
    from apao_ray.protocol import run_tags
    from apao_ray.study.cli.train import build_parser, trial_config_from_args
    from apao_ray.losses import LOSSES
    from apao_ray.tracking import flatten

    (to_dir / PER_USER_DIR).mkdir(parents=True, exist_ok=True)
    trials, rows = [], []
    for trial in trial_files(folder):
        loss, seed = trial["loss"], trial["seed"]
        if trial.get("config"):  # a finished trial's file has its resolved config
            config = TrialConfig.from_dict(trial["config"])
        else:  # a stopped one's is rebuilt from this script's flags for it
            config = trial_config_from_args(build_parser("apao train").parse_args(train_args(loss, seed, args)))
        backbone = config.model.backbone
        run_id = f"gpu-{backbone}-{config.protocol.name}-{loss}-seed{seed}"
        epochs = trial["epochs"]
        best = max(epochs, key=lambda e: e.get("val/ndcg_at_10", -1.0)) if epochs else {}
        metrics = {k: v for k, v in (epochs[-1] if epochs else {}).items() if isinstance(v, (int, float))}
        metrics.update({"best/epoch": best.get("epoch", 0), "best/val/ndcg_at_10": best.get("val/ndcg_at_10", 0.0)})
        metrics.update({k: v for k, v in (trial.get("final") or {}).items() if isinstance(v, (int, float))})
        knobs = LOSSES[loss].paper_point(backbone, config.data.dataset)
        record = {"run_id": run_id, "name": f"{backbone}/{loss} seed={seed}",
                  "status": "FINISHED" if trial["finished"] else "KILLED", "start_time": None, "end_time": None,
                  "tags": {"backbone": backbone, "loss": loss, "apao.study": study, "apao.seed": str(seed),
                           "apao.precision": str(best.get("precision", "")), **run_tags(config),
                           "apao.outcome": "finished" if trial["finished"] else "stopped at its --deadline"},
                  "params": {"backbone": backbone, "loss": loss, **{k: str(v) for k, v in knobs.items()},
                             **{k: str(v) for k, v in flatten({"base": config.to_dict()}).items()}},
                  "metrics": dict(sorted(metrics.items())), "per_user": None,
                  "per_user_source": "none: the trial did not finish"}
        if trial.get("per_user_test_csv"):
            (to_dir / PER_USER_DIR / f"{run_id}.csv.gz").write_bytes(gzip.compress(trial["per_user_test_csv"].encode()))
            record["per_user"], record["per_user_source"] = f"{PER_USER_DIR}/{run_id}.csv.gz", "logged by the trial"
        if trial.get("per_user_valid_csv"):
            (to_dir / PER_USER_VALID_DIR).mkdir(parents=True, exist_ok=True)
            (to_dir / PER_USER_VALID_DIR / f"{run_id}.csv.gz").write_bytes(gzip.compress(trial["per_user_valid_csv"].encode()))
            record["per_user_valid"] = f"{PER_USER_VALID_DIR}/{run_id}.csv.gz"
        trials.append(record)
        rows += [(run_id, key, e["epoch"], value) for e in epochs for key, value in e.items()
                 if key != "epoch" and isinstance(value, (int, float))]
    parent = {"run_id": f"gpu-{study}", "name": f"study {study}", "status": "FINISHED", "start_time": None,
              "end_time": None, "params": {}, "metrics": {},
              "tags": {"apao.study": study, "apao.role": "study",
                       "command_line": f"benchmarks/evidence/gpu_full_protocol.py --backbone {args.backbone} --protocol "
                                       f"{args.protocol} --losses {args.losses} --seeds {args.seeds} (one GPU, run_trial, "
                                       "no Ray)"}}
    (to_dir / STUDY_FILE).write_text(json.dumps({
        "format_version": FORMAT_VERSION, "study": study, "experiment": f"apao-{args.dataset}", "tracking_uri": f"files in {folder}",
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "parents": [parent], "trials": trials},
        indent=1) + "\n")
    with gzip.open(to_dir / EPOCHS_FILE, "wt", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run_id", "key", "step", "value"])
        writer.writerows((run_id, key, step, f"{value:.7g}") for run_id, key, step, value in rows)
    print(f"{len(trials)} trials of {folder} exported as study {study!r} to {to_dir}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="office", help="(default %(default)s; synthetic tries the script)")
    parser.add_argument("--data-dir", default=os.environ.get("APAO_DATA_DIR", str(ROOT.parent / "shared" / "datasets")))
    parser.add_argument("--out", required=True, help="folder for one JSON file per trial")
    parser.add_argument("--backbone", default="tiger", choices=("tiger", "llama"), help="(default %(default)s)")
    parser.add_argument("--protocol", default="paper", choices=("paper", "reference"),
                        help="the paper's setting or the released code's (default %(default)s)")
    parser.add_argument("--losses", default="ce,apao_pointwise", help="comma list (default %(default)s)")
    parser.add_argument("--seeds", default="0", help="comma list, all at once (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=1024,
                        help="micro-batch (default %(default)s: the fastest on an H200, benchmarks/bench_gpu.py)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per trial (default %(default)s)")
    parser.add_argument("--deadline", type=float, default=None, help="seconds; trials still running are stopped")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the script (default %(default)s)")
    parser.add_argument("--train-flags", default="", help="more `apao train` flags, e.g. to try the script")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "apao-gpu-full"),
                        help="trials' checkpoints (default %(default)s)")
    parser.add_argument("--export", nargs=2, metavar=("STUDY", "DIR"),
                        help="train nothing: write the trial files in --out as a study export named STUDY in DIR "
                             "(e.g. benchmarks/results/STUDY), which `python -m apao_ray report --exports` reads")
    parser.add_argument("--cohort", type=int, default=0, metavar="K",
                        help="train the (loss, seed) trials as fused cohorts of up to K members (training/cohort.py), "
                             "one process per cohort, all at once (default 0: one process per trial); a member "
                             "needs about a trial's GPU memory (benchmarks/bench_cohort.py's GiB column)")
    parser.add_argument("--one", nargs=2, metavar=("LOSS", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--cohort-members", help=argparse.SUPPRESS)  # loss:seed,... of the cohort's process
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.export:
        write_export(Path(args.out), args.export[0], Path(args.export[1]), args)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.one:
        one(args.one[0], int(args.one[1]), args)
        return 0
    if args.cohort_members:
        cohort([(item.split(":")[0], int(item.split(":")[1])) for item in args.cohort_members.split(",")], args)
        return 0
    started = time.perf_counter()
    trials = [(loss, int(seed)) for loss in args.losses.split(",") for seed in args.seeds.split(",")]
    common = ["--out", args.out, "--work", args.work, "--dataset", args.dataset, "--data-dir", args.data_dir,
              "--backbone", args.backbone, "--protocol", args.protocol, "--batch-size", str(args.batch_size),
              "--threads", str(args.threads), "--device", args.device, f"--train-flags={args.train_flags}"]
    # each job: its trials (name, loss, seed), its process, its log; one job per trial, or one per cohort
    size = max(1, args.cohort)
    groups = [trials[first:first + size] for first in range(0, len(trials), size)]
    jobs = []
    for number, group in enumerate(groups):
        names = [(trial_name(loss, seed, args.backbone, args.protocol), loss, seed) for loss, seed in group]
        log_path = Path(args.work, f"cohort{number}.log" if args.cohort else f"{names[0][0]}/trial.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "w")
        what = (["--cohort-members", ",".join(f"{loss}:{seed}" for loss, seed in group)] if args.cohort
                else ["--one", group[0][0], str(group[0][1])])
        jobs.append((names, subprocess.Popen([sys.executable, __file__, *what, *common], stdout=log,
                                             stderr=subprocess.STDOUT), log, log_path))
    while any(job[1].poll() is None for job in jobs):
        if args.deadline and time.perf_counter() - started > args.deadline:
            for job in jobs:
                if job[1].poll() is None:
                    job[1].terminate()
            break
        time.sleep(5)
    with open(Path(args.out) / "trials.log", "w") as combined:
        for names, process, log, log_path in jobs:
            process.wait()
            log.close()
            for name, loss, seed in names:
                if not (Path(args.out) / f"{name}.json").exists():
                    partial(name, loss, seed, args)
            line = f"{', '.join(name for name, _, _ in names)}: exit {process.returncode} after " \
                   f"{time.perf_counter() - started:.0f} s"
            print(line, flush=True)
            combined.write(f"===== {line}\n" + log_path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
