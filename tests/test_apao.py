"""losses/apao.py: prefix scores, APAO's pointwise and pairwise losses and its adaptive prefix weights against slow
float64 references written from SPEC §3 with explicit loops."""
from __future__ import annotations

import math

import pytest
import torch

from apao_ray.config import WEIGHTING_MODES, LossConfig
from apao_ray.losses import AdaptivePrefixWeights, apao_pairwise_losses, apao_pointwise_losses, build_loss, prefix_scores
from losses_helpers import T, assert_close, catalog, grad, make_inputs, ref_ce, ref_token_logp  # noqa: F401 - catalog: a fixture


def ref_pointwise(lp):
    return [sum(-sum(lp[b, 0, t] for t in range(m)) / m for b in range(lp.shape[0])) / lp.shape[0]
            for m in range(1, T + 1)]


def ref_pairwise(catalog, lp, candidates, mask_duplicates=True, divide=True, scale=True):
    codes = catalog.tokens_to_codes(candidates.numpy())                          # (B, C, T)
    out = []
    for m in range(1, T + 1):
        num_prefixes = len({tuple(c[:m]) for c in catalog.sem_codes})
        total = 0.0
        for b in range(lp.shape[0]):
            pos_prefix, pos_score = tuple(codes[b, 0, :m]), sum(lp[b, 0, t] for t in range(m))
            seen, terms = {pos_prefix}, []
            for j in range(1, lp.shape[1]):
                prefix = tuple(codes[b, j, :m])
                if prefix == pos_prefix or (mask_duplicates and prefix in seen):
                    continue
                seen.add(prefix)
                terms.append(torch.exp(sum(lp[b, j, t] for t in range(m))))
            a = (num_prefixes - 1) / max(1, len(terms)) if scale else 1.0
            neg_mass = a * sum(terms) if terms else 0.0
            loss = -torch.log(torch.exp(pos_score) / (torch.exp(pos_score) + neg_mass))
            total = total + (loss / m if divide else loss)
        out.append(total / lp.shape[0])
    return out


def ref_weights(mode, history, eta, lam=0.5, drop=None):
    """Weights for the next call given the prefix losses seen so far (SPEC §3 update rules)."""
    w = [1.0 / T] * T
    if mode == "exp_decay":
        w = [math.exp(-lam * m) for m in range(1, T + 1)]
    for losses in history if mode == "mirror" else history[-1:]:
        losses = [float(x) for x in losses]
        if mode == "mirror":
            w = [w[m] * math.exp(eta * losses[m]) for m in range(T)]
        elif mode == "per_batch":
            kept = [0.0 if drop == m + 1 else losses[m] for m in range(T)]
            w = [kept[m] / sum(kept) * math.exp(eta * kept[m]) for m in range(T)]
        elif mode == "hard_max":
            worst = max((m for m in range(T) if drop != m + 1), key=lambda m: losses[m])
            w = [float(m == worst) for m in range(T)]
        w = [x / sum(w) for x in w]
    if drop is not None:
        w[drop - 1] = 0.0
    return [x / sum(w) for x in w]


# --- the public functions --------------------------------------------------------------------
def test_prefix_scores_and_pointwise_match_loops(catalog):
    inputs = make_inputs(catalog, 4, 0, seed=1)
    lp = ref_token_logp(inputs.logits, inputs.candidates)
    scores = prefix_scores(lp)
    for t in range(T):
        assert_close(scores[..., t], sum(lp[..., k] for k in range(t + 1)))
    assert_close(apao_pointwise_losses(lp[:, 0]), torch.stack(ref_pointwise(lp)))


def test_pairwise_is_shift_invariant_and_finite_for_huge_scores(catalog):
    inputs = make_inputs(catalog, 3, 6, seed=2)
    lp = ref_token_logp(inputs.logits, inputs.candidates).detach()
    base = apao_pairwise_losses(lp)
    shifted = apao_pairwise_losses(lp - 2000.0)          # exp(S) underflows to 0 if computed naively
    assert torch.isfinite(shifted).all()
    torch.testing.assert_close(shifted, base, rtol=1e-6, atol=1e-6)


def test_pairwise_row_without_counted_negatives_gives_zero_and_finite_grad():
    lp = torch.randn(2, 4, T, dtype=torch.float64, requires_grad=True)
    valid = torch.ones(2, 4, T, dtype=torch.bool)
    valid[0, 1:] = False                                   # row 0: no negative counts anywhere
    losses = apao_pairwise_losses(lp, valid, num_distinct_prefixes=torch.tensor([1.0, 5, 9, 20]))
    (g,) = torch.autograd.grad(losses.sum(), lp)
    assert torch.isfinite(g).all() and (g[0] == 0).all()
    assert losses[0] == 0                                  # P_1 = 1: no competing prefix at depth 1


# --- every loss against its reference, values and gradients ------------------------------------
PAIRWISE_VARIANTS = [dict(), dict(pairwise_divide_by_m=False), dict(pairwise_scale_negatives=False),
                     dict(pairwise_mask_duplicates=False),
                     dict(pairwise_divide_by_m=False, pairwise_scale_negatives=False, pairwise_mask_duplicates=False)]
