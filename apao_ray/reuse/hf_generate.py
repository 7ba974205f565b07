"""Recommending with an exported model in plain Hugging Face ``transformers`` (no apao_ray needed).

``python -m apao_ray export --format hf`` copies this file into the export directory as
``recommend_hf.py``; it needs only torch and transformers:

    from recommend_hf import load, recommend
    model, item_map = load("export_dir")
    recommend(model, item_map, [["1503", "88", "2071"]], k=10)   # -> [[("3310", -2.31), ...]]

It is HF ``generate`` with beam search (beam = max(k, the trained beam size)) and a
``prefix_allowed_tokens_fn`` that walks the catalog trie, so only real semantic IDs come out:
the same search as ``apao_ray.load_recommender(...).recommend`` and the served model, all in fp32
(the tests check the top 10, also for a model trained in bf16).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

ITEM_MAP_FILE = "item_map.json"


def load(directory: str | Path):
    """The exported model (T5ForConditionalGeneration or LlamaForCausalLM, eval mode) and its item map."""
    from transformers import AutoConfig, LlamaForCausalLM, T5ForConditionalGeneration  # lazy: an optional extra

    config = AutoConfig.from_pretrained(directory)
    model_class = T5ForConditionalGeneration if config.model_type == "t5" else LlamaForCausalLM
    item_map = json.loads((Path(directory) / ITEM_MAP_FILE).read_text())
    return model_class.from_pretrained(directory).eval(), item_map


def prompt_ids(item_map: dict, histories: list[list]) -> tuple[torch.Tensor, torch.Tensor]:
    """Histories of item ids -> left-padded (B, L) prompt tokens and attention mask.

    Each item becomes its semantic ID's tokens; the prompt ends with EOS where the model was
    trained so (``item_map["history_ends_with_eos"]``).
    """
    items, special = item_map["items"], item_map["special_tokens"]
    rows = []
    for row, history in enumerate(histories):
        unknown = [item for item in history if str(item) not in items]
        if unknown:
            raise ValueError(f"history {row} has item(s) {unknown[:5]} that are not in the exported catalog")
        tokens = [t for item in list(history)[-item_map["max_history"]:] for t in items[str(item)]["tokens"]]
        if item_map["history_ends_with_eos"] or not tokens:
            tokens.append(special["eos"])
        rows.append(tokens)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), special["pad"], dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens):] = torch.tensor(tokens)
        mask[row, width - len(tokens):] = 1
    return ids, mask


def build_trie(item_map: dict) -> dict[tuple[int, ...], list[int]]:
    """Token prefix -> the tokens that may follow it (the catalog's prefix trie)."""
    trie: dict[tuple[int, ...], set[int]] = {}
    for entry in item_map["items"].values():
        tokens = tuple(entry["tokens"])
        for depth in range(len(tokens)):
            trie.setdefault(tokens[:depth], set()).add(tokens[depth])
    return {prefix: sorted(nxt) for prefix, nxt in trie.items()}


def allowed_tokens_fn(item_map: dict, prompt_length: int, is_encoder_decoder: bool):
    """``prefix_allowed_tokens_fn`` for ``generate``: the valid next codes after what was generated."""
    trie, skip = build_trie(item_map), 1 if is_encoder_decoder else prompt_length  # T5: the start token

    def allowed(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        return trie.get(tuple(input_ids[skip:].tolist()), [item_map["special_tokens"]["eos"]])

    return allowed


@torch.inference_mode()
def recommend(model, item_map: dict, histories: list[list], k: int = 10,
              beam_size: int | None = None) -> list[list[tuple[str, float]]]:
    """The items of the top-k semantic IDs per history, best first, as ``(item id, log-probability)``: k counts
    semantic IDs, and every item of a semantic ID that several items share comes back, in catalog order."""
    beam_size = beam_size or max(k, item_map["beam_size"])
    num_levels = item_map["num_levels"]
    ids, mask = prompt_ids(item_map, histories)
    out = model.generate(input_ids=ids, attention_mask=mask, num_beams=beam_size, num_return_sequences=beam_size,
                         max_new_tokens=num_levels, min_new_tokens=num_levels, do_sample=False,
                         length_penalty=0.0, early_stopping=True, output_scores=True, return_dict_in_generate=True,
                         prefix_allowed_tokens_fn=allowed_tokens_fn(item_map, ids.shape[1],
                                                                    model.config.is_encoder_decoder))
    codes = out.sequences[:, -num_levels:].view(len(histories), beam_size, num_levels)   # (B, K, T)
    scores = out.sequences_scores.view(len(histories), beam_size)                         # (B, K)
    by_tokens = item_map["tokens_to_items"]
    results = []
    for row_codes, row_scores in zip(codes.tolist(), scores.tolist()):
        results.append([(item, score) for codes_of, score in zip(row_codes[:k], row_scores[:k])
                        for item in by_tokens[" ".join(map(str, codes_of))]])
    return results
