"""A logged model per selection rule: beside the trial's own model (``runs:/<run>/model``, the epoch its rule keeps),
the model of the epoch each other rule keeps (``runs:/<run>/model_by_val_loss``, ``runs:/<run>/model_by_last``...),
so that every ``test_by/<rule>/`` row of the run can be loaded, served and exported as the row was tested.

Runs in the study's driver, without torch: the weights are files of the final checkpoint
(``training.checkpoint.rule_model_file``), copied into a checkpoint of their own (``rule_checkpoint``).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ...names import TEST_BY
from ...tracking import Tracker
from ...training.checkpoint import FINAL_METRICS_FILE, rule_checkpoint, rule_model_file

RULE_TAG = "apao.selection_rule"  # on each logged model: the rule whose kept epoch it holds (val_loss, last...)
EPOCH_TAG = "apao.epoch"  # on each logged model: that epoch


def rule_epochs(checkpoint: Path) -> dict[str, int]:
    """``{"val_ndcg_at_10": 3, "val_loss": 2, "last": 3}``: each selection rule the trial followed and the epoch
    it kept (``test_by/<rule>/epoch`` of the final metrics)."""
    metrics = json.loads((checkpoint / FINAL_METRICS_FILE).read_text())
    return {key.split("/")[1]: int(value) for key, value in metrics.items()
            if key.startswith(f"{TEST_BY}/") and key.endswith("/epoch")}


def own_rule(checkpoint: Path) -> str | None:
    """The rule whose epoch the checkpoint keeps as its model: the one rule with no ``model_by_<rule>.pt`` (None in
    a checkpoint written before the rules' weights were kept: none has one)."""
    own = [rule for rule in rule_epochs(checkpoint) if not (checkpoint / rule_model_file(rule)).exists()]
    return own[0] if len(own) == 1 else None


def model_name(rule: str) -> str:
    """``model_by_val_loss``: the logged model of the epoch ``rule`` keeps (as its weights' file is named)."""
    return rule_model_file(rule).removesuffix(".pt")


def model_tags(checkpoint: Path, rule: str | None) -> dict[str, str]:
    """The tags that say which rule's epoch a logged model holds (none where the checkpoint records no rules)."""
    epochs = rule_epochs(checkpoint)
    return {} if rule not in epochs else {RULE_TAG: rule, EPOCH_TAG: str(epochs[rule])}


def log_rule_models(tracker: Tracker, run_id: str, checkpoint: Path, example_history: list[str],
                    params: dict[str, Any]) -> dict[str, str]:
    """Logs a model per rule other than the trial's own (``model_by_<rule>``), each with the run's
    ``test_by/<rule>/`` metrics on its page, unless a run before a resume logged it; returns rule -> model URI.
    A checkpoint written before the rules' weights were kept logs none."""
    uris: dict[str, str] = {}
    for rule in rule_epochs(checkpoint):
        if not (checkpoint / rule_model_file(rule)).exists():
            continue
        name, linked = model_name(rule), (f"{TEST_BY}/{rule}/",)
        uri = tracker.logged_model_uri(run_id, name)
        if uri is not None:  # logged before the driver was killed: its metrics may not be linked yet
            tracker.link_model_metrics(run_id, uri, linked)
        else:
            with tempfile.TemporaryDirectory(prefix=f"apao-{name}-") as scratch:
                uri = tracker.log_recommender(run_id, rule_checkpoint(checkpoint, rule, Path(scratch) / "checkpoint"),
                                              example_history, params, linked, name=name,
                                              tags=model_tags(checkpoint, rule))
        uris[rule] = uri
    return uris
