"""Protocol presets (paper / reference) and each knob's effect, on small real runs (no mocks).

Each test pins one knob to what the paper or the released code (yuyq18/APAO aa08fcf) does and
would fail if the knob were ignored: the epoch kept, the label tokens and beam score, the
gradient that is clipped, the Llama input, the pairwise scale, and the MLflow-facing tags.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from apao_ray.config import DataConfig, LossConfig, ModelConfig, ProtocolConfig, TrainConfig, TrialConfig
from apao_ray.data import collate, iter_batches, load_dataset
from apao_ray.data.catalog import EOS_TOKEN
from apao_ray.losses import apao_pairwise_losses, build_loss
from apao_ray.losses.base import LossInputs
from apao_ray.models import build_model
from apao_ray.models.base import label_log_probs
from apao_ray.protocol import (KNOBS, PRESETS, apply_protocol, decoding_scoring, protocol_tag, resolved_knobs,
                               run_tags, schedule_label)
from apao_ray.training.checkpoint import load_checkpoint
from apao_ray.training.hooks import TrainingHooks
from apao_ray.training.loop import run_trial
from apao_ray.training.selection import selection_score
from apao_ray.training.steps import EpochRunner

from apao_ray.config import TINY_MODEL


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def short():
    return load_dataset("synthetic", max_history=2)


def tiny_config(protocol: str = "paper", loss: str = "ce", backbone: str = "tiger", knobs: dict | None = None,
                **train_options) -> TrialConfig:
    train = {"epochs": 3, "batch_size": 64, "effective_batch_size": 64, "lr": 3e-3, "max_train_samples": 256,
             "eval_max_users": 48, "retention_users": 0, "patience": 5, **train_options}
    config = TrialConfig(DataConfig(max_history=2), ModelConfig(backbone=backbone, dropout=0.0, **TINY_MODEL),
                         LossConfig(name=loss, beta=0.3, num_negatives=5), TrainConfig(**train))
    return apply_protocol(config, protocol, knobs)


# --- presets and knob resolution ---------------------------------------------------------------

def test_paper_preset_is_the_default_config():
    """--protocol paper changes nothing: its knobs are the config defaults (today's behaviour)."""
    assert resolved_knobs(TrialConfig()) == PRESETS["paper"]
    assert apply_protocol(TrialConfig(), "paper") == TrialConfig()
    assert protocol_tag(TrialConfig()) == "paper"


def test_reference_preset_and_explicit_knob_beats_it():
    config = apply_protocol(TrialConfig(), "reference")
    assert resolved_knobs(config) == {"select_by": "loss", "weighting": "per_batch", "eta": 0.0, "label_eos": True,
                                      "clip_summed_grad": True, "llama_history_eos": False,
                                      "pairwise_scale_plus_one": True}
    mixed = apply_protocol(TrialConfig(), "reference", {"select_by": "ndcg_at_10", "label_eos": False, "eta": None})
    assert mixed.protocol.select_by == "ndcg_at_10" and mixed.protocol.label_eos is False
    assert mixed.loss.eta == 0.0  # None = take the preset
    assert protocol_tag(mixed) == "reference+label_eos+select_by"
    # the resolved knobs are plain config fields: they round-trip through the dict MLflow logs
    flat = mixed.to_dict()
    assert flat["protocol"] == {"name": "reference", "select_by": "ndcg_at_10", "label_eos": False,
                                "clip_summed_grad": True}
    assert flat["model"]["llama_history_eos"] is False and flat["loss"]["pairwise_scale_plus_one"] is True
    assert TrialConfig.from_dict(flat) == mixed


def test_bad_protocol_values_are_named():
    with pytest.raises(ValueError, match=r"unknown protocol 'released'; choose from \['paper', 'reference'\]"):
        apply_protocol(TrialConfig(), "released")
    with pytest.raises(ValueError, match=r"unknown protocol knob\(s\) \['clip'\]"):
        apply_protocol(TrialConfig(), "paper", {"clip": True})
    with pytest.raises(ValueError, match="ProtocolConfig.name='x' is not allowed"):
        ProtocolConfig(name="x")
    from apao_ray.protocol import check_select_by

    with pytest.raises(ValueError, match=r"select_by='ndcg_at_50'.*choose from \['loss', 'loss_ce', 'recall_at_5'"):
        check_select_by(apply_protocol(TrialConfig(), "paper", {"select_by": "ndcg_at_50"}))


def test_train_and_sweep_cli_resolve_the_preset_and_flags():
    from apao_ray.study.cli import sweep as cli_sweep, train as cli_train

    parser = cli_train.build_parser()
    paper = cli_train.trial_config_from_args(parser.parse_args(["--loss", "apao_pointwise"]))
    assert resolved_knobs(paper) == PRESETS["paper"]
    args = parser.parse_args(["--loss", "apao_pairwise", "--protocol", "reference", "--no-label-eos",
                              "--weighting", "mirror", "--eta", "3e-5", "--select-by", "recall_at_20"])
    config = cli_train.trial_config_from_args(args)
    assert resolved_knobs(config) == {**PRESETS["reference"], "label_eos": False, "weighting": "mirror",
                                      "eta": 3e-5, "select_by": "recall_at_20"}
    sweep_args = cli_sweep.build_parser().parse_args(["--protocol", "reference", "--no-clip-summed-grad",
                                                       "--eta", "1e-5:1e-4"])
    assert sweep_args.label_eos is None  # not given: the preset decides
    from apao_ray.study.cli.protocol import apply_protocol_arguments

    swept = apply_protocol_arguments(TrialConfig(), sweep_args, with_eta=False)  # --eta is the search range there
    assert resolved_knobs(swept) == {**PRESETS["reference"], "clip_summed_grad": False}
    help_text = parser.format_help()
    for flag in ("--protocol", *(f"--{knob.replace('_', '-')}" for knob in KNOBS)):
        assert flag in help_text


# --- 1. which epoch is kept ----------------------------------------------------------------------

def test_select_by_loss_keeps_lowest_loss_where_ndcg_disagrees():
    history = [{"epoch": 1, "val/ndcg_at_10": 0.30, "val/loss": 2.0},
               {"epoch": 2, "val/ndcg_at_10": 0.10, "val/loss": 1.1},   # lowest loss, worst NDCG
               {"epoch": 3, "val/ndcg_at_10": 0.20, "val/loss": 1.5}]

    def kept(select_by: str) -> int:
        return max(history, key=lambda entry: selection_score(entry, select_by))["epoch"]

    assert kept("loss") == 2 and kept("ndcg_at_10") == 1
    with pytest.raises(ValueError, match=r"select_by='recall_at_10'.*choose from \['loss', 'ndcg_at_10'\]"):
        selection_score(history[0], "recall_at_10")


def test_reference_run_keeps_the_lowest_mean_validation_loss_epoch(short, tmp_path):
    """End to end: the kept epoch is the argmin of val/loss, its weights are the final ones, and
    val/loss there is the mean CE over the 4 codes + EOS on the validation users (by hand)."""
    config = tiny_config("reference", lr=2e-2, epochs=4, precision="fp32")  # fp32: the by-hand mean below is
    hooks = TrainingHooks(tmp_path, verbose=False)
    final = run_trial(config, hooks, short)
    epochs = [r for r in hooks.reports if not r.get("done")]
    losses = [r["val/loss"] for r in epochs]
    best = int(np.argmin(losses)) + 1
    assert final["best/epoch"] == best and final["best/val/loss"] == min(losses)
    assert final["best/val/ndcg_at_10"] == epochs[best - 1]["val/ndcg_at_10"]
    _, best_weights, _ = load_checkpoint(sorted((tmp_path / "checkpoints").glob("*_final"))[-1])
    model = build_model(config.model, short.catalog.vocab_size, short.catalog.num_levels)
    model.load_state_dict(best_weights)
    model.eval()
    from apao_ray.training.evaluation import select_users

    users = select_users(len(short.splits["valid"]), config.train.eval_max_users, config.train.seed)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in iter_batches(short.catalog, short.splits["valid"], 32, indices=users):
            labels = torch.cat([batch.labels, torch.full_like(batch.labels[:, :1], EOS_TOKEN)], 1)[:, None]  # (B, 1, 5)
            logp = label_log_probs(model(batch.history_ids, batch.history_mask, labels), labels)          # (B, 1, 5)
            total += float(-logp.mean()) * len(batch)
            count += len(batch)
    assert total / count == pytest.approx(final["best/val/loss"], abs=1e-5)


def test_paper_run_keeps_the_best_ndcg_epoch(short, tmp_path):
    hooks = TrainingHooks(tmp_path, verbose=False)
    final = run_trial(tiny_config("paper", lr=2e-2), hooks, short)
    ndcg = [r["val/ndcg_at_10"] for r in hooks.reports if not r.get("done")]
    assert final["best/epoch"] == int(np.argmax(ndcg)) + 1 and final["val/loss"] > 0  # the loss rule's, recorded too


def test_reference_apao_pairwise_validation_loss_is_its_objective(short, tmp_path):
    """APAO's val/loss is CE + beta * weighted prefix loss (not plain CE), and validating leaves the
    per-batch weights' state untouched."""
    hooks = TrainingHooks(tmp_path, verbose=False)
    final = run_trial(tiny_config("reference", loss="apao_pairwise", epochs=2), hooks, short)
    for report in (r for r in hooks.reports if not r.get("done")):
        assert math.isfinite(report["val/loss"]) and report["val/loss"] > 0
        assert abs(report["val/loss"] - report["val/loss_ce"]) > 1e-3  # includes beta * prefix loss, 5 tokens
    assert final["test/ndcg_at_10"] >= 0


# --- 3. labels = codes + EOS ----------------------------------------------------------------------

def test_label_eos_puts_eos_in_the_labels_and_ce_averages_five_tokens(short):
    config = tiny_config("reference")
    tensors = short.catalog.tensors()
    runner = EpochRunner(config, short, tensors, torch.device("cpu"))
    batch = collate(short.catalog, short.splits["train"], np.arange(8))
    candidates, nodes = runner.candidates_of(batch, None)
    assert candidates.shape == (8, 1, 5) and (candidates[..., -1] == EOS_TOKEN).all()
    assert torch.equal(candidates[:, 0, :4], batch.labels)
    paper_candidates, _ = EpochRunner(tiny_config("paper"), short, tensors, torch.device("cpu")).candidates_of(
        batch, None)
    assert paper_candidates.shape == (8, 1, 4)
    model = build_model(config.model, short.catalog.vocab_size, short.catalog.num_levels)
    logits = model(batch.history_ids, batch.history_mask, candidates)                    # (B, 1, 5, V)
    output = build_loss(config.loss, tensors)(LossInputs(logits, candidates, nodes))
    by_hand = -torch.log_softmax(logits[:, 0], -1).gather(-1, candidates[:, 0, :, None]).mean()
    torch.testing.assert_close(output.loss, by_hand)
    assert decoding_scoring(config).end_token == EOS_TOKEN and decoding_scoring(tiny_config()).end_token is None


def test_label_eos_apao_prefixes_use_codes_only(short):
    """With EOS labels the APAO prefix losses still cover the 4 codes; only its CE sees the EOS."""
    config = tiny_config("reference", loss="apao_pointwise")
    tensors = short.catalog.tensors()
    runner = EpochRunner(config, short, tensors, torch.device("cpu"))
    batch = collate(short.catalog, short.splits["train"], np.arange(8))
    candidates, nodes = runner.candidates_of(batch, None)
    model = build_model(config.model, short.catalog.vocab_size, short.catalog.num_levels)
    output = build_loss(config.loss, tensors)(LossInputs(model(batch.history_ids, batch.history_mask, candidates),
                                                         candidates, nodes))
    assert output.prefix_losses.shape == (4,)
    logp = label_log_probs(model(batch.history_ids, batch.history_mask, candidates), candidates)[:, 0]  # (B, 5)
    torch.testing.assert_close(output.metrics["loss_ce"], -logp.mean().detach())
    torch.testing.assert_close(output.prefix_losses[3], -(logp[:, :4].sum(-1) / 4).mean().detach())


def test_msl_with_label_eos_trains_eos_as_the_only_valid_token(short):
    config = tiny_config("reference", loss="msl")
    tensors = short.catalog.tensors()
    batch = collate(short.catalog, short.splits["train"], np.arange(8))
    candidates, nodes = EpochRunner(config, short, tensors, torch.device("cpu")).candidates_of(batch, None)
    model = build_model(config.model, short.catalog.vocab_size, short.catalog.num_levels)
    logits = model(batch.history_ids, batch.history_mask, candidates)
    with_eos = build_loss(config.loss, tensors)(LossInputs(logits, candidates, nodes)).loss
    without = build_loss(config.loss, tensors)(LossInputs(logits[:, :, :4], candidates[..., :4], nodes)).loss
    torch.testing.assert_close(with_eos, without * 4 / 5)  # the EOS step costs 0: mean over 5 tokens


# --- 4. clipping the summed gradient --------------------------------------------------------------

@pytest.mark.parametrize("protocol", ["paper", "reference"])
def test_grad_norm_is_of_the_summed_or_mean_gradient(short, protocol):
    """Two accumulation micro-batches of 4: the clipped norm is that of g1 + g2 (reference) or of
    (g1 + g2) / 2 (paper), computed here by hand from the same samples."""
    config = tiny_config(protocol, batch_size=4, effective_batch_size=8, max_train_samples=8, grad_clip=1e9,
                         precision="fp32")  # the by-hand gradients below are fp32
    tensors = short.catalog.tensors()
    runner = EpochRunner(config, short, tensors, torch.device("cpu"))
    assert runner.accumulation == 2
    torch.manual_seed(0)
    model = build_model(config.model, short.catalog.vocab_size, short.catalog.num_levels)
    by_hand_model = copy.deepcopy(model)
    loss_fn = build_loss(config.loss, tensors)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    metrics = runner.train_epoch(1, model, loss_fn, optimizer, scheduler, None)

    order = np.random.default_rng([config.train.seed, 1]).permutation(runner.indices)
    for chunk in (order[:4], order[4:8]):
        batch = collate(short.catalog, short.splits["train"], chunk)
        candidates, nodes = runner.candidates_of(batch, None)
        logits = by_hand_model(batch.history_ids, batch.history_mask, candidates)
        loss_fn(LossInputs(logits, candidates, nodes)).loss.backward()                   # g1 + g2
    summed = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in by_hand_model.parameters()]))
    expected = float(summed) if protocol == "reference" else float(summed) / 2
    assert metrics["train/grad_norm"] == pytest.approx(expected, rel=1e-4)


