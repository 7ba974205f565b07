"""Frozen configuration dataclasses; plain nested dicts at the edges (Tune, MLflow, checkpoints).

``from_dict`` rejects unknown keys and wrong types and names the key, so a typo in a sweep's
search space fails before any trial starts.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

C = TypeVar("C", bound="_Config")

BACKBONE_NAMES = ("tiger", "llama")
# `--model-size tiny`: smoke studies, quick plumbing checks and the tests' small real runs
TINY_MODEL = {"d_model": 64, "num_layers": 2, "num_heads": 2, "head_dim": 32, "d_ff": 128}
PRECISIONS = ("auto", "fp32", "bf16")  # resolved per device by training.precision.resolve_precision
FULL_SORT_TEST = ("auto", "on", "off")  # TrainConfig.full_sort_test
WEIGHTING_MODES = ("mirror", "per_batch", "uniform", "exp_decay", "hard_max")
PROTOCOL_NAMES = ("paper", "reference")  # see apao_ray/protocol.py and docs/PROTOCOLS.md
# the fastest micro-batch at effective batch 1024 (benchmarks/RESULTS.md): 128 on 2 CPUs (1.08x 256),
# 1024 on one H200 (5.6x 128, 2026-11-26); gradient accumulation keeps the optimizer step the same
MICRO_BATCH_CPU, MICRO_BATCH_GPU = 128, 1024
# evaluation (beam search) batches: 256 on a CPU keeps a worker's peak memory low; on one H200 1024 decoded
# 3.0x (TIGER) and 4.0x (Llama) the users/s of 256 (2026-11-26)
EVAL_BATCH_CPU, EVAL_BATCH_GPU = 256, 1024


def default_micro_batch(use_gpu: bool) -> int:
    """The micro-batch a trial gets when none is given: the fastest measured on its kind of device."""
    return MICRO_BATCH_GPU if use_gpu else MICRO_BATCH_CPU


def default_eval_batch(use_gpu: bool) -> int:
    """The evaluation batch a trial gets when none is given."""
    return EVAL_BATCH_GPU if use_gpu else EVAL_BATCH_CPU


class _Config:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any] | None) -> C:
        values = dict(values or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"unknown {cls.__name__} key(s) {unknown}; allowed: {sorted(fields)}")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for name, value in values.items():
            sub = _config_class(hints[name])
            if sub is not None and isinstance(value, (dict, sub)):
                value = sub.from_dict(value.to_dict() if isinstance(value, sub) else value)
            else:
                value = _coerce(cls.__name__, name, hints[name], value)
            kwargs[name] = value
        return cls(**kwargs)

    def replace(self: C, **changes: Any) -> C:
        return type(self).from_dict({**self.to_dict(), **changes})  # re-validated, unlike dataclasses.replace


def _config_class(hint: Any) -> type[_Config] | None:
    return hint if isinstance(hint, type) and issubclass(hint, _Config) else None


def _coerce(owner: str, name: str, hint: Any, value: Any) -> Any:
    """Checks ``value`` against the annotation; ints are accepted for floats (Tune, JSON)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return None
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is int and isinstance(value, float) and value.is_integer():
            return int(value)  # Tune/Optuna hand back 100.0 for an int grid sometimes
        if option in (str, bool) and isinstance(value, option):
            return value
        if typing.get_origin(option) is tuple and isinstance(value, (list, tuple)):
            return tuple(value)
        if typing.get_origin(option) is dict and isinstance(value, dict):
            return dict(value)  # its values are checked by the owner's __post_init__
    raise ValueError(f"{owner}.{name} must be {hint}, got {value!r} ({type(value).__name__})")


