"""A study's plan before any trial: trials per method, epochs, and its cost on this hardware, as the ``Plan``
the driver reads and the study prints (its text) and records (its dict). How one is made from the probes and
the budget fit: :mod:`.make`."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ...names import counted
from ..spec.duration import format_duration
from ..spec.study import with_pretrain
from .budget import Fit, MethodCost, asha_rungs, study_seconds
from .probe_cache import PROBE_SECONDS, PROBE_TRIAL_SHARE, probe_cache_path

if TYPE_CHECKING:  # the types only
    from ...config import TrialConfig
    from ..spec.space import SearchSpec

MEMORY_WARNING_FRACTION = 0.8  # of the machine's memory, for the plan's peak (Ray's monitor kills at 0.95)


def method_config(base: TrialConfig, backbone: str, loss: str) -> dict[str, Any]:
    """The trial config a method is probed with (and its cache entry's key is made of), as plain JSON."""
    config = base.replace(model=base.model.replace(backbone=backbone).to_dict(),
                          loss=base.loss.replace(name=loss).to_dict())
    return json.loads(json.dumps(config.to_dict()))


@dataclass
class Plan:
    """The study as it will run: derived from the spec and the probes, data (``to_dict``) and text."""

    dataset: str
    protocol: str
    precision: str
    slots: int
    methods: list[MethodCost]  # every requested method, deferred ones too (fit.deferred names them)
    asked_epochs: int
    asked_trials_per_tuned: int
    fit: Fit
    budget_s: float | None = None
    probes_cached: int = 0
    probes_observed: int = 0  # methods whose rates come from finished trials on this machine (record_observed)
    allocator: str = ""  # the probes' memory allocator, what this machine's trials get
    notes: list[str] = field(default_factory=list)
    repeat_seeds: tuple[int, ...] = ()  # --seeds after the first: each method's best configuration again
    threads: int = 1  # torch threads per worker (the CPU-seconds estimate)
    workers: int = 1  # data-parallel workers per trial (--workers-per-trial)
    machine_bytes: int = 0  # this machine's memory when the study runs on it (0: a cluster, not checked)
    start_order: tuple[tuple[str, str], ...] = ()  # (backbone, loss) by decreasing epoch time: trials start so
    side_by_side: float = 1.0  # the factor on probed rates for trials running side by side (SIDE_BY_SIDE_SLOWDOWN)
    search_seed: int = 0  # the seed the search runs on (seeds the fill adds follow the asked ones)
    effective_batch_size: int = 1024  # the asked optimizer batch (fit.effective_batch_size: the budget protocol's)
    cohort_size: int = 1  # the repeats train as fused cohorts of up to this many trials (--cohort-size; 1: alone)
    paper_setting_first: bool = True  # a tuned method's first trial is its paper setting (--enqueue-paper-setting)
    # the trials' schedule as the study runs it: every trial's config (the fitted epochs, training subset,
    # optimizer batch and CE stage) and the search (trials per tuned method, start order, deferred methods)
    base: TrialConfig | None = None
    search: SearchSpec | None = None

    @property
    def deferred(self) -> set[tuple[str, str]]:
        return {(d.backbone, d.loss) for d in self.fit.deferred}

    @property
    def fitted_methods(self) -> list[MethodCost]:
        """The methods that run, with the fitted training subset (a budget's last resort), if any."""
        return [m.with_train_samples(self.fit.train_samples) for m in self.methods
                if (m.backbone, m.loss) not in self.deferred]

    @property
    def run_repeat_seeds(self) -> tuple[int, ...]:
        """The seeds each method's best configuration trains on again: the asked ones, then the fill's."""
        taken, added = {self.search_seed, *self.repeat_seeds}, []
        candidate = max(taken) + 1
        while len(added) < self.fit.added_seeds:
            if candidate not in taken:
                added.append(candidate)
            candidate += 1
        return (*self.repeat_seeds, *added)

    @property
    def run_effective_batch_size(self) -> int:
        return self.fit.effective_batch_size or self.effective_batch_size

    @property
    def budget_protocol(self) -> str | None:
        """What the budget changed in how a trial learns (not the paper's protocol), or None."""
        if self.fit.effective_batch_size is None:
            return None
        return (f"effective batch {self.effective_batch_size} -> {self.fit.effective_batch_size} at "
                f"{self.fit.epochs} of {self.asked_epochs} epochs (a budget protocol, not the paper's)")

    @property
    def num_trials(self) -> int:
        return sum(self._search_trials(m) for m in self.fitted_methods) + \
            len(self.fitted_methods) * len(self.run_repeat_seeds)

    def _search_trials(self, method: MethodCost) -> int:
        return method.trials(self.fit.trials_per_tuned)

    def knob_source(self, method: MethodCost) -> str:
        """Where a tuned method's trials take their knobs from (``SearchSpec.knob_source``)."""
        if self.search is None:  # a plan not scheduled yet
            return "Optuna TPE + ASHA"
        return self.search.knob_source(method.backbone, method.loss, self._search_trials(method),
                                       self.paper_setting_first)

    def cost_estimates(self) -> dict[tuple[str, str], dict[str, float]]:
        """Per (backbone, loss) that runs, the figures each trial records (``training/cost.py``), summed over the
        method's trials as the study table sums them: wall and CPU seconds (wall x threads: an upper
        bound, threads are not always busy), peak RSS in MB (the probe's) and, where earlier trials of the method
        measured it here, energy in kWh (their energy per CPU-second times the CPU seconds)."""
        estimates = {}
        for m in self.fitted_methods:
            count = self._search_trials(m) + len(self.run_repeat_seeds)
            wall = count * m.trial_s(self.fit.epochs)
            cpu = wall * self.threads * self.workers
            estimates[(m.backbone, m.loss)] = {"cost/wall_seconds": wall, "cost/cpu_seconds": cpu,
                                               "cost/peak_rss_mb": m.peak_bytes / 2**20}
            if m.energy_kwh_per_cpu_s:
                estimates[(m.backbone, m.loss)]["cost/energy_kwh"] = cpu * m.energy_kwh_per_cpu_s
        return estimates

    @property
    def peak_bytes(self) -> int:
        peaks = sorted((m.peak_bytes for m in self.fitted_methods for _ in range(self._search_trials(m))),
                       reverse=True)
        return sum(peaks[:self.slots])

    def answers(self) -> str:
        """One line: what the study can answer, e.g. ``tiger/ce vs tiger/apao_pointwise at 10 epochs ...``."""
        running = self.fitted_methods
        names = " vs ".join(f"{m.backbone}/{m.loss}" for m in running)
        trials = ", ".join(f"{m.loss} {counted(self._search_trials(m), 'trial')}"
                           for m in running)
        seeds = len(self.run_repeat_seeds) + 1
        line = (f"{names} at {counted(self.fit.epochs, 'epoch')} each ({trials}"
                f"{f'; best of each on {seeds} seeds' if seeds > 1 else ''})")
        if len(running) < 2:
            line = f"{names} alone at {self.fit.epochs} epochs (no comparison)"
        if self.fit.deferred:
            line += "; " + ", ".join(f"{d.backbone}/{d.loss}" for d in self.fit.deferred) + " deferred"
        if self.budget_protocol:
            line += "; budget protocol"
        return line

    def scheduled(self, base: TrialConfig, search: SearchSpec, losses: tuple[str, ...], pretrain_ce_epochs: int | None) -> "Plan":
        """This plan with the trials' schedule it fits filled in (``base``, ``search``): the asked base config
        with the fitted epochs (and a preference loss's CE stage), training subset and the budget protocol's
        batch; the asked search with the fitted trials per tuned method, the start order, the deferred methods."""
        fit = self.fit
        train = base.train.replace(epochs=fit.epochs, effective_batch_size=self.run_effective_batch_size,
                                   max_train_samples=fit.train_samples or base.train.max_train_samples)
        return replace(self, base=with_pretrain(base.replace(train=train), losses, pretrain_ce_epochs),
                       search=replace(search, trials_per_tuned=fit.trials_per_tuned, first=self.start_order,
                                      deferred=tuple(sorted(self.deferred))))

    def to_dict(self) -> dict[str, Any]:
        """The plan as data (``--dry-run --json``, ``apao_ray.plan_study``): the schedule, and per requested
        method whether it runs (its trials, epochs, training samples, estimate) or is deferred (and why)."""
        estimates, fit = self.cost_estimates(), self.fit
        methods = []
        for m in self.fitted_methods:
            methods.append({"backbone": m.backbone, "loss": m.loss, "status": "run",
                            "trials": self._search_trials(m) + len(self.run_repeat_seeds),
                            "search_trials": self._search_trials(m), "epochs": fit.epochs,
                            "train_samples": m.train_samples or None, "epoch_s": m.epoch_s,
                            "estimate_s": estimates[(m.backbone, m.loss)]["cost/wall_seconds"],
                            "peak_bytes": m.peak_bytes,
                            "reason": "baseline, runs once" if m.is_baseline else self.knob_source(m)})
        by_key = {(m.backbone, m.loss): m for m in self.methods}
        for d in fit.deferred:
            methods.append({"backbone": d.backbone, "loss": d.loss, "status": "deferred", "trials": 0,
                            "search_trials": 0, "epochs": 0, "train_samples": by_key[(d.backbone, d.loss)].train_samples
                            or None, "epoch_s": d.epoch_s, "estimate_s": d.needs_s,
                            "peak_bytes": by_key[(d.backbone, d.loss)].peak_bytes, "reason": d.reason})
        return {"budget_s": self.budget_s, "estimate_s": fit.estimate_s, "slots": self.slots,
                "answers": self.answers(), "compared_at_equal_epochs": True, "dataset": self.dataset,
                "protocol": self.protocol, "precision": self.precision, "epochs": fit.epochs,
                "asked_epochs": self.asked_epochs, "trials_per_tuned": fit.trials_per_tuned,
                "asked_trials_per_tuned": self.asked_trials_per_tuned, "asha_grace_period": fit.asha_grace_period,
                "train_samples": fit.train_samples, "seeds": [self.search_seed, *self.run_repeat_seeds],
                "effective_batch_size": self.run_effective_batch_size, "budget_protocol": self.budget_protocol,
                "changes": list(fit.changes), "num_trials": self.num_trials, "peak_bytes": self.peak_bytes,
                "threads": self.threads, "start_order": [list(m) for m in self.start_order], "methods": methods}

    def record(self) -> dict[str, Any]:
        """What the study's MLflow parent run keeps of the plan (``outcomes.PLAN_TAG``): what it answers, the
        schedule, the budget protocol, and why each deferred method has no trials (the table's rows)."""
        return {"answers": self.answers(), "epochs": self.fit.epochs, "asked_epochs": self.asked_epochs,
                "effective_batch_size": self.run_effective_batch_size, "budget_protocol": self.budget_protocol,
                "budget_s": self.budget_s, "estimate_s": self.fit.estimate_s, "cohort_size": self.cohort_size,
                "deferred": {f"{d.backbone}/{d.loss}": d.reason for d in self.fit.deferred}}

    def cohorts_apart(self) -> str | None:
        """Why no repeat trial trains in a fused cohort under --cohort-size, or None when cohorts form (the rules
        of study/run/cohorts.assign_cohorts: two or more repeat trials of one backbone, no two-stage loss)."""
        if self.cohort_size <= 1:
            return "--cohort-size 1"
        if self.base is not None and self.base.loss.pretrain_ce_epochs:
            return "a two-stage loss's CE stage keeps its trials apart"
        per_backbone = Counter(m.backbone for m in self.fitted_methods)
        if max(per_backbone.values(), default=0) * len(self.run_repeat_seeds) < 2:
            return "one repeat trial per backbone forms no cohort"
        return None

    def _cohort_words(self) -> str:
        """How the repeat trials train under --cohort-size: as fused cohorts, or why each alone."""
        if self.cohort_size <= 1:
            return ""
        if apart := self.cohorts_apart():
            return f", each alone ({apart})"
        return (f", as fused cohorts of up to {self.cohort_size} trials of one backbone, each its own trial and "
                "MLflow run (the estimate counts them as separate trials)")

    def text(self) -> str:
        fit, gib = self.fit, 2 ** 30
        allocator = f", allocator {self.allocator}" if self.allocator else ""
        workers = f"{self.workers} data-parallel workers x " if self.workers > 1 else ""
        lines = [f"plan: {counted(self.num_trials, 'trial')} on {self.dataset}, protocol {self.protocol}, precision "
                 f"{self.precision}{allocator}, {self.slots} at a time, {workers}"
                 f"{counted(self.threads, 'thread')} each"]
        estimates = self.cost_estimates()
        for m in self.fitted_methods:
            count = self._search_trials(m)
            kind = "baseline, runs to the end" if m.is_baseline else self.knob_source(m)
            cost = estimates[(m.backbone, m.loss)]
            lines.append(f"  {m.backbone}/{m.loss:<16} {count} trial{'s' if count > 1 else ' '}  {fit.epochs} epoch{'s' if fit.epochs > 1 else ' '}  "
                         f"epoch ~{format_duration(m.epoch_s)}  trial ~{format_duration(m.trial_s(fit.epochs))}  "
                         f"peak ~{m.peak_bytes / gib:.1f} GiB  all its trials ~{format_duration(cost['cost/wall_seconds'])} "
                         f"wall, ~{format_duration(cost['cost/cpu_seconds'])} CPU  ({kind})")
        lines += [f"  {d.backbone}/{d.loss:<16} {d.reason}" for d in fit.deferred]
        if self.run_repeat_seeds:
            repeats = len(self.fitted_methods) * len(self.run_repeat_seeds)
            lines.append(f"  then the best configuration of each method again on seeds {list(self.run_repeat_seeds)}: "
                         f"{counted(repeats, 'trial')} of {counted(fit.epochs, 'epoch')}"
                         + self._cohort_words())
        rungs = asha_rungs(fit.asha_grace_period, fit.epochs)
        lines.append(f"  ASHA compares each tuned method's trials at epochs {rungs}" if rungs else
                     f"  ASHA prunes nothing (grace {fit.asha_grace_period} epochs >= {fit.epochs} epochs)")
        if len(self.start_order) > 1:
            lines.append(f"  trials start slowest method first: {', '.join(f'{b}/{l}' for b, l in self.start_order)}")
        at_once = "1 trial" if self.slots == 1 else f"{self.slots} trials"
        lines.append(f"  study ~{format_duration(fit.estimate_s)} wall, peak memory ~{self.peak_bytes / gib:.1f} GiB "
                     f"({at_once} at once), for full-length trials; ASHA pruning and early stopping shorten it")
        source = "cached" if self.probes_cached == len(self.methods) else "measured now"
        if self.probes_observed:
            source += (f"; training and validation rates of {self.probes_observed} of {len(self.methods)} methods from "
                       "finished trials of earlier studies here")
        side = (f"; probed rates x{self.side_by_side:g} for trials running side by side"
                if self.side_by_side != 1.0 else "")
        lines.append(f"  (from a probe of ~{PROBE_SECONDS:.0f} s of training (<= {PROBE_TRIAL_SHARE:.0%} of a trial's) + 1 "
                     "validation batch per method on this "
                     f"machine, {source}{side}; cache {probe_cache_path()})")
        if self.budget_s is not None:
            if fit.changes:
                asked = study_seconds(self.methods, self.asked_epochs, self.asked_trials_per_tuned, self.slots,
                                      len(self.repeat_seeds))
                lines.append(f"budget {format_duration(self.budget_s)}: the study as asked (~{format_duration(asked)}) "
                             f"exceeds it; fitted: {', '.join(fit.changes)} (~{format_duration(fit.estimate_s)})")
            else:
                lines.append(f"budget {format_duration(self.budget_s)}: the study fits")
            lines.append(f"  answers: {self.answers()} (methods compared at equal epochs)")
        if self.budget_protocol:
            lines.append(f"  budget protocol: {self.budget_protocol}")
        if self.machine_bytes and self.peak_bytes > MEMORY_WARNING_FRACTION * self.machine_bytes:
            lines.append(f"  warning: ~{self.peak_bytes / gib:.1f} GiB at peak is over {MEMORY_WARNING_FRACTION:.0%} of this "
                         f"machine's {self.machine_bytes / gib:.1f} GiB; Ray's memory monitor kills workers at 95%: "
                         "lower --max-concurrent or leave out the largest method")
        return "\n".join(lines + self.notes)