def test_on_a_gpu_a_micro_batch_with_negatives_is_chunked_by_its_candidates():
    from apao_ray.training.steps import GPU_CANDIDATES_PER_CHUNK, chunk_size

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert chunk_size(1024, 0, cuda) == 1024 and chunk_size(1024, 200, cpu) == 1024
    assert chunk_size(1024, 100, cuda) == 256 and chunk_size(1024, 200, cuda) == 128
    assert chunk_size(64, 100, cuda) == 64 and chunk_size(1024, GPU_CANDIDATES_PER_CHUNK, cuda) == 1


def test_chunks_of_a_micro_batch_train_as_the_whole_micro_batch(short, monkeypatch):
    """What the GPU's chunking does (run here on the CPU by shrinking the chunk): one optimizer step of a micro-batch
    of 8 in chunks of 3, 3 and 2 gives the same weights and adaptive prefix weights as in one piece."""
    from apao_ray.training import steps

    config = tiny_config("paper", loss="apao_pairwise", batch_size=8, effective_batch_size=8, max_train_samples=8,
                         precision="fp32")
    tensors = short.catalog.tensors()
    results = []
    for size in (None, 3):
        if size:
            monkeypatch.setattr(steps, "chunk_size", lambda batch_size, num_negatives, device: size)
        torch.manual_seed(0)
        model = build_model(config.model, short.catalog.vocab_size, short.catalog.num_levels)
        loss_fn = build_loss(config.loss, tensors)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the step is the (clipped) gradient itself
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        metrics = EpochRunner(config, short, tensors, torch.device("cpu")).train_epoch(
            1, model, loss_fn, optimizer, scheduler, None)
        results.append((torch.cat([p.detach().flatten() for p in model.parameters()]), metrics))
    (whole, whole_metrics), (chunked, chunked_metrics) = results
    torch.manual_seed(0)  # the same initial weights: the step moved them
    initial = build_model(config.model, short.catalog.vocab_size, short.catalog.num_levels)
    assert (whole - chunked).abs().max() < 1e-5
    assert (whole - torch.cat([p.detach().flatten() for p in initial.parameters()])).abs().max() > 1e-3
    for key in ("train/loss", "train/grad_norm", *(f"train/apao_weight_m{m}" for m in range(1, 5))):
        assert chunked_metrics[key] == pytest.approx(whole_metrics[key], rel=1e-5), key


