"""Every trial records the test metrics at the epoch each selection rule keeps: its own rule
(the model it keeps), the other of validation NDCG@10 / validation loss, and the last epoch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apao_ray.analysis.per_user import read_per_user
from apao_ray.models import build_model
from apao_ray.names import PER_USER_FILE, PER_USER_VALID_FILE, rule_name
from apao_ray.names import test_by_key as by_key  # not collected as a test
from apao_ray.protocol import decoding_scoring
from apao_ray.rank_metrics import PER_USER_METRICS
from apao_ray.training.checkpoint import load_checkpoint, rule_model_file
from apao_ray.training.evaluation import evaluate_split
from apao_ray.training.hooks import TrainingHooks
from apao_ray.training.loop import run_trial
from apao_ray.training.precision import resolve_precision
from apao_ray.training.selection import per_user_column
from test_protocol import short, tiny_config  # noqa: F401  (short: a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
RULE_METRICS = PER_USER_METRICS  # every registered metric: Recall/NDCG at 10 and 20, MRR@10


@pytest.mark.parametrize("protocol", ["paper", "reference"])
def test_each_rule_tests_the_weights_of_the_epoch_it_keeps(short, tmp_path, protocol):  # noqa: F811
    epochs = 5
    config = tiny_config(protocol, lr=2e-2, epochs=epochs, patience=epochs)
    hooks = TrainingHooks(tmp_path, keep_checkpoints=epochs + 1, verbose=False)
    final = run_trial(config, hooks, short)
    reports = [r for r in hooks.reports if not r.get("done")]
    expected = {"ndcg_at_10": int(np.argmax([r["val/ndcg_at_10"] for r in reports])) + 1,
                "loss": int(np.argmin([r["val/loss"] for r in reports])) + 1, "last": epochs}
    assert {rule: final[by_key(rule, "epoch")] for rule in expected} == expected
    own = "loss" if protocol == "reference" else "ndcg_at_10"
    assert final["best/epoch"] == expected[own]
    assert {k: final[by_key(own, k)] for k in RULE_METRICS} == {k: final[f"test/{k}"] for k in RULE_METRICS}
    assert len(set(expected.values())) >= 2, "every rule kept one epoch: pick a run where they differ"

    resolved = config.replace(train=config.train.replace(precision=resolve_precision(config.train.precision,
                                                                                      torch.device("cpu"))))
    model = build_model(resolved.model, short.catalog.vocab_size, short.catalog.num_levels)
    final_dir = next((tmp_path / "checkpoints").glob("*_final"))
    table = read_per_user(final_dir / PER_USER_FILE)
    # the kept model's validation per user: its means are the kept epoch's validation metrics
    valid = read_per_user(final_dir / PER_USER_VALID_FILE)
    assert len(valid) == reports[0]["val/num_users_evaluated"] < len(short.splits["valid"])  # the users selection saw
    for metric in RULE_METRICS:
        assert valid[metric].mean() == pytest.approx(reports[expected[own] - 1][f"val/{metric}"], abs=1e-6), metric
    # MRR@10, one registry entry, in every epoch's validation, the test, and both tables: 1/rank within the top 10
    assert "mrr_at_10" in RULE_METRICS and all("val/mrr_at_10" in r for r in reports)
    for split_table, value in ((table, final["test/mrr_at_10"]), (valid, reports[expected[own] - 1]["val/mrr_at_10"])):
        by_hand = [1 / r if 1 <= r <= 10 else 0.0 for r in split_table["rank"]]
        assert np.mean(by_hand) == pytest.approx(value, abs=1e-6)
    assert protocol == "reference" or final["test/mrr_at_10"] > 0  # hits in the top 10: the check compares something
    for rule, epoch in expected.items():
        state, _, _ = load_checkpoint(tmp_path / "checkpoints" / f"epoch_{epoch:04d}")
        model.load_state_dict(state["model"])  # the weights after that epoch: what the rule keeps
        # the final checkpoint keeps each other rule's weights (its logged model_by_<rule>); the own rule's are best_model.pt
        kept_file = final_dir / rule_model_file(rule_name(rule))
        if rule == own:
            assert not kept_file.exists()
        else:
            kept = torch.load(kept_file, map_location="cpu", weights_only=True)
            assert kept.keys() == state["model"].keys() and all(torch.equal(kept[k], state["model"][k]) for k in kept)
        again = evaluate_split(model, short, "test", short.catalog.tensors(), resolved.train, torch.device("cpu"),
                               None, decoding_scoring(resolved))
        for metric in RULE_METRICS:
            assert final[by_key(rule, metric)] == pytest.approx(again[f"test/{metric}"], abs=1e-9), (rule, metric)
            assert table[per_user_column(rule, metric)].mean() == pytest.approx(again[f"test/{metric}"], abs=1e-6)


def test_the_kept_epoch_is_also_ranked_by_the_full_sort_when_asked(short, tmp_path):  # noqa: F811
    """``full_sort_test=on``: the kept model's test pass ranks every user by the exact full sort too; its metrics
    equal a full sort computed here from the final checkpoint's weights. ``auto`` on a CPU leaves it off."""
    from apao_ray.data import iter_batches
    from apao_ray.decoding.full_sort import full_sort, topk_from_scores
    from apao_ray.metrics import target_ranks
    from apao_ray.rank_metrics import mrr_from_ranks, ndcg_from_ranks, recall_from_ranks
    from apao_ray.training.precision import autocast

    config = tiny_config("paper", lr=2e-2, epochs=2, full_sort_test="on")
    final = run_trial(config, TrainingHooks(tmp_path, verbose=False), short)
    final_dir = next((tmp_path / "checkpoints").glob("*_final"))
    _, weights, _ = load_checkpoint(final_dir)
    resolved = config.replace(train=config.train.replace(precision=resolve_precision(config.train.precision,
                                                                                      torch.device("cpu"))))
    model = build_model(resolved.model, short.catalog.vocab_size, short.catalog.num_levels)
    model.load_state_dict(weights)
    model.eval()
    tensors, split = short.catalog.tensors(), short.splits["test"]
    ranks = []
    for batch in iter_batches(short.catalog, split, 64):
        with autocast(resolved.train.precision, torch.device("cpu")):
            scores = full_sort(model, batch.history_ids, batch.history_mask, tensors, scoring=decoding_scoring(resolved))
        ranks.append(target_ranks(topk_from_scores(scores, resolved.train.beam_size)[0], batch.target_sem))
    ranks = torch.cat(ranks)
    assert final["test/full_sort_ndcg_at_10"] == pytest.approx(float(ndcg_from_ranks(ranks, 10).mean()), abs=1e-6)
    assert final["test/full_sort_recall_at_20"] == pytest.approx(float(recall_from_ranks(ranks, 20).mean()), abs=1e-6)
    assert final["test/full_sort_mrr_at_10"] == pytest.approx(float(mrr_from_ranks(ranks, 10).mean()), abs=1e-6)
    table = read_per_user(final_dir / PER_USER_FILE)
    assert table["full_sort_ndcg_at_10"].mean() == pytest.approx(final["test/full_sort_ndcg_at_10"], abs=1e-6)
    assert "test/beam_retention_at_20" in final and "full_sort_ndcg_at_10_by_last" not in table  # kept epoch only

    plain = run_trial(tiny_config("paper", lr=2e-2, epochs=1), TrainingHooks(tmp_path / "auto", verbose=False), short)
    assert not any("full_sort" in key for key in plain)
