"""The report from study exports alone: fabricated exports of two seeds with a known APAO effect."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from apao_ray.analysis.export import load_export
from apao_ray.analysis.report import build_report, find_exports
from apao_ray.cli import main
from apao_ray.rank_metrics import PER_USER_METRICS
from apao_ray.training.evaluation import write_per_user

NUM_USERS = 3000
SELECTION = "best/val/ndcg_at_10"


@pytest.fixture(autouse=True)
def no_dataset_files(tmp_path, monkeypatch):
    """The exports here are fabricated 'office' studies: the paper's Office files, where a machine has them
    (``$APAO_DATA_DIR``, CI's ../shared, the user cache), would add the training-free rows and the heuristic's
    verdict to every table (tests/test_analysis_bar.py and the grid's tests check those)."""
    monkeypatch.delenv("APAO_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "no-cache"))


def _per_user(ranks: np.ndarray) -> dict[str, np.ndarray]:
    hit = lambda k: ((ranks > 0) & (ranks <= k)).astype(float)  # noqa: E731
    gain = lambda k: np.where(hit(k) > 0, 1 / np.log2(np.maximum(ranks, 1) + 1), 0.0)  # noqa: E731
    return {"user": np.array([f"u{i:04d}" for i in range(ranks.size)], dtype=object), "rank": np.where(ranks > 0, ranks, -1),
            "recall_at_10": hit(10), "ndcg_at_10": gain(10), "recall_at_20": hit(20), "ndcg_at_20": gain(20),
            "mrr_at_10": np.where(hit(10) > 0, 1 / np.maximum(ranks, 1), 0.0)}


def _trial(run_id: str, loss: str, seed: int, ranks: np.ndarray, schedule: str, extra: dict) -> tuple[dict, dict]:
    table = _per_user(ranks)
    metrics = {f"test/{k}": float(v.mean()) for k, v in table.items() if k not in ("user", "rank")}
    metrics.update({"best/val/ndcg_at_10": 0.01, "best/epoch": 2.0, "perf/total_seconds": 120.0,
                    "test/beam_retention_at_20": 0.8, **{f"test/prefix_recall_at_20_m{m}": 1.0 / m for m in range(1, 5)}})
    params = {"base.train.seed": str(seed), "base.data.dataset": "office", "backbone": "tiger", "loss": loss, **extra}
    tags = {"backbone": "tiger", "loss": loss, "apao.protocol": "paper", "apao.schedule": schedule, "apao.precision": "fp32"}
    record = {"run_id": run_id, "name": f"tiger/{loss}", "status": "FINISHED", "tags": tags, "params": params,
              "metrics": metrics, "per_user": f"per_user/{run_id}.csv.gz", "per_user_source": "logged by the trial"}
    return record, table


def _fabricate(root: Path, seed: int, effect: float, schedule: str = "paper", curve: tuple = (0.01, 0.019, 0.02),
               beta: str = "0.3") -> Path:
    """A study export of one seed: CE, and APAO-pointwise whose ranks are CE's with ``effect`` of the
    users moved from a miss to rank 1 (so APAO's Recall@10 is higher by exactly ``effect``); both
    validate ``curve`` over their 3 epochs (levelled off by default)."""
    rng = np.random.default_rng(seed)
    directory = root / f"office-s{seed}"
    (directory / "per_user").mkdir(parents=True)
    ce_ranks = np.where(rng.random(NUM_USERS) < 0.06, rng.integers(1, 21, NUM_USERS), 0)
    apao_ranks = ce_ranks.copy()
    apao_ranks[rng.choice(np.flatnonzero(ce_ranks == 0), int(effect * NUM_USERS), replace=False)] = 1
    trials, rows = [], []
    for run_id, loss, ranks, extra in ((f"ce{seed}", "ce", ce_ranks, {}),
                                       (f"ap{seed}", "apao_pointwise", apao_ranks, {"beta": beta, "eta": "0.0001"})):
        record, table = _trial(run_id, loss, seed, ranks, schedule, extra)
        write_per_user(directory / record["per_user"], table)
        trials.append(record)
        for epoch in (1, 2, 3):
            rows.append((run_id, "val/ndcg_at_10", epoch, curve[epoch - 1]))
            rows.append((run_id, "perf/epoch_seconds", epoch, 400.0 if epoch == 3 else 40.0))  # one slow epoch
            if loss != "ce":
                rows += [(run_id, f"train/apao_weight_m{m}", epoch, 0.25 + 0.01 * epoch * (m - 2.5)) for m in range(1, 5)]
    plan = {"answers": "tiger/ce vs tiger/apao_pointwise at 3 epochs each (ce 1 trial, apao_pointwise 1 trial); "
                       "tiger/apao_pairwise deferred",
            "deferred": {"tiger/apao_pairwise": "deferred: needs ~9h here (~3h per epoch) for one trial of 3 epochs; "
                                                "run --backbones tiger --losses apao_pairwise --budget 9h, or on a GPU"}}
    parent = {"run_id": f"p{seed}", "tags": {"command_line": f"studies/sweep.py --seed {seed}", "code_version": "abc",
                                            "apao.plan": json.dumps(plan)}}
    record = {"format_version": 1, "study": f"office-s{seed}", "experiment": "apao-office", "tracking_uri": "sqlite:///x",
              "exported_at": "2026-11-23T00:00:00Z", "parents": [parent], "trials": trials}
    (directory / "study.json").write_text(json.dumps(record))
    with gzip.open(directory / "epochs.csv.gz", "wt") as handle:
        pd.DataFrame(rows, columns=["run_id", "key", "step", "value"]).to_csv(handle, index=False)
    return directory


def _section(text: str, title: str) -> list[str]:
    lines = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0].splitlines()
    return [line for line in lines if line.startswith("| ")]


def test_report_finds_a_known_effect_and_shows_paper_numbers(tmp_path):
    exports = [load_export(_fabricate(tmp_path / "exports", seed, effect=effect)) for seed, effect in ((0, 0.018), (1, 0.022))]
    report = build_report(exports, tmp_path / "out", num_resamples=1000).read_text()
    metrics = _section(report, "Test metrics")
    ce = next(line for line in metrics if "| ce |" in line)
    apao = next(line for line in metrics if "apao_pointwise b=0.3 eta=0.0001" in line)
    expected = [exports[s].trials[0]["metrics"]["test/recall_at_10"] for s in (0, 1)]
    assert f"{np.mean(expected):.4f} ± {np.std(expected, ddof=1):.4f}" in ce
    assert "| 0,1 (2 seeds) |" in ce and "| 0.0608 / 0.0292 |" in ce and "| 0.0667 / 0.0337 |" in apao  # paper schedule: comparable
    assert "- `office-s0` answers: tiger/ce vs tiger/apao_pointwise at 3 epochs each" in report
    assert "  - `tiger/apao_pairwise`: deferred: needs ~9h here" in report  # a method without trials, said why
    assert ce.endswith("| 40.0 | converged |")  # the median epoch: one slow epoch beside other work does not pull it up
    rows = _section(report, "Paired differences")
    recall = next(line for line in rows if "| recall_at_10 |" in line)
    cells = [cell.strip() for cell in recall.strip("|").split("|")]
    assert cells[2] == "apao_pointwise b=0.3 eta=0.0001 - ce"
    pooled, seed0, seed1 = cells[4], cells[5], cells[6]
    assert pooled.startswith("+0.0198 [") and "p_holm = " in pooled  # ~1.8% and ~2.2% of users gained a hit
    # two seeds 0.004 apart: the seed level's 1 degree of freedom (t quantile 12.7) makes the interval ~5 times
    # either seed's users-only one and reach past 0; p ~0.06 (t = 10 on 1 df)
    low, high = (float(x) for x in pooled.split("[")[1].split("]")[0].split(", "))
    seed_low, seed_high = (float(x) for x in seed0.split("[")[1].split("]")[0].split(", "))
    assert low < 0 < 0.04 < high and 4 * (seed_high - seed_low) < high - low < 7 * (seed_high - seed_low), (pooled, seed0)
    assert 0.04 < float(pooled.split("p_holm = ")[1].split(" ")[0]) < 0.1
    # one Holm family (a metric of a dataset), whatever else the report compares: the same p_holm as `best` prints
    assert pooled.endswith("over seeds and users (2 seeds), p_holm = " + pooled.split("p_holm = ")[1]), pooled
    assert pooled.endswith("(Holm over 1 comparison: 1 method x 1 metric (recall_at_10) vs ce, office, >= 2 seeds "
                           "each)"), pooled
    assert seed0.startswith("+0.0177") and seed1.startswith("+0.0220") and cells[7] == str(NUM_USERS)
    for name in ("prefix_recall.png", "beam_retention.png", "adaptive_weights.png", "val_ndcg_at_10.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG" and f"]({name})" in report


def test_no_effect_is_not_significant_and_short_schedules_are_not_compared_with_the_paper(tmp_path):
    # a short run still learning steeply (+33% validation NDCG@10 at its last epoch): early learning, said so
    exports = [load_export(_fabricate(tmp_path / "exports", seed, effect=0.0, schedule="10 epochs / patience 10",
                                      curve=(0.01, 0.02, 0.03))) for seed in (0, 1)]
    report = build_report(exports, tmp_path / "out", num_resamples=1000).read_text()
    assert "| (0.0608 / 0.0292) n/c |" in report
    assert all(line.endswith("| still rising: val/ndcg_at_10 +33% at its last epoch (3) |")
               for line in _section(report, "Test metrics")[2:])
    for line in _section(report, "Paired differences"):
        if "apao_pointwise" in line:
            assert "| early learning (not converged): +0.0000 [0.0000, 0.0000] over seeds and users (2 seeds), " \
                   "p_holm = 1.000" in line


def test_a_one_seed_comparison_has_no_verdict_and_says_the_seeds_its_cell_needs(tmp_path):
    """Seeds 0 and 1 of one configuration measure the seed spread (+0.02 and +0.01); another configuration of the
    same cell ran one seed (+0.005): its row keeps the users-only CI, labelled, without a p-value, and says how many
    seeds a verdict would need at the measured spread; the Holm family holds the seed-level comparison only."""
    from apao_ray.analysis.stats import ONE_SEED, seeds_for_verdict

    exports = [load_export(_fabricate(tmp_path / "exports", seed, effect)) for seed, effect in ((0, 0.02), (1, 0.01))]
    exports.append(load_export(_fabricate(tmp_path / "exports", 2, 0.005, beta="0.2")))
    report = build_report(exports, tmp_path / "out", num_resamples=500).read_text()
    # which seeds and how many: a bare "2" would read as two seeds
    assert any("apao_pointwise b=0.2 eta=0.0001 | 2 (1 seed) |" in line for line in _section(report, "Test metrics"))
    assert any("apao_pointwise b=0.2 eta=0.0001 | 2 (1 seed) |" in line for line in _section(report, "Cost per method"))
    rows = _section(report, "Paired differences")
    ndcg = {cells[2]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in rows)
            if cells[3] == "ndcg_at_10"}
    measured = ndcg["apao_pointwise b=0.3 eta=0.0001 - ce"][4]
    assert "over seeds and users (2 seeds), p_holm = " in measured and "Holm over 1 comparison: " in measured
    single = ndcg["apao_pointwise b=0.2 eta=0.0001 - ce"][4]
    needed = seeds_for_verdict(0.005, float(np.std([0.02, 0.01], ddof=1)))
    assert single.startswith("+0.0050 [") and "p_holm" not in single and "p =" not in single
    assert single.endswith(f"over test users, {ONE_SEED}; a verdict needs ~{needed} seeds at seed sd 0.0071"), single
    assert 10 < needed < 40


def test_the_report_reads_the_convergence_verdict_its_study_recorded(tmp_path):
    """A study's end records each best trial's verdict with the popularity check (which needs the dataset); the
    report, from the export alone, says the same verdict and labels the comparison, where its curves alone would
    say converged."""
    from apao_ray.names import CONVERGED_TAG

    verdict = "no better than popularity: test ndcg_at_10 0.0060 within noise of popularity's 0.0055"
    directory = _fabricate(tmp_path / "exports", 0, 0.02)
    study = json.loads((directory / "study.json").read_text())
    study["trials"][0]["tags"][CONVERGED_TAG] = verdict  # CE's
    (directory / "study.json").write_text(json.dumps(study))
    report = build_report([load_export(directory)], tmp_path / "out", num_resamples=200).read_text()
    ce = next(line for line in _section(report, "Test metrics") if "| ce |" in line)
    assert ce.endswith(f"| {verdict} |"), ce
    paired = [line for line in _section(report, "Paired differences") if " - ce |" in line]
    assert len(paired) == len(PER_USER_METRICS) and all("early learning (not converged): " in line for line in paired)
    untagged = build_report([load_export(_fabricate(tmp_path / "plain", 0, 0.02))], tmp_path / "out2",
                            num_resamples=200).read_text()
    assert "early learning" not in "\n".join(_section(untagged, "Paired differences"))


def test_the_report_compares_under_each_selection_rule_and_by_the_full_sort(tmp_path):
    """Per-user columns of the other selection rules' epochs and of the full sort get a section of their own:
    here APAO's edge (+0.02 on the kept epoch) is gone at the validation-loss epoch (a copy of CE's column)."""
    exports = []
    for seed in (0, 1):
        directory = _fabricate(tmp_path / "exports", seed, 0.02)
        tables = {path.name: pd.read_csv(path, dtype={"user": str}) for path in (directory / "per_user").glob("*.csv.gz")}
        ce = tables[f"ce{seed}.csv.gz"]["ndcg_at_10"]
        for name, table in tables.items():
            table["ndcg_at_10_by_val_loss"] = ce  # both methods: CE's values
            table["full_sort_ndcg_at_10"] = table["ndcg_at_10"]
            write_per_user(directory / "per_user" / name, {c: table[c].to_numpy() for c in table.columns})
        exports.append(load_export(directory))
    report = build_report(exports, tmp_path / "out", num_resamples=300).read_text()
    rows = {line.split("|")[4].strip(): line for line in
            _section(report, "The same differences at the epoch each selection rule keeps") if " - ce |" in line}
    assert set(rows) == {"ndcg_at_10_by_val_loss", "full_sort_ndcg_at_10"}
    assert "| +0.0000 [0.0000, 0.0000] over seeds and users (2 seeds), p_holm = 1.000" in rows["ndcg_at_10_by_val_loss"]
    assert "| +0.0200 [" in rows["full_sort_ndcg_at_10"]
    plain = build_report([load_export(_fabricate(tmp_path / "plain", 0, 0.02))], tmp_path / "out2", num_resamples=200)
    assert "each selection rule keeps" not in plain.read_text()  # runs without those columns: no section


def test_methods_are_labelled_by_every_knob_their_runs_recorded_even_of_an_unloaded_plugin(tmp_path):
    """Two seeds of a plugin loss 'focal' (not loaded here) with gamma 1 and 2: two methods, each labelled with its
    gamma, and the report says the knob is unknown to the registry loaded."""
    exports = []
    for seed in (0, 1):
        directory = _fabricate(tmp_path / "exports", seed, 0.01)
        study = json.loads((directory / "study.json").read_text())
        apao = study["trials"][1]
        apao["tags"]["loss"] = apao["params"]["loss"] = "focal"
        for knob in ("beta", "eta"):
            del apao["params"][knob]
        apao["params"]["gamma"] = str(float(seed + 1))
        (directory / "study.json").write_text(json.dumps(study))
        exports.append(load_export(directory))
    report = build_report(exports, tmp_path / "out", num_resamples=200).read_text()
    labels = {line.split("|")[3].strip() for line in _section(report, "Test metrics") if "| office |" in line}
    assert labels == {"ce", "focal gamma=1", "focal gamma=2"}
    assert "Knobs that no loss loaded here declares (a plugin whose module `APAO_PLUGINS` does not name): " \
           "`focal`: gamma." in report


def test_cli_report_from_a_folder_of_exports_and_bad_input(tmp_path, capsys):
    for seed in (0, 1):
        _fabricate(tmp_path / "results", seed, effect=0.01)
    assert main(["report", "--exports", str(tmp_path / "results"), "--study", "office-s1", "--out",
                 str(tmp_path / "out"), "--resamples", "200"]) == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "office-s1" in report and "office-s0" not in report and "| 1 (1 seed) |" in _section(report, "Test metrics")[2]
    assert capsys.readouterr().out.strip().endswith("(1 study)")
    header, _, *rows = _section(report, "Test metrics")
    epoch = [c.strip() for c in header.strip("|").split("|")].index("best epoch")
    assert rows and {[c.strip() for c in row.strip("|").split("|")][epoch] for row in rows} == {"2"}  # a count, not 2.0
    assert main(["report", "--exports", str(tmp_path / "results" / "office-s0"), str(tmp_path / "results" / "office-s1"),
                 "--out", str(tmp_path / "both"), "--resamples", "200"]) == 0  # one flag, several directories
    assert "| 0,1 (2 seeds) |" in _section((tmp_path / "both" / "report.md").read_text(), "Test metrics")[2]
    assert main(["report", "--exports", str(tmp_path / "results"), "--study", "nope", "--out", str(tmp_path / "o")]) == 2
    assert "studies ['nope'] are not in the exports given; found ['office-s0', 'office-s1']" in capsys.readouterr().err
    assert main(["report", "--exports", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no such directory" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="not a study export"):
        load_export(tmp_path)
    assert len(find_exports([str(tmp_path / "results")], None)) == 2


def test_trials_without_test_metrics_are_listed_with_their_validation_curves(tmp_path):
    directory = _fabricate(tmp_path / "exports", 0, effect=0.01, curve=(0.01, 0.02, 0.03))
    record = json.loads((directory / "study.json").read_text())
    for trial in record["trials"]:  # as a study still training: no test metrics yet
        trial["status"], trial["per_user"] = "RUNNING", None
        trial["metrics"] = {"val/ndcg_at_10": 0.03, SELECTION: 0.03}
    (directory / "study.json").write_text(json.dumps(record))
    report = build_report([load_export(directory)], tmp_path / "out", num_resamples=200).read_text()
    rows = _section(report, "Trials without test metrics")
    assert len(rows) == 3 and "| office-s0 | tiger | ce | 0 | RUNNING | - | 3 | 0.0300 | 0.0300 | 40.0 |" in rows
    assert (tmp_path / "out" / "unfinished_val_ndcg_at_10.png").exists()
    assert len(_section(report, "Test metrics")) == 1  # the header only: nothing finished
    for trial in record["trials"]:
        trial["metrics"] = {}  # not even one epoch
    (directory / "study.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"studies \['office-s0'\] have no trial that trained an epoch"):
        build_report([load_export(directory)], tmp_path / "out2")


def test_seeds_from_a_cpu_and_a_gpu_show_their_epoch_times_and_epochs_per_seed(tmp_path):
    """A mean of a CPU seed's 40-s epochs and a GPU seed's 0.4-s ones describes neither: the report lists them per
    seed; and each seed's trained epochs come from its own record (a GPU file's epochs_trained, else its history)."""
    directories = [_fabricate(tmp_path / "exports", seed, effect=0.0) for seed in (0, 1)]
    epochs_file = directories[1] / "epochs.csv.gz"
    rows = pd.read_csv(epochs_file)
    rows.loc[rows.key == "perf/epoch_seconds", "value"] /= 100
    with gzip.open(epochs_file, "wt") as handle:
        rows.to_csv(handle, index=False)
    study = json.loads((directories[1] / "study.json").read_text())
    for trial in study["trials"]:
        trial["metrics"]["epochs_trained"] = 5.0
    (directories[1] / "study.json").write_text(json.dumps(study))
    report = build_report([load_export(d) for d in directories], tmp_path / "out", num_resamples=200).read_text()
    ce = next(line for line in _section(report, "Test metrics") if "| ce |" in line)
    assert ce.endswith("| 3,5 | 40.0 / 0.4 | converged |"), ce
    cost = next(line for line in _section(report, "Cost per method") if "| ce |" in line)
    # the chosen trial's wall minutes per seed (perf/total_seconds); no cost/* recorded: the trials' cost is unknown
    assert "| 0,1 (2 seeds) | 2 | - | - |" in cost and cost.endswith("| 2.0 / 2.0 |"), cost