# --- 5. Llama input -------------------------------------------------------------------------------

@pytest.mark.parametrize("history_eos", [True, False])
def test_llama_input_has_or_lacks_the_eos(short, history_eos):
    """Teacher-forced logits equal a plain causal pass over history (+ EOS when asked) + target."""
    config = apply_protocol(tiny_config(backbone="llama"), "paper", {"llama_history_eos": history_eos})
    torch.manual_seed(0)
    model = build_model(config.model, short.catalog.vocab_size, short.catalog.num_levels).double().eval()
    batch = collate(short.catalog, short.splits["valid"], np.arange(6))
    assert (batch.history_ids[:, -1] == EOS_TOKEN).all()
    labels = batch.labels[:, None]                                                       # (B, 1, T)
    got = model(batch.history_ids, batch.history_mask, labels)[:, 0]                      # (B, T, V)
    history = batch.history_ids if history_eos else batch.history_ids[:, :-1]
    mask = batch.history_mask if history_eos else batch.history_mask[:, :-1]
    sequence = torch.cat([history, batch.labels[:, :-1]], 1)                              # (B, L' + T - 1)
    full = model.forward_full(sequence, torch.cat([mask, torch.ones_like(batch.labels[:, :-1], dtype=torch.bool)], 1))
    torch.testing.assert_close(got, full[:, -4:], atol=1e-6, rtol=0)  # RoPE angles are float32
    other = apply_protocol(config, "paper", {"llama_history_eos": not history_eos})
    model_other = build_model(other.model, short.catalog.vocab_size, short.catalog.num_levels).double().eval()
    model_other.load_state_dict(model.state_dict())
    assert not torch.allclose(model_other(batch.history_ids, batch.history_mask, labels)[:, 0], got)


