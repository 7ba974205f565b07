"""Beam search against a brute-force reference written here from SPEC §4, and full sorting.

The reference enumerates every valid child of every kept prefix, scores each candidate
prefix from scratch with its own teacher-forced model call (S^m = sum of the log-softmax of
its tokens), and keeps the K best in plain Python. Models run in float64 so that batched and
one-at-a-time evaluation agree to far below the 1e-5 tolerance and near-ties cannot reorder.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apao_ray.config import ModelConfig
from apao_ray.data.catalog import EOS_TOKEN, PAD_TOKEN, Catalog
from apao_ray.decoding import beam_search, full_sort, topk_from_scores
from apao_ray.decoding.scoring import StepScoring
from apao_ray.models import build_model

LEVEL_SIZES = (6, 5, 4, 4)
NUM_ROWS = 3


def random_catalog(num_items: int = 300, seed: int = 0) -> Catalog:
    rng = np.random.default_rng(seed)
    codes = np.stack([rng.integers(0, size, num_items) for size in LEVEL_SIZES], axis=1)
    codes[0] = [size - 1 for size in LEVEL_SIZES]  # every level reaches its full size
    return Catalog.from_codes([f"item{i}" for i in range(num_items)], codes)


def sparse_catalog() -> Catalog:
    """5 semantic IDs under 2 of the 6 first codes: the beam must pad with -1 / -inf."""
    codes = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [5, 0, 1, 2], [5, 0, 1, 3], [5, 4, 3, 3]])
    return Catalog.from_codes([f"item{i}" for i in range(len(codes))], codes)


def histories(catalog: Catalog, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) left-padded history tokens ending with EOS, rows of different lengths."""
    rng = np.random.default_rng(seed)
    lengths = [1, 4, 7][:NUM_ROWS]
    num_cols = max(lengths) * catalog.num_levels + 1
    ids = np.full((NUM_ROWS, num_cols), PAD_TOKEN, dtype=np.int64)
    for row, length in enumerate(lengths):
        tokens = catalog.item_tokens[rng.integers(0, catalog.num_items, length)].reshape(-1)
        ids[row, num_cols - 1 - len(tokens):num_cols - 1] = tokens
    ids[:, -1] = EOS_TOKEN
    ids = torch.from_numpy(ids)
    return ids, ids != PAD_TOKEN


def tiny_model(backbone: str, catalog: Catalog) -> torch.nn.Module:
    torch.manual_seed(0)
    config = ModelConfig(backbone=backbone, d_model=32, num_layers=2, num_heads=2, head_dim=16, d_ff=64)
    return build_model(config, catalog.vocab_size, catalog.num_levels).double().eval()


@torch.inference_mode()
def reference_beam(model, history_ids, history_mask, catalog: Catalog, beam_size: int, cache: dict,
                   over_valid_children: bool = False, temperature: float = 1.0):
    """Plain-Python constrained beam search for ONE row (history (1, L)).

    ``over_valid_children``: each step's softmax (of logits / temperature) runs over the valid
    children of the prefix only (how an MSL model is decoded), not over the vocabulary.

    Returns (items, node_lists): items = [(sem index, score)] best first; node_lists[m-1] =
    node ids of the prefixes kept after step m, best first.
    """
    offsets = catalog.token_offsets

    def node_of(codes: tuple[int, ...]) -> int:
        node = 0
        for depth, code in enumerate(codes):
            node = int(catalog.child_node[depth][node, code])
        return node

    def score(codes: tuple[int, ...]) -> float:
        if codes not in cache:  # one teacher-forced call per candidate prefix
            tokens = torch.tensor([[[code + int(offsets[m]) for m, code in enumerate(codes)]]])
            logits = model.candidate_logits(history_ids, history_mask, tokens)[0, 0] / temperature  # (m, V)
            total = 0.0
            for m in range(len(codes)):
                allowed = range(logits.shape[-1])  # every token
                if over_valid_children:
                    allowed = [int(offsets[m]) + c for c in range(catalog.level_sizes[m])
                               if catalog.child_node[m][node_of(codes[:m]), c] >= 0]
                total += float(torch.log_softmax(logits[m, list(allowed)], dim=-1)[
                    list(allowed).index(int(tokens[0, 0, m]))])
            cache[codes] = total
        return cache[codes]

    kept: list[tuple[int, ...]] = [()]
    node_lists = []
    for depth, level_size in enumerate(catalog.level_sizes):
        extensions = [prefix + (code,) for prefix in kept for code in range(level_size)
                      if catalog.child_node[depth][node_of(prefix), code] >= 0]
        kept = sorted(extensions, key=score, reverse=True)[:beam_size]
        node_lists.append([node_of(prefix) for prefix in kept])
    return [(node_of(codes), score(codes)) for codes in kept], node_lists


