"""What a study records of each trial: its MLflow tag names and outcome texts, its run name, how a Tune
result is read (the trial's final report, a failure's kind), and the epoch at which the scheduler pruned it.

Plain names and functions, no Ray, MLflow or torch: the driver's callbacks (MLflow, progress), the pruned-trial
tests, the trial actor (its progress label) and the search's scheduler read them alike.
"""
from __future__ import annotations

from typing import Any

from ...names import COHORT_TAG, REPEATS_TAG, SEED_TAG
from ..spec.space import COHORT_KEY, MEMBER_KEY, REPEATS_KEY, SEED_KEY, SIZE_KEY, trial_choices

TRIAL_TAG = "apao.trial_id"
STUDY_TAG = "apao.study"
NODE_TAG = "apao.node_id"
ENERGY_TAG = "apao.energy_method"  # how cost/energy_kwh was obtained (measured, estimated, or not at all)
ALLOCATOR_TAG = "apao.allocator"  # the worker's memory allocator (tcmalloc/glibc-cached/system)
PRECISION_TAG = "apao.precision"  # the precision the trial resolved on its worker (fp32/bf16)
BUDGET_PROTOCOL_TAG = "apao.budget_protocol"  # on a study's parent run: what the budget changed in training
INTERRUPTED = "interrupted: the study was stopped; re-run the same command (or add --resume) to continue"
PRUNED_EPOCH_TAG = "apao.pruned_epoch"
# a failed trial's error (ERROR_TAG) moves to PREVIOUS_ERROR_TAG on a retry
PREVIOUS_OUTCOME_TAG, PREVIOUS_ERROR_TAG = "apao.previous_outcome", "apao.previous_error"
STOPPED_BY_TUNE = ("stopped before its end by Tune, not by the scheduler's pruning (the time budget ran out, "
                   "or it was pruned in a driver that was lost)")
TERMINAL = ("TERMINATED", "ERROR")

# trial id -> the epoch at which the scheduler (search/scheduler.py) stopped it, for the trials it stopped in this
# driver process. The MLflow callback reads it to say "pruned at epoch e" only of trials really pruned
# (a trial that Tune stops for a time budget or a stop signal ends the same way, TERMINATED).
_pruned_at: dict[str, int] = {}


def mark_pruned(trial_id: str, epoch: int) -> None:
    """Remembers that the scheduler pruned this trial at ``epoch``."""
    _pruned_at[trial_id] = epoch


def pruned_epoch(trial_id: str) -> int | None:
    """The epoch at which the scheduler pruned this trial, or None if it did not."""
    return _pruned_at.get(trial_id)


def seed_tags(config: dict[str, Any], seed: int) -> dict[str, str]:
    """A child run's seed tags: the seed it trained on; for a repeat the run it repeats, and the cohort it trained
    in (``--cohort-size``)."""
    tags = {SEED_TAG: str(seed), **({REPEATS_TAG: str(config[REPEATS_KEY])} if REPEATS_KEY in config else {})}
    if config.get(COHORT_KEY) is not None:  # which runs trained together, as one batched model
        tags[COHORT_TAG] = f"{config[COHORT_KEY]}: member {config[MEMBER_KEY]} of {config[SIZE_KEY]}"
    return tags


def is_final_report(result: dict[str, Any]) -> bool:
    """The trial's own last report (best weights tested), not an epoch's. Tune also sets ``done`` on
    the epoch report that the scheduler answered with STOP, so ``done`` alone cannot tell them apart."""
    return bool(result.get("done")) and "epochs_trained" in result


def failure_outcome(reason: str) -> str:
    """What the MLflow outcome tag says of a failed trial, from its error text."""
    if "OutOfMemoryError" in reason or "out of memory" in reason.lower():
        return "out of memory"
    if "NonFiniteLossError" in reason:
        return "non-finite loss"
    if "TrialStartError" in reason:
        return "could not start its workers"
    return "failed"


def short_reason(error: str, width: int = 200) -> str:
    """A failed trial's error in one line for a table: its last line, without the wrapper the trial's driver
    raised it in (``apao_ray.training.failures.TrialFailedError: ``), cut at ``width`` characters."""
    line = (error.strip().splitlines() or ["unknown error"])[-1]
    wrapper, _, reason = line.partition(" ")
    return (reason if wrapper.endswith("TrialFailedError:") else line)[:width]


def describe(choices: dict[str, Any]) -> str:
    """Run name that says backbone/loss/beta/eta/N, e.g. ``tiger/apao_pairwise b=0.2 eta=3e-05 N=100``."""
    parts = [f"{choices['backbone']}/{choices['loss']}"]
    if "beta" in choices:
        parts.append(f"b={choices['beta']:.3g}")
    if "eta" in choices:
        parts.append(f"eta={choices['eta']:.2g}")
    if "num_negatives" in choices:
        parts.append(f"N={int(choices['num_negatives'])}")
    named = {"backbone", "loss", "beta", "eta", "num_negatives"}
    parts += [f"{name}={value:.3g}" for name, value in choices.items() if name not in named]  # other losses' knobs
    return " ".join(parts)


def summarize_results(results: Any, search_seed: int) -> list[dict[str, Any]]:
    """One row per trial: its choices, seed (a repeat's own, else the search's), final metrics and error."""
    rows = []
    for result in results:
        config = result.config or {}
        if "loss" not in config:
            continue
        rows.append({"choices": trial_choices(config), "seed": int(config.get(SEED_KEY, search_seed)),
                     "repeats": config.get(REPEATS_KEY), "metrics": dict(result.metrics or {}),
                     "error": str(result.error) if result.error else None})
    return rows
