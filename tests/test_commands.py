"""One command line: every ``python -m apao_ray`` subcommand runs through ``./apao``, and every one refuses
bad input the same way (exit 2, one error line naming the bad value, no traceback, no file left behind:
in particular no empty ``mlflow.db`` from a failed MLflow read)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from apao_ray import cli
from conftest import ROOT, mlflow_sqlite


def registered_commands() -> list[str]:
    """Every subcommand cli/commands.py registers (pass-through and ``register(subparsers)`` ones)."""
    parser = cli.build_parser()
    commands = next(action for action in parser._actions if action.dest == "command")
    return sorted(commands.choices)


def test_every_registered_command_runs_through_the_apao_wrapper():
    if Path(sys.executable).resolve() != (ROOT / ".venv" / "bin" / "python").resolve() and \
            Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"./apao runs {ROOT / '.venv'}, which is not this interpreter ({sys.executable})")
    names = registered_commands()
    assert {"sweep", "train", "best", "data", "serve", "export", "report", "export-study", "tokenize"} <= set(names)
    # all at once: each child spends a second or more importing
    processes = {name: subprocess.Popen([str(ROOT / "apao"), name, "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True) for name in names}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, f"./apao {name} --help: {stderr[-2000:]}"
        assert f"apao_ray {name}" in stdout.split("\n", 2)[0] + stdout.split("\n", 2)[1], stdout[:300]
        if name == "best":  # best reads every seed a study ran; a --seeds flag there would do nothing
            assert "[--seeds" not in stdout and not re.search(r"^\s+--seeds", stdout, re.M), stdout
    unknown = subprocess.run([str(ROOT / "apao"), "no-such-command"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert unknown.returncode == 2 and "'no-such-command'" in unknown.stderr and "export-study" in unknown.stderr


# (argv, what the error line must name); "{store}" is an existing, empty MLflow store
BAD_INPUTS = [
    (["export", "--model", "/no/such/checkpoint", "--to", "out"], "'/no/such/checkpoint': no such directory"),
    (["export", "--model", "models:/ghost@best", "--to", "out"], "no MLflow database at"),
    (["export", "--model", "models:/ghost@best", "--to", "out", "--tracking-uri", "{store}"], "'models:/ghost@best' not found"),
    (["export", "--model", ".", "--to", "out", "--format", "onnx"], "--format 'onnx'"),
    (["export", "--model", "runs:/x/model", "--to", "out", "--tracking-uri", "ftp://host/db"], "'ftp://host/db' is not supported"),
    (["best", "--dataset", "office"], "no MLflow database at"),
    (["best", "--dataset", "nosuch", "--tracking-uri", "{store}"], "no experiment 'apao-nosuch'"),
    (["best", "--dataset", "office", "--format", "xml"], "invalid choice: 'xml'"),
    (["best", "--dataset", "office", "--seeds", "0,1"], "unrecognized arguments: --seeds 0,1"),
    (["report", "--exports", "/no/such/exports", "--out", "r"], "--exports /no/such/exports: no such directory"),
    (["report", "--study", "s1", "--out", "r"], "database"),
    (["report", "--exports", ".", "--out", "r", "--resamples", "0"], "--resamples: '0' must be an integer >= 1"),
    (["report", "--exports", ".", "--out", "r", "--trials", "some"], "invalid choice: 'some'"),
    (["serve", "models:/ghost@best"], "no MLflow database at"),
    (["serve", "models:/ghost@best", "--tracking-uri", "{store}"], "'models:/ghost@best' not found"),
    (["serve", "/no/such/model"], "'/no/such/model': no such directory"),
    (["serve", "models:/ghost@best", "--port", "70000"], "--port 70000"),
    (["serve", "models:/ghost@best", "--workers", "0"], "--workers: '0' must be an integer >= 1"),
    (["tokenize", "--dataset", "/no/such/data"], "/no/such/data does not exist"),
    (["tokenize", "--dataset", ".", "--levels", "0"], "--levels: '0' must be an integer >= 1"),
    (["tokenize", "--dataset", ".", "--codes", "x"], "--codes: 'x' is not an integer"),
    (["data", "stats", "--dataset", "nosuch"], "unknown dataset 'nosuch'"),
    (["data", "stats", "--dataset", "synthetic", "--max-history", "0"], "--max-history: '0' must be"),
    (["data", "frob"], "invalid choice: 'frob'"),
    (["export-study", "--study", "s1", "--to", "x"], "database"),
    (["export-study", "--study", "ghost", "--to", "x", "--tracking-uri", "{store}"], "no study 'ghost'"),
    (["export-study", "--study", "s1", "--to", "x", "--threads", "0"], "--threads: '0' must be an integer >= 1"),
    (["export-study", "--study", "s1", "--to", "x", "--tracking-uri", "http://127.0.0.1:9"], "is unreachable"),
    (["sweep", "--num-samples", "0"], "--num-samples: '0' must be an integer >= 1"),
    (["sweep", "--seed", "1", "--seeds", "0,1"], "--seed 1 and --seeds 0,1"),
    (["train", "--epochs", "-1"], "--epochs: '-1' must be"),
    (["train", "--loss", "nope"], "unknown loss 'nope'"),
    (["train", "--backbone", "gpt"], "invalid choice: 'gpt'"),
    (["train", "--smoke", "--select-by", "ndcg@10"], "select_by='ndcg@10' is not a validation metric"),
    (["sweep", "--backbones", "tiger,gpt"], "unknown backbone(s) ['gpt']; choose from ['tiger', 'llama']"),
    (["sweep", "--precision", "fp16"], "invalid choice: 'fp16'"),
    (["best", "--baseline", "cee"], "--baseline: 'cee' is not one of apao_pairwise, apao_pointwise"),
    (["best", "--metric", "ndcg@10"], "--metric: 'ndcg@10' is not a validation metric; choose from recall_at_5"),
    (["report", "--exports", ".", "--out", "r", "--baseline", "cee"], "--baseline: 'cee' is not one of apao_pairwise"),
]


@pytest.mark.parametrize("argv, named", BAD_INPUTS, ids=[" ".join(argv)[:60] for argv, _ in BAD_INPUTS])
def test_a_bad_input_is_one_error_line_exit_2_and_no_stray_file(argv, named, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("APAO_DATA_URL", "http://127.0.0.1:9")  # a dataset is never downloaded here
    store = mlflow_sqlite(tmp_path / "store") if "{store}" in argv else ""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = [arg.replace("{store}", store) for arg in argv]
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's refusals
        code = exit_.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert code == 2, captured.err
    assert "Traceback" not in captured.err and len(errors) == 1 and errors[0] == lines[-1], captured.err
    assert named in errors[0], errors[0]
    assert sorted(os.listdir(work)) == [], "a refused command left files behind"


def _registries() -> list[tuple[list[str], str, list[str]]]:
    """(command, flag, the names it accepts), each read from the registry or constant that defines them."""
    from apao_ray.config import FULL_SORT_TEST, PRECISIONS, PROTOCOL_NAMES, WEIGHTING_MODES, TrialConfig
    from apao_ray.data import known_dataset_names
    from apao_ray.losses import LOSSES
    from apao_ray.models import BACKBONES
    from apao_ray.protocol import selectable_metrics
    from apao_ray.reuse.export import FORMATS
    from apao_ray.analysis.results import TRIAL_CHOICES
    from apao_ray.study.spec.space import knob_names

    losses, metrics = sorted(LOSSES), selectable_metrics(TrialConfig())
    found = [(["best"], "--baseline", losses), (["report"], "--baseline", losses),
             (["best"], "--metric", [name for name in metrics if not name.startswith("loss")]),
             (["export"], "--format", list(FORMATS)), (["report"], "--trials", list(TRIAL_CHOICES)),
             (["data", "stats"], "--dataset", list(known_dataset_names()))]
    for command, one in (("sweep", False), ("train", True)):
        found += [([command], "--loss" if one else "--losses", losses),
                  ([command], "--backbone" if one else "--backbones", list(BACKBONES)),
                  ([command], "--knob", list(knob_names())), ([command], "--select-by", metrics),
                  ([command], "--dataset", list(known_dataset_names())), ([command], "--precision", list(PRECISIONS)),
                  ([command], "--full-sort-test", list(FULL_SORT_TEST)), ([command], "--protocol", list(PROTOCOL_NAMES)),
                  ([command], "--weighting", list(WEIGHTING_MODES))]
    return found


def _flag_help(command: list[str], flag: str, capsys) -> str:
    """The lines --help prints for ``flag`` of ``command``, joined (argparse wraps them)."""
    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    text = capsys.readouterr().out
    start = re.search(rf"^  {re.escape(flag)}[ ,=\n]", text, re.M)
    assert start, f"{' '.join(command)} --help has no {flag}"
    entry = text[start.start():]
    following = re.search(r"^  -", entry[3:], re.M)
    return " ".join(entry[:following.start() + 3 if following else None].split())


def test_every_flag_with_a_fixed_set_of_values_lists_them_in_its_help(capsys, monkeypatch):
    """A flag whose values come from a registry (losses, backbones, knobs, metrics, formats, ...) lists every name
    the registry holds now in its --help: a registry that grows without its flag's help fails here."""
    monkeypatch.setenv("COLUMNS", "100")
    registries = _registries()
    assert len(registries) >= 20
    for command, flag, names in registries:
        listed = _flag_help(command, flag, capsys)
        missing = [name for name in names if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", listed)]
        assert len(names) >= 1 and not missing, f"{' '.join(command)} {flag}: {missing} not in its help: {listed}"
