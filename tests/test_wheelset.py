"""benchmarks/gpu/wheelset.py: a wheel rebuilt without some files (Ray's Java jars) and with its ELF files
stripped has a RECORD that matches it exactly, keeps its files' modes, and pip installs it and the program in it
runs. (That the whole set is complete is benchmarks/gpu/check_wheelset.py's job: it needs the downloaded set.)"""
from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import shutil
import stat
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def wheelset():
    spec = importlib.util.spec_from_file_location("wheelset", ROOT / "benchmarks" / "gpu" / "wheelset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_wheel(path, files):
    """A wheel of ``files`` ({name: (bytes, mode)}) with an exact RECORD, as a build backend writes it."""
    rows = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, (data, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | mode) << 16  # pip sets exec bits on regular files only
            archive.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append([name, f"sha256={digest}", str(len(data))])
        rows.append(["toy-1.0.dist-info/RECORD", "", ""])
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        archive.writestr("toy-1.0.dist-info/RECORD", text.getvalue())


def toy_files():
    elf = shutil.which("true")
    return {
        "toy/__init__.py": (b"VALUE = 42\n", 0o644),
        "toy/jars/big.jar": (b"\0" * 100_000, 0o644),
        "toy/bin/true": (open(elf, "rb").read(), 0o755),  # an ELF executable: stripped, then run
        # a vendored package's own RECORD (Ray has a dozen): not the wheel's
        "toy/vendor/dep-2.0.dist-info/RECORD": (b"dep/__init__.py,,\n", 0o644),
        "toy/a,comma.txt": (b"csv quoting\n", 0o644),
        "toy-1.0.dist-info/METADATA": (b"Metadata-Version: 2.1\nName: toy\nVersion: 1.0\n", 0o644),
        "toy-1.0.dist-info/WHEEL": (b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    b"Tag: py3-none-any\n", 0o644),
    }


def test_rebuilt_wheel_has_an_exact_record_and_installs(tmp_path, wheelset):
    wheel = tmp_path / "toy-1.0-py3-none-any.whl"
    make_wheel(wheel, toy_files())
    assert wheelset.verify_record(wheel) == []

    counts = wheelset.rebuild(wheel, ("toy/jars/",), strip=True)

    assert counts["files_dropped"] == 1 and counts["bytes_dropped"] == 100_000
    assert counts["bytes_after"] < counts["bytes_before"]
    assert wheelset.verify_record(wheel) == []
    with zipfile.ZipFile(wheel) as archive:
        assert "toy/jars/big.jar" not in archive.namelist()
        record = archive.read("toy-1.0.dist-info/RECORD").decode()
        assert "toy/jars/big.jar" not in record and '"toy/a,comma.txt"' in record
        assert archive.getinfo("toy/bin/true").external_attr >> 16 & 0o777 == 0o755
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--no-compile", "--target", str(target), str(wheel)], check=True)
    assert (target / "toy" / "__init__.py").read_text() == "VALUE = 42\n"
    assert subprocess.run([str(target / "toy" / "bin" / "true")]).returncode == 0


def test_verify_record_names_a_file_that_does_not_match(tmp_path, wheelset):
    wheel = tmp_path / "toy-1.0-py3-none-any.whl"
    files = toy_files()
    make_wheel(wheel, files)
    # the jar's bytes changed after RECORD was written: what a rebuild that forgot RECORD would leave
    tampered = tmp_path / "tampered.whl"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(tampered, "w") as target:
        for info in source.infolist():
            target.writestr(info, b"other" if info.filename == "toy/jars/big.jar" else source.read(info))
        target.writestr("toy/extra.py", b"")

    problems = wheelset.verify_record(tampered)

    assert any(p.startswith("toy/jars/big.jar: RECORD says") for p in problems)
    assert "toy/extra.py: not in RECORD" in problems


def test_a_wheel_without_its_own_record_is_refused(tmp_path, wheelset):
    wheel = tmp_path / "bad-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("bad/__init__.py", b"")
        archive.writestr("bad/vendor/dep-2.0.dist-info/RECORD", b"")
    with pytest.raises(ValueError, match="expected one <name>.dist-info/RECORD at the top, found \\[\\]"):
        wheelset.rebuild(wheel, ("bad/jars/",))
