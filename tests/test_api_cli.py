"""The one CLI (python -m apao_ray ...): its subcommands and their help (the real defaults, no torch loaded),
--smoke yielding to flags written in any form, the command a study records, `best` on methods without a finished
trial, and the table of StudySpec fields every flag is built from (the Python API: test_api.py)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT


def test_smoke_settings_yield_to_options_written_in_any_form():
    from apao_ray.study.cli import sweep as cli_sweep

    parser = cli_sweep.build_parser()
    # long form, --x=v and an abbreviation argparse accepts all count as written; a default value written counts too
    argv = ["--smoke", "--epo", "7", "--patience=3", "--num-samples", "3"]
    given = cli_sweep.given_flags(parser, argv)
    assert given == {"smoke", "epochs", "patience", "num_samples"}
    args = parser.parse_args(argv)
    cli_sweep.apply_quick(args, given)
    assert (args.epochs, args.patience) == (7, 3)
    assert args.asha_grace_period == 8  # not written: --smoke's grace past the last epoch
    # a --knob range of the negatives is the one searched, not --smoke's (which would give it twice)
    knobbed = ["--smoke", "--losses", "ce,apao_pairwise", "--knob", "num_negatives=5:50"]
    args = parser.parse_args(knobbed)
    cli_sweep.apply_quick(args, cli_sweep.given_flags(parser, knobbed))
    assert args.negatives is None and cli_sweep.spec_from_args(args).search.range_named("num_negatives") == (5, 50)
    from apao_ray.study.spec.study import QUICK_SETTINGS, StudySpec

    quick = StudySpec.quick(losses=("ce", "apao_pairwise"), knob_ranges={"num_negatives": (5, 50)})
    assert quick.search.range_named("num_negatives") == (5, 50)
    plain = parser.parse_args(["--smoke"])
    cli_sweep.apply_quick(plain, cli_sweep.given_flags(parser, ["--smoke"]))
    assert plain.epochs == QUICK_SETTINGS["epochs"] and plain.patience == plain.epochs
    # --quick and StudySpec.quick are one definition: the same study from either route, written options kept
    for argv, changes in ((["--quick"], {}), (["--quick", "--epochs", "4", "--losses", "ce,apao_pairwise"],
                                                {"epochs": 4, "losses": ("ce", "apao_pairwise")})):
        args = parser.parse_args(argv)
        cli_sweep.apply_quick(args, cli_sweep.given_flags(parser, argv))
        assert cli_sweep.spec_from_args(args) == StudySpec.quick(**changes), argv


def test_the_recorded_command_is_the_one_a_user_types_again():
    from apao_ray.study.run.study import invocation

    assert invocation(["/x/apao_ray/__main__.py", "sweep", "--dataset", "office"]) == [
        "python", "-m", "apao_ray", "sweep", "--dataset", "office"]
    assert invocation(["studies/sweep.py", "--smoke"]) == ["studies/sweep.py", "--smoke"]


def test_help_texts_show_the_real_defaults():
    from apao_ray.study.cli import sweep as cli_sweep, train as cli_train

    def option_help(parser, flag):
        text = re.sub(r"\s+", " ", parser.format_help())
        return text[text.index(f"{flag} ", text.index("options:")) + len(flag):][:200]

    sweep, train = cli_sweep.build_parser(), cli_train.build_parser()
    assert "(default 20;" in option_help(sweep, "--epochs") and "(default 5;" in option_help(sweep, "--patience")
    assert "(default 200;" in option_help(train, "--epochs") and "(default 20;" in option_help(train, "--patience")
    assert "(default 3)" in option_help(sweep, "--num-samples")
    assert "deprecated: --budget SECONDS" in option_help(sweep, "--time-budget")
    assert "instead of reading ~/.cache/apao_ray/probes.json" in option_help(sweep, "--reprobe")


def test_reading_the_flags_of_best_and_report_does_not_load_torch():
    """`best` and `report` read MLflow or exports, no tensor: torch (~1 s to import) is loaded where a tensor is made,
    not by their flags. Their --baseline lists the loss registry (plugins included), which imports torch: that
    happens only when --help shows the list or --baseline is given; sweep's and train's flags list the losses
    whenever they are built."""
    code = ("import sys\nfrom apao_ray import cli\nfrom apao_ray.study.cli.sweep import build_best_parser\n"
            "loaded = []\ncli.build_parser().parse_args(['report', '--exports', 'x', '--out', 'y'])\n"
            "build_best_parser().parse_args(['--metric', 'ndcg_at_10', '--format', 'csv'])\n"
            "loaded.append('torch' in sys.modules)\n"
            "for command in ('best', 'report', 'sweep', 'train'):\n"
            "    try:\n        cli.main([command, '--help'])\n    except SystemExit:\n        pass\n"
            "    loaded.append('torch' in sys.modules)\nprint(loaded, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0 and result.stderr.strip().splitlines()[-1] == "[False, True, True, True, True]", \
        result.stderr


def test_one_cli_lists_and_delegates_its_subcommands(capsys):
    from apao_ray import cli

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("sweep", "train", "best", "data"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["sweep", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: python -m apao_ray sweep") and "--dry-run" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["sweep", "--budget", "soon"])
    assert exit_info.value.code == 2 and "argument --budget: budget 'soon' is not a duration" in capsys.readouterr().err


def test_best_prints_a_row_for_a_method_whose_trials_were_all_pruned_or_failed(tmp_path, capsys):
    from test_record_report import _study

    from apao_ray.study.cli.sweep import best_main

    _study(tmp_path)
    assert best_main(["--dataset", "tiny", "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--no-register",
                      "--format", "csv"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(",")[1]: line for line in out.splitlines()[1:] if line}
    assert set(rows) == {"ce", "apao_pointwise", "apao_pairwise"}
    assert rows["ce"].endswith(",finished") and rows["apao_pointwise"].endswith(",all 2 trials pruned")
    assert "failed: TrialOutOfMemoryError: out of memory while training in epoch 1" in rows["apao_pairwise"]
    # without --dataset: the store's only study experiment; with two, the error names them
    assert best_main(["--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--no-register", "--format", "csv"]) == 0
    assert capsys.readouterr().out == out
    import mlflow

    mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").create_experiment("apao-other")
    with pytest.raises(SystemExit):
        best_main(["--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--no-register"])
    error = capsys.readouterr().err
    assert "--dataset is needed: " in error and "holds 2 study experiments ['apao-other', 'apao-tiny']" in error


def test_every_study_field_is_one_table_entry_that_builds_its_flags_and_checks():
    """The CLI, StudySpec and --help cannot drift: every field is declared with `option` (help, bounds, flag), and
    `sweep` (every field) and `train` (the trial group) build their flags from those entries: same dest, default and
    help; a value out of a field's bounds is refused by its flag and by the spec alike."""
    from dataclasses import MISSING, fields

    from apao_ray.study.cli import sweep as cli_sweep
    from apao_ray.study.cli import train as cli_train
    from apao_ray.study.spec.fields import flag_of, table
    from apao_ray.study.spec.study import StudySpec

    assert [f.name for f in table(StudySpec)] == [f.name for f in fields(StudySpec)], "a field outside the table"
    written_by_the_command = {"protocol", "protocol_knobs", "tracking_uri"}  # --protocol and its knobs, --tracking-uri
    for name, parser in (("sweep", cli_sweep.build_parser()), ("train", cli_train.build_parser())):
        actions = {action.dest: action for action in parser._actions}
        for entry in table(StudySpec):
            if name == "train" and entry.metadata["group"] != "trial" or entry.name in written_by_the_command:
                continue
            action = actions.get(entry.name)
            assert action is not None and flag_of(entry) in action.option_strings, f"{name}: no flag for {entry.name}"
            if entry.metadata["lists"]:  # the registry's names, read when the flags are built
                from apao_ray.study.cli.fields import registered_names

                assert action.help == entry.metadata["help"].replace("%(names)s",
                                                                     registered_names(entry.metadata["lists"]))
            else:
                assert action.help == entry.metadata["help"], entry.name
            default = entry.default if entry.default is not MISSING else entry.default_factory()
            if not (name == "train" and entry.name in ("epochs", "patience")) and entry.metadata["kind"] != "knobs" \
                    and entry.metadata["env"] is None:
                assert action.default == default, (name, entry.name)
    assert cli_train.build_parser().get_default("epochs") == 200  # one trial at the paper's schedule
    parser = cli_sweep.build_parser()
    for entry in table(StudySpec):
        low = entry.metadata["low"]
        if low is None or not entry.metadata["cli"]:
            continue
        bad = low if entry.metadata["above"] else low - 1
        with pytest.raises(SystemExit):
            parser.parse_args([flag_of(entry), str(bad)])
        with pytest.raises(ValueError, match=entry.name):
            StudySpec(**{entry.name: bad})
