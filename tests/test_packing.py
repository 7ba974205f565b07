"""The padding-free encoder and the cached decoder compute the same function as the plain paths."""
from __future__ import annotations

import pytest
import torch

from apao_ray.data.catalog import PAD_TOKEN
from apao_ray.models import LlamaBackbone, TigerBackbone
from apao_ray.models.base import Backbone
from apao_ray.models.packing import PackedHistory

BACKBONES = {"tiger": TigerBackbone, "llama": LlamaBackbone}


def mixed_length_batch(num_rows: int = 37, length: int = 29, vocab_size: int = 67, seed: int = 0):
    """Left-padded histories of every length from 1 to ``length`` (shuffled), PAD ids on padding."""
    generator = torch.Generator().manual_seed(seed)
    every_length = torch.arange(1, length + 1)
    drawn = torch.randint(1, length + 1, (max(0, num_rows - length),), generator=generator)
    lengths = torch.cat([every_length, drawn])[torch.randperm(max(num_rows, length), generator=generator)][:num_rows]
    lengths[0] = length  # the batch is padded to its longest row
    mask = torch.arange(length)[None, :] >= length - lengths[:, None]                 # (B, L)
    ids = torch.randint(3, vocab_size, (num_rows, length), generator=generator).masked_fill(~mask, PAD_TOKEN)
    candidates = torch.randint(3, vocab_size, (num_rows, 3, 4), generator=generator)  # (B, C, T)
    return ids, mask, candidates


