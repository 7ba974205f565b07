"""losses/preference.py: DPO, DMPO, S-DPO and CE+S-DPO against slow float64 references written from SPEC §3 with
explicit loops."""
from __future__ import annotations

import pytest
import torch

from apao_ray.config import LossConfig
from apao_ray.losses import build_loss
from losses_helpers import T, assert_close, catalog, grad, make_inputs, ref_ce, ref_token_logp  # noqa: F401 - catalog: a fixture


def ref_preference(name, lp, ref, beta_pref, lam):
    rows = []
    for b in range(lp.shape[0]):
        r = [beta_pref * (sum(lp[b, c, t] for t in range(T)) - (sum(ref[b, c, t] for t in range(T))
                                                                 if ref is not None else 0.0))
             for c in range(lp.shape[1])]
        negatives = r[1:]
        if name == "dpo":
            z = r[0] - negatives[0]
        elif name == "dmpo":
            z = r[0] - sum(negatives) / len(negatives)
        else:
            z = -torch.log(sum(torch.exp(rj - r[0]) for rj in negatives))
        rows.append(-torch.log(1.0 / (1.0 + torch.exp(-z))))
    pref = sum(rows) / len(rows)
    return ref_ce(lp) + lam * pref if name == "ce_sdpo" else pref


@pytest.mark.parametrize("name,with_ref", [("dpo", True), ("dmpo", True), ("sdpo", True),
                                           ("ce_sdpo", True), ("ce_sdpo", False)])
def test_preference_losses_match_reference(catalog, name, with_ref):
    config = LossConfig(name=name, beta=0.2, beta_pref=1.5, num_negatives=4)
    loss_fn = build_loss(config, catalog.tensors())
    assert loss_fn.num_negatives == (1 if name == "dpo" else 4)
    inputs = make_inputs(catalog, 3, loss_fn.num_negatives, seed=4, with_ref=with_ref)
    out = loss_fn(inputs)
    lp = ref_token_logp(inputs.logits, inputs.candidates)
    expected = ref_preference(name, lp, inputs.ref_token_logp, config.beta_pref, config.beta)
    assert_close(out.loss, expected.detach())
    assert_close(grad(out.loss, inputs), grad(expected, inputs))