def padded(values: list, width: int, fill) -> list:
    return values + [fill] * (width - len(values))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a shared CPU every op of a 2-thread pool
    waits for its descheduled second thread; restored for the modules after this one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=["tiger", "llama"])
def setup(request):
    catalog = random_catalog()
    model = tiny_model(request.param, catalog)
    history_ids, history_mask = histories(catalog)
    caches = [{} for _ in range(NUM_ROWS)]  # prefix scores do not depend on K: share them
    return model, catalog, history_ids, history_mask, caches


def check_against_reference(model, catalog, history_ids, history_mask, caches, beam_size):
    result = beam_search(model, history_ids, history_mask, catalog.tensors(), beam_size)
    assert result.sem_ids.shape == result.scores.shape == (NUM_ROWS, beam_size)
    assert len(result.prefix_nodes) == catalog.num_levels
    for row in range(NUM_ROWS):
        items, node_lists = reference_beam(model, history_ids[row:row + 1], history_mask[row:row + 1],
                                           catalog, beam_size, caches[row])
        assert result.sem_ids[row].tolist() == padded([sem for sem, _ in items], beam_size, -1)
        expected = torch.tensor(padded([s for _, s in items], beam_size, float("-inf")), dtype=torch.float64)
        torch.testing.assert_close(result.scores[row], expected, atol=1e-5, rtol=0)
        for depth, nodes in enumerate(node_lists):
            got = result.prefix_nodes[depth][row].tolist()
            assert got == padded(nodes, len(got), -1), f"depth {depth + 1}, row {row}"
    return result


@pytest.mark.parametrize("beam_size", [1, 3, 8, 20])
def test_beam_equals_brute_force(setup, beam_size):
    """K = 8 and 20 exceed the 6 distinct first codes: step 0 keeps min(K, 6) real beams."""
    check_against_reference(*setup, beam_size)


def test_beam_pads_when_the_trie_is_narrow(setup):
    model, _, history_ids, history_mask, _ = setup
    catalog = sparse_catalog()
    caches = [{} for _ in range(NUM_ROWS)]
    result = check_against_reference(model, catalog, history_ids, history_mask, caches, 5)
    assert (result.prefix_nodes[0][:, 2:] == -1).all()  # only 2 first codes exist
    assert torch.isfinite(result.scores).all()  # 5 semantic IDs: the last step fills K = 5


def test_row_chunks_and_trimmed_padding_change_nothing(setup):
    """Rows are chunked by history length, [0, 1] then [2]; chunk [0, 1] drops the PAD
    columns that only row 2's longer history needed; results return in input order."""
    model, catalog, history_ids, history_mask, _ = setup
    whole = beam_search(model, history_ids, history_mask, catalog.tensors(), 8, row_chunk_size=NUM_ROWS)
    flipped = torch.arange(NUM_ROWS - 1, -1, -1)  # longest history first: the order matters
    chunked = beam_search(model, history_ids[flipped], history_mask[flipped], catalog.tensors(), 8,
                          row_chunk_size=2)
    chunked = type(chunked)(chunked.sem_ids[flipped], chunked.scores[flipped],
                            tuple(nodes[flipped] for nodes in chunked.prefix_nodes))
    assert torch.equal(whole.sem_ids, chunked.sem_ids)
    torch.testing.assert_close(whole.scores, chunked.scores, atol=1e-9, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(whole.prefix_nodes, chunked.prefix_nodes))
    with pytest.raises(ValueError, match="row_chunk_size must be >= 1, got 0"):
        beam_search(model, history_ids, history_mask, catalog.tensors(), 8, row_chunk_size=0)