APAO_CASES = ([("apao_pointwise", dict(weighting=mode)) for mode in WEIGHTING_MODES]
              + [("apao_pairwise", dict(weighting=mode)) for mode in WEIGHTING_MODES]
              + [("apao_pairwise", variant) for variant in PAIRWISE_VARIANTS]
              + [(name, extra) for name in ("apao_pointwise", "apao_pairwise") for extra in
                 (dict(drop_level=1), dict(drop_level=3, weighting="per_batch"), dict(drop_level=4, weighting="hard_max"),
                  dict(use_ce=False), dict(use_prefix_loss=False), dict(beta=0.0))])


@pytest.mark.parametrize("name,extra", APAO_CASES)
def test_apao_matches_reference_over_steps(catalog, name, extra):
    config = LossConfig.from_dict({"name": name, "beta": 0.3, "eta": 0.7, "num_negatives": 5,
                                   "exp_decay_lambda": 0.4, **extra})
    loss_fn = build_loss(config, catalog.tensors())
    pairwise = name == "apao_pairwise"
    history = []
    for step in range(3):
        inputs = make_inputs(catalog, 3, config.num_negatives if pairwise else 0, seed=10 + step)
        out = loss_fn(inputs)
        lp = ref_token_logp(inputs.logits, inputs.candidates)
        prefix = (ref_pairwise(catalog, lp, inputs.candidates, config.pairwise_mask_duplicates,
                               config.pairwise_divide_by_m, config.pairwise_scale_negatives)
                  if pairwise else ref_pointwise(lp))
        prefix_values = [float(x.detach()) for x in prefix]
        seen = history + [prefix_values] if config.weighting in ("per_batch", "hard_max") else history
        w = ref_weights(config.weighting, seen, config.eta, config.exp_decay_lambda, config.drop_level)
        weighted = sum(w[m] * prefix[m] for m in range(T))
        expected = (ref_ce(lp) if config.use_ce else 0.0) + (config.beta * weighted if config.use_prefix_loss else 0.0)
        assert_close(out.loss, expected.detach())
        assert_close(grad(out.loss, inputs), grad(expected, inputs))
        assert_close(out.prefix_losses, torch.stack(prefix).detach())
        for m in range(T):
            assert_close(out.metrics[f"apao_weight_m{m + 1}"], w[m])
        loss_fn.after_optimizer_step(out)
        history.append(prefix_values)


# --- adaptive weights ---------------------------------------------------------------------------
@pytest.mark.parametrize("drop_level", [None, 2])
def test_mirror_update_equals_closed_form_of_appendix_a(drop_level):
    weights = AdaptivePrefixWeights(T, eta=0.3, drop_level=drop_level)
    losses = torch.rand(25, T, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 5
    for step in range(25):
        weights.update(losses[step])
        closed = torch.softmax(0.3 * losses[: step + 1].sum(0), dim=0)      # w ∝ exp(eta sum_i L^(i))
        if drop_level is not None:
            closed[drop_level - 1] = 0
            closed = closed / closed.sum()
        torch.testing.assert_close(weights.weights, closed, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(weights.weights, torch.tensor(ref_weights("mirror", losses[: step + 1].tolist(),
                                                                             0.3, drop=drop_level),
                                                                 dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert weights.update(torch.full((T,), 1e6, dtype=torch.float64)).isfinite().all()  # no overflow


def test_fixed_modes_and_errors():
    torch.testing.assert_close(AdaptivePrefixWeights(T, 0.1, "uniform").update(torch.arange(4.0)),
                               torch.full((T,), 0.25, dtype=torch.float64))
    decay = AdaptivePrefixWeights(T, 0.1, "exp_decay", exp_decay_lambda=0.5).weights
    torch.testing.assert_close(decay[1:] / decay[:-1], torch.full((T - 1,), math.exp(-0.5), dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown weighting mode 'nope'"):
        AdaptivePrefixWeights(T, 0.1, "nope")
    with pytest.raises(ValueError, match="drop_level=5"):
        AdaptivePrefixWeights(T, 0.1, drop_level=5)


def test_state_dict_round_trip_restores_weights(catalog):
    config = LossConfig(name="apao_pointwise", eta=0.5)
    first, second = build_loss(config, catalog.tensors()), build_loss(config, catalog.tensors())
    for step in range(3):
        first.after_optimizer_step(first(make_inputs(catalog, 3, 0, seed=step)))
    assert not torch.allclose(first.prefix_weights.weights, second.prefix_weights.weights)
    second.load_state_dict(first.state_dict())
    torch.testing.assert_close(second.prefix_weights.weights, first.prefix_weights.weights)
    inputs = make_inputs(catalog, 3, 0, seed=9)
    torch.testing.assert_close(second(inputs).loss, first(inputs).loss)
    other = build_loss(config.replace(weighting="per_batch"), catalog.tensors())
    with pytest.raises(ValueError, match="mode 'mirror'"):
        other.load_state_dict(first.state_dict())
