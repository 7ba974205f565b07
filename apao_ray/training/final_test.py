"""A trial's end: the test of the model each selection rule kept (each epoch once), the final checkpoint with
every rule's model, the per-user tables the paired tests read, and the final report."""
from __future__ import annotations

import copy
import json
import time
from typing import Any

import torch

from ..names import LAST_RULE, PER_USER_FILE, PER_USER_VALID_FILE, PRECISION_KEY, RESUMED_HISTORY_KEY, rule_name, test_by_key
from ..rank_metrics import PER_USER_METRICS
from .checkpoint import FINAL_METRICS_FILE, rule_model_file, save_catalog, save_checkpoint, seal_checkpoint
from .evaluation import evaluate_split_per_user, tests_full_sort, write_per_user
from .selection import per_user_column
from .trial_setup import CE_STAGE_PREFIX, TrialSetup
from .weights import unwrap


def finish(run: TrialSetup) -> dict[str, Any]:
    """Tests ``run``'s kept epochs' models, writes the final checkpoint and reports the final metrics."""
    config, hooks, state, dataset = run.config, run.hooks, run.state, run.dataset
    train_cfg, model, tensors, device = config.train, run.model, run.tensors, hooks.device
    final: dict[str, Any] = dict(state["history"][-1]) if state["history"] else {}
    if "ce_best_epoch" in state:
        final[f"{CE_STAGE_PREFIX}best/epoch"] = state["ce_best_epoch"]
    final.update({"epochs_trained": state["epoch"], "best/epoch": state["best_epoch"],
                  PRECISION_KEY: train_cfg.precision, "perf/total_seconds": time.perf_counter() - run.started,
                  "done": True})
    if hooks.rank != 0:
        run.meter.stop()
        hooks.report(final, None)
        return final
    best_weights, others = run.best_weights, run.others
    last_weights = copy.deepcopy(unwrap(model).state_dict())  # the model's own tensors change below
    kept = {run.select_by: (state["best_epoch"], best_weights), LAST_RULE: (state["epoch"], last_weights),
            **{rule: (state["rules"][rule]["best_epoch"], run.rule_weights[rule]) for rule in others}}
    tested: dict[int, tuple[dict[str, float], dict[str, Any]]] = {}  # epoch -> its test metrics, per-user table
    for rule, (rule_epoch, weights) in kept.items():  # the trial's own rule first: the model it keeps
        if rule_epoch not in tested:
            unwrap(model).load_state_dict(weights)
            # the kept model alone is also ranked by the full sort, where that is cheap (tests_full_sort)
            tested[rule_epoch] = evaluate_split_per_user(
                unwrap(model), dataset, "test", tensors, train_cfg, device, None, run.scoring,
                full_sort=not tested and tests_full_sort(train_cfg, device))
        final[test_by_key(rule, "epoch")] = rule_epoch
        final.update({test_by_key(rule, key): value for key, value in tested[rule_epoch][0].items()})
    unwrap(model).load_state_dict(best_weights)
    test_metrics, per_user = tested[state["best_epoch"]]
    per_user = {**per_user, **{per_user_column(rule, column): tested[rule_epoch][1][column]
                               for rule, (rule_epoch, _) in kept.items()
                               for column in per_user if column in PER_USER_METRICS}}
    final.update(test_metrics)
    # the kept model's validation per user (the users selection saw): its means are the kept epoch's
    _, valid_per_user = evaluate_split_per_user(unwrap(model), dataset, "valid", tensors, train_cfg, device,
                                                run.valid_users, run.scoring)
    final.update(run.meter.stop())  # the test and validation passes included
    final_dir = hooks.new_checkpoint_dir(state["epoch"])
    save_checkpoint(final_dir, {**state, "model": best_weights}, best_weights, config.to_dict())
    for rule, (_, weights) in kept.items():  # each other rule's model, loadable by its name (rule_checkpoint)
        if rule != run.select_by:
            torch.save(weights, final_dir / rule_model_file(rule_name(rule)))
    write_per_user(final_dir / PER_USER_FILE, per_user)  # the paired significance tests read it
    write_per_user(final_dir / PER_USER_VALID_FILE, valid_per_user)
    save_catalog(final_dir, dataset.catalog.item_ids, dataset.catalog.item_codes)
    (final_dir / FINAL_METRICS_FILE).write_text(json.dumps(final, indent=2, sort_keys=True))
    seal_checkpoint(final_dir)  # the manifest again, last: the files added since save_checkpoint
    # a resumed run may have trained nothing new: its history goes with the final report too
    hooks.report({**final, RESUMED_HISTORY_KEY: state["history"]} if run.resumed_after else final, final_dir)
    return final