def test_full_beam_equals_full_sort(setup):
    model, catalog, history_ids, history_mask, caches = setup
    num_sem = catalog.num_semantic_ids
    result = check_against_reference(model, catalog, history_ids, history_mask, caches, num_sem)
    scores = full_sort(model, history_ids, history_mask, catalog.tensors(), chunk_size=37)
    assert scores.shape == (NUM_ROWS, num_sem)
    sem_ids, top_scores = topk_from_scores(scores, num_sem)
    assert torch.equal(result.sem_ids, sem_ids)
    torch.testing.assert_close(result.scores, top_scores, atol=1e-5, rtol=0)


def test_full_sort_scores_are_teacher_forced_sums(setup):
    model, catalog, history_ids, history_mask, _ = setup
    scores = full_sort(model, history_ids, history_mask, catalog.tensors())
    candidates = torch.from_numpy(catalog.sem_tokens)[None, :5]                  # (1, 5, T)
    for row in range(NUM_ROWS):
        logits = model.candidate_logits(history_ids[row:row + 1], history_mask[row:row + 1], candidates)
        expected = torch.log_softmax(logits, -1).gather(-1, candidates.unsqueeze(-1)).sum((-1, -2))[0]
        torch.testing.assert_close(scores[row, :5], expected, atol=1e-8, rtol=0)
    # probabilities of all semantic IDs sum to at most 1 (mass on special/invalid tokens is lost)
    assert (scores.exp().sum(dim=1) <= 1 + 1e-9).all()


@pytest.mark.parametrize("beam_size", [0, -1, 2.0, "bad", "too_many"])
def test_invalid_beam_size(setup, beam_size):
    model, catalog, history_ids, history_mask, _ = setup
    num_sem = catalog.num_semantic_ids
    if beam_size == "too_many":
        beam_size = num_sem + 1
        match = rf"beam_size={num_sem + 1}.*\({num_sem}\)"
    else:
        match = "beam_size"
    with pytest.raises(ValueError, match=match):
        beam_search(model, history_ids, history_mask, catalog.tensors(), beam_size)
    with pytest.raises(ValueError, match="k="):
        topk_from_scores(torch.zeros(2, num_sem), num_sem + 1)


def test_evaluate_matches_metrics_and_restores_mode(setup):
    from apao_ray.data.batches import iter_batches
    from apao_ray.data.splits import build_splits
    from apao_ray.decoding import evaluate
    from apao_ray.metrics import beam_retention, ndcg_at_k, prefix_recall, recall_at_k

    model, catalog, _, _, _ = setup
    rng = np.random.default_rng(2)
    sequences = [rng.integers(0, catalog.num_items, rng.integers(3, 9)) for _ in range(10)]
    test = build_splits(sequences, max_history=5)["test"]
    tensors = catalog.tensors()
    model.train()
    results = evaluate(model, iter_batches(catalog, test, 4), tensors, topk=(1, 5, 60), beam_size=60,
                       with_full_sort=True)
    assert model.training  # restored
    model.eval()
    whole = next(iter_batches(catalog, test, len(test)))
    beam = beam_search(model, whole.history_ids, whole.history_mask, tensors, 60)
    assert results["num_users"] == 10
    assert results["recall_at_60"] > 0  # ~60 of ~220 IDs: some random-model hits, not all
    for k in (1, 5, 60):
        assert results[f"recall_at_{k}"] == pytest.approx(recall_at_k(beam.sem_ids, whole.target_sem, k))
        assert results[f"ndcg_at_{k}"] == pytest.approx(ndcg_at_k(beam.sem_ids, whole.target_sem, k))
    expected = prefix_recall(beam.prefix_nodes, tensors.leaf_prefix_nodes[whole.target_sem])
    assert [results[f"prefix_recall_at_60_m{m}"] for m in (1, 2, 3, 4)] == pytest.approx(expected)
    exact, _ = topk_from_scores(full_sort(model, whole.history_ids, whole.history_mask, tensors), 60)
    assert results["beam_retention_at_60"] == pytest.approx(beam_retention(beam.sem_ids, exact))
    with pytest.raises(ValueError, match=r"\[10\] must be ints in \[1, beam_size=5\]"):
        evaluate(model, iter_batches(catalog, test, 4), tensors, topk=(1, 10), beam_size=5)


