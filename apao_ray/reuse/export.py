"""``python -m apao_ray export --model URI --to DIR --format hf``: a trained model as a Hugging Face
``transformers`` model (TIGER -> T5ForConditionalGeneration, Llama -> LlamaForCausalLM).

The directory holds ``model.safetensors`` + ``config.json`` (``from_pretrained`` loads it),
``generation_config.json`` (beam search over exactly T new tokens), ``item_map.json`` (item id
<-> semantic ID <-> token ids, the prompt layout) and ``recommend_hf.py`` (``hf_generate``:
trie-constrained ``generate``, transformers only). Weights map one to one; the tests check
equal logits (1e-5) and equal top-10 items against ``load_recommender``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data.catalog import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
from ..data.files import LEVEL_LETTERS
from ..protocol import decoding_scoring

if TYPE_CHECKING:  # annotations only: every `python -m apao_ray ... --help` imports this module
    import torch

FORMATS = ("hf",)
TRIAL_CONFIG_FILE = "apao_trial_config.json"  # sizes, max_history, beam and loss: what load_recommender needs


def tiger_names(ours: Any) -> dict[str, str]:
    """T5ForConditionalGeneration parameter name -> the ``TigerBackbone`` parameter it holds (one to one)."""
    names = {"shared.weight": "embedding.weight",
             "encoder.final_layer_norm.weight": "encoder_norm.weight",
             "decoder.final_layer_norm.weight": "decoder_norm.weight",
             "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "encoder_bias.embedding.weight",
             "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "decoder_bias.embedding.weight"}
    for i in range(len(ours.encoder_layers)):
        block, layer = f"encoder.block.{i}.layer", f"encoder_layers.{i}"
        names.update({f"{block}.0.SelfAttention.{n}.weight": f"{layer}.attn.{n}.weight" for n in "qkvo"})
        names.update({f"{block}.0.layer_norm.weight": f"{layer}.attn_norm.weight",
                      f"{block}.1.DenseReluDense.wi.weight": f"{layer}.ff.wi.weight",
                      f"{block}.1.DenseReluDense.wo.weight": f"{layer}.ff.wo.weight",
                      f"{block}.1.layer_norm.weight": f"{layer}.ff_norm.weight"})
    for i in range(len(ours.decoder_layers)):
        block, layer = f"decoder.block.{i}.layer", f"decoder_layers.{i}"
        names.update({f"{block}.0.SelfAttention.{n}.weight": f"{layer}.self_attn.{n}.weight" for n in "qkvo"})
        names.update({f"{block}.1.EncDecAttention.{n}.weight": f"{layer}.cross_attn.{n}.weight" for n in "qkvo"})
        names.update({f"{block}.0.layer_norm.weight": f"{layer}.self_norm.weight",
                      f"{block}.1.layer_norm.weight": f"{layer}.cross_norm.weight",
                      f"{block}.2.DenseReluDense.wi.weight": f"{layer}.ff.wi.weight",
                      f"{block}.2.DenseReluDense.wo.weight": f"{layer}.ff.wo.weight",
                      f"{block}.2.layer_norm.weight": f"{layer}.ff_norm.weight"})
    return names


def llama_names(ours: Any) -> dict[str, str]:
    """LlamaForCausalLM parameter name -> the ``LlamaBackbone`` parameter it holds (head tied to embeddings)."""
    names = {"model.embed_tokens.weight": "embedding.weight", "model.norm.weight": "norm.weight"}
    for i in range(len(ours.blocks)):
        hf, block = f"model.layers.{i}", f"blocks.{i}"
        names.update({f"{hf}.self_attn.{n}.weight": f"{block}.attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        names.update({f"{hf}.mlp.{n}.weight": f"{block}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")})
        names.update({f"{hf}.input_layernorm.weight": f"{block}.attn_norm.weight",
                      f"{hf}.post_attention_layernorm.weight": f"{block}.mlp_norm.weight"})
    return names


TIED = ("embed_tokens.weight", "lm_head.weight")  # tied to the shared embedding on both sides


def _load_mapped(hf_model: Any, ours: Any, names: dict[str, str]) -> Any:
    state = ours.state_dict()
    missing, unexpected = hf_model.load_state_dict({hf: state[mine].detach().clone().float() for hf, mine in names.items()},
                                                   strict=False)
    missing = [k for k in missing if not k.endswith(TIED)]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    hf_model.tie_weights()
    return hf_model.eval()


def from_hf_state(ours: Any, hf_state: dict[str, torch.Tensor]) -> Any:
    """Loads an exported (or HF-fine-tuned) model's weights back into our backbone of the same sizes."""
    from ..models import TigerBackbone  # lazy: torch; every command's parser imports this module (export_command)

    names = tiger_names(ours) if isinstance(ours, TigerBackbone) else llama_names(ours)
    uncovered = sorted(set(ours.state_dict()) - set(names.values()))
    if uncovered:  # a backbone change the mapping does not know yet: never leave weights random
        raise RuntimeError(f"the transformers mapping does not cover {uncovered}")
    missing = sorted(hf for hf in names if hf not in hf_state)
    if missing:
        raise ValueError(f"the transformers weights lack {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                         "not a model exported by apao_ray for this backbone and size")
    ours.load_state_dict({mine: hf_state[hf] for hf, mine in names.items()}, strict=False)
    return ours


def tiger_to_t5(ours: Any) -> Any:
    """T5ForConditionalGeneration of the same sizes holding a copy of a ``TigerBackbone``'s weights."""
    from transformers import T5Config, T5ForConditionalGeneration  # lazy: transformers, an optional extra

    enc0 = ours.encoder_layers[0]
    config = T5Config(vocab_size=ours.vocab_size, d_model=ours.d_model, d_kv=enc0.attn.head_dim,
                      d_ff=enc0.ff.wi.out_features, num_layers=len(ours.encoder_layers),
                      num_decoder_layers=len(ours.decoder_layers), num_heads=enc0.attn.num_heads,
                      relative_attention_num_buckets=ours.encoder_bias.num_buckets,
                      relative_attention_max_distance=ours.encoder_bias.max_distance,
                      dropout_rate=ours.dropout.p, layer_norm_epsilon=1e-6, feed_forward_proj="relu",
                      tie_word_embeddings=True, pad_token_id=PAD_TOKEN, eos_token_id=EOS_TOKEN,
                      decoder_start_token_id=BOS_TOKEN)
    return _load_mapped(T5ForConditionalGeneration(config), ours, tiger_names(ours))


def llama_to_hf(ours: Any) -> Any:
    """LlamaForCausalLM of the same sizes holding a copy of a ``LlamaBackbone``'s weights (tied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: transformers, an optional extra

    block0 = ours.blocks[0]
    head_dim = block0.attn.head_dim
    theta = float(ours.rotary.inv_freq[1].double() ** (-head_dim / 2))  # inv_freq[i] = theta^(-2i/dh)
    config = LlamaConfig(vocab_size=ours.vocab_size, hidden_size=ours.embedding.embedding_dim,
                         intermediate_size=block0.mlp.gate_proj.out_features, num_hidden_layers=len(ours.blocks),
                         num_attention_heads=block0.attn.num_heads, num_key_value_heads=block0.attn.num_heads,
                         head_dim=head_dim, hidden_act="silu", rms_norm_eps=ours.norm.eps,
                         rope_parameters={"rope_type": "default", "rope_theta": float(f"{theta:.6g}")},
                         max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=False,
                         mlp_bias=False, pad_token_id=PAD_TOKEN, eos_token_id=EOS_TOKEN, bos_token_id=BOS_TOKEN)
    return _load_mapped(LlamaForCausalLM(config), ours, llama_names(ours))


def to_hf(ours: Any) -> Any:
    """Our backbone -> the equivalent ``transformers`` model (eval mode, float32)."""
    from ..models import LlamaBackbone, TigerBackbone  # lazy: torch, as in from_hf_state

    if isinstance(ours, TigerBackbone):
        return tiger_to_t5(ours)
    if isinstance(ours, LlamaBackbone):
        return llama_to_hf(ours)
    raise ValueError(f"no transformers equivalent for {type(ours).__name__}; exportable: TigerBackbone, LlamaBackbone")


def item_map(recommender: Any) -> dict[str, Any]:
    """item id <-> semantic ID <-> token ids, and the prompt layout the model was trained on."""
    catalog, config = recommender.catalog, recommender.config
    items = {}
    for item, codes, tokens in zip(catalog.item_ids, catalog.item_codes.tolist(), catalog.item_tokens.tolist()):
        items[item] = {"semantic_id": [f"<{LEVEL_LETTERS[m]}_{c}>" for m, c in enumerate(codes)], "tokens": tokens}
    tokens_to_items: dict[str, list[str]] = {}  # every item of a semantic ID, catalog order, as recommend() returns
    for item in catalog.item_ids:
        tokens_to_items.setdefault(" ".join(map(str, items[item]["tokens"])), []).append(item)
    return {
        "backbone": config.model.backbone, "num_levels": catalog.num_levels, "level_sizes": list(catalog.level_sizes),
        "token_offsets": catalog.token_offsets.tolist(), "vocab_size": catalog.vocab_size,
        "special_tokens": {"pad": PAD_TOKEN, "eos": EOS_TOKEN, "bos": BOS_TOKEN},
        "max_history": config.data.max_history, "beam_size": config.train.beam_size,
        "history_ends_with_eos": bool(getattr(recommender.model, "history_eos", True)),
        "prompt": "each history item's semantic-ID tokens, oldest first, the last max_history items, then EOS "
                  "(unless history_ends_with_eos is false), left-padded with pad",
        "items": items, "tokens_to_items": tokens_to_items,
    }


def export_hf(recommender: Any, directory: str | Path) -> Path:
    """Writes the transformers directory for ``recommender`` (see the module docstring)."""
    from transformers import GenerationConfig  # lazy: an optional extra

    from . import hf_generate  # lazy: torch, as in from_hf_state
    from ..decoding.scoring import VOCABULARY_SCORING  # lazy: torch

    scoring = decoding_scoring(recommender.config)
    if scoring != VOCABULARY_SCORING:
        raise ValueError(f"loss {recommender.config.loss.name!r} (protocol {recommender.config.protocol}) is decoded "
                         f"with {scoring}, which HF generate does not reproduce; export supports models decoded by "
                         "full-vocabulary log-probabilities at temperature 1 without an end token")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = to_hf(recommender.model.float().cpu())
    hf.save_pretrained(directory, safe_serialization=True)
    mapping = item_map(recommender)
    is_t5 = mapping["backbone"] == "tiger"
    GenerationConfig(num_beams=max(10, mapping["beam_size"]), num_return_sequences=10,
                     max_new_tokens=mapping["num_levels"], min_new_tokens=mapping["num_levels"], do_sample=False,
                     length_penalty=0.0, early_stopping=True, pad_token_id=PAD_TOKEN, eos_token_id=EOS_TOKEN,
                     **({"decoder_start_token_id": BOS_TOKEN} if is_t5 else {"bos_token_id": BOS_TOKEN}),
                     ).save_pretrained(directory)
    (directory / hf_generate.ITEM_MAP_FILE).write_text(json.dumps(mapping))
    (directory / TRIAL_CONFIG_FILE).write_text(json.dumps(recommender.config.to_dict(), indent=2, sort_keys=True))
    shutil.copy(Path(hf_generate.__file__), directory / "recommend_hf.py")
    return directory
