"""Protocol presets: the paper as written, or the authors' released code (docs/PROTOCOLS.md).

A preset is a value for every protocol knob. ``apply_protocol`` writes a preset into a
:class:`~apao_ray.config.TrialConfig`, then the knobs given explicitly on top, so an explicit
knob always beats the preset; the resolved knobs are ordinary config fields, hence MLflow
params and checkpoint contents of every run. ``protocol_overrides`` names the knobs that differ
from the run's preset (the ``apao.protocol`` tag says ``reference+select_by`` then).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterable

from .config import PROTOCOL_NAMES, ProtocolConfig, TrialConfig
from .data.catalog import EOS_TOKEN
from .names import LOSS_RULE, SELECTION_TAG
from .rank_metrics import rank_metrics_at

if TYPE_CHECKING:  # torch where a tensor is touched: the study's driver and `--help` import this module
    import torch

    from .decoding.scoring import StepScoring

# knob -> (TrialConfig section, field): where each knob lives and acts
KNOBS: dict[str, tuple[str, str]] = {
    "select_by": ("protocol", "select_by"),
    "weighting": ("loss", "weighting"),
    "eta": ("loss", "eta"),
    "label_eos": ("protocol", "label_eos"),
    "clip_summed_grad": ("protocol", "clip_summed_grad"),
    "llama_history_eos": ("model", "llama_history_eos"),
    "pairwise_scale_plus_one": ("loss", "pairwise_scale_plus_one"),
}

PRESETS: dict[str, dict[str, Any]] = {
    # the paper (and SPEC.md) as written
    "paper": {"select_by": "ndcg_at_10", "weighting": "mirror", "eta": 1e-4, "label_eos": False,
              "clip_summed_grad": False, "llama_history_eos": True, "pairwise_scale_plus_one": False},
    # github.com/yuyq18/APAO at aa08fcf with transformers 4.51, as its scripts run it
    "reference": {"select_by": "loss", "weighting": "per_batch", "eta": 0.0, "label_eos": True,
                  "clip_summed_grad": True, "llama_history_eos": False, "pairwise_scale_plus_one": True},
}

PRESET_HELP = {
    "paper": "the paper as written: keep the epoch with the best validation NDCG@10, persistent mirror weights "
             "(eta 1e-4), CE over the 4 code tokens, clip the mean gradient of the accumulation steps, Llama reads "
             "an EOS between history and target, pairwise scale (P_m - 1) / counted negatives",
    "reference": "the authors' released code (yuyq18/APAO aa08fcf, transformers 4.51): keep the epoch with the "
                 "lowest validation loss (the training objective, averaged over the validation split), per-batch "
                 "weights with eta 0, labels = 4 codes + EOS (CE over 5 tokens, beam score includes log p(EOS)), "
                 "clip the summed gradient, no EOS between history and target for Llama, pairwise scale "
                 "(P_m - 1) / (counted + 1)",
}


def preset(name: str) -> dict[str, Any]:
    """The knob values of preset ``name`` (a copy)."""
    if name not in PRESETS:
        raise ValueError(f"unknown protocol {name!r}; choose from {list(PROTOCOL_NAMES)}")
    return dict(PRESETS[name])


def apply_protocol(config: TrialConfig, name: str, overrides: dict[str, Any] | None = None) -> TrialConfig:
    """``config`` with preset ``name``'s knobs, then ``overrides`` (None values = take the preset).

    Args:
        config: any trial config; its fields outside ``KNOBS`` are kept.
        name: one of ``PROTOCOL_NAMES``.
        overrides: knob name (a key of ``KNOBS``) -> explicit value.

    Returns:
        The re-validated config with ``protocol.name = name``.
    """
    values = preset(name)
    explicit = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(explicit) - set(KNOBS))
    if unknown:
        raise ValueError(f"unknown protocol knob(s) {unknown}; choose from {sorted(KNOBS)}")
    values.update(explicit)
    sections: dict[str, dict[str, Any]] = {"protocol": {"name": name}}
    for knob, value in values.items():
        section, field_name = KNOBS[knob]
        sections.setdefault(section, {})[field_name] = value
    return config.replace(**{section: {**getattr(config, section).to_dict(), **fields}
                             for section, fields in sections.items()})


def selectable_metrics(config: TrialConfig) -> list[str]:
    """What ``protocol.select_by`` may name: ``loss`` and the validation metrics a trial reports."""
    train = config.train
    cutoffs = [k for k in train.topk if k <= train.beam_size]
    names = ["loss", "loss_ce", *(name for name, (metric, _) in rank_metrics_at(cutoffs, train.beam_size).items()
                                   if metric.is_selectable)]
    names += [f"prefix_recall_at_{train.beam_size}_m{m}" for m in range(1, 5)]
    if train.retention_users:
        names.append(f"beam_retention_at_{train.beam_size}")
    return names


def check_select_by(config: TrialConfig) -> None:
    """Raises ValueError unless ``protocol.select_by`` names a metric the trial reports."""
    allowed = selectable_metrics(config)
    if config.protocol.select_by not in allowed:
        raise ValueError(f"select_by={config.protocol.select_by!r} is not a validation metric of this trial; "
                         f"choose from {allowed}")


def resolved_knobs(config: TrialConfig) -> dict[str, Any]:
    """Knob name -> the value ``config`` runs with."""
    return {knob: getattr(getattr(config, section), field_name) for knob, (section, field_name) in KNOBS.items()}


def protocol_overrides(config: TrialConfig) -> list[str]:
    """Knobs whose value differs from the run's preset, sorted."""
    base = preset(config.protocol.name)
    return sorted(knob for knob, value in resolved_knobs(config).items() if value != base[knob])


