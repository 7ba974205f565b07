"""APAO: prefix-aware pointwise / pairwise losses with adaptive worst-prefix weights (SPEC §3).

Notation: s^t = log p(y^t | y^{<t}, x) (log-softmax over the full vocabulary) and
S^m = sum_{t<=m} s^t, the score of the length-m prefix, m = 1..T.
Total (paper Eq. overall_loss): L = L_CE + beta * sum_m w_m L_m.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config import WEIGHTING_MODES, LossConfig
from ..data.catalog import CatalogTensors
from .base import LossInputs, LossOutput
from .negatives import counted_negatives_mask
from .knobs import BETA, ETA, NUM_NEGATIVES
from .registry import Loss, register

__all__ = ["prefix_scores", "apao_pointwise_losses", "apao_pairwise_losses", "AdaptivePrefixWeights",
           "APAOPointwiseLoss", "APAOPairwiseLoss"]


def prefix_scores(token_logp: torch.Tensor) -> torch.Tensor:
    """Prefix scores S^m = sum_{t<=m} s^t (SPEC §3).

    Args:
        token_logp: (..., T) label log-probs s^t.

    Returns:
        (..., T); entry m-1 is S^m.
    """
    return token_logp.cumsum(dim=-1)


def _depths(token_logp: torch.Tensor) -> torch.Tensor:
    """(T,) the prefix lengths 1..T, in ``token_logp``'s dtype and device."""
    num_levels = token_logp.shape[-1]
    return torch.arange(1, num_levels + 1, dtype=token_logp.dtype, device=token_logp.device)


def apao_pointwise_losses(token_logp: torch.Tensor) -> torch.Tensor:
    """Pointwise prefix losses L_point(m) = -(1/m) S^m, batch mean (SPEC §3, paper Eq. point_loss_def).

    Args:
        token_logp: (B, T) label log-probs of the target.

    Returns:
        (T,) with grad; entry m-1 is L_point(m).
    """
    if token_logp.dim() != 2:
        raise ValueError(f"token_logp must be (B, T), got shape {tuple(token_logp.shape)}")
    return -(prefix_scores(token_logp) / _depths(token_logp)).mean(dim=0)   # (T,)


def apao_pairwise_losses(token_logp: torch.Tensor, valid: torch.Tensor | None = None,
                         divide_by_m: bool = True,
                         num_distinct_prefixes: torch.Tensor | None = None, scale_offset: int = 0) -> torch.Tensor:
    """Pairwise prefix losses, batch mean (SPEC §3, paper Eq. pair_loss_def).

    L_pair(m) = -log( exp(S_+^m) / (exp(S_+^m) + a_m * sum_{j counted at m} exp(S_j^m)) ),
    which equals -log sigma(-log sum_j exp(S_j^m - S_+^m)) when a_m = 1. Computed in log space
    as logsumexp([S_+^m, S_j^m + log a_m]) - S_+^m with uncounted negatives at -inf, so it
    stays finite for any scores, and a row with no counted negative contributes 0.

    Args:
        token_logp: (B, 1 + N, T) label log-probs; candidate 0 is the positive.
        valid: optional (B, 1 + N, T) bool, True where candidate j counts at depth m (see
            ``counted_negatives_mask``); the positive always counts. None: all count.
        divide_by_m: divide L_pair(m) by m, as the paper's code does.
        num_distinct_prefixes: optional (T,) P_m. When given, row b's negative mass at depth m
            is scaled by a_m = (P_m - 1) / max(1, negatives counted in row b at depth m), the
            sampled negatives standing in for all P_m - 1 competing prefixes. None: a_m = 1.
        scale_offset: added to the counted negatives in a_m's denominator; 1 gives the released
            code's (P_m - 1) / (counted + 1), whose count includes the positive.

    Returns:
        (T,) with grad; entry m-1 is L_pair(m).
    """
    if token_logp.dim() != 3 or token_logp.shape[1] < 2:
        raise ValueError(f"token_logp must be (B, 1 + N, T) with N >= 1, got shape {tuple(token_logp.shape)}")
    scores = prefix_scores(token_logp)                                      # (B, C, T)
    positive, negative = scores[:, 0], scores[:, 1:]                         # (B, T), (B, N, T)
    if valid is None:
        counted = torch.ones_like(negative, dtype=torch.bool)                # (B, N, T)
    elif valid.shape != token_logp.shape:
        raise ValueError(f"valid must have token_logp's shape {tuple(token_logp.shape)}, got {tuple(valid.shape)}")
    else:
        counted = valid[:, 1:].bool()                                        # (B, N, T)
    if num_distinct_prefixes is not None:
        if num_distinct_prefixes.shape != (token_logp.shape[-1],):
            raise ValueError(f"num_distinct_prefixes must be (T,) = ({token_logp.shape[-1]},), "
                             f"got {tuple(num_distinct_prefixes.shape)}")
        num_counted = (counted.sum(dim=1) + scale_offset).clamp_min(1).to(scores.dtype)  # (B, T)
        scale = (num_distinct_prefixes.to(scores) - 1) / num_counted         # (B, T); 0 when P_m = 1
        negative = negative + scale.log().unsqueeze(1)                       # (B, N, T)
    negative = negative.masked_fill(~counted, float("-inf"))
    logits = torch.cat([positive.unsqueeze(1), negative], dim=1)            # (B, C, T)
    losses = torch.logsumexp(logits, dim=1) - positive                      # (B, T), >= 0
    if divide_by_m:
        losses = losses / _depths(token_logp)
    return losses.mean(dim=0)                                               # (T,)


