"""Backbones: shared-context decoding, Llama vs a naive causal LM, causality, sizes, gradients (their dropout:
test_dropout.py)."""
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