def test_llama_without_eos_reads_an_empty_history_as_its_eos():
    """Inference may pass an empty history: without the EOS column it would have no token at all."""
    from apao_ray.data.batches import encode_histories

    short = load_dataset("synthetic", max_history=2)
    config = apply_protocol(tiny_config(backbone="llama"), "reference")
    torch.manual_seed(0)
    model = build_model(config.model, short.catalog.vocab_size, short.catalog.num_levels).eval()
    ids, mask = encode_histories(short.catalog.item_tokens, np.array([[-1, -1], [-1, 3], [5, 7]]))  # (3, 9)
    labels = torch.from_numpy(short.catalog.item_tokens[[1, 2, 3]])[:, None]                        # (3, 1, T)
    logits = model(ids, mask, labels)
    assert torch.isfinite(logits).all()
    one_ids, one_mask = encode_histories(short.catalog.item_tokens, np.array([[3]]))                # (1, 5)
    torch.testing.assert_close(logits[1:2], model(one_ids, one_mask, labels[1:2]), atol=1e-5, rtol=0)
    with_eos = build_model(tiny_config(backbone="llama").model, short.catalog.vocab_size, short.catalog.num_levels)
    with_eos.load_state_dict(model.state_dict())
    only_eos = torch.tensor([[EOS_TOKEN]])
    torch.testing.assert_close(logits[:1], with_eos.eval()(only_eos, only_eos > 0, labels[:1]), atol=1e-5, rtol=0)


