"""Proves on CPU that the wheel set of ``wheelset.py`` is complete: the GPU runner (``study.sh --smoke``) installs
it with no index into a fresh venv beside a stand-in for the GPU machine's Python, and a smoke study runs on it.

The stand-in: a clean venv (``python -m venv``) holding only torch 2.13.0 (the local CPU wheel, its needs from
the index) and ``.gpu/standin-cpXY`` (the scientific stack the GPU image holds, installed with no index). The
runner then does exactly what it does on the GPU machine: a venv that sees the stand-in's site-packages, the
copied wheels installed with ``--no-index``, ``apao sweep --smoke`` (Ray + Optuna + MLflow on SQLite),
``export-study``. Any package missing from the set fails the install or the study.

    python benchmarks/gpu/wheelset.py                       # builds .gpu/wheels-cp311 and .gpu/standin-cp311
    flock /tmp/apao-heavy.lock python benchmarks/gpu/check_wheelset.py \\
        --json-out benchmarks/results/wheelset_check_cp311.json
    # the GPU machine's Python, where no CPU torch wheel is at hand: the install and Ray/MLflow/Optuna only
    python benchmarks/gpu/wheelset.py --python-version 3.12
    python benchmarks/gpu/check_wheelset.py --python python3.12 --install-only \\
        --json-out benchmarks/results/wheelset_check_cp312.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_DIR = ROOT / ".gpu"
TORCH = os.environ.get("APAO_TORCH", "torch==2.13.0")  # as ./apao installs it: the cached CPU wheel


def run(command: list[str], **kwargs) -> float:
    start = time.time()
    subprocess.run(command, check=True, **kwargs)
    return time.time() - start


def smoke_study(out: Path, scratch: Path) -> dict:
    """The smoke study's record from the runner's export: trials, and those that reached their test."""
    with tarfile.open(out / "export.tar.gz") as archive:
        archive.extractall(scratch, filter="data")
    trials = json.loads((scratch / "export" / "study.json").read_text())["trials"]
    tested = [t for t in trials if any(key.startswith("test/") for key in t.get("metrics", {}))]
    return {"trials": len(trials), "trials_with_test_metrics": len(tested)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable,
                        help="the Python whose wheel set is checked (default: this one)")
    parser.add_argument("--install-only", action="store_true",
                        help="no torch (none for this Python here): the stand-in gets what torch brings instead, "
                             "and the runner checks Ray, MLflow and Optuna without a study (study.sh --install-only)")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary folder (venvs, runner output; kept anyway when the check fails)")
    args = parser.parse_args()
    version = subprocess.run([args.python, "-c", "import sys; print(sys.version.split()[0])"], check=True,
                             capture_output=True, text=True).stdout.strip()
    tag = "cp" + "".join(version.split(".")[:2])
    wheels, standin = GPU_DIR / f"wheels-{tag}", GPU_DIR / f"standin-{tag}"
    if not wheels.is_dir() or not standin.is_dir():
        sys.exit(f"no {wheels} or {standin}: run python benchmarks/gpu/wheelset.py --python-version "
                 f"{'.'.join(version.split('.')[:2])} first")
    manifest = json.loads((wheels / "manifest.json").read_text())
    scratch = Path(tempfile.mkdtemp(prefix="apao-wheelset-check."))
    base, out = scratch / "base", scratch / "out"
    timings = {"stand-in venv: python -m venv": run([args.python, "-m", "venv", str(base)])}
    pip = [str(base / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    torch = manifest["skipped_torch_brings"] if args.install_only else [TORCH]
    timings[f"stand-in: pip install {' '.join(torch)}"] = run([*pip, *torch])
    no_config = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""}
    timings["stand-in: the image's stack, --no-index"] = run(
        [*pip, "--no-index", "--find-links", str(standin), *map(str, sorted(standin.glob("*.whl")))], env=no_config)
    runner_env = {**os.environ, "PYTHON": str(base / "bin" / "python"), "OUT": str(out)}
    for key in ("PYTHONPATH", "VIRTUAL_ENV"):  # nothing of this checkout's .venv may leak into the runner
        runner_env.pop(key, None)
    mode = "--install-only" if args.install_only else "--smoke"
    start = time.time()
    runner = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "study.sh"), mode], env=runner_env)
    timings[f"runner (study.sh {mode}): all"] = time.time() - start
    summary = json.loads((out / "summary.json").read_text())
    timings["runner: wheel set install (--no-index)"] = summary["install_s"]
    if not args.install_only:
        timings["runner: smoke study (sweep)"] = summary["study_s"]
    versions = re.search(r"^ray .*$", (out / "runner.log").read_text(), re.MULTILINE)
    study = {} if args.install_only or runner.returncode else smoke_study(out, scratch)
    result = {"python": version, "machine": os.uname().machine, "mode": mode, "stand_in_torch": torch,
              "wheel_set_bytes": manifest["total_bytes"], "wheels": len(manifest["wheels"]),
              "standin": manifest["standin"], "runner_rc": runner.returncode, "summary": summary,
              "versions": versions.group(0) if versions else None, **study,
              "seconds": {k: round(v, 1) for k, v in timings.items()}}
    print(f"{'step':<52} {'s':>7}")
    for name, seconds in timings.items():
        print(f"{name:<52} {seconds:7.1f}")
    print(f"Python {version}: wheel set {manifest['total_bytes'] / 2**20:.1f} MiB, {len(manifest['wheels'])} wheels; "
          f"{result['versions']}; runner exit {runner.returncode}")
    if study:
        print(f"smoke study: {study['trials']} trials exported, {study['trials_with_test_metrics']} with test metrics")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    if runner.returncode or (not args.install_only and not study["trials_with_test_metrics"]):
        sys.exit(f"the check failed: runner exit {runner.returncode}; its log: {out / 'runner.log'}")
    if not args.keep:
        shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
