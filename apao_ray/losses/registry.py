"""The Loss interface every loss implements, and the ``LOSSES`` name registry.

Loss modules register their classes with ``@register("name")``; importing
``apao_ray.losses`` imports them all, so ``LOSSES`` is complete whenever this module is.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..config import LossConfig
from ..data.catalog import CatalogTensors
from ..models.base import label_log_probs
from .base import LossInputs, LossOutput
from .knobs import Knob, PaperSettings, paper_setting


class Loss:
    """One training objective, built from a LossConfig and the catalog, called once per micro-batch.

    What the training loop must provide:
        * ``inputs.logits`` of shape (B, 1 + num_negatives, T, V), candidate 0 the target;
          losses without negatives accept any C and read candidate 0 only.
        * ``inputs.ref_token_logp`` (B, C, T) from a frozen reference when ``needs_reference``.
        * ``after_optimizer_step(output)`` once per optimizer step, after ``optimizer.step()``,
          with ``output.prefix_losses`` averaged over that step's accumulation micro-batches
          (and all-reduced across data-parallel ranks, so every rank keeps the same state).
        * ``state_dict()`` in the checkpoint and ``load_state_dict()`` on resume.

    Attributes:
        name: the registry key.
        display_name, help: how tables and ``--help`` name it, and one line on what it is.
        knobs: what a study tunes, with default ranges (``Knob``); none: a baseline, trained once per backbone.
        paper_settings: backbone -> dataset -> knob values (paper Table 5): a study's first trial of the
            method (``paper_point``); a dataset not named takes the Office setting, a knob not named its default.
        needs_ce_stage: a two-stage loss: CE for ``LossConfig.pretrain_ce_epochs`` epochs first, then this
            loss against the frozen CE model.
        uses_negatives: whether it scores sampled negatives (true also where their number is fixed, as DPO's one).
        num_negatives: N, sampled negatives per target (C = 1 + N).
        needs_reference: whether ``ref_token_logp`` is required.
        step_normaliser: ``vocabulary`` or ``valid_children``, what decoding must normalise
            over so that it scores items as the loss trained them.
    """

    name: str = ""
    display_name: str = ""
    help: str = ""
    knobs: tuple[Knob, ...] = ()
    paper_settings: PaperSettings = {}
    needs_ce_stage: bool = False
    uses_negatives: bool = False
    num_negatives: int = 0
    needs_reference: bool = False
    # how decoding normalises step scores for a model trained with this loss (decoding/scoring.py)
    step_normaliser: str = "vocabulary"
    # set by a data-parallel training loop while it trains: averages a detached tensor over the ranks (a
    # collective), for state a loss derives from a micro-batch (APAO's per_batch weights); None: one process
    average_over_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def decoding_temperature(cls, config: LossConfig) -> float:
        """Temperature decoding divides the logits by (MSL: its tau; others 1)."""
        return 1.0

    @classmethod
    def knob_named(cls, name: str) -> Knob | None:
        return next((knob for knob in cls.knobs if knob.name == name), None)

    @classmethod
    def paper_point(cls, backbone: str, dataset: str) -> dict[str, float]:
        """Each tuned knob's paper value for (backbone, dataset) (``paper_settings``)."""
        return paper_setting(cls.paper_settings, cls.knobs, backbone, dataset)

    def __init__(self, config: LossConfig, catalog: CatalogTensors) -> None:
        self.config = config
        self.catalog = catalog

    def knob(self, name: str) -> float:
        """The value of knob ``name`` in this loss's config: a ``LossConfig`` field or one of its ``extra``
        knobs, else the default of the ``Knob`` declared here."""
        declared = self.knob_named(name)
        return self.config.knob(name, None if declared is None else declared.default)

    def __call__(self, inputs: LossInputs) -> LossOutput:
        raise NotImplementedError

    def after_optimizer_step(self, output: LossOutput) -> None:
        """Updates training state (APAO's mirror weights) once per optimizer step; default: none."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"loss {self.name!r} has no state; got keys {sorted(state)}")

    # --- helpers shared by the subclasses ---------------------------------------------------
    def check_candidates(self, inputs: LossInputs) -> None:
        """Raises when the inputs do not carry 1 + num_negatives candidates per row."""
        if inputs.logits.dim() != 4:
            raise ValueError(f"loss {self.name!r}: logits must be (B, C, T, V), got {tuple(inputs.logits.shape)}")
        num_candidates = inputs.logits.shape[1]
        if self.num_negatives and num_candidates != 1 + self.num_negatives:
            raise ValueError(f"loss {self.name!r} needs C = 1 + num_negatives = {1 + self.num_negatives} "
                             f"candidates per row; got C={num_candidates}")

    def token_log_probs(self, inputs: LossInputs, num_candidates: int | None = None) -> torch.Tensor:
        """(B, C', T) label log-probs s^t (log-softmax over the full vocabulary).

        Only the first ``num_candidates`` candidates are scored (all when None), in at least
        float32 whatever the logits' dtype (``label_log_probs``).
        """
        logits, candidates = inputs.logits, inputs.candidates
        if num_candidates is not None:
            logits, candidates = logits[:, :num_candidates], candidates[:, :num_candidates]
        return label_log_probs(logits, candidates)                         # (B, C', T) float32+


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Upcasts float16/bfloat16 to float32; float32/float64 pass unchanged."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


LOSSES: dict[str, type[Loss]] = {}


def register(name: str) -> Callable[[type[Loss]], type[Loss]]:
    """Class decorator: adds the class to ``LOSSES`` under ``name`` and sets its ``name``."""
    def add(cls: type[Loss]) -> type[Loss]:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice")
        cls.name = name
        cls.display_name = cls.__dict__.get("display_name") or name
        LOSSES[name] = cls
        return cls
    return add


def build_loss(config: LossConfig, catalog: CatalogTensors) -> Loss:
    """Builds the loss named ``config.name`` (a key of ``LOSSES``).

    Args:
        config: every loss knob (SPEC §3).
        catalog: trie tables on the training device (MSL masks, P_m for the pairwise scaling).

    Raises:
        ValueError: unknown name, listing the registered ones.
    """
    name = config.name
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose from {sorted(LOSSES)}")
    return LOSSES[name](config, catalog)
