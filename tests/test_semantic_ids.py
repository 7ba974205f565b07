"""Semantic IDs for a new catalog (`python -m apao_ray tokenize`): the quantizer's properties, and
Office tokenized from its item texts alone, then trained on."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from apao_ray.data import load_dataset
from apao_ray.data.files import parse_index
from apao_ray.semantic_ids import report, semantic_ids, tokenize
from apao_ray.semantic_ids.quantize import disambiguate
from apao_ray.config import TINY_MODEL
from conftest import ROOT
from test_own_data import needs_office, office_as_table


def clustered_vectors(seed: int = 0) -> np.ndarray:
    """300 points around 30 centres in 16 dims: a structure k-means should find."""
    centres = np.random.default_rng(seed + 100).normal(size=(30, 16))
    which = np.random.default_rng(seed).integers(0, 30, 300)
    return centres[which] + 0.05 * np.random.default_rng(seed + 200).normal(size=(300, 16))


def test_same_seed_same_codes_other_seed_other_codes():
    vectors = clustered_vectors()
    first, again = semantic_ids(vectors, 3, 16, seed=0), semantic_ids(vectors, 3, 16, seed=0)
    np.testing.assert_array_equal(first, again)
    assert first.shape == (300, 3) and first.min() >= 0 and first.max() < 16
    assert not np.array_equal(first, semantic_ids(vectors, 3, 16, seed=1))


def test_later_levels_tell_apart_what_the_first_could_not():
    # 30 centres, 8 first-level codes: several centres share a code; levels 2-3 must split them
    codes = semantic_ids(clustered_vectors(), 3, 8)
    centre = np.random.default_rng(0).integers(0, 30, 300)  # the centres clustered_vectors drew
    quality = report(codes)
    assert quality.codes_used_per_level == [8, 8, 8]
    assert quality.largest_bucket_per_level[0] > quality.largest_bucket_per_level[1] >= quality.largest_bucket_per_level[2]
    _, sem = np.unique(codes, axis=0, return_inverse=True)
    mixed = [s for s in np.unique(sem) if len(np.unique(centre[sem.reshape(-1) == s])) > 1]
    assert len(np.unique(codes[:, 0])) < 30 and mixed == [], "an ID holds points of two centres"


def test_disambiguation_level_numbers_items_inside_a_collision():
    codes = np.array([[0, 1], [0, 1], [2, 0], [0, 1]])
    np.testing.assert_array_equal(disambiguate(codes, 4)[:, 2], [0, 1, 0, 2])
    with pytest.raises(ValueError, match="3 items share one semantic ID prefix, more than the 2 codes"):
        disambiguate(codes, 2)
    unique = semantic_ids(clustered_vectors(), 3, 32, should_disambiguate=True)
    assert report(unique).colliding_semantic_ids == 0


def test_report_counts():
    quality = report(np.array([[0, 0], [0, 0], [0, 1], [1, 0]]))
    assert quality.codes_used_per_level == [2, 2] and quality.largest_bucket_per_level == [3, 2]
    assert (quality.distinct_semantic_ids, quality.colliding_semantic_ids, quality.items_in_collisions) == (3, 1, 2)


@pytest.mark.parametrize("kwargs, message", [({"num_levels": 27}, "levels=27 must be between 1 and 26"),
                                             ({"num_codes": 1}, "codes=1 must be >= 2")])
def test_bad_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        semantic_ids(clustered_vectors(), **{"num_levels": 2, "num_codes": 4, **kwargs})


def test_vectors_from_a_parquet_file_and_errors(tmp_path):
    import pandas as pd

    directory = tmp_path / "d"
    directory.mkdir()
    rows = [(f"u{u}", f"i{(u + n) % 12}", n) for u in range(12) for n in range(6)]
    pd.DataFrame(rows, columns=["user", "item", "timestamp"]).to_parquet(directory / "log.parquet")
    vectors = clustered_vectors()[:12]
    pd.DataFrame({"item": [f"i{i}" for i in range(12)], "embedding": list(vectors)}).to_parquet(tmp_path / "v.parquet")
    result = tokenize(str(directory), num_levels=2, num_codes=4, embeddings=str(tmp_path / "v.parquet"))
    assert result["items"] == 12 and result["embedding"].startswith("file v.parquet (16 dims)")
    # the libraries the codes depend on, with their threads (a machine with other ones may get other codes)
    from threadpoolctl import threadpool_info

    blas = next(pool for pool in threadpool_info() if pool["user_api"] == "blas")
    assert any(line.startswith(blas["internal_api"]) and line.endswith(f", {blas['num_threads']} threads")
               for line in result["linear_algebra"]), result["linear_algebra"]
    assert len(load_dataset(str(directory)).user_ids) == 12  # the index loads with the table
    with pytest.raises(ValueError, match="exists; pass --overwrite"):
        tokenize(str(directory), num_levels=2, num_codes=4, embeddings=str(tmp_path / "v.parquet"))
    pd.DataFrame({"item": ["i0"], "embedding": [vectors[0]]}).to_parquet(tmp_path / "few.parquet")
    with pytest.raises(ValueError, match=r"no vector for 11 item\(s\)"):
        tokenize(str(directory), embeddings=str(tmp_path / "few.parquet"), should_overwrite=True)
    with pytest.raises(ValueError, match="no item texts"):
        tokenize(str(directory), should_overwrite=True)


def popularity_recall_at_10(dataset, users: np.ndarray | None = None) -> float:
    """Validation Recall@10 (over ``users``, default all) of recommending the 10 most frequent
    training-target semantic IDs to everyone (an ID equal to the target's is a hit, as in the metrics)."""
    catalog = dataset.catalog
    counts = np.bincount(catalog.item_sem[dataset.splits["train"].targets], minlength=catalog.num_semantic_ids)
    top = np.argsort(-counts, kind="stable")[:10]
    targets = dataset.splits["valid"].targets
    return float(np.isin(catalog.item_sem[targets if users is None else targets[users]], top).mean())


HISTORY = 5  # items of history per sample in the Office run below


@needs_office
@pytest.mark.e2e
def test_office_tokenized_from_texts_trains_beyond_popularity(tmp_path):
    from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
    from apao_ray.training.hooks import TrainingHooks
    from apao_ray.training.loop import run_trial

    directory = office_as_table(tmp_path / "shop", with_index=False)
    result = subprocess.run([sys.executable, "-m", "apao_ray", "tokenize", "--dataset", str(directory)],
                            capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    assert "collisions:" in result.stdout and "codes used per level: [256, 256, 256, 256]" in result.stdout
    item_ids, codes = parse_index(directory / "shop.index.rq-kmeans.json")
    assert codes.shape == (2420, 4) and len(set(item_ids)) == 2420
    meta = json.loads((directory / "shop.index.rq-kmeans.meta.json").read_text())
    assert meta["embedding"].startswith("tfidf-svd") and meta["min_interactions"] == 5
    assert meta["distinct_semantic_ids"] > 2000  # the trie is not degenerate
    dataset = load_dataset(str(directory), max_history=HISTORY)
    assert dataset.stats()["semantic_ids"] == meta["embedding"]

    # 4 epochs at batch 64 on all 38,543 training samples, the last 5 items of each history, lr 5e-3, validated
    # on all 4,905 users. The IDs differ from machine to machine (the SVD's last bits follow the BLAS library and
    # its threads, and k-means amplifies them), and so does how fast a tiny model gets past popularity with them:
    # 3 epochs on 1,500 users reached 0.0273 / 0.0287 against popularity 0.0107-0.0133 on an AVX2 EPYC
    # (2026-11-28), but 0.0173 against 0.0147 on an Intel Xeon with AMX, whose IDs (1 BLAS thread, as in CI's
    # workers) the model learned more slowly. There, 4 epochs on all users: 0.0334 against 0.0177 (1.88x; the
    # 2-thread IDs 0.0367 against 0.0143), and all users halve the 1,500's sampling noise (2026-11-29).
    config = TrialConfig(DataConfig(dataset=str(directory), max_history=HISTORY),
                         ModelConfig(backbone="tiger", **TINY_MODEL),
                         LossConfig(name="ce"), TrainConfig(epochs=4, batch_size=64, effective_batch_size=64,
                                                            lr=5e-3, patience=4, precision="fp32", retention_users=16))
    hooks = TrainingHooks(tmp_path / "run", verbose=False)
    run_trial(config, hooks, dataset)
    recall = max(r["val/recall_at_10"] for r in hooks.reports if not r.get("done"))
    baseline = popularity_recall_at_10(dataset)  # the same users: all of them
    print(f"validation recall@10 {recall:.4f}, popularity {baseline:.4f}")
    # 1.9x popularity or more where measured: 1.5x leaves room for another machine's IDs, not for a model that
    # learned no more than which IDs are frequent
    assert recall > 1.5 * baseline, f"validation recall@10 {recall:.4f} <= 1.5 x popularity {baseline:.4f}"