def test_tiger_ignores_the_llama_knob(short):
    config = tiny_config("reference", backbone="tiger")
    assert config.model.llama_history_eos is False
    torch.manual_seed(0)
    model = build_model(config.model, short.catalog.vocab_size, short.catalog.num_levels)
    torch.manual_seed(0)
    plain = build_model(tiny_config().model, short.catalog.vocab_size, short.catalog.num_levels)
    batch = collate(short.catalog, short.splits["valid"], np.arange(4))
    model.eval(), plain.eval()
    torch.testing.assert_close(model(batch.history_ids, batch.history_mask, batch.labels[:, None]),
                               plain(batch.history_ids, batch.history_mask, batch.labels[:, None]))


# --- 6. pairwise scaling --------------------------------------------------------------------------

def test_pairwise_scale_plus_one_matches_by_hand():
    """a_m = (P_m - 1) / (counted + 1) with the flag, (P_m - 1) / counted without, by hand."""
    torch.manual_seed(0)
    token_logp = -torch.rand(2, 4, 2, dtype=torch.float64) * 3                          # (B, 1+N, T)
    valid = torch.tensor([[[True, True], [True, False], [True, True], [False, False]],
                          [[True, True], [True, True], [True, True], [True, True]]])    # (B, 1+N, T)
    num_prefixes = torch.tensor([5.0, 11.0], dtype=torch.float64)
    scores = token_logp.cumsum(-1)
    for offset in (0, 1):
        got = apao_pairwise_losses(token_logp, valid, divide_by_m=True, num_distinct_prefixes=num_prefixes,
                                   scale_offset=offset)
        expected = []
        for m in range(2):
            rows = []
            for b in range(2):
                counted = [j for j in range(1, 4) if valid[b, j, m]]
                scale = (float(num_prefixes[m]) - 1) / max(1, len(counted) + offset)
                positive = math.exp(float(scores[b, 0, m]))
                negatives = scale * sum(math.exp(float(scores[b, j, m])) for j in counted)
                rows.append(-math.log(positive / (positive + negatives)) / (m + 1))
            expected.append(sum(rows) / 2)
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))
    config = tiny_config("reference", loss="apao_pairwise")
    assert config.loss.pairwise_scale_plus_one and not tiny_config(loss="apao_pairwise").loss.pairwise_scale_plus_one


