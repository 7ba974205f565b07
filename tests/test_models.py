"""Backbones: shared-context decoding, Llama vs a naive causal LM, causality, sizes, gradients."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from apao_ray.config import ModelConfig
from apao_ray.data.batches import Batch
from apao_ray.data.catalog import EOS_TOKEN, NUM_SPECIAL_TOKENS, PAD_TOKEN
from apao_ray.models import BACKBONES, PAPER_SIZES, build_model, label_log_probs
from apao_ray.models.llama import LlamaBackbone
from apao_ray.models.llama_layers import apply_rotary

NUM_LEVELS, CODES_PER_LEVEL = 4, 8
VOCAB = NUM_SPECIAL_TOKENS + NUM_LEVELS * CODES_PER_LEVEL
TINY = {"d_model": 32, "num_layers": 2, "num_heads": 2, "head_dim": 16, "d_ff": 64}


def tiny_model(backbone: str, dropout: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(backbone=backbone, dropout=dropout, **TINY), VOCAB, NUM_LEVELS)


def code_tokens(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """Random level-specific code tokens, (..., T) with level m in the last axis."""
    codes = torch.randint(0, CODES_PER_LEVEL, (*shape, NUM_LEVELS), generator=generator)
    return NUM_SPECIAL_TOKENS + torch.arange(NUM_LEVELS) * CODES_PER_LEVEL + codes


def make_histories(num_items=(5, 2, 3), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) left-padded histories ending with EOS, rows of different lengths, and their mask."""
    generator = torch.Generator().manual_seed(seed)
    length = max(num_items) * NUM_LEVELS + 1
    history = torch.full((len(num_items), length), PAD_TOKEN)
    for row, count in enumerate(num_items):
        tokens = code_tokens(generator, count).reshape(-1)
        history[row, length - 1 - len(tokens):-1] = tokens
    history[:, -1] = EOS_TOKEN
    return history, history != PAD_TOKEN


def make_candidates(num_rows: int, num_candidates: int, seed: int = 1) -> torch.Tensor:
    return code_tokens(torch.Generator().manual_seed(seed), num_rows, num_candidates)  # (B, C, T)


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
@pytest.mark.parametrize("prefix_len", [0, 1, 3])
def test_shared_context_equals_each_candidate_alone(backbone, prefix_len):
    model = tiny_model(backbone).eval()
    history, mask = make_histories()
    prefix = make_candidates(len(history), 5)[..., :prefix_len]                # (B, C, t)
    with torch.no_grad():
        together = model.decode(model.encode(history, mask), prefix)           # (B, C, t+1, V)
        assert together.shape == (len(history), 5, prefix_len + 1, VOCAB)
        for row in range(len(history)):
            real = history[row, mask[row]][None]  # the row alone, without its padding
            context = model.encode(real, torch.ones_like(real, dtype=torch.bool))
            for cand in range(prefix.shape[1]):
                alone = model.decode(context, prefix[row:row + 1, cand:cand + 1])[0, 0]
                torch.testing.assert_close(together[row, cand], alone, atol=1e-5, rtol=1e-5)


def naive_llama_logits(model: LlamaBackbone, tokens: torch.Tensor) -> torch.Tensor:
    """Textbook causal LM over one unpadded (S,) sequence with the model's weights -> (S, V)."""
    seq_len = tokens.shape[0]
    cos, sin = model.rotary(torch.arange(seq_len))                            # (S, dh)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    x = model.embedding.weight[tokens]                                         # (S, d)
    for block in model.blocks:
        attn, h = block.attn, block.attn_norm(x)
        q, k, v = (p(h).view(seq_len, attn.num_heads, attn.head_dim).transpose(0, 1)
                   for p in (attn.q_proj, attn.k_proj, attn.v_proj))           # (H, S, dh)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        scores = (q @ k.transpose(-1, -2)) / attn.head_dim ** 0.5
        out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v       # (H, S, dh)
        x = x + attn.o_proj(out.transpose(0, 1).reshape(seq_len, -1))
        m = block.mlp
        h = block.mlp_norm(x)
        x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
    return model.norm(x) @ model.embedding.weight.T