def protocol_tag(config: TrialConfig) -> str:
    """The ``apao.protocol`` tag: the preset's name, plus ``+knob`` for each knob set apart from it."""
    return "+".join([config.protocol.name, *protocol_overrides(config)])


def decoding_scoring(config: TrialConfig) -> "StepScoring":
    """How a model trained under ``config`` is decoded: its loss's step normaliser and
    temperature, and the end token when the labels carried one (``protocol.label_eos``)."""
    # lazy: torch; the study driver and every command's parser import this module
    from .decoding.scoring import StepScoring
    from .losses import LOSSES

    if config.loss.name not in LOSSES:
        raise ValueError(f"unknown loss {config.loss.name!r}; choose from {sorted(LOSSES)}")
    loss_class = LOSSES[config.loss.name]
    return StepScoring(normaliser=loss_class.step_normaliser,
                       temperature=loss_class.decoding_temperature(config.loss),
                       end_token=EOS_TOKEN if config.protocol.label_eos else None)


PROTOCOL_TAG = "apao.protocol"
SCHEDULE_TAG = "apao.schedule"
PAPER_SCHEDULE = {"epochs": 200, "patience": 20}  # SPEC §5; what paper Table 1's numbers were trained with


def schedule_label(epochs: int, patience: int) -> str:
    """``paper`` for the paper's 200 epochs / patience 20, else ``<E> epochs / patience <P>``.

    Only runs labelled ``paper`` (and run long enough to stop on their own) can be compared
    with paper Table 1: a shorter schedule also ends its cosine learning rate sooner.
    """
    if epochs == PAPER_SCHEDULE["epochs"] and patience == PAPER_SCHEDULE["patience"]:
        return "paper"
    return f"{epochs} epochs / patience {patience}"


