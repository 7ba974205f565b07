"""``python -m apao_ray data stats``: as a real subprocess, and in-process for the table output."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from apao_ray import paths
from apao_ray.cli import commands as cli
from apao_ray.data import files
from conftest import closed_port
from datasets_helpers import SHARED_DATASETS, has_shared, needs_shared

REPO = Path(__file__).parents[1]


def start_cli(workdir: Path, *args: str) -> subprocess.Popen:
    """Starts ``python -m apao_ray ARGS`` with a private cache, no $APAO_DATA_DIR, no reachable mirror."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items() if key != paths.DATA_DIR_ENV}
    env.update(XDG_CACHE_HOME=str(workdir / "cache"), PYTHONPATH=os.pathsep.join(filter(None, [
        str(REPO), os.environ.get("PYTHONPATH")])), **{files.DATA_URL_ENV: f"http://127.0.0.1:{closed_port()}"})
    return subprocess.Popen([sys.executable, "-m", "apao_ray", *args], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# Started when this module is collected, not when its tests run: each child spends seconds
# importing torch, and this way that overlaps the other test files instead of adding to them.
_CLI_TMP = tempfile.TemporaryDirectory(prefix="apao-cli-test-")  # removed at interpreter exit
_CLI_PROCESSES = {"unknown": start_cli(Path(_CLI_TMP.name) / "unknown", "data", "stats", "--dataset", "nosuchdataset")}
if has_shared():
    _CLI_PROCESSES["office"] = start_cli(Path(_CLI_TMP.name) / "office", "data", "stats", "--dataset", "office",
                                         "--data-dir", str(SHARED_DATASETS), "--json")


@pytest.fixture(scope="module")
def cli_runs():
    results = {}
    for name, process in _CLI_PROCESSES.items():
        stdout, stderr = process.communicate(timeout=120)
        results[name] = (process.returncode, stdout, stderr, Path(_CLI_TMP.name) / name)
    yield results
    _CLI_TMP.cleanup()


@needs_shared
def test_stats_json_for_office(cli_runs):
    returncode, stdout, stderr, workdir = cli_runs["office"]
    assert returncode == 0, stderr
    stats = json.loads(stdout)
    assert stats["dataset"] == "office"
    assert (stats["users"], stats["items"], stats["interactions"]) == (4905, 2420, 53258)
    assert stats["distinct_semantic_ids"] == 2415 and stats["train_samples"] == 38543
    assert (stats["colliding_semantic_ids"], stats["items_in_collisions"]) == (5, 10)
    assert stats["codes_per_level"] == [256, 256, 256, 256]
    assert not (workdir / "cache").exists()


def test_unknown_dataset_exits_2_with_one_line(cli_runs):
    returncode, stdout, stderr, workdir = cli_runs["unknown"]
    assert returncode == 2
    assert "Traceback" not in stderr and stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown dataset 'nosuchdataset'")
    for known in ["beauty", "grocery", "office", "synthetic", "yelp"]:
        assert known in lines[0]
    assert not (workdir / "cache").exists()


@pytest.mark.parametrize("name", ["../x", "a/b", "/etc"])
def test_escaping_name_exits_2_with_one_line(isolated, capsys, name):
    # with --data-dir a name must stay inside it; without, a path is a dataset directory and a
    # missing or empty one is the error
    assert cli.main(["data", "stats", "--dataset", name, "--data-dir", str(isolated)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1
    assert lines[0].startswith(f"error: dataset name {name!r} must be a plain name")
    assert cli.main(["data", "stats", "--dataset", name]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and ("does not exist" in lines[0] or "holds no interaction files" in lines[0])


def test_download_failure_exits_2_and_says_how_to_work_offline(isolated, capsys):
    assert cli.main(["data", "stats", "--dataset", "office"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "could not download" in lines[0] and "APAO_DATA_DIR" in lines[0]
    assert [p for p in (isolated / "cache").rglob("*") if p.is_file()] == []


def test_table_output_in_process(isolated, capsys):
    assert cli.main(["data", "stats", "--dataset", "Synthetic", "--max-history", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "dataset synthetic"
    rows = {line[:26].strip(): line[26:].strip() for line in out[1:]}
    assert rows["users"] == "600" and rows["items"] == "400"
    assert int(rows["train samples"].replace(",", "")) == int(rows["interactions"].replace(",", "")) - 3 * 600
    assert set(rows) == {key.replace("_", " ") for key in cli._ORDER}


def test_missing_arguments_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["data", "stats"])
    assert info.value.code == 2
    assert "--dataset" in capsys.readouterr().err
