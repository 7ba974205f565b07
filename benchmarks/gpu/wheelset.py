"""The wheel set that lets a study (Ray + Optuna + MLflow) run on a GPU machine that reaches no package registry.

That machine has Python and a CUDA torch but no Ray, MLflow or Optuna; what it gets is a copy of this checkout
with the wheel set and the datasets beside it, kept within 64 MiB in all (``COPY_LIMIT_BYTES``).
This script writes, under the git-ignored ``.gpu/`` folder:

    .gpu/wheels-cp312/   the wheels to copy: Ray (without its Java jars and web client, its ELF files
                         stripped, RECORD rewritten), Optuna, mlflow-skinny + what its SQLite store needs and
                         what they all need, less torch and what torch brings, less the scientific stack the
                         GPU image already holds (``PREINSTALLED``); manifest.json lists every wheel's size
    .gpu/standin-cp312/  that scientific stack, not copied: the CPU check (check_wheelset.py) installs it
                         first, as a stand-in for the GPU image
    .gpu/datasets/       the datasets to copy (interactions + semantic IDs, the item texts left out)

    python benchmarks/gpu/wheelset.py --python-version 3.12 --datasets office   # the GPU machine's
    python benchmarks/gpu/wheelset.py --python-version 3.11                     # this machine's check

Versions are those the test suite passed with (constraints.txt, and ``STORE_PINS``); pip resolves the rest for the
target Python. See docs/gpu.md for the steps on the GPU machine and the sizes.
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_DIR = ROOT / ".gpu"  # git-ignored (.gitignore): copied to the GPU machine beside the checkout, never committed
MIB = 1024 * 1024
COPY_LIMIT_BYTES = 64 * MIB  # the budget for what is copied to the GPU machine: working tree, wheel set, datasets

# ray[tune,train] without [default]: a study starts its local Ray without the dashboard (study/cluster/ray_cluster.py), the
# only user of [default]'s State API; apao train keeps it and is not what study.sh runs
REQUIREMENTS = ["ray[tune,train]", "optuna", "mlflow-skinny",
                # skinny declares no store: the SQLite store needs SQLAlchemy and Alembic, and imports cryptography
                # (mlflow/store/model_registry/dbmodels/models.py: Fernet), found by the CPU check
                "sqlalchemy", "alembic", "cryptography"]
TESTED = ROOT / "constraints.txt"  # the versions the suite passed with: ray, optuna, mlflow-skinny, numpy, ...
# the store's packages at the versions the suite's environment resolved (constraints.txt does not name them)
STORE_PINS = ["sqlalchemy==2.1.9", "alembic==1.20.1", "cryptography==50.0.2"]
# Size, not need: SQLAlchemy's pure-Python wheel is 2.0 MB against 4.5 MB for its compiled one, and a study
# writes a few rows a second
PURE_PYTHON = ["sqlalchemy"]
# What the GPU machine's image holds (its package list, read 2026-11-17), too big to copy (pyarrow alone
# is ~40 MB) and imported by the product: assumed there, with whatever they need
PREINSTALLED = ["numpy", "pandas", "pyarrow", "scipy", "scikit-learn", "matplotlib"]
# the platforms of manylinux wheels that glibc >= 2.28 runs (this machine: 2.36; the GPU image: newer)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
# Dead weight in the Ray wheel for a Python study: the Java worker's jar (32 MB of 79) and the dashboard's web
# client (2.5 MB; without [default] the dashboard does not start, and the study starts Ray without it)
RAY_DROPPED = ("ray/jars/", "ray/dashboard/client/build/")
DATASET_FILES = ("{name}.inter.json", "{name}.index.rq-kmeans.json")  # the item texts are only for tokenize


def normalize(name: str) -> str:
    """PEP 503 name: ``PyYAML`` and ``pyyaml``, ``typing_extensions`` and ``typing-extensions`` are one."""
    return re.sub(r"[-_.]+", "-", name).lower()


def torch_brings() -> set[str]:
    """torch and every distribution its installed metadata requires, transitively (the GPU machine's torch
    brings the same names, plus CUDA ones no package here asks for)."""
    from packaging.requirements import Requirement

    seen, todo = set(), ["torch"]
    while todo:
        name = normalize(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def pip_target(python_version: str) -> list[str]:
    return ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            *(flag for platform in PLATFORMS for flag in ("--platform", platform))]


def resolve(requirements: list[str], python_version: str, constraints: list[str]) -> dict[str, str]:
    """{normalized name: version} of everything pip would install for ``requirements`` on the target Python
    (``pip install --dry-run --report``: metadata only, no wheel downloaded)."""
    with tempfile.TemporaryDirectory() as scratch:
        report, constraint_file = Path(scratch) / "report.json", Path(scratch) / "constraints.txt"
        constraint_file.write_text("".join(line + "\n" for line in constraints))
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--report", str(report), *pip_target(python_version), "--constraint", str(constraint_file),
                   *requirements]
        subprocess.run(command, check=True)
        items = json.loads(report.read_text())["install"]
    return {normalize(item["metadata"]["name"]): item["metadata"]["version"] for item in items}


def download(pins: dict[str, str], python_version: str, destination: Path) -> None:
    """The wheels of exactly ``pins`` for the target Python; those named in PURE_PYTHON as py3-none-any."""
    destination.mkdir(parents=True, exist_ok=True)
    pure = {name: version for name, version in pins.items() if name in PURE_PYTHON}
    for group, target in ((pins.keys() - pure.keys(), pip_target(python_version)),
                          (pure.keys(), ["--only-binary=:all:", "--python-version", python_version,
                                         "--implementation", "py", "--abi", "none", "--platform", "any"])):
        if group:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest",
                            str(destination), *target, *(f"{name}=={pins[name]}" for name in sorted(group))],
                           check=True)


# the wheel's own RECORD, at the top: Ray vendors packages with dist-info folders (and RECORDs) of their own
RECORD_PATH = re.compile(r"[^/]+\.dist-info/RECORD")


def record_hash(data: bytes) -> str:
    """A RECORD entry's hash: ``sha256=`` + urlsafe base64 without padding (the wheel spec, PEP 376)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def strip_symbols(data: bytes) -> bytes:
    """An ELF file without its static symbol table (``strip --strip-unneeded``, as Debian's packaging does):
    the loader reads only the dynamic symbols, so the program runs the same; a crash's backtrace loses names.
    Ray's gcs_server, raylet and _raylet.so carry ~12 MB of .symtab/.strtab each, and no debug sections."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "elf"
        path.write_bytes(data)
        subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
        return path.read_bytes()


def rebuild(wheel: Path, drop: tuple[str, ...], strip: bool = False) -> dict[str, int]:
    """Rewrites ``wheel`` in place without the files under the prefixes ``drop`` and, with ``strip``, its ELF
    files stripped, with a RECORD whose every hash and size is recomputed from what the new wheel holds. Modes
    (the raylet's executable bit) and dates are kept.

    Returns:
        {"files_dropped", "bytes_dropped", "bytes_stripped" (uncompressed), "bytes_before", "bytes_after"
        (the wheel's size)}.
    """
    if strip and shutil.which("strip") is None:
        raise RuntimeError("strip (binutils) is not on PATH: install it (apt-get install binutils)")
    counts = {"files_dropped": 0, "bytes_dropped": 0, "bytes_stripped": 0, "bytes_before": wheel.stat().st_size}
    scratch = wheel.with_suffix(".rebuild")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(scratch, "w", zipfile.ZIP_DEFLATED) as target:
        record_names = [name for name in source.namelist() if RECORD_PATH.fullmatch(name)]
        if len(record_names) != 1:
            raise ValueError(f"{wheel.name}: expected one <name>.dist-info/RECORD at the top, found {record_names}")
        rows = []
        for info in source.infolist():
            if info.filename == record_names[0] or info.is_dir():
                continue
            if info.filename.startswith(drop):
                counts["files_dropped"] += 1
                counts["bytes_dropped"] += info.file_size
                continue
            data = source.read(info)
            if strip and data.startswith(b"\x7fELF"):
                data = strip_symbols(data)
                counts["bytes_stripped"] += info.file_size - len(data)
            copy = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            copy.external_attr, copy.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            target.writestr(copy, data, compresslevel=9)
            rows.append([info.filename, record_hash(data), str(len(data))])
        rows.append([record_names[0], "", ""])  # RECORD lists itself without a hash
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        record_info = zipfile.ZipInfo(record_names[0], date_time=source.getinfo(record_names[0]).date_time)
        record_info.external_attr, record_info.compress_type = 0o644 << 16, zipfile.ZIP_DEFLATED
        target.writestr(record_info, text.getvalue())
    scratch.replace(wheel)
    return {**counts, "bytes_after": wheel.stat().st_size}


def verify_record(wheel: Path) -> list[str]:
    """Problems of ``wheel``'s RECORD against its contents: a file missing from it, a listed file absent, a hash
    or size that does not match. Empty when the RECORD is exact."""
    with zipfile.ZipFile(wheel) as archive:
        record_name = next(name for name in archive.namelist() if RECORD_PATH.fullmatch(name))
        listed = {row[0]: row[1:] for row in csv.reader(io.StringIO(archive.read(record_name).decode())) if row}
        problems = []
        for info in archive.infolist():
            if info.is_dir() or info.filename == record_name:
                continue
            entry = listed.pop(info.filename, None)
            data = archive.read(info)
            if entry is None:
                problems.append(f"{info.filename}: not in RECORD")
            elif entry != [record_hash(data), str(len(data))]:
                problems.append(f"{info.filename}: RECORD says {entry}, the file is {record_hash(data)}, {len(data)}")
        problems += [f"{name}: in RECORD, not in the wheel" for name in listed if name != record_name]
    return problems


def copy_datasets(names: list[str], data_dir: Path, destination: Path) -> list[Path]:
    """The datasets' interaction and semantic-ID files, as ``<destination>/<Name>/...`` (APAO_DATA_DIR's layout)."""
    copied = []
    for name in names:
        folder = next((p for p in data_dir.iterdir() if p.name.lower() == name.lower()), None)
        if folder is None:
            raise ValueError(f"dataset {name!r} not in {data_dir}; there: {sorted(p.name for p in data_dir.iterdir())}")
        (destination / folder.name).mkdir(parents=True, exist_ok=True)
        for pattern in DATASET_FILES:
            path = folder / pattern.format(name=folder.name)
            shutil.copyfile(path, destination / folder.name / path.name)
            copied.append(destination / folder.name / path.name)
    return copied


def tree_bytes() -> int:
    """The checkout's own files as a copy of it holds them: tracked files and untracked files git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def build(python_version: str, preinstalled: list[str]) -> dict:
    tag = "cp" + python_version.replace(".", "")
    wheels_dir, standin_dir = GPU_DIR / f"wheels-{tag}", GPU_DIR / f"standin-{tag}"
    for directory in (wheels_dir, standin_dir):
        shutil.rmtree(directory, ignore_errors=True)
    tested = [line.strip() for line in TESTED.read_text().splitlines() if line.strip() and not line.startswith("#")]
    everything = resolve(REQUIREMENTS + preinstalled, python_version, tested + STORE_PINS)
    # what the preinstalled packages need, at the versions of the whole resolution
    pinned = [f"{name}=={version}" for name, version in everything.items()]
    standin = resolve(preinstalled, python_version, pinned) if preinstalled else {}
    skipped = torch_brings()
    carried = {name: v for name, v in everything.items() if name not in standin and name not in skipped}
    download(carried, python_version, wheels_dir)
    if standin:
        download({name: v for name, v in standin.items() if name not in skipped}, python_version, standin_dir)
    ray_wheel = next(wheels_dir.glob("ray-*.whl"))
    rebuilt = rebuild(ray_wheel, RAY_DROPPED, strip=True)
    problems = verify_record(ray_wheel)
    if problems:
        raise RuntimeError(f"{ray_wheel.name}: RECORD does not match after the rebuild: {problems[:5]}")
    wheels = [{"file": path.name, "bytes": path.stat().st_size} for path in sorted(wheels_dir.glob("*.whl"))]
    manifest = {"python_version": python_version, "requirements": REQUIREMENTS, "pure_python": PURE_PYTHON,
                "preinstalled": preinstalled,
                "skipped_torch_brings": sorted(skipped & set(everything)), "ray_dropped": list(RAY_DROPPED),
                "ray_rebuild": rebuilt, "wheels": wheels, "total_bytes": sum(w["bytes"] for w in wheels),
                "standin": sorted(f"{name}=={version}" for name, version in standin.items())}
    (wheels_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                        help="the target machine's Python, X.Y (default: this one's; the GPU machine's: check "
                             "`python3 --version` there, 3.12.3 when last read)")
    parser.add_argument("--preinstalled", default=",".join(PREINSTALLED),
                        help="comma list of packages the target already holds, not copied (default %(default)s)")
    parser.add_argument("--datasets", default="", help="comma list copied into .gpu/datasets, e.g. office,grocery")
    parser.add_argument("--data-dir", type=Path,
                        default=Path(os.environ.get("APAO_DATA_DIR", ROOT.parent / "shared" / "datasets")))
    args = parser.parse_args()
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version {args.python_version!r}: expected X.Y, e.g. 3.12")
    manifest = build(args.python_version, [name for name in args.preinstalled.split(",") if name])
    datasets = GPU_DIR / "datasets"
    if args.datasets:
        shutil.rmtree(datasets, ignore_errors=True)
        copy_datasets(args.datasets.split(","), args.data_dir, datasets)
    rebuilt = manifest["ray_rebuild"]
    print(f"{'wheel':<78} {'MiB':>7}")
    for wheel in sorted(manifest["wheels"], key=lambda w: -w["bytes"]):
        print(f"{wheel['file']:<78} {wheel['bytes'] / MIB:7.2f}")
    tree, data = tree_bytes(), dir_bytes(datasets)
    total = manifest["total_bytes"] + tree + data
    print(f"ray rebuilt without {', '.join(RAY_DROPPED)} ({rebuilt['files_dropped']} files, "
          f"{rebuilt['bytes_dropped'] / MIB:.1f} MiB) and ELF symbol tables ({rebuilt['bytes_stripped'] / MIB:.1f} "
          f"MiB): {rebuilt['bytes_before'] / MIB:.1f} -> {rebuilt['bytes_after'] / MIB:.1f} MiB")
    print(f"wheel set {manifest['total_bytes'] / MIB:.1f} MiB ({len(manifest['wheels'])} wheels) + working tree "
          f"{tree / MIB:.1f} MiB + .gpu/datasets {data / MIB:.1f} MiB = {total / MIB:.1f} MiB of the "
          f"{COPY_LIMIT_BYTES / MIB:.0f} MiB copy budget")
    if total > COPY_LIMIT_BYTES:
        sys.exit(f"over the copy budget by {(total - COPY_LIMIT_BYTES) / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
