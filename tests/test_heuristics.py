"""The training-free baselines (popularity, last-item transitions): their lists by hand and against a slow
reference, scored by the metric code on semantic IDs like a model."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from apao_ray.analysis.heuristics import heuristic_per_user, last_item_ranking, popularity_ranking
from apao_ray.data import Catalog, Dataset, build_splits
from datasets_helpers import SHARED_DATASETS, needs_shared

# items 0..4 have semantic IDs 0..4; item 5 collides with item 4 (semantic ID 4)
CODES = np.array([[0, 0, 0, i] for i in range(5)] + [[0, 0, 0, 4]])
# training parts (all but the last two items): u0 [0,1,0,2] -> 0>1, 1>0, 0>2; u1 [0,1] -> 0>1;
# u2 [2] -> none; u3 [3,2,3,2] -> 3>2, 2>3, 3>2
SEQUENCES = [np.array(s) for s in ([0, 1, 0, 2, 0, 1], [0, 1, 3, 3], [2, 4, 5], [3, 2, 3, 2, 3, 2])]


def dataset(sequences=SEQUENCES, codes=CODES) -> Dataset:
    return Dataset("hand", Catalog.from_codes([f"i{i}" for i in range(len(codes))], codes),
                   build_splits(sequences), tuple(f"u{u}" for u in range(len(sequences))), 0)


def test_the_lists_by_hand():
    data = dataset()
    sem = data.catalog.item_sem
    # training targets 1, 0, 2, 1, 2, 3, 2 -> counts sem 0:1, 1:2, 2:3, 3:1, 4:0 -> popularity 2, 1, 0, 3, 4
    np.testing.assert_array_equal(popularity_ranking(data.splits, sem, k=5), [[2, 1, 0, 3, 4]] * 4)
    # last items of the test histories (the validation targets): 0, 3, 4, 3
    # after 0: 1 (twice), 2 (once), then popularity; after 3: 2, then popularity; after 4: nothing -> popularity
    np.testing.assert_array_equal(last_item_ranking(data.splits, sem, k=5),
                                  [[1, 2, 0, 3, 4], [2, 1, 0, 3, 4], [2, 1, 0, 3, 4], [2, 1, 0, 3, 4]])
    np.testing.assert_array_equal(last_item_ranking(data.splits, sem, k=2), [[1, 2], [2, 1], [2, 1], [2, 1]])


def test_per_user_tables_score_semantic_ids_as_a_model_is_scored():
    data = dataset()
    table = heuristic_per_user(data, "last_item")
    assert table["user"].tolist() == ["u0", "u1", "u2", "u3"]
    # test targets 1, 3, 5 (semantic ID 4: a hit through the collision, at rank 5), 2
    assert table["rank"].tolist() == [1, 4, 5, 1]
    assert table["ndcg_at_10"].tolist() == pytest.approx([1, 1 / np.log2(5), 1 / np.log2(6), 1])
    assert table["recall_at_10"].tolist() == [1, 1, 1, 1]
    popularity = heuristic_per_user(data, "popularity")
    assert popularity["rank"].tolist() == [2, 4, 5, 1]
    assert heuristic_per_user(data, "last_item", split="valid")["rank"].tolist() == [4, 4, 5, 1]
    with pytest.raises(ValueError, match="unknown training-free baseline 'markov'.*last_item"):
        heuristic_per_user(data, "markov")


def reference_last_item(sequences, item_sem, k):
    """Slow and plain: per test user, the successors of their last item in the training parts, by count, then
    popularity, then id; popularity after."""
    pairs, popular = Counter(), Counter()
    for seq in sequences:
        part = [int(item_sem[i]) for i in seq[:-2]]
        popular.update(part[1:])
        pairs.update(zip(part[:-1], part[1:]))
    by_popularity = sorted(range(int(item_sem.max()) + 1), key=lambda s: (-popular[s], s))
    rows = []
    for seq in sequences:
        last = int(item_sem[seq[-2]])
        successors = sorted((b for (a, b) in pairs if a == last), key=lambda b: (-pairs[last, b], -popular[b], b))
        row = successors[:k]
        rows.append(row + [s for s in by_popularity if s not in row][:k - len(row)])
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_last_item_transitions_equal_a_slow_reference(seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 3, size=(30, 4))  # 30 items over at most 81 semantic IDs: some collide
    sequences = [rng.integers(0, 30, size=rng.integers(3, 12)) for _ in range(60)]
    data = dataset(sequences, codes)
    np.testing.assert_array_equal(last_item_ranking(data.splits, data.catalog.item_sem, k=20),
                                  reference_last_item(sequences, data.catalog.item_sem, 20))


@needs_shared
def test_the_report_sets_the_baselines_and_the_field_beside_a_study(tmp_path):
    from apao_ray.analysis.export import load_export
    from apao_ray.analysis.report import build_report
    from apao_ray.data import load_dataset
    from test_analysis_report import _fabricate

    exports = [load_export(_fabricate(tmp_path / "exports", 0, effect=0.03))]  # an Office study
    text = build_report(exports, tmp_path / "out", num_resamples=200, data_dir=str(SHARED_DATASETS)).read_text()
    office = load_dataset("office", str(SHARED_DATASETS))
    rows = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| office | ")}
    for name, label in (("popularity", "popularity (training-free)"), ("last_item", "last-item transitions (training-free)")):
        table = heuristic_per_user(office, name)
        assert f"| {table['ndcg_at_10'].mean():.4f} |" in rows[label] and rows[label].endswith("| 4905 |")
    # the field: paper Table 1's Office rows with their source, and no other dataset's
    assert "| office | tiger | APAO-pointwise | 0.0667 | 0.1105 | 0.0337 | 0.0447 | [1] |" in text
    assert "[1] APAO (Yu et al., KDD'26), Table 1: the same preprocessed files" in text and "| beauty |" not in text
    # without the files: said, not guessed
    missing = build_report(exports, tmp_path / "out2", num_resamples=200, data_dir=str(tmp_path)).read_text()
    assert "- office: not computed, its files are not here" in missing and "(training-free) |" not in missing
