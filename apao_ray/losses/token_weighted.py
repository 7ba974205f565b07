"""Front-greater token weighting (arXiv 2601.17787; code CHIUWEINING/Token-Weighted-Multi-Target-Learning-...,
``TIGER/modeling_letter.py``, ``front_greater_loss``), for the catalog's semantic IDs (docs/SPEC.md).

The paper weights the cross-entropy of code level k by how much that level narrows the item set:

    w_k = T * log(1 + g_k) / sum_j log(1 + g_j),    k = 1..T   (EOS, when labelled, weight 1)
    L = sum_{b,t} w'_t CE_{b,t} / sum_{b,t} w'_t,   w'_t = (1 - alpha) + alpha * w_t

where its gain g_k is the drop in the item embeddings' spread from prefixes of length k-1 to length k. The
embeddings behind a catalog are not at hand here (the paper's datasets ship semantic IDs only), so g_k is the
information level k adds about the semantic ID: the drop in entropy, in bits, of the catalog's IDs grouped by
their length-k prefix (H_k - H_{k-1}, H_0 = 0, over distinct IDs). Both decrease with depth on RQ codes; on
Office the weights are 2.00, 1.13, 0.38, 0.48. ``alpha`` mixes with plain CE (the released code's ``front_gain``
mixes the two; alpha = 1 is its ``front_greater_loss`` alone). Its frequency weighting is not implemented.
"""
from __future__ import annotations

import torch

from ..config import LossConfig
from ..data.catalog import CatalogTensors
from .base import LossInputs, LossOutput
from .knobs import Knob
from .registry import Loss, register

FRONT_ALPHA = Knob("front_alpha", 0.1, 1.0, 1.0, help="share of the front-greater weights against plain CE (1: them alone)")


def level_gains(leaf_prefix_nodes: torch.Tensor) -> torch.Tensor:
    """(T,) g_k = H_k - H_{k-1} in bits: the entropy of the catalog's distinct IDs over their length-k prefixes."""
    entropies = [torch.zeros((), dtype=torch.float64)]
    for depth in range(1, leaf_prefix_nodes.shape[1]):
        counts = torch.unique(leaf_prefix_nodes[:, depth].cpu(), return_counts=True)[1].double()
        share = counts / counts.sum()
        entropies.append(-(share * share.log2()).sum())
    return torch.stack(entropies).diff()


def front_greater_weights(gains: torch.Tensor) -> torch.Tensor:
    """(T,) w_k = T log(1 + g_k) / sum_j log(1 + g_j) (negative gains count as 0; all zero: uniform)."""
    scores = torch.log1p(gains.clamp(min=0))
    if float(scores.sum()) <= 0:
        return torch.ones_like(gains)
    return len(gains) * scores / scores.sum()


@register("token_weighted")
class FrontGreaterTokenLoss(Loss):
    """Token CE weighted per code level, the earlier levels more (module doc)."""

    display_name = "token-weighted"
    help = "CE with front-greater per-level token weights from the catalog's information per level (token weighting)"
    knobs = (FRONT_ALPHA,)
    paper_settings = {"tiger": {"office": {"front_alpha": 1.0}}, "llama": {"office": {"front_alpha": 1.0}}}
    num_negatives = 0

    def __init__(self, config: LossConfig, catalog: CatalogTensors) -> None:
        super().__init__(config, catalog)
        self.level_weights = front_greater_weights(level_gains(catalog.leaf_prefix_nodes)).float().to(
            catalog.leaf_prefix_nodes.device)                                       # (T,)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        self.check_candidates(inputs)
        token_logp = self.token_log_probs(inputs, num_candidates=1)[:, 0]           # (B, T) or (B, T + 1) with EOS
        alpha = self.knob("front_alpha")
        levels = self.level_weights.to(token_logp.dtype)
        if token_logp.shape[1] > len(levels):                                       # EOS labelled: weight 1
            levels = torch.cat([levels, levels.new_ones(token_logp.shape[1] - len(levels))])
        weights = (1 - alpha) + alpha * levels                                      # (T',)
        loss = -(token_logp * weights).sum() / (weights.sum() * token_logp.shape[0])
        return LossOutput(loss=loss, metrics={"loss": loss.detach(), "loss_ce": -token_logp.mean().detach()})