def paper_like(backbone: str) -> Backbone:
    torch.manual_seed(0)
    model = BACKBONES[backbone](vocab_size=67, num_levels=4, d_model=32, num_layers=2, num_heads=4,
                                head_dim=8, d_ff=64, dropout=0.0)
    return model.double()


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
@pytest.mark.parametrize("bucket_rows, token_multiple", [(None, None), (5, None), (1000, None), (5, 64), (None, 128)])
def test_packed_equals_padded_in_float64(backbone, bucket_rows, token_multiple, monkeypatch):
    """Logits and every parameter's gradient agree to 1e-9 on histories of mixed lengths, also with
    spare packed rows (bf16 autocast's rounding; they must reach no real token)."""
    if bucket_rows is not None:
        monkeypatch.setattr("apao_ray.models.packing.CPU_BUCKET_ROWS", bucket_rows)
    if token_multiple is not None:
        monkeypatch.setattr("apao_ray.models.packing.default_token_multiple", lambda device: token_multiple)
    model = paper_like(backbone)
    ids, mask, candidates = mixed_length_batch()
    results = {}
    for is_packed in (False, True):
        model.pack_histories = is_packed
        model.zero_grad()
        logits = model(ids, mask, candidates)                                           # (B, C, T, V)
        (logits.sin() * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
        results[is_packed] = (logits.detach(), [p.grad.clone() for p in model.parameters()])
    (padded, padded_grads), (packed, packed_grads) = results[False], results[True]
    assert (padded - packed).abs().max() <= 1e-9
    assert all(g.abs().max() > 0 for g in padded_grads)  # the comparison covers every parameter
    assert max(float((a - b).abs().max()) for a, b in zip(padded_grads, packed_grads)) <= 1e-9


@pytest.mark.parametrize("token_multiple", [1, 64])
def test_packing_maps_round_trip_and_buckets_are_tight(token_multiple):
    ids, mask, _ = mixed_length_batch(num_rows=50, length=20)
    packing = PackedHistory.from_mask(mask, bucket_rows=8, token_multiple=token_multiple)
    real = int(mask.sum())
    assert packing.num_tokens == real and (packing.spare == 0) == (token_multiple == 1)
    packed = packing.pack(ids)
    assert packed.shape == (real + packing.spare,) and packed.shape[0] % token_multiple == 0
    # a spare row left in the matrix by mistake would overwrite a real token (index 0) on unpack
    packed[real:] = -1
    assert (packed[:real] != PAD_TOKEN).all()
    assert torch.equal(packing.unpack(packed), ids.masked_fill(~mask, 0))
    assert torch.equal(packed[packing.last_token], ids[:, -1])               # each row's last real token
    assert [b.num_rows for b in packing.buckets] == [8] * 6 + [2]
    for bucket in packing.buckets:  # every bucket pads only to its own longest row
        assert bucket.length == int(bucket.key_mask.sum(dim=1).max())
        assert torch.equal(bucket.pack(bucket.unpack(packed[bucket.start:bucket.end])), packed[bucket.start:bucket.end])


def test_packed_rows_are_rounded_only_under_bf16_autocast_on_a_cpu():
    """oneDNN's primitive cache (bf16) is what the rounding is for; fp32 would only pay for the spare rows."""
    from apao_ray.models.packing import CPU_TOKEN_MULTIPLE

    _, mask, _ = mixed_length_batch(num_rows=50, length=20)
    assert PackedHistory.from_mask(mask).spare == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packing = PackedHistory.from_mask(mask)
    assert CPU_TOKEN_MULTIPLE > 1 and packing.spare > 0
    assert (packing.num_tokens + packing.spare) % CPU_TOKEN_MULTIPLE == 0


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_cached_decode_step_equals_full_decode(backbone):
    """Each cached step's logits equal the full decode's logits at that position, also after
    the beams are reordered and duplicated by ``DecodeCache.select``."""
    model = paper_like(backbone).eval()
    ids, mask, _ = mixed_length_batch(num_rows=9, length=13)
    generator = torch.Generator().manual_seed(3)
    context = model.encode(ids, mask)
    logits, cache = model.decode_step(context, None)
    full = model.decode(context, cache.prefix)                                   # (B, 1, 1, V)
    assert (logits - full[:, :, -1]).abs().max() <= 1e-10
    for step, num_beams in enumerate((3, 5, 2), start=1):
        parent = torch.randint(0, cache.prefix.shape[1], (9, num_beams), generator=generator)
        tokens = torch.randint(3, 67, (9, num_beams), generator=generator)
        cache = cache.select(parent, tokens)
        logits, cache = model.decode_step(context, cache)                        # (B, K, V)
        full = model.decode(context, cache.prefix)                               # (B, K, t+1, V)
        assert cache.prefix.shape == (9, num_beams, step)
        assert (logits - full[:, :, -1]).abs().max() <= 1e-10


def test_tiger_shared_start_equals_one_candidate_at_a_time_in_float64():
    """Many candidates per row run BOS once per row; logits and gradients equal per-candidate decoding."""
    model = paper_like("tiger")
    ids, mask, candidates = mixed_length_batch(num_rows=11, length=17)
    results = []
    for together in (True, False):
        model.zero_grad()
        context = model.encode(ids, mask)
        if together:
            logits = model.decode(context, candidates[..., :-1])                  # (B, C, T, V), shared start
        else:
            logits = torch.cat([model.decode(context, candidates[:, c:c + 1, :-1])  # C = 1: the plain path
                                for c in range(candidates.shape[1])], dim=1)
        (logits.cos() * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (shared, shared_grads), (alone, alone_grads) = results
    assert (shared - alone).abs().max() <= 1e-9
    assert max(float((a - b).abs().max()) for a, b in zip(shared_grads, alone_grads)) <= 1e-9


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_absorbed_cross_attention_equals_projected_keys_and_values_in_float64(num_candidates):
    """Reading the encoder output through the attention weights (no keys or values projected) is the
    same function: logits and every parameter's gradient agree to 1e-9, for the plain decoder (C = 1)
    and the shared-start one (C > 1)."""
    model = paper_like("tiger")
    ids, mask, candidates = mixed_length_batch()
    candidates = candidates[:, :num_candidates]
    results = {}
    for form in ("projected", "absorbed"):
        model.cross_attention = form
        model.zero_grad()
        context = model.encode(ids, mask, queries_per_row=candidates.shape[1] * candidates.shape[2])
        assert bool(context.cross_keys) == (form == "projected")
        logits = model.decode(context, candidates[..., :-1])
        (logits.sin() * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
        results[form] = (logits.detach(), [p.grad.clone() for p in model.parameters()])
    (projected, projected_grads), (absorbed, absorbed_grads) = results["projected"], results["absorbed"]
    assert (projected - absorbed).abs().max() <= 1e-9
    assert all(g.abs().max() > 0 for g in absorbed_grads)
    assert max(float((a - b).abs().max()) for a, b in zip(projected_grads, absorbed_grads)) <= 1e-9


@pytest.mark.parametrize("backbone, form", [("tiger", "projected"), ("tiger", "absorbed"), ("llama", None)])
def test_decoding_by_row_groups_skips_their_padding_and_is_the_same_function(backbone, form):
    """Rows in order of history length (as training orders every micro-batch): each group of rows attends only
    over the history columns where one of its rows has a real token (TIGER's cross-attention, Llama's prefix
    attention), and logits and gradients agree to 1e-9 with attending over every column, TIGER's shared-start
    decoder (the pairwise loss's candidates) included."""
    import dataclasses

    from apao_ray.models.packing import row_groups

    model = paper_like(backbone)
    if form:
        model.cross_attention = form
    ids, mask, candidates = mixed_length_batch()
    order = mask.sum(dim=1).argsort(stable=True)
    ids, mask, candidates = ids[order], mask[order], candidates[order]
    groups = row_groups(mask, rows=5)
    assert [(start, end) for start, end, _ in groups] == [(i, min(i + 5, 37)) for i in range(0, 37, 5)]
    for start, end, first in groups:  # exactly the columns all of the group's rows pad
        assert not mask[start:end, :first].any() and mask[start:end, first].any()
    assert groups[0][2] > 20 and groups[-1][2] == 0
    assert row_groups(mask[torch.randperm(37)][:, :5].fill_(True)) is None       # nothing to skip
    assert model.encode(ids, mask).row_groups == row_groups(mask)               # the default groups
    results = []
    for chosen in (None, groups):
        model.zero_grad()
        if form:
            context = model.encode(ids, mask, queries_per_row=candidates.shape[1] * candidates.shape[2])
            assert bool(context.cross_keys) == (form == "projected")
        else:
            context = model.encode(ids, mask)
        logits = model.decode(dataclasses.replace(context, row_groups=chosen), candidates[..., :-1])
        (logits.sin() * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (whole, whole_grads), (grouped, grouped_grads) = results
    assert (whole - grouped).abs().max() <= 1e-9
    assert max(float((a - b).abs().max()) for a, b in zip(whole_grads, grouped_grads)) <= 1e-9


def test_cross_attention_absorbs_only_where_it_costs_fewer_multiply_adds():
    """Paper-size TIGER on an Office-like batch: CE's 4 queries per row absorb, the pairwise loss's
    101 candidates x 4 codes project keys and values, and decoding (queries unknown) always projects."""
    from apao_ray.models.t5_layers import absorbed_cost

    model = TigerBackbone(vocab_size=1027, num_levels=4)
    rows, length, tokens = 128, 81, 4480
    assert model.absorbs(rows, 4, tokens, length) and not model.absorbs(rows, 101 * 4, tokens, length)
    projected, absorbed = absorbed_cost(rows, 4, tokens, length, 128, 6, 64)
    assert 2 < projected / absorbed < 3
    ids, mask, _ = mixed_length_batch(num_rows=64, length=40, vocab_size=1027)
    assert model.encode(ids, mask).cross_keys                                   # decoding's context
    assert not model.encode(ids, mask, queries_per_row=4).cross_keys
    # the weight products are paid once per batch: a batch of a few short rows still projects
    assert model.encode(ids[:4, -9:], mask[:4, -9:], queries_per_row=4).cross_keys
