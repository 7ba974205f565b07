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


@pytest.fixture(scope="module")
def trained(synthetic, tmp_path_factory, one_torch_thread):
    """A tiny TIGER trained for two short CE epochs, loaded as a user loads a checkpoint."""
    from conftest import train_tiny

    return Recommender.from_checkpoint(train_tiny("tiger", tmp_path_factory.mktemp("tiny"), synthetic))


def test_every_item_of_a_shared_semantic_id_is_recommended_and_k_counts_semantic_ids(trained, synthetic):
    """Items 398 and 399 of the synthetic catalog share one semantic ID: the metrics count a hit on either, so
    recommend returns both, adjacent, with that ID's score, and k counts semantic IDs, not items."""
    catalog = synthetic.catalog
    (shared,) = catalog.collisions().values()
    assert len(shared) == 2 and catalog.num_items == catalog.num_semantic_ids + 1
    split = synthetic.splits["test"]
    histories = [[catalog.item_ids[i] for i in split.histories[row] if i >= 0] for row in range(8)]
    everything = trained.recommend(histories, k=catalog.num_semantic_ids)
    ranks = []
    for row in everything:
        items = [item for item, _ in row]
        assert sorted(items) == sorted(catalog.item_ids)  # every item once: the ID's second item too
        at = items.index(shared[0])
        assert items[at + 1] == shared[1] and row[at][1] == row[at + 1][1]
        ranks.append(at)  # the shared ID's rank: the distinct IDs before it (it is the only shared one)
    row = int(np.argmin(ranks))
    # the shared ID is the k-th (the same beam: a narrower one may rank others differently)
    top = trained.recommend([histories[row]], k=ranks[row] + 1, beam_size=catalog.num_semantic_ids)[0]
    assert [item for item, _ in top] == [item for item, _ in everything[row][:ranks[row]]] + list(shared)
    assert len(top) == ranks[row] + 2  # k semantic IDs, k + 1 items
