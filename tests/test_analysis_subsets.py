"""Memorization and generalization subsets: the labels against a brute-force count on the synthetic dataset, and
the report's subset table on fabricated exports with a known difference on each subset."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from apao_ray.analysis.export import load_export
from apao_ray.analysis.results import finished_trials, group_methods
from apao_ray.analysis.subsets import subset_difference, subset_table, transition_labels
from apao_ray.data import load_dataset
from apao_ray.rank_metrics import AT_10_METRICS
from test_analysis_report import NUM_USERS, _fabricate


def test_labels_match_a_brute_force_count_of_training_transitions():
    dataset = load_dataset("synthetic")
    train, test = dataset.splits["train"], dataset.splits["test"]
    seen = {(int(h), int(t)) for h, t in zip(train.histories[:, -1], train.targets) if h >= 0}
    targets = set(train.targets.tolist())
    labels = transition_labels(dataset)
    assert len(labels) == len(test) and labels["user"].tolist() == [dataset.user_ids[u] for u in test.users]
    expected = [int(h) >= 0 and (int(h), int(t)) in seen for h, t in zip(test.histories[:, -1], test.targets)]
    assert labels["is_memorization"].tolist() == expected
    assert labels["is_seen_target"].tolist() == [int(t) in targets for t in test.targets]
    assert 0 < labels["is_memorization"].sum() < len(labels)  # both subsets present: the test can tell them apart


def test_subset_table_shows_each_subsets_difference_with_its_interval(tmp_path):
    """APAO gains ~2% of users, all of whom fall in the first half: the memorization half carries the whole
    difference, the generalization half none."""
    exports = [load_export(_fabricate(tmp_path, seed, effect=effect)) for seed, effect in ((0, 0.018), (1, 0.022))]
    methods = group_methods(finished_trials(exports))
    apao = next(m for m in methods if m.loss == "apao_pointwise")
    ce = next(m for m in methods if m.loss == "ce")
    gained = [set(a.per_user().loc[a.per_user()["ndcg_at_10"] > c.per_user()["ndcg_at_10"], "user"])
              for a, c in zip(apao.trials, ce.trials)]
    users = sorted(apao.trials[0].per_user()["user"])
    memorized = set().union(*gained)
    labels = pd.DataFrame({"user": users, "is_memorization": [u in memorized for u in users],
                           "is_seen_target": [True] * len(users)})
    generalization = subset_difference(apao, ce, labels, "generalization", num_resamples=200)
    assert generalization.mean_difference == 0 and generalization.num_seeds == 2
    memorization = subset_difference(apao, ce, labels, "memorization", num_resamples=200)
    expected = np.mean([len(g) / len(memorized) for g in gained])
    assert memorization.mean_difference == pytest.approx(expected)
    heuristic = apao.trials[0].per_user()[["user", *AT_10_METRICS]]
    rows = subset_table(methods, labels, {"a heuristic": heuristic}, num_resamples=200)
    memo = [r for r in rows if r.startswith(f"| memorization | {len(memorized)} |")]
    on_memo = heuristic[heuristic["user"].isin(memorized)]
    means = " | ".join(f"{on_memo[metric].mean():.4f}" for metric in AT_10_METRICS)  # every metric at 10, in order
    assert len(memo) == 3 and memo[0].endswith(f"| a heuristic | - | {means} | |")
    assert rows[0].startswith("| subset | users | method | seeds | R@10 | N@10 | MRR@10 |")
    assert any(f"+{expected:.4f} [" in r and "over seeds and users (2 seeds), p_holm = " in r for r in memo)
    assert not any(r.startswith("| unseen target |") for r in rows)  # no user in it: no rows
    assert len([r for r in rows if r.startswith(f"| generalization | {NUM_USERS - len(memorized)} |")]) == 3


def test_the_report_reads_the_labels_a_trial_stored_and_computes_them_for_older_tables(tmp_path):
    """Exports on the synthetic dataset's test users: tables carrying labels that differ from the dataset's (every
    user with an even number is memorization) are read as stored; the same tables without the columns (written
    before they existed) get the dataset's."""
    import gzip

    from apao_ray.analysis.report import build_report
    from test_analysis_bar import _export
    from test_analysis_report import _section

    dataset = load_dataset("synthetic")
    computed = transition_labels(dataset)
    users = sorted(computed["user"])
    stored = [int(u[1:]) % 2 == 0 for u in users]
    assert stored != computed.set_index("user").loc[users, "is_memorization"].tolist()  # the two can be told apart
    ranks = {"ce": np.where(np.arange(len(users)) % 3 == 0, 1, 0), "apao_pointwise": np.ones(len(users), int)}
    labelled = _export(tmp_path / "labelled", 0, users, ranks)
    for path in (labelled / "per_user").iterdir():
        table = pd.read_csv(path, dtype={"user": str})
        table["is_memorization"], table["is_seen_target"] = np.array(stored, int), 1
        with gzip.open(path, "wt") as handle:
            table.to_csv(handle, index=False)
    text = build_report([load_export(labelled)], tmp_path / "out", num_resamples=200).read_text()
    section = text.split("## Memorization and generalization", 1)[1]
    assert "Labels read from the per-user tables." in section
    assert f"| memorization | {sum(stored)} | tiger/ce |" in section
    assert f"| generalization | {len(users) - sum(stored)} | tiger/ce |" in section
    assert "| unseen target |" not in section  # every stored target seen: no such users

    older = _export(tmp_path / "older", 0, users, ranks)
    text = build_report([load_export(older)], tmp_path / "out-older", num_resamples=200).read_text()
    section = text.split("## Memorization and generalization", 1)[1]
    assert "Labels computed from the dataset's files." in section
    assert f"| memorization | {int(computed['is_memorization'].sum())} | tiger/ce |" in section
    assert _section(text, "Memorization and generalization")  # the table is there
