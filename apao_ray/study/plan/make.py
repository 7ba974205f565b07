"""How a study's ``Plan`` is made: a short probe of the real model and loss per method (~8 s of optimizer steps
and one validation batch, in a subprocess so that its peak memory is its own), cached per hardware and config in
``~/.cache/apao_ray/probes.json``; with a wall-clock budget, the study fitted to it (:mod:`.budget`: the pure,
unit-tested arithmetic of that fit). And, once the study ran, its cost against the plan's estimate."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ...training.memory import find_tcmalloc
from .budget import TRIAL_START_S, MethodCost, fit_budget
from .plan import Plan, method_config
from .probe_cache import SIDE_BY_SIDE_SLOWDOWN, probe
from ..spec.space import is_baseline

if TYPE_CHECKING:  # the types only
    from ...config import TrialConfig
    from ...data.splits import Split
    from ..setup import StudySetup
    from ..spec.study import StudySpec


def machine_memory_bytes() -> int:
    """This machine's physical memory (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def validation_users(base: TrialConfig, splits: dict[str, Split]) -> int:
    """Users a trial validates on each epoch (``eval_max_users`` caps the split)."""
    return min(len(splits["valid"]), base.train.eval_max_users or len(splits["valid"]))


def trial_threads(cpus_per_trial: float) -> int:
    """The torch threads of a trial's worker: its CPUs, at least one."""
    return max(1, int(round(cpus_per_trial)))


def make_plan(spec: StudySpec, setup: StudySetup, slots: int, use_cache: bool = True) -> Plan:
    """Probes each (backbone, loss) of a ``StudySpec`` (checked: ``setup`` is what ``prepare`` found) and fits the
    study to its budget.

    Raises:
        ValueError: the budget is too small for ``min_epochs`` of any method (naming the estimate).
    """
    base, dataset, search = setup.base, setup.dataset, spec.search
    splits = dataset.splits
    train_samples = min(len(splits["train"]), base.train.max_train_samples or len(splits["train"]))
    valid_users = validation_users(base, splits)
    threads = trial_threads(setup.cpus_per_trial)
    # a slot no trial can fill neither runs a trial side by side nor holds memory: a one-trial study runs alone
    num_methods = len({(b, l) for b, l, _ in search.allocation()})
    slots = max(1, min(slots, max(search.num_trials, num_methods * len(spec.repeat_seeds))))
    methods, cached, observed, precisions, devices, allocators = [], 0, 0, set(), set(), set()
    side_by_side = SIDE_BY_SIDE_SLOWDOWN if slots > 1 and not spec.address else 1.0
    for backbone, loss, _ in search.allocation():
        if any((m.backbone, m.loss) == (backbone, loss) for m in methods):
            continue
        measured, was_cached = probe(method_config(base, backbone, loss), threads, use_cache)
        cached += was_cached
        observed += measured.observed_trials > 0
        precisions.add(measured.precision)
        devices.add(measured.device)
        allocators.add(measured.allocator)
        # rates that finished trials measured here already ran beside others; a probe ran alone
        slowdown = 1.0 if measured.observed_trials else side_by_side
        train_s, eval_s_per_user = train_samples * measured.train_s_per_sample * slowdown, measured.eval_s_per_user * slowdown
        methods.append(MethodCost(
            backbone, loss, is_baseline(loss), fixed=not (is_baseline(loss) or search.searches(loss)),
            epoch_s=train_s + valid_users * eval_s_per_user,
            fixed_s=TRIAL_START_S + len(splits["test"]) * eval_s_per_user, peak_bytes=measured.peak_bytes,
            train_samples=train_samples, train_epoch_s=train_s, energy_kwh_per_cpu_s=measured.energy_kwh_per_cpu_s))
    fit = fit_budget(methods, base.train.epochs, search.trials_per_tuned, spec.asha_grace_period, slots,
                     spec.budget_s, len(spec.repeat_seeds), spec.min_epochs, base.train.effective_batch_size,
                     base.train.batch_size)
    # the slowest method's trials start first: the makespan estimate (longest first) is then what Tune does,
    # and the longest trials never start last to overrun a budget
    deferred = {(d.backbone, d.loss) for d in fit.deferred}
    start_order = tuple((m.backbone, m.loss) for m in sorted(methods, key=lambda m: -m.epoch_s)
                        if (m.backbone, m.loss) not in deferred)
    notes = []
    if spec.gpus_per_trial > 0 and "cuda" not in devices:
        notes.append("  note: probed on this machine's CPU (no GPU here): trials on GPUs will be faster")
    if spec.workers_per_trial > 1:
        notes.append(f"  note: epoch times are one worker's; {spec.workers_per_trial} workers train an epoch in up to "
                     f"1/{spec.workers_per_trial} of that (validation stays on one; docs/parallelism.md)")
    if "cuda" not in devices and "glibc-cached" in allocators and find_tcmalloc() is None:
        notes.append("  note: tcmalloc is not installed here; with it (Debian/Ubuntu: apt-get install "
                     "libtcmalloc-minimal4) CPU training ran ~1.1x faster than on glibc (benchmarks/RESULTS.md)")
    if spec.cohort_size > 1 and not spec.repeat_seeds and not fit.added_seeds:
        notes.append(f"  note: --cohort-size {spec.cohort_size} fuses the repeats of --seeds (after the first); this "
                     "study has none, so every trial trains alone")
    plan = Plan(dataset=base.data.dataset, protocol=spec.protocol, precision="/".join(sorted(precisions)),
                slots=slots, methods=methods, asked_epochs=base.train.epochs,
                asked_trials_per_tuned=search.trials_per_tuned, fit=fit, budget_s=spec.budget_s, probes_cached=cached,
                probes_observed=observed, notes=notes, repeat_seeds=spec.repeat_seeds,
                allocator="/".join(sorted(a for a in allocators if a)), threads=threads,
                workers=spec.workers_per_trial, machine_bytes=0 if spec.address else machine_memory_bytes(),
                start_order=start_order, search_seed=spec.search_seed,
                effective_batch_size=base.train.effective_batch_size, cohort_size=spec.cohort_size,
                paper_setting_first=spec.enqueue_paper_setting,
                side_by_side=side_by_side if observed < len(methods) else 1.0)
    plan = plan.scheduled(base, search, spec.losses, spec.pretrain_ce_epochs)
    if plan.run_repeat_seeds and plan.cohorts_apart() is None and not spec.gpus_per_trial:
        notes.append("  note: on CPUs a fused cohort trained at 0.2-0.4x the samples/s of the same trials run apart "
                     "(benchmarks/RESULTS.md, 2026-11-28): --cohort-size is for GPUs; here it makes the repeats slower")
    return plan


