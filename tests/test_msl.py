"""losses/msl.py and losses/ce.py: MSL and CE against slow float64 references written from SPEC §3 with explicit
loops."""
from __future__ import annotations

import pytest
import torch

from apao_ray.config import LossConfig
from apao_ray.losses import build_loss
from losses_helpers import T, assert_close, catalog, grad, make_inputs, ref_ce, ref_token_logp  # noqa: F401 - catalog: a fixture


def ref_msl(catalog, logits, candidates, tau):
    codes = catalog.tokens_to_codes(candidates[:, 0].numpy())
    total = 0.0
    for b in range(len(codes)):
        for t in range(T):
            children = sorted({int(c[t]) for c in catalog.sem_codes if tuple(c[:t]) == tuple(codes[b, :t])})
            z = logits[b, 0, t] / tau
            allowed = [int(catalog.token_offsets[t]) + c for c in children]
            total = total - (z[candidates[b, 0, t]] - torch.log(torch.exp(z[allowed]).sum()))
    return total / (len(codes) * T)


@pytest.mark.parametrize("tau", [1.0, 2.5])
def test_ce_and_msl_match_reference(catalog, tau):
    tensors = catalog.tensors()
    inputs = make_inputs(catalog, 5, 0, seed=3)
    lp = ref_token_logp(inputs.logits, inputs.candidates)
    ce = build_loss(LossConfig(name="ce"), tensors)(inputs).loss
    assert_close(ce, ref_ce(lp).detach())
    assert_close(grad(ce, inputs), grad(ref_ce(lp), inputs))
    msl = build_loss(LossConfig(name="msl", tau=tau), tensors)(inputs).loss
    expected = ref_msl(catalog, inputs.logits, inputs.candidates, tau)
    assert_close(msl, expected.detach())
    assert_close(grad(msl, inputs), grad(expected, inputs))
    assert msl < ce or tau != 1.0                          # fewer tokens in the softmax: smaller loss