def test_llama_encode_decode_equals_naive_causal_lm():
    model = tiny_model("llama").eval()
    history, mask = make_histories()
    labels = make_candidates(len(history), 1)[:, 0]                            # (B, T)
    batch = Batch(history, mask, labels, *(torch.zeros(len(history), dtype=torch.long),) * 3)
    input_ids, attention_mask, lm_labels = batch.decoder_only_inputs()         # (B, L+T)
    with torch.no_grad():
        cached = model.candidate_logits(history, mask, labels[:, None])[:, 0]   # (B, T, V)
        full = model.forward_full(input_ids, attention_mask)                    # (B, L+T, V)
        predicting = full[:, :-1][lm_labels[:, 1:] != -100].view_as(cached)     # shifted LM positions
        torch.testing.assert_close(cached, predicting, atol=1e-5, rtol=1e-5)
        for row in range(len(history)):
            naive = naive_llama_logits(model, input_ids[row, attention_mask[row]])
            torch.testing.assert_close(full[row, attention_mask[row]], naive, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cached[row], naive[-NUM_LEVELS - 1:-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_logits_ignore_future_prefix_tokens_and_pad_values(backbone):
    model = tiny_model(backbone).eval()
    history, mask = make_histories()
    prefix = make_candidates(len(history), 3)                                  # (B, C, T) used as t = T
    with torch.no_grad():
        context = model.encode(history, mask)
        base = model.decode(context, prefix)                                    # (B, C, T+1, V)
        for k in range(prefix.shape[-1]):
            changed = prefix.clone()
            changed[..., k] = NUM_SPECIAL_TOKENS + k * CODES_PER_LEVEL + (changed[..., k] + 1 - 3) % CODES_PER_LEVEL
            out = model.decode(context, changed)
            torch.testing.assert_close(out[..., :k + 1, :], base[..., :k + 1, :], atol=1e-6, rtol=1e-6)
            assert (out[..., k + 1, :] - base[..., k + 1, :]).abs().max() > 1e-4  # the test can fail
        noisy = torch.where(mask, history, torch.randint_like(history, NUM_SPECIAL_TOKENS, VOCAB))
        assert (noisy != history).any()
        torch.testing.assert_close(model.decode(model.encode(noisy, mask), prefix), base, atol=1e-6, rtol=1e-6)


def test_paper_size_parameter_counts():
    # V=1027 = 3 special tokens + 4 levels x 256 codes
    tiger = build_model(ModelConfig(backbone="tiger"), 1027, 4)
    llama = build_model(ModelConfig(backbone="llama"), 1027, 4)
    print(f"paper-size parameters at V=1027: tiger={tiger.num_parameters():,} llama={llama.num_parameters():,}")
    assert 4.4e6 <= tiger.num_parameters() <= 4.7e6
    assert tiger.num_parameters() == 4_591_104
    # Llama: embedding 131,456 + 8 x (4 x 128^2 attention + 3 x 128 x 1024 MLP + 2 x 128 norms) + 128
    assert 3.75e6 <= llama.num_parameters() <= 3.85e6
    assert llama.num_parameters() == 3_803_648
    assert dataclasses.asdict(ModelConfig(backbone="llama"))["dropout"] is None
    assert llama.blocks[0].attn.head_dim == PAPER_SIZES["llama"]["head_dim"] == 16


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_gradients_reach_every_parameter(backbone):
    model = tiny_model(backbone, dropout=0.1).train()
    history, mask = make_histories()
    candidates = make_candidates(len(history), 4)                              # (B, C, T)
    log_probs = label_log_probs(model(history, mask, candidates), candidates)  # (B, C, T)
    log_probs.sum().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reaches {missing}"


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_bf16_autocast_runs_and_stays_close(backbone):
    model = tiny_model(backbone).eval()
    history, mask = make_histories()
    candidates = make_candidates(len(history), 4)
    with torch.no_grad():
        reference = model(history, mask, candidates)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(history, mask, candidates)
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()
    assert (low.float() - reference).abs().max() < 0.1 * reference.abs().max()


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_select_rows_matches_encoding_those_rows(backbone):
    model = tiny_model(backbone).eval()
    history, mask = make_histories()
    prefix = make_candidates(len(history), 2)[..., :2]
    rows = torch.tensor([2, 0])
    with torch.no_grad():
        picked = model.decode(model.encode(history, mask).select_rows(rows), prefix[rows])
        direct = model.decode(model.encode(history[rows], mask[rows]), prefix[rows])
    torch.testing.assert_close(picked, direct)


def test_build_model_fills_paper_sizes_and_rejects_unknown_backbone():
    model = build_model(ModelConfig(backbone="tiger", d_model=32), VOCAB, NUM_LEVELS)
    assert model.d_model == 32 and len(model.encoder_layers) == PAPER_SIZES["tiger"]["num_layers"]
    llama = build_model(ModelConfig(backbone="llama", d_model=32, num_heads=4), VOCAB, NUM_LEVELS)
    assert llama.blocks[0].attn.head_dim == 8  # Llama: head_dim follows d_model / heads
    bad = ModelConfig()
    object.__setattr__(bad, "backbone", "gpt2")  # ModelConfig itself refuses it, so bypass
    with pytest.raises(ValueError, match=r"unknown backbone 'gpt2'; choose from \['llama', 'tiger'\]"):
        build_model(bad, VOCAB, NUM_LEVELS)


def test_label_log_probs_is_log_softmax_at_the_label_in_float32_with_its_exact_gradient(monkeypatch):
    """The chunked log-softmax (forward and hand-written backward) equals autograd's log_softmax:
    float64 gradcheck across chunk boundaries, and bf16 logits give float32 log-probs equal to the
    upcast reference with a bf16 gradient equal to the reference's cast back."""
    import apao_ray.models.base as base

    monkeypatch.setattr(base, "CPU_CHUNK_ELEMENTS", 3 * 11)  # 3 rows of V=11 per chunk: 7 rows -> 3 chunks
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.randint(0, 11, (7,), generator=generator)
    assert torch.autograd.gradcheck(lambda x: label_log_probs(x, labels), (logits,))
    expected = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    assert torch.allclose(label_log_probs(logits, labels), expected, atol=1e-12, rtol=0)

    shaped = (torch.randn(2, 3, 5, 40, generator=generator) * 4).to(torch.bfloat16).requires_grad_()
    shaped_labels = torch.randint(0, 40, (2, 3, 5), generator=generator)
    weights = torch.randn(2, 3, 5, generator=generator)
    out = label_log_probs(shaped, shaped_labels)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 5)
    (out * weights).sum().backward()
    reference_input = shaped.detach().float().requires_grad_()
    reference = torch.log_softmax(reference_input, -1).gather(-1, shaped_labels[..., None]).squeeze(-1)
    (reference * weights).sum().backward()
    assert torch.allclose(out, reference, atol=1e-5, rtol=0)
    assert shaped.grad.dtype == torch.bfloat16
    assert torch.equal(shaped.grad, reference_input.grad.to(torch.bfloat16))
    with torch.inference_mode():  # evaluation calls it without autograd
        assert torch.allclose(label_log_probs(shaped.detach(), shaped_labels), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_dropout_is_inverted_dropout_with_independent_elements(p, dtype):
    from apao_ray.models.dropout import Dropout

    n = 1 << 20
    layer = Dropout(p)
    x = torch.full((n // 64, 64), 2.0, dtype=dtype, requires_grad=True)
    torch.manual_seed(0)
    y = layer(x)
    kept = y != 0
    # each element kept with probability 1 - p: within 5 binomial standard deviations over 2^20 elements
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    # kept ones scaled by 1 / (1 - p), p as rounded to a multiple of 2^-16
    assert torch.allclose(y[kept].float(), torch.tensor(2.0 / (1 - p)), rtol=1e-4 if dtype == torch.float32 else 4e-3)
    # the four 16-bit lanes of one random word, and neighbouring words, are independent: no correlation
    flat = kept.flatten().double()
    for lag in (1, 2, 3, 4):
        assert abs(torch.corrcoef(torch.stack([flat[:-lag], flat[lag:]]))[0, 1].item()) < 5 / n ** 0.5, lag
    y.float().sum().backward()
    assert torch.equal(x.grad * 2, y.detach())  # the same mask and scale backward (x is 2 everywhere)
    torch.manual_seed(0)
    assert torch.equal(layer(x), y)  # the seeded torch generator: a run repeats
    layer.eval()
    assert layer(x) is x


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 1 - 1e-6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_keep_mask_is_the_complement_of_drop_mask_and_dropout_applies_it_exactly(p, dtype):
    """The float keep mask comes from the same draws as the bool drop mask (also where p rounds to 0 or 1
    of 2^16 lanes), and the layer's output and gradient are where(dropped, 0, x) * scale to the bit."""
    from apao_ray.models.dropout import _Dropout, drop_mask, keep_mask

    shape = torch.Size((37, 129))                                             # not a multiple of 4 lanes
    torch.manual_seed(5)
    dropped = drop_mask(shape, p)
    torch.manual_seed(5)
    kept = keep_mask(shape, p, dtype)
    assert kept.dtype == dtype and torch.equal(kept, (~dropped).to(dtype))
    x = torch.randn(shape, dtype=torch.float64).to(dtype).requires_grad_()
    torch.manual_seed(5)
    out = _Dropout.apply(x, p)
    scale = 65536 / (65536 - round(p * 65536)) if round(p * 65536) < 65536 else 0.0
    assert torch.equal(out, torch.where(dropped, 0.0, x.detach()).mul_(scale))
    grad = torch.randn(shape, dtype=torch.float64).to(dtype)
    out.backward(grad)
    assert torch.equal(x.grad, torch.where(dropped, 0.0, grad).mul_(scale))


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 1 - 1e-6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_relu_dropout_and_dropout_to_are_the_unfused_ops_to_the_bit(p, dtype):
    """relu_dropout (T5's feed-forward) is dropout(relu(x)) and dropout_to (the attention probabilities) is
    dropout(x).to(bf16), outputs and gradients bit for bit, from the same draws."""
    from apao_ray.models.dropout import _Dropout, dropout_to, relu_dropout

    shape = torch.Size((37, 3, 129))                                          # not a multiple of 4 lanes
    x = torch.randn(shape, dtype=torch.float64).to(dtype).requires_grad_()
    x.data[0, 0, :8] = 0.0                                                    # relu's kink
    cases = [(lambda t: relu_dropout(t, p), lambda t: _Dropout.apply(torch.relu(t), p))]
    if dtype != torch.bfloat16:
        cases.append((lambda t: dropout_to(t, p, torch.bfloat16), lambda t: _Dropout.apply(t, p).to(torch.bfloat16)))
    for fused, unfused in cases:
        torch.manual_seed(7)
        out = fused(x)
        grad = torch.randn(shape, dtype=torch.float64).to(out.dtype)
        (fused_grad,) = torch.autograd.grad(out, x, grad)
        torch.manual_seed(7)
        expected = unfused(x)
        (expected_grad,) = torch.autograd.grad(expected, x, grad)
        assert out.dtype == expected.dtype and torch.equal(out, expected)
        assert torch.equal(fused_grad, expected_grad)
        assert (out == 0).any() and (out != 0).any() if 0.01 < p < 0.99 else True


@pytest.mark.parametrize("scale", [1.0, 0.25])  # T5's unscaled scores; Llama's 1/sqrt(head_dim)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_attention_dropout_on_cpu_is_sdpa_with_dropout_on_the_probabilities(p, scale):
    """The unfused CPU attention used in training with dropout computes SDPA's function (additive bias, the
    given scale) with inverted dropout on the attention probabilities, drawn like every other dropout
    (drop_mask), forward and backward in float64; without training it is SDPA itself."""
    import torch.nn.functional as F

    from apao_ray.models.dropout import attention, drop_mask

    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, length, 8, dtype=torch.float64, generator=generator, requires_grad=True)
               for length in (5, 7, 7))
    padding = torch.arange(7) < torch.tensor([0, 2, 6])[:, None, None, None]   # rows left-padded by 0, 2, 6 keys
    bias = torch.zeros(3, 1, 1, 7, dtype=torch.float64).masked_fill(padding, float("-inf"))
    torch.manual_seed(0)
    out = attention(q, k, v, bias, p, training=True, scale=scale)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    probs = torch.softmax(q @ k.transpose(-2, -1) * scale + bias, dim=-1)
    torch.manual_seed(0)
    dropped = drop_mask(probs.shape, p) if p else torch.zeros_like(probs, dtype=torch.bool)
    kept_scale = 65536 / (65536 - round(p * 65536))
    expected = (probs * kept_scale).masked_fill(dropped, 0) @ v
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    assert 0 < dropped.double().mean() < 0.6 if p else not dropped.any()
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(grads, expected_grads))
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    assert torch.allclose(attention(q, k, v, bias, p, training=False, scale=scale), sdpa, atol=1e-12, rtol=0)
    if not p:
        assert torch.allclose(out, sdpa, atol=1e-12, rtol=0)


@pytest.mark.parametrize("scale", [1.0, 16.0])  # the attention scores' spread: T5 does not scale them
def test_bf16_attention_in_training_keeps_float32_scores_and_about_their_accuracy(scale):
    """In bf16 training on a CPU the attention's v product runs in bf16 (no float32 copies of the padded
    values, forward and backward), the scores, softmax and dropout in float32: output and gradients within
    2x of the distance from float64 of the attention computed all in float32 between bf16 input and output
    (as before; bf16 scores would be ~10x off at scale 16)."""
    from apao_ray.models.dropout import attention, drop_mask

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(16, 6, 5, 64, generator=generator, dtype=torch.float64) * scale / 8
    k, v = (torch.randn(16, 6, 81, 64, generator=generator, dtype=torch.float64) for _ in range(2))
    bias = torch.zeros(16, 1, 1, 81, dtype=torch.float64)
    bias[:8, ..., :40] = float("-inf")  # left padding of half the rows
    weights = torch.randn(16, 6, 5, 64, generator=generator, dtype=torch.float64)
    inputs = [t.bfloat16() for t in (q, k, v)]

    def run(function, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in inputs]
        torch.manual_seed(0)
        out = function(*leaves, bias.to(dtype))
        return [out.double(), *(g.double() for g in torch.autograd.grad((out.double() * weights).sum(), leaves))]

    def exact(q, k, v, bias):  # the same function (and dropout mask) in whatever dtype the inputs have
        probs = torch.softmax(q @ k.transpose(-2, -1) + bias, dim=-1)
        dropped = drop_mask(probs.shape, 0.1)
        return (probs / (1 - round(0.1 * 65536) / 65536)).masked_fill(dropped, 0) @ v

    reference = run(exact, torch.float64)
    bf16 = run(lambda *a: attention(*a, 0.1, training=True), torch.bfloat16)
    # what bf16 training ran before: bf16 in, everything in float32, bf16 out
    float32 = run(lambda *a: exact(*(t.float() for t in a)).bfloat16(), torch.bfloat16)
    for got, wide, want in zip(bf16, float32, reference):
        error, float32_error = ((x - want).abs().max().item() / want.abs().max().item() for x in (got, wide))
        assert error <= 2 * float32_error, (error, float32_error)


@pytest.mark.parametrize("scale", [1.0, 16.0])  # the scores' spread: T5 does not scale them
@pytest.mark.parametrize("queries, keys", [(1, 4), (20, 81)])  # a beam's cached self-attention; cross-attention
def test_bf16_attention_in_evaluation_is_sdpa_about_as_accurately(queries, keys, scale):
    """In evaluation on a CPU in bf16 the attention is the unfused products (SDPA's kernel is slower for a
    beam's small problems): the same function, within 2x of SDPA's own bf16 distance from float64, also
    when the scores spread widely (scores rounded to bf16 were 15x SDPA's error at spread 16)."""
    import torch.nn.functional as F

    from apao_ray.models.dropout import attention

    generator = torch.Generator().manual_seed(2)
    q = torch.randn(64, 6, queries, 64, generator=generator, dtype=torch.float64) * scale / 8
    k, v = (torch.randn(64, 6, keys, 64, generator=generator, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(1, 6, 1, keys, generator=generator, dtype=torch.float64)
    bias[..., :1] = float("-inf")  # a masked key
    dtype = torch.bfloat16
    q, k, v, bias = (t.to(dtype) for t in (q, k, v, bias))
    exact = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), attn_mask=bias.double(), scale=1.0)
    out = attention(q, k, v, bias, 0.1, training=False)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
    assert out.dtype == dtype and out.shape == exact.shape
    error, sdpa_error = ((x.double() - exact).abs().max().item() for x in (out, sdpa))
    assert error <= 2 * sdpa_error, (error, sdpa_error)