def cost_summary(plan: Plan, actual: dict[tuple[str, str], dict[str, float]]) -> str:
    """The end-of-study lines: per method, the plan's estimate next to what its trials recorded.

    Args:
        plan: the plan printed before the study.
        actual: per (backbone, loss), the summed ``cost/*`` of its trials (``seeds.cost_totals``).
    """
    def pair(estimate: float | None, value: float | None, scale: float, digits: int) -> str:
        shown = lambda v: "-" if v is None else f"{v / scale:.{digits}f}"  # noqa: E731
        return f"{shown(estimate)} / {shown(value)}"

    def shown_energy(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    lines = ["cost per method, estimate / actual (estimates are for full-length trials, from a short probe: pruning "
             "and early stopping shorten trials, whole epochs in a worker run slower than the probe):",
             "  method                  wall min       CPU min        peak RSS MB    energy kWh"]
    estimates = plan.cost_estimates()
    for method in sorted(set(estimates) | set(actual)):
        est, got = estimates.get(method, {}), actual.get(method, {})
        lines.append(f"  {'/'.join(method):<23} {pair(est.get('cost/wall_seconds'), got.get('cost/wall_seconds'), 60, 1):<14} "
                     f"{pair(est.get('cost/cpu_seconds'), got.get('cost/cpu_seconds'), 60, 1):<14} "
                     f"{pair(est.get('cost/peak_rss_mb'), got.get('cost/peak_rss_mb'), 1, 0):<14} "
                     f"{shown_energy(est.get('cost/energy_kwh'))} / {shown_energy(got.get('cost/energy_kwh'))}")
    return "\n".join(lines)
