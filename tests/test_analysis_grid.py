"""The paper Table 1 grid page from exports alone: done cells with their seeds and paired difference,
an in-progress cell with its epoch, queued cells with their cost, and runs that are not paper cells."""
from __future__ import annotations

import json

from apao_ray.analysis.export import load_export
from apao_ray.analysis.grid import GRID_CELLS, build_grid, load_queue
from apao_ray.cli import main
from test_analysis_report import _fabricate


def _rows(text: str) -> dict[tuple[str, str, str], list[str]]:
    rows = {}
    for line in text.split("## Other", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] in {"office", "grocery", "beauty"}:
            rows[tuple(cells[:3])] = cells[3:]
    return rows


def _queue(path):
    path.write_text(json.dumps({
        "office_cost_per_trial": {"tiger/ce": {"cpu_hours": 3.6, "gpu_minutes": 5},
                                  "llama/ce": {"cpu_hours": 4.0, "gpu_minutes": 6}},
        "dataset_scale": {"office": 1.0, "grocery": 2.5},
        "items": [{"dataset": "grocery", "backbone": "tiger", "losses": ["ce"], "protocol": "paper", "seeds": [0],
                   "command": "DATASET=grocery bash x.sh"}]}))
    return path


def test_grid_shows_done_running_and_queued_cells(tmp_path):
    done = [load_export(_fabricate(tmp_path / "exports", seed, effect=0.03)) for seed in (0, 1)]
    budget = load_export(_fabricate(tmp_path / "budget", 5, effect=0.03, schedule="4 epochs / patience 4"))
    running = load_export(_fabricate(tmp_path / "running", 7, effect=0.0))
    for trial in running.trials:  # llama CE at the paper's schedule, 3 epochs in, no test metrics yet
        trial["status"], trial["tags"]["backbone"] = "RUNNING", "llama"
        trial["metrics"] = {k: v for k, v in trial["metrics"].items() if not k.startswith("test/")}
        trial["metrics"]["val/ndcg_at_10"] = 0.03
    running.trials[:] = running.trials[:1]
    grid = build_grid([*done, budget, running], tmp_path / "out", load_queue(_queue(tmp_path / "q.json")),
                      num_resamples=500).read_text()
    rows = _rows(grid)
    assert len(rows) == len(GRID_CELLS) == 18
    ours, difference, paper, status = rows[("office", "tiger", "apao_pointwise")]
    recalls = [e.trials[1]["metrics"]["test/recall_at_10"] for e in done]
    assert ours.startswith(f"{sum(recalls) / 2:.4f} ± ") and ours.endswith("(n=2)")
    assert difference.startswith("+") and "p_holm" in difference  # the fabricated APAO is better for 3% of users
    assert float(difference.split("[")[1].split(",")[0]) > 0
    assert paper == "0.0667 / 0.0337" and status == "done (seeds 0,1)"
    assert rows[("office", "tiger", "ce")][1] == "-"  # the baseline has no difference with itself
    assert rows[("office", "llama", "ce")][3].startswith("in progress: seed 7: epoch 3")
    assert rows[("grocery", "tiger", "ce")][3] == "queued #1: seeds 0, ~9 h per trial on 2 CPUs, ~12 min on a GPU"
    assert rows[("beauty", "tiger", "ce")][3] == "not queued"
    assert "2 of 18 cells done, 1 in progress, 15 not started" in grid
    # the 4-epoch budget study is a full-length run of neither kind: it stays out of the grid entirely
    assert "seed 5" not in grid and "seeds 0,1,5" not in grid


def test_report_grid_command_reads_the_queue_beside_the_exports(tmp_path, capsys):
    results = tmp_path / "benchmarks" / "results"
    _fabricate(results, 0, effect=0.03)
    (tmp_path / "benchmarks" / "evidence").mkdir()
    _queue(tmp_path / "benchmarks" / "evidence" / "queue.json")
    assert main(["report", "--grid", "--exports", str(results), "--out", str(tmp_path / "grid"),
                 "--resamples", "200"]) == 0
    assert "queue.json" in capsys.readouterr().out
    assert _rows((tmp_path / "grid" / "grid.md").read_text())[("grocery", "tiger", "ce")][3].startswith("queued #1")
    assert main(["report", "--grid", "--tracking-uri", "sqlite:///x.db", "--out", str(tmp_path / "g2")]) == 2


def test_the_grid_holds_the_heuristics_and_a_cell_below_the_last_item_heuristic_says_so(tmp_path):
    """On Office's real test users (its files needed: the grid's cells are paper datasets): CE fabricated with a
    hit at rank 2 for 2% of the users (N@10 ~0.013), APAO at rank 1 for all; the last-item heuristic (N@10 ~0.048)
    stands between them."""
    import numpy as np

    from apao_ray.analysis.bar import dataset_heuristics
    from test_analysis_bar import _export
    from datasets_helpers import SHARED_DATASETS as SHARED, require_shared

    require_shared()
    tables = dataset_heuristics(["office"], str(SHARED))["office"]
    users = sorted(tables["last_item"]["user"])
    exports = []
    for seed in (0, 1):
        ce = np.where(np.random.default_rng(seed).random(len(users)) < 0.02, 2, 0)
        exports.append(load_export(_export(tmp_path / "exports", seed, users,
                                           {"ce": ce, "apao_pointwise": np.ones(len(users), int)}, "office")))
    rows = _rows(build_grid(exports, tmp_path / "out", num_resamples=200, data_dir=str(SHARED)).read_text())
    bar = tables["last_item"]
    assert "below the last-item heuristic: test ndcg_at_10 0.01" in rows[("office", "tiger", "ce")][3]
    assert rows[("office", "tiger", "apao_pointwise")][3] == "done (seeds 0,1)"
    heuristic = rows[("office", "tiger", "last-item transitions (training-free)")]
    assert heuristic[0] == " / ".join(f"{bar[name].mean():.4f}" for name in ("recall_at_10", "ndcg_at_10", "mrr_at_10"))
    assert heuristic[1].startswith("heuristic - CE: +0.03") and "p_holm" in heuristic[1]
    assert heuristic[2:] == ["-", "training-free"]
    assert ("office", "tiger", "popularity (training-free)") in rows