class AdaptivePrefixWeights:
    """Prefix weights w on the simplex for sum_m w_m L_m (SPEC §3, paper §4.3 and appendix A).

    Modes:
        ``mirror`` (default): w starts at 1/T; each ``update(L)`` applies the paper's Eq.
            weight_update, w <- w exp(eta L) / sum_j w_j exp(eta L_j), the exact maximiser of
            sum_m w_m L_m - KL(w || w_old) / eta (appendix A). After k updates
            w = softmax(eta * sum_{i<=k} L^(i)); held as log-weights so it never under/overflows.
        ``per_batch`` (the paper's released code): w = normalise(L) * exp(eta L), renormalised,
            recomputed from every batch's own losses (negative losses count as 0; all-zero
            losses give 1/T).
        ``hard_max``: one-hot at argmax_m L_m of the batch (the worst prefix).
        ``uniform``: w_m = 1/T. ``exp_decay``: w_m proportional to exp(-lambda m), m = 1..T.
    ``drop_level=m`` zeroes w_m and renormalises the rest (the prefix-level ablation); the
    mirror state keeps accumulating level m, which only rescales the other levels jointly.

    Args:
        num_prefixes: T.
        eta: step size (>= 0) of ``mirror`` and ``per_batch``.
        mode: one of ``WEIGHTING_MODES``.
        exp_decay_lambda: lambda of ``exp_decay``.
        drop_level: optional level in 1..T to leave unsupervised.
    """

    def __init__(self, num_prefixes: int, eta: float, mode: str = "mirror", exp_decay_lambda: float = 0.5,
                 drop_level: int | None = None) -> None:
        if mode not in WEIGHTING_MODES:
            raise ValueError(f"unknown weighting mode {mode!r}; choose from {list(WEIGHTING_MODES)}")
        if num_prefixes < 1:
            raise ValueError(f"num_prefixes={num_prefixes} must be >= 1")
        if eta < 0:
            raise ValueError(f"eta={eta} must be >= 0")
        if drop_level is not None and not (1 <= drop_level <= num_prefixes and num_prefixes > 1):
            raise ValueError(f"drop_level={drop_level} must lie in [1, {num_prefixes}] and leave a level "
                             f"(num_prefixes={num_prefixes})")
        self.num_prefixes, self.eta, self.mode = num_prefixes, float(eta), mode
        self.exp_decay_lambda, self.drop_level = float(exp_decay_lambda), drop_level
        depths = torch.arange(1, num_prefixes + 1, dtype=torch.float64)     # (T,) m = 1..T
        # unnormalised log w; every mode but exp_decay starts uniform
        self.log_weights = -self.exp_decay_lambda * depths if mode == "exp_decay" else torch.zeros_like(depths)
        self.num_updates = 0

    @property
    def depends_on_batch(self) -> bool:
        """True when w is recomputed from each batch's own losses (``per_batch``, ``hard_max``)."""
        return self.mode in ("per_batch", "hard_max")

    def _kept(self, device: torch.device) -> torch.Tensor:
        kept = torch.ones(self.num_prefixes, dtype=torch.bool, device=device)   # (T,)
        if self.drop_level is not None:
            kept[self.drop_level - 1] = False
        return kept

    @property
    def weights(self) -> torch.Tensor:
        """(T,) float64 current weights on the simplex (zero at ``drop_level``)."""
        kept = self._kept(self.log_weights.device)
        return self.log_weights.masked_fill(~kept, float("-inf")).softmax(dim=0)

    def update(self, losses: torch.Tensor) -> torch.Tensor:
        """Moves w given the prefix losses and returns the new weights (unchanged for fixed modes).

        Args:
            losses: (T,) prefix losses L_m (detached; any device: the state follows it, so no
                device-to-host sync happens on the training step). Non-finite entries count as
                0, as in the paper's code, so one bad batch cannot poison the mirror state.

        Returns:
            (T,) float64 weights on the simplex.
        """
        if losses.shape != (self.num_prefixes,):
            raise ValueError(f"losses must be (T,) = ({self.num_prefixes},), got {tuple(losses.shape)}")
        losses = losses.detach().to(torch.float64)
        losses = torch.where(losses.isfinite(), losses, 0.0)                # as the paper's code; no sync
        log_w = self.log_weights.to(losses.device)
        kept = self._kept(losses.device)
        if self.mode == "mirror":
            log_w = log_w + self.eta * losses
            log_w = log_w - torch.logsumexp(log_w, dim=0)                   # keep it bounded
        elif self.mode == "per_batch":
            nonneg = losses.clamp_min(0).masked_fill(~kept, 0.0)            # (T,)
            total = nonneg.sum()
            base = torch.where(total > 0, nonneg / total.clamp_min(1e-300), torch.full_like(nonneg, 1.0))
            log_w = base.log() + self.eta * nonneg                          # log(normalise(L) exp(eta L))
        elif self.mode == "hard_max":
            worst = losses.masked_fill(~kept, float("-inf")).argmax()
            log_w = torch.full_like(losses, float("-inf")).index_fill(0, worst.view(1), 0.0)
        self.log_weights = log_w
        self.num_updates += 1
        return self.weights

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "log_weights": self.log_weights.detach().cpu().clone(),
                "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mode") != self.mode:
            raise ValueError(f"prefix-weight state was saved in mode {state.get('mode')!r}; "
                             f"this run uses {self.mode!r}")
        log_weights = torch.as_tensor(state["log_weights"], dtype=torch.float64)
        if log_weights.shape != (self.num_prefixes,):
            raise ValueError(f"saved log_weights have shape {tuple(log_weights.shape)}; "
                             f"expected ({self.num_prefixes},)")
        self.log_weights = log_weights.to(self.log_weights.device)
        self.num_updates = int(state["num_updates"])


