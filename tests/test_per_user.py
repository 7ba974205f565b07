"""The per-user test table: one row per user whose means are the split's metrics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apao_ray.analysis.per_user import read_per_user
from apao_ray.config import ModelConfig, TrainConfig
from apao_ray.decoding import PerUser
from apao_ray.models import build_model
from apao_ray.training.evaluation import evaluate_split_per_user, per_user_table, write_per_user
from apao_ray.config import TINY_MODEL


def test_table_means_are_the_split_metrics(synthetic, one_torch_thread):
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone="tiger", **TINY_MODEL), synthetic.catalog.vocab_size,
                        synthetic.catalog.num_levels)
    train = TrainConfig(precision="fp32", retention_users=16, eval_batch_size=128)
    metrics, table = evaluate_split_per_user(model, synthetic, "test", synthetic.catalog.tensors("cpu"), train,
                                             torch.device("cpu"), None)
    assert len(table["user"]) == len(synthetic.splits["test"]) and len(set(table["user"])) == len(table["user"])
    assert list(table["user"]) == list(synthetic.user_ids)  # sorted by user index, external ids
    for name in ("recall_at_10", "recall_at_20", "ndcg_at_10", "ndcg_at_20"):
        assert table[name].mean() == pytest.approx(metrics[f"test/{name}"], abs=1e-12)
    for m in range(1, 5):
        assert table[f"prefix_hit_m{m}"].mean() == pytest.approx(metrics[f"test/prefix_recall_at_20_m{m}"], abs=1e-12)
    assert (table["recall_at_20"] > 0).sum() > 0  # some hits, so the checks above compare something
    assert set(np.unique(table["rank"])) <= {-1, *range(1, 21)}
    # what training holds of each case, by user: the labels the report's memorization/generalization split reads
    from apao_ray.analysis.subsets import transition_labels

    labels = transition_labels(synthetic).set_index("user")
    for column in ("is_memorization", "is_seen_target"):
        assert table[column].tolist() == labels.loc[list(table["user"]), column].astype(int).tolist()
    assert 0 < table["is_memorization"].sum() < len(table["user"])  # both kinds of case: the check can fail
    _, valid = evaluate_split_per_user(model, synthetic, "valid", synthetic.catalog.tensors("cpu"), train,
                                       torch.device("cpu"), None)
    assert "is_memorization" not in valid  # the test split's labels only


def test_rows_follow_users_not_batch_order_and_round_trip(tmp_path):
    per_user = PerUser(sample_index=torch.tensor([2, 0, 1]), ranks=torch.tensor([0, 3, 11]),
                       prefix_hits=torch.tensor([[1, 0], [1, 1], [1, 1]], dtype=torch.bool), retention=None)
    table = per_user_table(per_user, ("007", "b", "c"), split_users=np.array([0, 1, 2]),
                           labels={"is_memorization": np.array([True, False, False])})  # per sample of the split
    assert list(table["user"]) == ["007", "b", "c"] and list(table["rank"]) == [3, 11, -1]
    assert list(table["is_memorization"]) == [1, 0, 0]
    # samples 0, 1, 2 of users b, c, 007 (the split's order is not the users'): each label follows its sample
    shuffled = per_user_table(per_user, ("007", "b", "c"), split_users=np.array([1, 2, 0]),
                              labels={"is_memorization": np.array([False, True, False])})
    assert list(shuffled["user"]) == ["007", "b", "c"] and list(shuffled["is_memorization"]) == [0, 0, 1]
    assert list(table["recall_at_10"]) == [1.0, 0.0, 0.0] and list(table["recall_at_20"]) == [1.0, 1.0, 0.0]
    assert table["ndcg_at_10"][0] == pytest.approx(1 / np.log2(4))
    read = read_per_user(write_per_user(tmp_path / "t.csv.gz", table))
    assert list(read["user"]) == ["007", "b", "c"]  # ids read as text
    assert read["ndcg_at_20"].to_numpy() == pytest.approx(table["ndcg_at_20"], abs=1e-6)
    assert read["is_memorization"].tolist() == [1, 0, 0]
    (tmp_path / "bad.csv.gz").write_bytes(b"")
    import gzip

    with gzip.open(tmp_path / "bad.csv.gz", "wt") as handle:
        handle.write("user,score\nu1,3\n")
    with pytest.raises(ValueError, match=r"columns \['rank'\] are missing"):
        read_per_user(tmp_path / "bad.csv.gz")
