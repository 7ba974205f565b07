"""Data parallelism: two ranks train the model one worker trains (training/loop.py, steps.py).

Two gloo processes (torch.multiprocessing) run the project's own loop, ``run_trial``, with hooks that give it
a rank and a DDP-wrapped model, as Ray Train's ``prepare_model`` does on CPUs; ``apao train --num-workers 2``
runs the same loop in Ray Train workers (tests/test_train_cli.py kills and resumes one).

Tolerance: fp32, dropout off, one thread per process. One worker sums a step's gradient over its micro-batch
in one order; two ranks sum halves and DDP averages them, so the gradients differ by float rounding, ~1e-7
relative. AdamW then moves each weight by about lr * g / |g|, whatever g's size: where a gradient element is
itself no larger than that rounding (cancelling terms), its update's sign is noise, and a few elements differ
by up to ~lr per step (measured 1.8e-3 after 8 CE steps at lr 2e-3). So the runs are compared as a whole:
||W_two - W_one|| / ||W_one - W_init||, measured 2e-6 (APAO-pointwise), 1.5e-5 (per_batch weights), 2e-3 (CE,
APAO-pairwise), against 0.47 with overlapping shards or with gradients never all-reduced (CE) and 0.02 with
per_batch APAO weights from each rank's own micro-batch; ``RELATIVE`` = 1e-2 sits between them. The loss and
gradient norm must agree to 1e-4 / 1e-3 relative, the ranks' weights and APAO weights exactly: mirror APAO
weights updated from each rank's own losses diverge between the ranks (0.187 vs 0.201 after epoch 1) while
the model weights stay 2e-3 (relative) from one worker's.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from apao_ray.config import DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
from apao_ray.training.hooks import TrainingHooks
from apao_ray.config import TINY_MODEL

RELATIVE = 1e-2
EPOCHS = 2
RANK_BATCH = 32           # per rank; one worker trains micro-batches of both ranks' size, 64
EFFECTIVE_BATCH = 128     # 2 micro-batches per rank per step, 1 for the single worker: 4 steps per epoch
TRAIN_SAMPLES = 512


class DataParallelHooks(TrainingHooks):
    """A rank of a torch.distributed group; keeps every epoch's weights and report for the test."""

    def __init__(self, output_dir: Path) -> None:
        super().__init__(output_dir, verbose=False)
        self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.epochs: list[dict] = []

    def prepare_model(self, model):
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.model = torch.nn.parallel.DistributedDataParallel(model.to(self.device))  # prepare_model on a CPU
        return self.model

    def report(self, metrics, checkpoint_dir) -> None:
        super().report(metrics, checkpoint_dir)
        if not metrics.get("done"):
            weights = {k: v.detach().clone() for k, v in self.model.module.state_dict().items()}
            self.epochs.append({"metrics": dict(metrics), "weights": weights})


def trial_config(loss: LossConfig, world_size: int, **train: object) -> TrialConfig:
    return TrialConfig(DataConfig(), ModelConfig(dropout=0.0, **TINY_MODEL), loss, TrainConfig(
        epochs=EPOCHS, batch_size=RANK_BATCH * 2 // world_size, effective_batch_size=EFFECTIVE_BATCH, lr=2e-3,
        max_train_samples=TRAIN_SAMPLES, eval_max_users=16, retention_users=0, beam_size=10, precision="fp32",
        num_workers=world_size, **train))


def _rank(rank: int, world_size: int, config: TrialConfig, directory: str) -> None:
    from apao_ray.training.loop import run_trial

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank,
                                         world_size=world_size)
    try:
        hooks = DataParallelHooks(Path(directory) / f"rank{rank}")
        final = run_trial(config, hooks)
        torch.save([{"weights": hooks.initial}, *hooks.epochs], Path(directory) / f"rank{rank}.pt")
        torch.save(final, Path(directory) / f"rank{rank}_final.pt")
    finally:
        torch.distributed.destroy_process_group()