def _check_choice(owner: str, name: str, value: Any, allowed: typing.Iterable[Any]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{owner}.{name}={value!r} is not allowed; choose from {allowed}")


def _check_range(owner: str, name: str, value: float | int | None, low: float, high: float = float("inf")) -> None:
    if value is not None and not (low <= value <= high):
        raise ValueError(f"{owner}.{name}={value!r} is out of range; allowed: [{low}, {high}]")


@dataclass(frozen=True)
class DataConfig(_Config):
    """Which dataset and how it is cut into samples."""

    dataset: str = "synthetic"
    data_dir: str | None = None
    max_history: int = 20
    synthetic_seed: int = 0

    def __post_init__(self) -> None:
        _check_range("DataConfig", "max_history", self.max_history, 1, 1000)


@dataclass(frozen=True)
class ModelConfig(_Config):
    """Backbone and its size; None means the paper's size for that backbone (SPEC §2)."""

    backbone: str = "tiger"
    d_model: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    dropout: float | None = None
    llama_history_eos: bool = True     # Llama only: EOS between history and target (the released code has none)

    def __post_init__(self) -> None:
        _check_choice("ModelConfig", "backbone", self.backbone, BACKBONE_NAMES)
        for name in ("d_model", "num_layers", "num_heads", "head_dim", "d_ff"):
            _check_range("ModelConfig", name, getattr(self, name), 1, 1 << 16)
        _check_range("ModelConfig", "dropout", self.dropout, 0.0, 1.0)


@dataclass(frozen=True)
class LossConfig(_Config):
    """Every knob of SPEC §3. ``name`` is a key of ``apao_ray.losses.LOSSES``."""

    name: str = "ce"
    beta: float = 0.1                  # weight of the prefix loss (APAO) / lambda of one-stage CE+S-DPO
    eta: float = 1e-4                  # step size of the adaptive weights
    tau: float = 1.0                   # MSL temperature
    num_negatives: int = 100           # pairwise / preference losses only
    weighting: str = "mirror"
    exp_decay_lambda: float = 0.5      # w_m proportional to exp(-lambda * m) for weighting="exp_decay"
    pairwise_divide_by_m: bool = True
    pairwise_scale_negatives: bool = True
    pairwise_scale_plus_one: bool = False  # (P_m - 1) / (counted + 1) as the released code, not / counted
    pairwise_mask_duplicates: bool = True
    use_ce: bool = True                # ablation: without CE
    use_prefix_loss: bool = True       # ablation: without the prefix loss
    drop_level: int | None = None      # ablation: no supervision at prefix level m (1..T)
    beta_pref: float = 1.0             # DPO / DMPO / S-DPO temperature
    pretrain_ce_epochs: int = 0        # two-stage: CE epochs, then this loss from the best CE epoch (own optimizer)
    # knobs of losses defined later (``Loss.knobs`` not named above), by name; configs written before: none
    extra: dict[str, float] = field(default_factory=dict)

    def knob(self, name: str, default: float | None = None) -> float:
        """The knob ``name``: a field above or an ``extra`` knob, else ``default`` (None: a KeyError)."""
        if name in self.extra:
            return self.extra[name]
        if name != "extra" and name in {f.name for f in dataclasses.fields(self)}:
            return getattr(self, name)
        if default is None:
            raise KeyError(f"LossConfig has no knob {name!r}: not a field and not in extra {sorted(self.extra)}")
        return default

    def with_knobs(self, knobs: dict[str, float]) -> "LossConfig":
        """This config with ``knobs`` set: a field's name sets the field, any other name goes in ``extra``."""
        fields = {f.name for f in dataclasses.fields(self)} - {"extra"}
        extra = {**self.extra, **{k: v for k, v in knobs.items() if k not in fields}}
        return self.replace(**{k: v for k, v in knobs.items() if k in fields}, extra=extra)

    def __post_init__(self) -> None:
        fields = {f.name for f in dataclasses.fields(self)}
        for name, value in self.extra.items():
            if name in fields or not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"LossConfig.extra[{name!r}]={value!r}: extra knobs are numbers whose names are "
                                 f"not LossConfig fields ({sorted(fields)})")
        _check_choice("LossConfig", "weighting", self.weighting, WEIGHTING_MODES)
        _check_range("LossConfig", "beta", self.beta, 0.0)
        _check_range("LossConfig", "eta", self.eta, 0.0)
        _check_range("LossConfig", "tau", self.tau, 1e-6)
        _check_range("LossConfig", "num_negatives", self.num_negatives, 1, 1 << 20)
        _check_range("LossConfig", "drop_level", self.drop_level, 1, 64)
        _check_range("LossConfig", "pretrain_ce_epochs", self.pretrain_ce_epochs, 0)


