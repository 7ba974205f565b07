"""models/dropout.py: fast dropout, its masks and fused forms, and the attention it drops in (CPU and bf16), each
against the unfused torch ops."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


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
