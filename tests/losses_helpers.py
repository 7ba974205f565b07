"""What the tests of the losses share: a small catalog with dense prefix sharing and a collision, random loss inputs
on it, a tiny trie where only one level has a choice, and the float64 references they build on (loops over rows,
candidates and depths; no code shared with the package)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from apao_ray.data.catalog import Catalog
from apao_ray.losses import LossInputs, sample_negatives


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


def grad(loss, inputs):
    return torch.autograd.grad(loss, inputs.logits, retain_graph=True)[0]


def assert_close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=1e-9, atol=1e-10)


def tiny_inputs(targets: list[int], level2: list[float]):
    """Items (0,0,0,0), (0,1,0,0), (0,2,0,0): only level 2 has a choice. Every row's logits are 0 except its
    level-2 logits over codes 0, 1, 2."""
    cat = Catalog.from_codes(["a", "b", "c"], np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 2, 0, 0]]))
    logits = torch.zeros(len(targets), 1, T, cat.vocab_size, dtype=torch.float64)
    offset = int(cat.token_offsets[1])
    logits[:, 0, 1, offset:offset + 3] = torch.tensor(level2, dtype=torch.float64)
    sem = np.array(targets)[:, None]
    return cat, LossInputs(logits=logits.requires_grad_(), candidates=torch.as_tensor(cat.sem_tokens[sem]),
                           candidate_nodes=torch.as_tensor(cat.leaf_prefix_nodes[sem]))
