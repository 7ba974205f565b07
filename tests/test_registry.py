"""losses/registry.py: every registered loss by name, its counts and metric names, and the errors that name a bad
loss or input."""
from __future__ import annotations

import re

import pytest

from apao_ray.config import LossConfig
from apao_ray.losses import LOSSES, LossOutput, build_loss
from losses_helpers import catalog, make_inputs  # noqa: F401 - catalog: a fixture


# --- registry, interface, errors ----------------------------------------------------------------
def test_registry_names_counts_and_metric_names(catalog):
    assert sorted(LOSSES) == sorted(["ce", "msl", "apao_pointwise", "apao_pairwise", "dpo", "dmpo", "sdpo", "ce_sdpo",
                                     "bear", "token_weighted"])
    expected_negatives = dict(ce=0, msl=0, apao_pointwise=0, apao_pairwise=7, dpo=1, dmpo=7, sdpo=7, ce_sdpo=7, bear=0,
                              token_weighted=0)
    for name in LOSSES:
        loss_fn = build_loss(LossConfig(name=name, num_negatives=7), catalog.tensors())
        assert loss_fn.name == name and loss_fn.num_negatives == expected_negatives[name]
        assert loss_fn.needs_reference == (name in ("dpo", "dmpo", "sdpo"))
        out = loss_fn(make_inputs(catalog, 2, loss_fn.num_negatives, seed=5, with_ref=True))
        assert isinstance(out, LossOutput) and out.loss.dim() == 0 and "loss" in out.metrics
        for key, value in out.metrics.items():
            assert re.fullmatch(r"[a-z0-9_]+", key) and not value.requires_grad, key
    keys = build_loss(LossConfig(name="apao_pairwise", num_negatives=3), catalog.tensors())(
        make_inputs(catalog, 2, 3, seed=6)).metrics
    assert {f"loss_prefix_m{m}" for m in range(1, 5)} | {f"apao_weight_m{m}" for m in range(1, 5)} <= set(keys)
    assert {"loss_ce", "loss_apao"} <= set(keys)


def test_clear_errors(catalog):
    tensors = catalog.tensors()
    with pytest.raises(ValueError, match=r"unknown loss 'nope'; choose from \['apao_pairwise', "):
        build_loss(LossConfig(name="nope"), tensors)
    for name in ("dpo", "dmpo", "sdpo"):
        loss_fn = build_loss(LossConfig(name=name, num_negatives=2), tensors)
        with pytest.raises(ValueError, match="needs inputs.ref_token_logp"):
            loss_fn(make_inputs(catalog, 2, loss_fn.num_negatives, seed=7))
    with pytest.raises(ValueError, match="C = 1 \\+ num_negatives = 4 candidates per row; got C=3"):
        build_loss(LossConfig(name="apao_pairwise", num_negatives=3), tensors)(make_inputs(catalog, 2, 2, seed=8))
    with pytest.raises(ValueError, match="nothing to minimise"):
        build_loss(LossConfig(name="apao_pointwise", use_ce=False, use_prefix_loss=False), tensors)


def test_both_are_registered_with_their_knobs_and_paper_points():
    assert LOSSES["bear"].paper_point("tiger", "grocery") == {"bear_b": 10, "bear_xi": 1.0, "bear_lambda": 1.0}
    assert LOSSES["token_weighted"].paper_point("llama", "beauty") == {"front_alpha": 1.0}
    assert [k.name for k in LOSSES["bear"].knobs] == ["bear_b", "bear_xi", "bear_lambda"]