def train(config: TrialConfig, directory: Path) -> list[list[dict]]:
    """Trains ``config`` on ``config.train.num_workers`` ranks; every rank's initial weights, then its weights
    and report of each epoch (``directory/rank0_final.pt`` holds rank 0's final metrics)."""
    directory.mkdir(parents=True)
    world_size = config.train.num_workers
    torch.multiprocessing.spawn(_rank, args=(world_size, config, str(directory)), nprocs=world_size)
    return [torch.load(directory / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def max_difference(first: dict, second: dict) -> float:
    return max(float((first[k] - second[k]).abs().max()) for k in first)


def relative_difference(first: dict, second: dict, initial: dict) -> float:
    """||first - second|| / ||first - initial|| over all the weights: how far apart two runs ended up, relative
    to how far training moved them."""
    def norm(tensors) -> float:
        return float(sum((t.double() ** 2).sum() for t in tensors)) ** 0.5

    return norm(first[k] - second[k] for k in first) / norm(first[k] - initial[k] for k in first)


LOSSES = {
    "ce": LossConfig(name="ce"),
    # a large eta moves the mirror weights visibly within 8 steps; beta large so they matter to the gradient
    "apao_pointwise": LossConfig(name="apao_pointwise", beta=1.0, eta=0.5),
    "apao_pointwise_per_batch": LossConfig(name="apao_pointwise", beta=1.0, eta=0.5, weighting="per_batch"),
    "apao_pairwise": LossConfig(name="apao_pairwise", beta=1.0, eta=0.5, num_negatives=8),
}


@pytest.mark.e2e  # two trainings in subprocesses, ~15 s
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_two_ranks_train_the_weights_one_worker_trains(tmp_path, loss):
    (initial, *single), = train(trial_config(LOSSES[loss], 1), tmp_path / "one")
    (_, *first), (_, *second) = train(trial_config(LOSSES[loss], 2), tmp_path / "two")
    assert len(single) == len(first) == len(second) == EPOCHS
    for epoch in range(EPOCHS):
        # DDP keeps the ranks' weights identical: each applies the same averaged gradient
        assert max_difference(first[epoch]["weights"], second[epoch]["weights"]) == 0.0, f"epoch {epoch + 1}"
        difference = relative_difference(single[epoch]["weights"], first[epoch]["weights"], initial["weights"])
        assert difference < RELATIVE, f"epoch {epoch + 1}: weights {difference:.2e} (relative) from one worker's"
        one, ranks = single[epoch]["metrics"], [first[epoch]["metrics"], second[epoch]["metrics"]]
        # each rank trained half the samples, none twice: together they trained the one worker's
        assert sum(r["train/num_samples"] for r in ranks) == one["train/num_samples"] == TRAIN_SAMPLES
        assert ranks[0]["train/loss"] != ranks[1]["train/loss"]  # different halves, not the same shard twice
        assert (ranks[0]["train/loss"] + ranks[1]["train/loss"]) / 2 == pytest.approx(one["train/loss"], rel=1e-4)
        # the gradient of the whole step, averaged over the ranks (a sum would be twice as large)
        assert ranks[0]["train/grad_norm"] == ranks[1]["train/grad_norm"]
        assert ranks[0]["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=1e-3)
        for m in range(1, 5):
            key = f"train/apao_weight_m{m}"
            if loss != "ce":  # the adaptive weights are state: equal on every rank, and the one worker's
                assert ranks[0][key] == ranks[1][key], f"{key} diverged between ranks in epoch {epoch + 1}"
                # the same samples, summed in another order (each micro-batch's rows are in order of history
                # length): float32 rounding, amplified by eta 0.5, moves the weights by ~1e-5
                assert ranks[0][key] == pytest.approx(one[key], abs=5e-5)
                assert one[key] != pytest.approx(0.25, abs=1e-3), "the adaptive weights did not move: a weak test"


@pytest.mark.e2e
def test_early_stopping_stops_every_rank_at_rank_0s_epoch(tmp_path):
    """Only rank 0 validates; patience 1 at lr 0 (nothing improves after epoch 1) stops after epoch 2 on both."""
    config = trial_config(LOSSES["ce"], 2)
    config = config.replace(train=config.train.replace(epochs=5, patience=1, lr=1e-12))
    (_, *first), (_, *second) = train(config, tmp_path / "two")
    assert [e["metrics"]["epoch"] for e in first] == [e["metrics"]["epoch"] for e in second] == [1, 2]
    assert first[-1]["metrics"]["best/epoch"] == second[-1]["metrics"]["best/epoch"] == 1
    checkpoints = sorted(p.name for p in (tmp_path / "two" / "rank0" / "checkpoints").iterdir())
    assert checkpoints == ["epoch_0002", "epoch_0002_final"]  # rank 0 saved them; rank 1 saved none
    assert not (tmp_path / "two" / "rank1" / "checkpoints").exists()
    final = torch.load(tmp_path / "two" / "rank0" / "checkpoints" / "epoch_0002_final" / "best_model.pt")
    assert not any(key.startswith("module.") for key in final)  # the unwrapped model, loadable without DDP
    assert max_difference(final, first[0]["weights"]) == 0.0  # epoch 1's, the best


@pytest.mark.parametrize("group_by_length", [False, True])
def test_the_ranks_shards_are_disjoint_and_interleave_into_one_workers_epoch(synthetic, group_by_length):
    """Rank r trains positions r, r + 2, ... of the one worker's order, and draws the same negatives there."""
    import numpy as np

    from apao_ray.training.draws import PositionNegatives
    from apao_ray.training.steps import EpochRunner

    def order(world_size: int, rank: int) -> np.ndarray:
        config = trial_config(LOSSES["apao_pairwise"], world_size, group_by_length=group_by_length)
        runner = EpochRunner(config, synthetic, synthetic.catalog.tensors(), torch.device("cpu"), rank, world_size)
        return runner.epoch_order(3)

    one, first, second = order(1, 0), order(2, 0), order(2, 1)
    assert len(first) == len(second) == TRAIN_SAMPLES // 2 and not set(first) & set(second)
    assert np.array_equal(np.stack([first, second], axis=1).reshape(-1), one)
    targets = torch.as_tensor(synthetic.catalog.item_sem[synthetic.splits["train"].targets[one]])
    negatives = PositionNegatives(0, 3, synthetic.catalog.num_semantic_ids, 8)
    everything = negatives(np.arange(len(one)), targets)                              # (S, N)
    for rank in (0, 1):  # a fresh sampler per rank, as each rank has its own
        positions = np.arange(rank, len(one), 2)
        mine = PositionNegatives(0, 3, synthetic.catalog.num_semantic_ids, 8)(positions, targets[positions])
        assert torch.equal(mine, everything[positions])
    assert not (everything == targets[:, None]).any()
    assert not torch.equal(everything, PositionNegatives(0, 4, synthetic.catalog.num_semantic_ids, 8)(
        np.arange(len(one)), targets))  # resampled every epoch


def test_each_micro_batch_is_in_order_of_history_length_and_each_sample_keeps_its_places_negatives(synthetic):
    """The rows of every micro-batch the model sees are in order of history length (TIGER's cross-attention
    then skips each row group's padding), and the rows are the epoch's samples with the negatives drawn for
    their places: the same candidates as the unsorted order, only their row order changes."""
    import numpy as np

    from apao_ray.data.batches import collate
    from apao_ray.losses import build_loss
    from apao_ray.models import build_model
    from apao_ray.training.draws import PositionNegatives
    from apao_ray.training.steps import EpochRunner

    config = trial_config(LOSSES["apao_pairwise"], 1)
    config = config.replace(train=config.train.replace(max_train_samples=96, batch_size=16, effective_batch_size=32))
    runner = EpochRunner(config, synthetic, synthetic.catalog.tensors(), torch.device("cpu"))
    model = build_model(config.model, synthetic.catalog.vocab_size, synthetic.catalog.num_levels)
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append((args[1].sum(dim=1), args[2])))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    runner.train_epoch(2, model, build_loss(config.loss, synthetic.catalog.tensors()), optimizer, scheduler, None)
    assert len(seen) == 96 // 16
    assert all(bool((lengths[1:] >= lengths[:-1]).all()) for lengths, _ in seen)
    assert any(bool((lengths[1:] > lengths[:-1]).any()) for lengths, _ in seen)  # lengths vary: order is tested
    local = runner.epoch_order(2)
    batch = collate(synthetic.catalog, synthetic.splits["train"], local)
    negatives = PositionNegatives(config.train.seed, 2, len(runner.sem_tokens), config.loss.num_negatives)
    expected, _ = runner.candidates_of(batch, negatives(np.arange(len(local)), batch.target_sem))
    got = torch.cat([candidates for _, candidates in seen])
    assert sorted(map(tuple, got.flatten(1).tolist())) == sorted(map(tuple, expected.flatten(1).tolist()))


# --- a study's data-parallel trials (sweep --workers-per-trial) -------------------------------------------------

def test_workers_are_placed_only_where_the_nodes_hold_them_all():
    from apao_ray.study.run.trial import Resources

    two = Resources(num_workers=2, cpus_per_worker=1.0)
    two.check_placeable([{"CPU": 2.0}], "this machine")
    two.check_placeable([{"CPU": 1.0}, {"CPU": 1.5}], "the Ray cluster")  # one worker on each node
    with pytest.raises(ValueError, match=r"--workers-per-trial 2: each worker needs 1 CPU, and this machine "
                                         r"\(1 CPU\) can place 1 at once; lower --workers-per-trial"):
        two.check_placeable([{"CPU": 1.0}], "this machine")
    on_gpus = Resources(num_workers=2, cpus_per_worker=4.0, gpus_per_worker=1.0)
    with pytest.raises(ValueError, match=r"each worker needs 4 CPU and 1 GPU, and the Ray cluster \(16 CPU 1 GPU\) "
                                         "can place 1"):
        on_gpus.check_placeable([{"CPU": 16.0, "GPU": 1.0}], "the Ray cluster")
    # the Tune actor of a data-parallel trial only drives it; its workers give the driver's sliver back
    assert two.tune_resources() == {"cpu": 0.01} and two.for_ray_train().cpus_per_worker == pytest.approx(0.99)
    assert Resources(1, 2.0).tune_resources() == {"cpu": 2.0, "gpu": 0.0}


def test_a_study_with_workers_per_trial_plans_and_records_them(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    import apao_ray
    from apao_ray.study.api import study_slots
    from apao_ray.hardware import available_cpus
    from apao_ray.study.plan.budget import Fit, MethodCost
    from apao_ray.study.plan.plan import Plan

    spec = apao_ray.StudySpec.quick(losses=("ce",), workers_per_trial=2, cpus_per_trial=1,
                                    output_dir=str(tmp_path / "runs"))
    setup = apao_ray.prepare(spec)
    base = setup.base  # the parent run's and every child's params record it
    assert base.train.num_workers == 2 and base.train.effective_batch_size >= 2 * base.train.batch_size
    if available_cpus() >= 2:
        assert study_slots(spec, setup, start_ray=False) == available_cpus() // 2  # a trial holds 2 x 1 CPU
    method = MethodCost("tiger", "ce", True, epoch_s=100.0, fixed_s=10.0)
    plan = Plan(dataset="synthetic", protocol="paper", precision="fp32", slots=1, methods=[method], asked_epochs=2,
                asked_trials_per_tuned=1, fit=Fit(2, 1, 3, 220.0), threads=1, workers=2)
    assert "1 at a time, 2 data-parallel workers x 1 thread each" in plan.text()
    cost = plan.cost_estimates()[("tiger", "ce")]
    assert cost["cost/cpu_seconds"] == 2 * cost["cost/wall_seconds"] == 2 * 210.0  # both workers' CPUs
    too_many = spec.replace(workers_per_trial=available_cpus() + 1)
    with pytest.raises(ValueError, match=rf"--workers-per-trial {available_cpus() + 1}: each worker needs 1 CPU, "
                                         r"and this machine .* can place"):
        study_slots(too_many, setup, start_ray=False)
    with pytest.raises(ValueError, match="workers_per_trial=0 must be an integer >= 1"):
        spec.replace(workers_per_trial=0)
