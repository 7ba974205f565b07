"""export --format hf: the exported transformers model computes our logits and, through HF
generate with the trie-constrained prefix_allowed_tokens_fn, recommends what load_recommender does."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from apao_ray.data.batches import encode_histories
from apao_ray import load_recommender
from apao_ray.training.precision import cpu_has_native_bf16
from conftest import ROOT, post, register_tiny, run_script, serving, train_tiny

pytest.importorskip("transformers", reason="export --format hf needs the hf extra (pip install 'apao_ray[hf]')")
pytestmark = pytest.mark.e2e  # trains and exports real models: minutes on 2 CPUs


@pytest.fixture(scope="module", params=["tiger", "llama"])
def trained(request, synthetic, tmp_path_factory):
    """A tiny model trained for 2 short epochs on the synthetic data: its final checkpoint directory."""
    return train_tiny(request.param, tmp_path_factory.mktemp(request.param), synthetic)


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    target = tmp_path_factory.mktemp("export") / "hf"
    result = subprocess.run([sys.executable, "-m", "apao_ray", "export", "--model", str(trained), "--to", str(target),
                             "--format", "hf"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    return target


def snippet(directory):
    """The recommend_hf.py written into the export: the documented snippet, run as a user would."""
    spec = importlib.util.spec_from_file_location(f"recommend_hf_{abs(hash(str(directory)))}",
                                                  directory / "recommend_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def real_histories(synthetic, count: int = 6) -> list[list[str]]:
    split = synthetic.splits["test"]
    rows = np.linspace(0, len(split) - 1, count).astype(int)
    return [[synthetic.catalog.item_ids[i] for i in split.histories[r] if i >= 0] for r in rows]


def test_files_and_item_map(exported, synthetic):
    names = {p.name for p in exported.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "item_map.json", "recommend_hf.py"} <= names
    mapping = json.loads((exported / "item_map.json").read_text())
    catalog = synthetic.catalog
    item = catalog.item_ids[5]
    assert mapping["items"][item]["tokens"] == catalog.item_tokens[5].tolist()
    assert mapping["items"][item]["semantic_id"][0] == f"<a_{catalog.item_codes[5, 0]}>"
    assert mapping["tokens_to_items"][" ".join(map(str, catalog.item_tokens[5]))] == [catalog.item_ids[5]]
    shared = next(iter(catalog.collisions().values()))  # two items of one semantic ID: both, catalog order
    assert mapping["tokens_to_items"][" ".join(map(str, catalog.item_tokens[catalog.item_index[shared[0]]]))] == shared
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == generation["min_new_tokens"] == 4


def test_hf_logits_equal_ours(trained, exported, synthetic):
    recommender = load_recommender(str(trained), precision="fp32")
    model, mapping = snippet(exported).load(exported)
    split = synthetic.splits["test"]
    rows = np.arange(0, len(split), max(1, len(split) // 16))[:16]
    history_ids, history_mask = encode_histories(synthetic.catalog.item_tokens, split.histories[rows])  # (B, L)
    labels = torch.from_numpy(synthetic.catalog.item_tokens[split.targets[rows]])                        # (B, T)
    with torch.no_grad():
        ours = recommender.model.candidate_logits(history_ids, history_mask, labels[:, None])[:, 0]      # (B, T, V)
        if mapping["backbone"] == "tiger":
            decoder_ids = torch.cat([torch.full_like(labels[:, :1], mapping["special_tokens"]["bos"]), labels[:, :-1]], 1)
            theirs = model(input_ids=history_ids, attention_mask=history_mask.long(), decoder_input_ids=decoder_ids).logits
        else:  # decoder-only: history (+ EOS) then the target's codes; logits from the last history token on
            ids = torch.cat([history_ids, labels[:, :-1]], 1)
            mask = torch.cat([history_mask, torch.ones_like(labels[:, :-1], dtype=torch.bool)], 1).long()
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            theirs = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, history_ids.shape[1] - 1:]
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)


def test_hf_constrained_beam_search_returns_our_top_10(trained, exported, synthetic):
    recommender = load_recommender(str(trained), precision="fp32")
    hf_snippet = snippet(exported)
    model, mapping = hf_snippet.load(exported)
    histories = real_histories(synthetic)
    ours = recommender.recommend(histories, k=10)
    theirs = hf_snippet.recommend(model, mapping, histories, k=10)
    for row, (mine, hf) in enumerate(zip(ours, theirs)):
        assert [item for item, _ in hf] == [item for item, _ in mine], f"history {row}"
        np.testing.assert_allclose([s for _, s in hf], [s for _, s in mine], atol=1e-4)


def test_hf_recommend_returns_every_item_of_a_shared_semantic_id_as_ours_does(trained, exported, synthetic):
    """Asked for every semantic ID, both searches return all 400 items, items 398 and 399 (one ID) side by side."""
    recommender = load_recommender(str(trained), precision="fp32")
    hf_snippet = snippet(exported)
    model, mapping = hf_snippet.load(exported)
    history = real_histories(synthetic, 1)
    k = synthetic.catalog.num_semantic_ids
    (ours,), (theirs,) = recommender.recommend(history, k=k), hf_snippet.recommend(model, mapping, history, k=k)
    assert sorted(item for item, _ in theirs) == sorted(synthetic.catalog.item_ids)
    assert {item for item, _ in theirs} == {item for item, _ in ours}
    (shared,) = synthetic.catalog.collisions().values()
    at = [item for item, _ in theirs].index(shared[0])
    assert theirs[at + 1][0] == shared[1] and theirs[at][1] == theirs[at + 1][1]


def test_load_recommender_reads_the_export_directory(trained, exported, synthetic):
    from_checkpoint = load_recommender(str(trained), precision="fp32")
    from_export = load_recommender(str(exported), precision="fp32")
    assert from_export.catalog.item_ids == from_checkpoint.catalog.item_ids
    histories = real_histories(synthetic)
    for mine, theirs in zip(from_checkpoint.recommend(histories, k=10), from_export.recommend(histories, k=10)):
        assert [i for i, _ in theirs] == [i for i, _ in mine]
        np.testing.assert_allclose([s for _, s in theirs], [s for _, s in mine], atol=1e-5)


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="needs a CPU with native bf16 (AVX512-BF16 or AMX): only there "
                    "does a trial train in bf16, whose decoding the export and the server must not follow")
@pytest.mark.parametrize("backbone", ["tiger", "llama"])
def test_a_bf16_trial_ranks_alike_exported_loaded_and_served(backbone, synthetic, tmp_path_factory):
    """The three ways to use a model give identical top-10 lists: bf16 autocast rounds per operation, so the
    transformers port and our model rank near-ties differently in bf16 (22/40 lists equal on a tiny TIGER);
    all three decode in fp32 (inference.INFERENCE_PRECISION)."""
    registered = register_tiny(tmp_path_factory.mktemp(f"bf16-{backbone}"), synthetic, backbone, precision="bf16")
    target = registered["dir"] / "hf"
    done = run_script(["-m", "apao_ray", "export", "--model", registered["model_uri"], "--tracking-uri",
                       registered["tracking_uri"], "--to", str(target)], cwd=registered["dir"])
    assert done.returncode == 0, done.stderr[-3000:]
    histories = real_histories(synthetic, 40)
    hf_snippet = snippet(target)
    model, mapping = hf_snippet.load(target)
    exported = [[item for item, _ in row] for row in hf_snippet.recommend(model, mapping, histories, k=10)]
    loaded = load_recommender(registered["model_uri"], tracking_uri=registered["tracking_uri"])
    assert loaded.config.train.precision == "bf16"  # the trial trained in bf16
    with serving(registered) as url:
        status, answer = post(url, {"dataframe_records": [{"history": h} for h in histories], "params": {"k": 10}})
    assert status == 200, answer
    served = [row["items"] for row in answer["predictions"]]
    assert exported == [[item for item, _ in row] for row in loaded.recommend(histories, k=10)] == served
