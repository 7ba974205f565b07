"""Every loss against a slow float64 reference written from SPEC §3 with explicit loops."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from apao_ray.config import WEIGHTING_MODES, LossConfig
from apao_ray.data.catalog import Catalog
from apao_ray.losses import (LOSSES, AdaptivePrefixWeights, LossInputs, LossOutput, apao_pairwise_losses,
                             apao_pointwise_losses, build_loss, prefix_scores, sample_negatives)

T = 4


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    rng = np.random.default_rng(0)
    codes = np.stack([rng.integers(0, size, 18) for size in (2, 3, 2, 3)], axis=1)  # dense prefix sharing
    codes[0] = (1, 2, 1, 2)  # every level reaches its max code
    codes[1] = codes[2]      # one collision
    return Catalog.from_codes([f"item{i}" for i in range(len(codes))], codes)


def make_inputs(catalog: Catalog, num_rows: int, num_negatives: int, seed: int, with_ref: bool = False,
                scale: float = 2.0) -> LossInputs:
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, catalog.num_semantic_ids, (num_rows,), generator=gen)
    negatives = sample_negatives(targets, catalog.num_semantic_ids, num_negatives, gen)
    sem = torch.cat([targets[:, None], negatives], dim=1).numpy()                 # (B, C)
    logits = scale * torch.randn(num_rows, 1 + num_negatives, T, catalog.vocab_size, generator=gen,
                                 dtype=torch.float64)
    ref = -torch.rand(num_rows, 1 + num_negatives, T, generator=gen, dtype=torch.float64) * 3 if with_ref else None
    return LossInputs(logits=logits.requires_grad_(), candidates=torch.as_tensor(catalog.sem_tokens[sem]),
                      candidate_nodes=torch.as_tensor(catalog.leaf_prefix_nodes[sem]), ref_token_logp=ref)


# --- references: loops over rows, candidates, depths; no code shared with the package --------
def ref_token_logp(logits, candidates):
    num_rows, num_cands, num_levels, _ = logits.shape
    values = [logits[b, c, t, candidates[b, c, t]] - torch.log(torch.exp(logits[b, c, t]).sum())
              for b in range(num_rows) for c in range(num_cands) for t in range(num_levels)]
    return torch.stack(values).reshape(num_rows, num_cands, num_levels)


def ref_ce(lp):
    return -sum(lp[b, 0, t] for b in range(lp.shape[0]) for t in range(T)) / (lp.shape[0] * T)


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


def grad(loss, inputs):
    return torch.autograd.grad(loss, inputs.logits, retain_graph=True)[0]


def assert_close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=1e-9, atol=1e-10)


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