@dataclass(frozen=True)
class TrainConfig(_Config):
    """Optimisation and evaluation schedule (SPEC §5 defaults)."""

    epochs: int = 200
    batch_size: int | None = None      # per optimizer micro-step; None: default_micro_batch(use_gpu)
    effective_batch_size: int = 1024   # reached by gradient accumulation
    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup_fraction: float = 0.01
    patience: int = 20
    metric: str = "ndcg_at_10"         # best/val/<metric>, at the kept epoch, ranks trials (select_by keeps it)
    seed: int = 0
    max_train_samples: int | None = None
    num_workers: int = 1
    use_gpu: bool = False
    precision: str = "auto"            # auto: bf16 where the device has it natively, else fp32
    group_by_length: bool = False      # batches of similar history lengths (less padding, faster)
    grad_clip: float = 1.0
    beam_size: int = 20
    eval_batch_size: int | None = None  # None: default_eval_batch(use_gpu)
    eval_max_users: int | None = None  # validate on a fixed random subset of users (recorded)
    retention_users: int = 128         # test users whose full-sort top-K gives beam retention (0 = off)
    validate_retention: bool = False   # also measure retention on validation every epoch (costly)
    full_sort_test: str = "auto"       # rank every test user by the exact full sort too, at the kept epoch: on / off /
                                       # auto (on a GPU; training/evaluation.py tests_full_sort)
    test_every_epoch: bool = False     # diagnosis only: the test split after every epoch, as diagnosis/test/<metric>;
                                       # no selection rule reads it (names.DIAGNOSIS_PREFIX)
    topk: tuple[int, ...] = (5, 10, 20)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "TrainConfig":
        values = dict(values or {})
        if "bf16" in values:  # configs and checkpoints written before `precision` replaced `bf16`
            is_bf16 = values.pop("bf16")
            values.setdefault("precision", "bf16" if is_bf16 else "fp32")
        return super().from_dict(values)

    def __post_init__(self) -> None:
        if self.batch_size is None:  # the device's, unless the workers' micro-batches would pass the optimizer step
            object.__setattr__(self, "batch_size", max(1, min(default_micro_batch(self.use_gpu),
                                                              self.effective_batch_size // max(1, self.num_workers))))
        if self.eval_batch_size is None:
            object.__setattr__(self, "eval_batch_size", default_eval_batch(self.use_gpu))
        _check_choice("TrainConfig", "precision", self.precision, PRECISIONS)
        _check_choice("TrainConfig", "full_sort_test", self.full_sort_test, FULL_SORT_TEST)
        for name in ("epochs", "batch_size", "effective_batch_size", "patience", "num_workers",
                     "beam_size", "eval_batch_size"):
            _check_range("TrainConfig", name, getattr(self, name), 1)
        _check_range("TrainConfig", "lr", self.lr, 1e-12, 10.0)
        _check_range("TrainConfig", "warmup_fraction", self.warmup_fraction, 0.0, 1.0)
        _check_range("TrainConfig", "max_train_samples", self.max_train_samples, 1)
        _check_range("TrainConfig", "eval_max_users", self.eval_max_users, 1)
        if self.effective_batch_size < self.batch_size * self.num_workers:
            raise ValueError(f"TrainConfig.effective_batch_size={self.effective_batch_size} must be "
                             f">= batch_size={self.batch_size} x num_workers={self.num_workers} (one micro-batch "
                             "per worker per optimizer step); lower the batch size")


@dataclass(frozen=True)
class ProtocolConfig(_Config):
    """Which protocol the run follows and its knobs kept here (``apao_ray.protocol`` resolves presets).

    The other protocol knobs live where they act: ``LossConfig.weighting``/``eta``/
    ``pairwise_scale_plus_one`` and ``ModelConfig.llama_history_eos``.
    """

    name: str = "paper"                # the preset the knobs were resolved from
    select_by: str = "ndcg_at_10"      # validation metric that keeps the epoch; "loss" = lowest mean validation loss
    label_eos: bool = False            # labels are the T codes + EOS: CE over T+1 tokens, beam score + log p(EOS | item)
    clip_summed_grad: bool = False     # clip (and step with) the sum of the micro-batch gradients, not their mean

    def __post_init__(self) -> None:
        _check_choice("ProtocolConfig", "name", self.name, PROTOCOL_NAMES)
        if not self.select_by or "/" in self.select_by:
            raise ValueError(f"ProtocolConfig.select_by={self.select_by!r} must be 'loss' or a validation metric "
                             "name without its 'val/' prefix, e.g. 'ndcg_at_10'")


@dataclass(frozen=True)
class TrialConfig(_Config):
    """One trial = dataset x backbone x loss x training schedule x seed, under one protocol."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
