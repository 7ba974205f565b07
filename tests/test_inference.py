"""Recommender from other code: unknown item ids, vectorised history batches, export directories."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
from apao_ray.reuse.inference import Recommender, served_request
from apao_ray.models import build_model
from apao_ray.config import TINY_MODEL


@pytest.fixture(scope="module")
def recommender(synthetic):
    torch.manual_seed(0)
    config = TrialConfig(DataConfig(max_history=5), ModelConfig(backbone="tiger", **TINY_MODEL), LossConfig(name="ce"),
                         TrainConfig(precision="fp32"))
    model = build_model(config.model, synthetic.catalog.vocab_size, synthetic.catalog.num_levels)
    return Recommender(model, synthetic.catalog, config)


def reference_matrix(recommender, histories):
    """The row-by-row construction the vectorised one replaced."""
    rows = [[recommender.catalog.item_index[str(i)] for i in h][-5:] for h in histories]
    width = max(1, max(len(r) for r in rows))
    matrix = np.full((len(rows), width), -1)
    for row, indices in enumerate(rows):
        if indices:
            matrix[row, width - len(indices):] = indices
    return matrix


def test_vectorised_history_matrix_equals_row_by_row(recommender):
    rng = np.random.default_rng(0)
    ids = recommender.catalog.item_ids
    histories = [[ids[i] for i in rng.integers(0, len(ids), rng.integers(0, 9))] for _ in range(200)] + [[]]
    np.testing.assert_array_equal(recommender._history_matrix(histories, False), reference_matrix(recommender, histories))
    assert recommender._history_matrix([[]], False).shape == (1, 1)


def test_unknown_items_are_named_or_skipped(recommender):
    ids = recommender.catalog.item_ids
    histories = [[ids[1], "ghost-1", ids[2]], [ids[3]], ["ghost-2", 12345]]
    with pytest.raises(ValueError) as info:
        recommender.recommend(histories, k=5)
    message = str(info.value)
    assert "3 item id(s) not in the model's catalog" in message and "'ghost-1'" in message and "'12345'" in message
    assert "histories [0, 2]" in message and "skip_unknown=True" in message
    skipped = recommender.recommend(histories, k=5, skip_unknown=True)
    assert skipped == recommender.recommend([[ids[1], ids[2]], [ids[3]], []], k=5)


def test_batches_give_what_one_by_one_gives(recommender, synthetic):
    split = synthetic.splits["test"]
    histories = [[synthetic.catalog.item_ids[i] for i in row if i >= 0] for row in split.histories[:40]]
    together = recommender.recommend(histories, k=10, batch_size=16)
    alone = [recommender.recommend([h], k=10)[0] for h in histories[:5]]
    for mine, single in zip(together, alone):
        assert [i for i, _ in mine] == [i for i, _ in single]
        np.testing.assert_allclose([s for _, s in mine], [s for _, s in single], atol=1e-5)


@pytest.mark.parametrize("frame, k, named", [
    ({"items": [["1"]]}, 10, "input columns ['items'] lack 'history'"),
    ({"history": [["1"], []]}, 10, "history 1 is empty"),
    ({"history": ["12"]}, 10, "history 0 is '12': send a list"),
    ({"history": [["1"]]}, 0, "k=0 must be an integer between 1 and 399"),
    ({"history": [["1"]]}, 400, "k=400 must be an integer between 1 and 399"),
    ({"history": [["1"]]}, 2.5, "k=2.5 must be an integer"),
    ({"history": [["1"]]}, True, "k=True must be an integer"),
])
def test_a_served_request_names_what_is_wrong(frame, k, named):
    import pandas as pd

    with pytest.raises(ValueError) as info:
        served_request(pd.DataFrame(frame), k, num_semantic_ids=399)
    assert named in str(info.value)


def test_a_served_request_gives_string_ids_and_an_integer_k():
    import pandas as pd

    histories, k = served_request(pd.DataFrame({"history": [["1", 2], ["3"]]}), 5.0, num_semantic_ids=399)
    assert histories == [["1", "2"], ["3"]] and k == 5 and isinstance(k, int)