@pytest.mark.parametrize("beam_size", [1, 3, 8])
def test_msl_beam_equals_brute_force_over_valid_children(setup, beam_size):
    """MSL's scores are normalised over the valid children only (at its temperature): the beam
    equals a brute force over those scores, and differs from the full-vocabulary beam."""
    model, catalog, history_ids, history_mask, _ = setup
    scoring = StepScoring("valid_children", temperature=2.0)
    result = beam_search(model, history_ids, history_mask, catalog.tensors(), beam_size, scoring=scoring)
    for row in range(NUM_ROWS):
        items, node_lists = reference_beam(model, history_ids[row:row + 1], history_mask[row:row + 1], catalog,
                                           beam_size, {}, over_valid_children=True, temperature=2.0)
        assert result.sem_ids[row].tolist() == [sem for sem, _ in items]
        torch.testing.assert_close(result.scores[row], torch.tensor([s for _, s in items], dtype=torch.float64),
                                   atol=1e-5, rtol=0)
        for depth, nodes in enumerate(node_lists):  # prefix recall reads these
            got = result.prefix_nodes[depth][row].tolist()
            assert got == padded(nodes, len(got), -1)
    # normalised over the children, a prefix's continuations sum to 1: probabilities never leak
    full = full_sort(model, history_ids, history_mask, catalog.tensors(), scoring=scoring)
    torch.testing.assert_close(full.exp().sum(dim=1), torch.ones(NUM_ROWS, dtype=torch.float64))
    plain = beam_search(model, history_ids, history_mask, catalog.tensors(), beam_size)
    assert not torch.allclose(plain.scores, result.scores)


def test_msl_full_beam_equals_full_sort(setup):
    """Full sort and retention use the same valid-children scores as the beam."""
    model, catalog, history_ids, history_mask, _ = setup
    scoring = StepScoring("valid_children", temperature=3.0)
    num_sem = catalog.num_semantic_ids
    result = beam_search(model, history_ids, history_mask, catalog.tensors(), num_sem, scoring=scoring)
    sem_ids, top = topk_from_scores(full_sort(model, history_ids, history_mask, catalog.tensors(), 41, scoring),
                                    num_sem)
    assert torch.equal(result.sem_ids, sem_ids)
    torch.testing.assert_close(result.scores, top, atol=1e-5, rtol=0)


def test_msl_loss_declares_valid_children_decoding():
    from apao_ray.config import LossConfig, TrialConfig
    from apao_ray.protocol import decoding_scoring

    msl = decoding_scoring(TrialConfig(loss=LossConfig(name="msl", tau=2.0)))
    assert (msl.normaliser, msl.temperature, msl.end_token) == ("valid_children", 2.0, None)
    for name in ("ce", "apao_pointwise", "apao_pairwise"):
        assert decoding_scoring(TrialConfig(loss=LossConfig(name=name))).normaliser == "vocabulary"


@pytest.mark.parametrize("beam_size", [3, 8])
def test_end_token_score_is_codes_plus_log_p_eos(setup, beam_size):
    """label_eos: a beam item's score is the sum of its 4 code log-probs plus log p(EOS | item),
    and the K items kept by S^T are re-ranked by that score."""
    model, catalog, history_ids, history_mask, caches = setup
    scoring = StepScoring(end_token=EOS_TOKEN)
    result = beam_search(model, history_ids, history_mask, catalog.tensors(), beam_size, scoring=scoring)
    full = full_sort(model, history_ids, history_mask, catalog.tensors(), scoring=scoring)
    sem_tokens = torch.from_numpy(catalog.sem_tokens)
    for row in range(NUM_ROWS):
        items, _ = reference_beam(model, history_ids[row:row + 1], history_mask[row:row + 1], catalog, beam_size,
                                  caches[row])
        expected = {}
        for sem, code_score in items:
            labels = torch.cat([sem_tokens[sem], torch.tensor([EOS_TOKEN])])[None, None]  # (1, 1, T+1)
            logits = model.candidate_logits(history_ids[row:row + 1], history_mask[row:row + 1], labels)
            log_p_eos = float(torch.log_softmax(logits[0, 0, -1].detach(), -1)[EOS_TOKEN])
            expected[sem] = code_score + log_p_eos
            assert log_p_eos < 0
            torch.testing.assert_close(float(full[row, sem]), expected[sem], atol=1e-6, rtol=0)
        ranked = sorted(expected, key=expected.get, reverse=True)
        assert result.sem_ids[row].tolist() == ranked
        torch.testing.assert_close(result.scores[row], torch.tensor([expected[s] for s in ranked],
                                                                    dtype=torch.float64), atol=1e-5, rtol=0)