class _APAOLoss(Loss):
    """L = [use_ce] L_CE + [use_prefix_loss] beta * sum_m w_m L_m (SPEC §3, paper Eq. final_*).

    The weights w come from ``AdaptivePrefixWeights`` (``config.weighting``). In ``mirror`` mode
    (the default) each call uses the weights of the previous optimizer steps and
    ``after_optimizer_step`` applies w <- w exp(eta L) with the step's averaged prefix losses;
    ``per_batch`` and ``hard_max`` recompute w from each micro-batch's own (detached) losses
    inside ``__call__``; ``uniform`` and ``exp_decay`` are fixed.

    Metrics: ``loss``, ``loss_ce`` (logged even when unused), ``loss_apao`` = sum_m w_m L_m
    (before beta), ``loss_prefix_m{m}`` = L_m and ``apao_weight_m{m}`` = the w_m used here.
    """

    def __init__(self, config: LossConfig, catalog: CatalogTensors) -> None:
        super().__init__(config, catalog)
        if not (config.use_ce or config.use_prefix_loss):
            raise ValueError(f"loss {self.name!r}: use_ce=False and use_prefix_loss=False leave nothing to "
                             "minimise; enable at least one")
        self.num_levels = len(catalog.level_sizes)
        self.prefix_weights = AdaptivePrefixWeights(self.num_levels, config.eta, mode=config.weighting,
                                                    exp_decay_lambda=config.exp_decay_lambda,
                                                    drop_level=config.drop_level)

    def prefix_losses(self, token_logp: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        """(B, C, T) label log-probs -> (T,) prefix losses L_m with grad."""
        raise NotImplementedError

    def __call__(self, inputs: LossInputs) -> LossOutput:
        self.check_candidates(inputs)
        token_logp = self.token_log_probs(inputs, 1 + self.num_negatives)   # (B, C, T)
        loss_ce = -token_logp[:, 0].mean()
        # labels may end with EOS (protocol.label_eos): it counts in CE, prefixes are codes only
        prefix = self.prefix_losses(token_logp[..., :self.num_levels], inputs)  # (T,)
        if self.prefix_weights.depends_on_batch:
            batch_prefix = prefix.detach().clone()
            if self.average_over_ranks is not None:  # the ranks' micro-batches together, as one worker's batch
                batch_prefix = self.average_over_ranks(batch_prefix)
            weights = self.prefix_weights.update(batch_prefix)
        else:
            weights = self.prefix_weights.weights
        weights = weights.to(prefix)                                        # (T,)
        loss_apao = (weights * prefix).sum()
        config = self.config
        if config.use_ce and config.use_prefix_loss:
            loss = loss_ce + config.beta * loss_apao
        else:
            loss = loss_ce if config.use_ce else config.beta * loss_apao
        metrics = {"loss": loss.detach(), "loss_ce": loss_ce.detach(), "loss_apao": loss_apao.detach()}
        prefix = prefix.detach()
        for m in range(self.num_levels):
            metrics[f"loss_prefix_m{m + 1}"] = prefix[m]
            metrics[f"apao_weight_m{m + 1}"] = weights[m].detach()
        return LossOutput(loss=loss, metrics=metrics, prefix_losses=prefix)

    def after_optimizer_step(self, output: LossOutput) -> None:
        """Mirror update w <- w exp(eta L) / Z (paper Eq. weight_update), once per optimizer step.

        Args:
            output: its ``prefix_losses`` (T,) must be the mean over the step's accumulation
                micro-batches (and over data-parallel ranks). Other modes ignore it.
        """
        if output.prefix_losses is None:
            raise ValueError(f"loss {self.name!r}: after_optimizer_step needs output.prefix_losses, got None")
        if not self.prefix_weights.depends_on_batch:
            self.prefix_weights.update(output.prefix_losses)

    def state_dict(self) -> dict[str, Any]:
        return {"prefix_weights": self.prefix_weights.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"prefix_weights"}:
            raise ValueError(f"loss {self.name!r} state needs exactly the key 'prefix_weights'; "
                             f"got {sorted(state)}")
        self.prefix_weights.load_state_dict(state["prefix_weights"])


@register("apao_pointwise")
class APAOPointwiseLoss(_APAOLoss):
    """APAO with L_m = L_point(m) = -(1/m) S_+^m; no negatives (paper Eq. final_pointwise)."""

    display_name = "APAO-pointwise"
    help = "CE + beta x adaptively weighted pointwise prefix losses"
    knobs = (BETA, ETA)
    paper_settings = {  # paper Table 5
        "tiger": {"office": {"beta": 0.3, "eta": 1e-4}, "grocery": {"beta": 0.1, "eta": 5e-5},
                  "beauty": {"beta": 0.1, "eta": 1e-5}, "yelp": {"beta": 0.05, "eta": 1e-5}},
        "llama": {"office": {"beta": 0.4, "eta": 5e-4}, "grocery": {"beta": 0.4, "eta": 5e-5},
                  "beauty": {"beta": 0.3, "eta": 1e-4}, "yelp": {"beta": 0.4, "eta": 1e-5}},
    }
    num_negatives = 0

    def prefix_losses(self, token_logp: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        return apao_pointwise_losses(token_logp[:, 0])


@register("apao_pairwise")
class APAOPairwiseLoss(_APAOLoss):
    """APAO with L_m = L_pair(m) against N sampled negatives (paper Eq. final_pairwise).

    Negatives that share the positive's length-m prefix never count; repeats among negatives
    are dropped when ``pairwise_mask_duplicates``; ``pairwise_scale_negatives`` scales by
    (P_m - 1) / counted (``pairwise_scale_plus_one``: / (counted + 1)); ``pairwise_divide_by_m`` divides by m.
    """

    display_name = "APAO-pairwise"
    help = "CE + beta x adaptively weighted pairwise prefix losses against N sampled negatives"
    knobs = (BETA, ETA, NUM_NEGATIVES)
    # paper Table 5; it gives no number of negatives: 100 (NUM_NEGATIVES.default) everywhere
    paper_settings = {
        "tiger": {"office": {"beta": 0.2, "eta": 3e-5}, "grocery": {"beta": 0.1, "eta": 5e-5},
                  "beauty": {"beta": 0.1, "eta": 1e-4}, "yelp": {"beta": 0.05, "eta": 5e-6}},
        "llama": {"office": {"beta": 0.4, "eta": 5e-5}, "grocery": {"beta": 0.2, "eta": 3e-5},
                  "beauty": {"beta": 0.4, "eta": 1e-5}, "yelp": {"beta": 0.1, "eta": 5e-6}},
    }
    uses_negatives = True

    def __init__(self, config: LossConfig, catalog: CatalogTensors) -> None:
        super().__init__(config, catalog)
        self.num_negatives = config.num_negatives
        self.num_distinct_prefixes = catalog.num_distinct_prefixes if config.pairwise_scale_negatives else None

    def prefix_losses(self, token_logp: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
        valid = counted_negatives_mask(inputs.candidate_nodes, self.config.pairwise_mask_duplicates)  # (B, C, T)
        return apao_pairwise_losses(token_logp, valid, divide_by_m=self.config.pairwise_divide_by_m,
                                    num_distinct_prefixes=self.num_distinct_prefixes,
                                    scale_offset=int(self.config.pairwise_scale_plus_one))
