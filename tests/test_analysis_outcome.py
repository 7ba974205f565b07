"""analysis/outcome.py: one reading of how a trial ended and what it measured, and the one choice of a method's best
trial by the study's selection (protocol.Selection)."""
from __future__ import annotations

import json

import pytest

from apao_ray.analysis.outcome import Outcome, best_trial
from apao_ray.protocol import Selection, recorded_selection


def _record(status: str, metrics: dict, start: int = 0, **tags: str) -> dict:
    return {"run_id": f"r{start}", "status": status, "start_time": start, "tags": tags, "params": {},
            "metrics": metrics}


def test_each_ending_reads_as_one_state_with_its_reason():
    tested = {"val/ndcg_at_10": 0.3, "best/val/ndcg_at_10": 0.3, "test/ndcg_at_10": 0.2}
    cases = {
        "finished": _record("FINISHED", tested, **{"apao.outcome": "finished"}),
        # a pruned trial tested on its best checkpoint has test metrics but is no candidate: it did not end on its own
        "pruned": _record("KILLED", tested, **{"apao.outcome": "pruned at epoch 2"}),
        "failed": _record("FAILED", {}, **{"apao.outcome": "out of memory",
                                           "apao.error": "Traceback\nOOM in epoch 1"}),
        "stopped": _record("KILLED", {"val/ndcg_at_10": 0.1}, **{"apao.outcome": "interrupted: ..."}),
        "running": _record("RUNNING", {}),
    }
    outcomes = {name: Outcome(record) for name, record in cases.items()}
    assert {name: o.state for name, o in outcomes.items()} == {name: name for name in cases}
    assert [name for name, o in outcomes.items() if o.finished] == ["finished"]
    assert [name for name, o in outcomes.items() if o.tested] == ["finished", "pruned"]
    assert [name for name, o in outcomes.items() if o.trained] == ["finished", "pruned", "stopped"]
    assert outcomes["failed"].reason == "Traceback\nOOM in epoch 1" and outcomes["pruned"].reason == "pruned at epoch 2"
    assert outcomes["running"].reason == "running"  # no outcome tag yet: its status
    # a FINISHED run without its test (it ended before testing) is no candidate either
    assert Outcome(_record("FINISHED", {"best/val/ndcg_at_10": 0.3})).state == "stopped"


def test_the_test_metrics_under_each_selection_rule():
    outcome = Outcome(_record("FINISHED", {"test/ndcg_at_10": 0.20, "test_by/val_loss/ndcg_at_10": 0.18,
                                           "test_by/last/ndcg_at_10": 0.15, "test_by/val_ndcg_at_10/ndcg_at_10": 0.20}))
    assert outcome.test("ndcg_at_10") == outcome.test("test/ndcg_at_10") == 0.20  # the kept model's
    assert (outcome.test("ndcg_at_10", "loss"), outcome.test("ndcg_at_10", "last")) == (0.18, 0.15)
    assert outcome.test("ndcg_at_10", "ndcg_at_10", Selection()) == 0.20  # the trial's own rule: its test/
    assert outcome.test("recall_at_10", "loss") is None


def test_the_best_trial_follows_the_selections_direction_and_a_tie_goes_to_the_first_started():
    late, early, worse = (_record("FINISHED", {"best/val/loss": value, "best/val/ndcg_at_10": ndcg}, start)
                          for value, ndcg, start in ((1.0, 0.1, 9), (1.0, 0.2, 1), (2.0, 0.9, 0)))
    by_loss = Selection(metric="loss", rule="loss")
    assert by_loss.mode == "min" and Selection().mode == "max"
    for order in ([late, early, worse], [worse, late, early]):  # whatever order the runs are listed in
        assert best_trial(order, by_loss, lambda r: r) is early  # lowest loss; the tie to the earlier start
        assert best_trial(order, Selection(), lambda r: r) is worse  # highest NDCG@10
    assert best_trial([_record("FINISHED", {})], Selection(), lambda r: r) is None  # no value: no candidate


def test_a_study_records_one_selection_and_studies_that_differ_are_refused():
    tagged = ({"apao.selection": Selection("recall_at_20", "loss").to_json()}, {})
    assert recorded_selection([tagged]) == Selection("recall_at_20", "loss")
    # a study recorded before the tag: its base config's params
    params = ({}, {"base.train.metric": "recall_at_20", "base.protocol.select_by": "loss"})
    assert recorded_selection([params, tagged]) == Selection("recall_at_20", "loss")
    assert recorded_selection([]) == Selection() == Selection(**json.loads(Selection().to_json()))
    with pytest.raises(ValueError, match=r"select their best trial differently .*best/val/ndcg_at_10 \(max\).*"
                       r"best/val/recall_at_20 \(max\).*--study-name"):
        recorded_selection([({}, {}), tagged])