def run_tags(config: TrialConfig) -> dict[str, str]:
    """MLflow tags every study run carries: the protocol and the schedule."""
    return {PROTOCOL_TAG: protocol_tag(config), SCHEDULE_TAG: schedule_label(config.train.epochs, config.train.patience)}


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of validation ``metric`` is the better one (the validation loss); every rule that keeps
    an epoch or ranks trials reads its direction here."""
    return metric == LOSS_RULE


@dataclass(frozen=True)
class Selection:
    """How a study names its best trial, defined once per study from its base config and recorded with it (the
    parent run's tag ``apao.selection``, the Optuna study's user attribute ``selection``).

    Each trial keeps the epoch ``rule`` picks (``protocol.select_by``: a validation metric, or ``loss``) and stops
    early on it; trials are ranked by ``key`` (``best/val/<metric>``, the validation ``metric`` at the kept epoch),
    best first in direction ``mode``, a tie going to the trial that started first (``analysis.outcome.best_of``).
    Optuna, ASHA, the progress lines, the study's table, ``best``, ``report``, the registered ``@best`` model and the
    parent run's answer all read this one value.
    """

    metric: str = "ndcg_at_10"  # TrainConfig.metric
    rule: str = "ndcg_at_10"    # ProtocolConfig.select_by

    @classmethod
    def of(cls, config: TrialConfig) -> "Selection":
        """The selection of a study whose trials run ``config`` (its base config)."""
        return cls(config.train.metric, config.protocol.select_by)

    @property
    def key(self) -> str:
        """``best/val/ndcg_at_10``: what each trial reports and every surface ranks trials by."""
        return f"best/val/{self.metric}"

    @property
    def mode(self) -> str:
        """``max`` or ``min`` (the validation loss), as Optuna and ASHA take it."""
        return "min" if lower_is_better(self.metric) else "max"

    def score(self, metrics: Any) -> float | None:
        """The trial's ``key`` made larger-is-better (negated for ``min``); None when it has none."""
        value = metrics.get(self.key)
        return None if value is None else (-float(value) if self.mode == "min" else float(value))

    def text(self) -> str:
        """``best/val/ndcg_at_10 (max) at the epoch validation ndcg_at_10 keeps, a tie to the trial started first``."""
        kept = "the lowest validation loss" if self.rule == LOSS_RULE else f"validation {self.rule}"
        return f"{self.key} ({self.mode}) at the epoch {kept} keeps, a tie to the trial started first"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def recorded_selection(parents: Iterable[tuple[dict[str, str], dict[str, str]]]) -> Selection:
    """The selection the studies of ``parents`` (each its parent run's ``(tags, params)``) recorded: the tag
    ``apao.selection``, else (a study recorded before it) the base config's ``train.metric`` and ``select_by``
    params, else the default. Raises ValueError, naming them, when the studies select differently (one winner per
    method could not be named across them)."""
    found: dict[Selection, None] = {}
    for tags, params in parents:
        if tags.get(SELECTION_TAG):
            found[Selection(**json.loads(tags[SELECTION_TAG]))] = None
        else:
            default = Selection()
            found[Selection(params.get("base.train.metric", default.metric),
                            params.get("base.protocol.select_by", default.rule))] = None
    if len(found) > 1:
        raise ValueError(f"these studies select their best trial differently ({[s.text() for s in found]}); "
                         "read one study at a time (--study-name)")
    return next(iter(found), Selection())


def with_end_token(tokens: torch.Tensor, label_eos: bool) -> torch.Tensor:
    """Label tokens of candidates: (..., T) codes, plus an EOS column when ``label_eos`` -> (..., T+1).

    A backbone decodes ``labels[..., :-1]``, so with EOS its last position predicts EOS after
    the T codes, and every loss's CE averages T + 1 tokens, as the released code's labels do.
    """
    if not label_eos:
        return tokens
    import torch  # lazy: as in decoding_scoring

    return torch.cat([tokens, torch.full_like(tokens[..., :1], EOS_TOKEN)], dim=-1)


def gradient_scale(num_chunk: int, num_step: int, protocol: ProtocolConfig) -> float:
    """Factor on a micro-batch's mean loss before backward.

    ``num_chunk / num_step`` makes the accumulated gradient the mean over the optimizer step's
    samples (paper); 1 makes it the sum of the micro-batch gradients, which transformers 4.51
    clips and steps with in the released code (``clip_summed_grad``).
    """
    return 1.0 if protocol.clip_summed_grad else num_chunk / num_step