# --- 9. schedule honesty ---------------------------------------------------------------------------

def test_run_tags_name_protocol_and_schedule():
    assert run_tags(TrialConfig()) == {"apao.protocol": "paper", "apao.schedule": "paper"}
    short_run = apply_protocol(TrialConfig(train=TrainConfig(epochs=20, patience=5)), "reference")
    assert run_tags(short_run) == {"apao.protocol": "reference", "apao.schedule": "20 epochs / patience 5"}
    assert schedule_label(200, 20) == "paper" and schedule_label(200, 5) == "200 epochs / patience 5"


def test_results_table_calls_columns_paper_comparable_only_on_the_paper_schedule():
    from apao_ray.study.record.report import format_rows

    row = {"backbone": "tiger", "loss": "ce", "best/val/ndcg_at_10": 0.1, "test/ndcg_at_10": 0.05,
           "protocol": "paper", "schedule": "paper", "run_id": "r"}
    assert format_rows([row]).endswith("comparable to paper Table 1") and "NOT" not in format_rows([row])
    short_row = {**row, "schedule": "20 epochs / patience 5", "protocol": "reference"}
    text = format_rows([row, short_row])
    assert "NOT comparable to paper Table 1" in text and "20 epochs / patience 5" in text
    # the study's MLflow description says it once, also where its table is cut to fit MLflow's tag
    from apao_ray.study.record.answer import DESCRIPTION_LIMIT, study_description

    for rows in ([row, short_row], [{**short_row, "run_id": f"r{i:03d}"} for i in range(200)]):
        description = study_description("s", rows)
        assert description.count("comparable to paper Table 1") == 1 and len(description) <= DESCRIPTION_LIMIT
    assert "(table cut: " in description and description.rstrip().endswith("no verdict.")
