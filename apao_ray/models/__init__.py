"""Backbones behind one interface (:class:`Backbone`), picked by short name from ``BACKBONES``."""
from __future__ import annotations

from typing import Any

from .base import Backbone, Context, label_log_probs
from .llama import LlamaBackbone, LlamaContext
from .tiger import TigerBackbone, TigerContext

__all__ = ["BACKBONES", "PAPER_SIZES", "Backbone", "Context", "LlamaBackbone", "LlamaContext",
           "TigerBackbone", "TigerContext", "build_model", "label_log_probs", "resolve_sizes"]

# SPEC §2 (the paper's appendix and code); ModelConfig fields left None take these values
PAPER_SIZES: dict[str, dict[str, Any]] = {
    "tiger": {"d_model": 128, "num_layers": 4, "num_heads": 6, "head_dim": 64, "d_ff": 1024, "dropout": 0.1},
    "llama": {"d_model": 128, "num_layers": 8, "num_heads": 8, "head_dim": 16, "d_ff": 1024, "dropout": 0.0},
}

BACKBONES: dict[str, type[Backbone]] = {"tiger": TigerBackbone, "llama": LlamaBackbone}


def resolve_sizes(config: Any) -> dict[str, Any]:
    """Constructor keyword arguments of ``config``'s backbone, None fields from ``PAPER_SIZES``.

    Llama's head dim defaults to d_model // num_heads (as in Llama) when only those are set;
    TIGER's head dim is independent of d_model (T5's d_kv), so it keeps the paper's 64.

    Args:
        config: a :class:`~apao_ray.config.ModelConfig` (anything with its attributes).

    Returns:
        Plain ints/floats, e.g. to store in a checkpoint and rebuild with
        ``BACKBONES[name](vocab_size=..., num_levels=..., **sizes)``.
    """
    name = config.backbone
    if name not in BACKBONES:
        raise ValueError(f"unknown backbone {name!r}; choose from {sorted(BACKBONES)}")
    sizes = dict(PAPER_SIZES[name])
    for key in sizes:
        value = getattr(config, key)
        if value is not None:
            sizes[key] = value
    if name == "llama" and config.head_dim is None:
        sizes["head_dim"] = sizes["d_model"] // sizes["num_heads"]
    return sizes


def build_model(config: Any, vocab_size: int, num_levels: int) -> Backbone:
    """Builds the backbone named by ``config.backbone`` at the configured (or paper) size.

    Args:
        config: a :class:`~apao_ray.config.ModelConfig`.
        vocab_size: ``Catalog.vocab_size`` (special tokens + level-specific codes).
        num_levels: T, the number of code levels.
    """
    sizes = resolve_sizes(config)  # validates the name first
    if config.backbone == "llama":  # TIGER's encoder input always ends with EOS, as in the released code
        sizes["history_eos"] = getattr(config, "llama_history_eos", True)
    return BACKBONES[config.backbone](vocab_size=vocab_size, num_levels=num_levels, **sizes)
