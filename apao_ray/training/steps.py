"""One training epoch: shuffled micro-batches, per-epoch negatives, gradient accumulation."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import defaultdict
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..config import TrialConfig
from ..data import PAD_TOKEN, CatalogTensors, Dataset, ResidentSplit
from ..data.batches import group_by_length
from ..losses.base import LossInputs, LossOutput
from ..models.base import label_log_probs
from ..protocol import gradient_scale, with_end_token
from .draws import PositionNegatives, seed_of
from .evaluation import select_users
from .loss_watch import LossWatch
from .memory import MemoryReleaser
from .precision import autocast


# On a GPU a micro-batch defaults to 1024 samples (config.default_micro_batch), but a loss with negatives scores
# 1+N candidates per sample: there a micro-batch is run in chunks of at most this many candidates. 256 samples x
# 101 candidates peaked at 7.7 GiB (TIGER) and 11.6 GiB (Llama) of an H200 (benchmarks/RESULTS.md, 2026-11-26);
# 1024 x 201 would need ~8x that. On a CPU the micro-batch is the chunk (a worker's memory cap decides there).
GPU_CANDIDATES_PER_CHUNK = 256 * 101


def chunk_size(batch_size: int, num_negatives: int, device: torch.device) -> int:
    """Samples per forward/backward within a micro-batch: all of it, except on a GPU where its candidates
    would exceed ``GPU_CANDIDATES_PER_CHUNK`` (the gradients are the same: chunks accumulate)."""
    if device.type != "cuda" or not num_negatives:
        return batch_size
    return max(1, min(batch_size, GPU_CANDIDATES_PER_CHUNK // (1 + num_negatives)))


def average_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of ``tensor`` over the data-parallel ranks, in place (itself in one process). A collective:
    every rank must call it, in the same order."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.AVG)
    return tensor


class EpochRunner:
    """Holds what every epoch reuses (sample indices, token tables) and runs one epoch."""

    def __init__(self, config: TrialConfig, dataset: Dataset, tensors: CatalogTensors, device: torch.device,
                 rank: int = 0, world_size: int = 1) -> None:
        self.config, self.dataset, self.tensors, self.device = config, dataset, tensors, device
        self.rank, self.world_size = rank, world_size
        train = config.train
        split = dataset.splits["train"]
        self.indices = select_users(len(split), train.max_train_samples, train.seed)
        if self.indices is None:
            self.indices = np.arange(len(split))
        self.per_rank = len(self.indices) // world_size  # equal shards keep DDP ranks in lockstep
        if self.per_rank == 0:
            raise ValueError(f"{len(self.indices)} training samples cannot be split over {world_size} workers")
        self.accumulation = max(1, round(train.effective_batch_size / (train.batch_size * world_size)))
        micro_batches = math.ceil(self.per_rank / train.batch_size)
        self.optimizer_steps_per_epoch = math.ceil(micro_batches / self.accumulation)
        self.item_tokens = dataset.catalog.item_tokens
        self.sem_tokens = torch.as_tensor(dataset.catalog.sem_tokens, device=device)          # (U, T)
        self.samples = ResidentSplit(dataset.catalog, split, device, self.item_tokens)  # batches gathered there
        self.target_sem = torch.from_numpy(dataset.catalog.item_sem[split.targets])  # (S,) host, for negatives
        self.memory = MemoryReleaser()  # keeps a worker's resident memory near what it holds

    def candidates_of(self, batch: Any, negatives: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Positive first, then ``negatives`` (B, N) if any: tokens (B, 1+N, T or T+1 with EOS) and prefix
        nodes (B, 1+N, T+1)."""
        sem = batch.target_sem[:, None]                                                      # (B, 1)
        if negatives is not None:
            if self.device.type == "cuda":  # a copy from pinned memory does not wait for the device's queue
                negatives = negatives.pin_memory()
            sem = torch.cat([sem, negatives.to(self.device, non_blocking=True)], dim=1)      # (B, 1+N)
        return with_end_token(self.sem_tokens[sem], self.config.protocol.label_eos), self.tensors.leaf_prefix_nodes[sem]

    def epoch_order(self, epoch: int) -> np.ndarray:
        """This rank's training samples of ``epoch``, in order: positions r, r + W, r + 2W, ... of the epoch's
        shuffled order for rank r of W. Disjoint equal shards, whose k-th micro-batches (and optimizer steps)
        together hold the samples of one worker's k-th micro-batch W times as large."""
        train = self.config.train
        rng = np.random.default_rng([train.seed, epoch])
        order = rng.permutation(self.indices)
        if train.group_by_length:  # before sharding, in micro-batches of all ranks: the ranks' parts pad alike
            order = group_by_length(order, self.dataset.splits["train"].history_lengths,
                                    train.batch_size * self.world_size, rng)
        return order[:self.per_rank * self.world_size][self.rank::self.world_size]

    def epoch_steps(self, local: np.ndarray, size: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """This rank's optimizer steps of an epoch (``local``: :meth:`epoch_order`), each a list of chunks of
        at most ``size`` samples: ``(indices, places)``, the samples in order of history length and their
        places in the epoch's order (what their negatives are drawn by). In that order a chunk's rows are
        the loss's mean over rows as ever, and the decoders' attention over the history skips each group of
        rows' common padding (models/packing.row_groups)."""
        lengths = self.dataset.splits["train"].history_lengths
        step_size = self.config.train.batch_size * self.accumulation
        steps = []
        for start in range(0, len(local), step_size):
            step = []
            for first in range(start, min(start + step_size, len(local)), size):
                chunk = local[first:min(first + size, start + step_size, len(local))]
                places = np.arange(first, first + len(chunk)) * self.world_size + self.rank
                by_length = np.argsort(lengths[chunk], kind="stable")
                step.append((chunk[by_length], places[by_length]))
            steps.append(step)
        return steps

    def train_epoch(self, epoch: int, model: nn.Module, loss_fn: Any, optimizer: torch.optim.Optimizer,
                    scheduler: Any, reference: nn.Module | None,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """One pass over this rank's shuffled share of the training samples.

        ``progress(samples_done, samples_total)`` is called after every optimizer step.
        """
        # per_batch/hard_max APAO weights from every rank's micro-batch, not each rank's own; only while
        # training: rank 0 alone calls the loss in validation
        loss_fn.average_over_ranks = average_over_ranks if self.world_size > 1 else None
        try:
            member = EpochMember(self, model, loss_fn, optimizer, scheduler, reference)
            return train_members(epoch, [member], None, progress)[0]
        finally:
            loss_fn.average_over_ranks = None


@dataclasses.dataclass
class EpochMember:
    """One model's share of an epoch: its samples (``runner``: its seed's order and negatives), its loss, its
    optimizer and schedule, and the frozen reference a preference loss reads (or None)."""

    runner: EpochRunner
    model: nn.Module
    loss_fn: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    reference: nn.Module | None = None


class _MemberEpoch:
    """What one member accumulates through an epoch: its steps, its place in them, its loss sums."""

    def __init__(self, member: EpochMember, epoch: int, size: int) -> None:
        self.member, self.epoch = member, epoch
        runner, train = member.runner, member.runner.config.train
        self.local = runner.epoch_order(epoch)
        self.negatives = PositionNegatives(train.seed, epoch, len(runner.sem_tokens), member.loss_fn.num_negatives)
        self.steps = runner.epoch_steps(self.local, size)
        self.rows = torch.as_tensor(np.concatenate([chunk for step in self.steps for chunk, _ in step]),
                                    device=runner.device)
        self.watch = LossWatch(runner.device)
        self.sums: dict[str, Any] = defaultdict(float)  # on the device: read once, at the epoch's end
        self.grad_norm_sum: torch.Tensor | None = None
        self.num_clipped_steps = self.offset = self.done = 0
        self.prefix_sum: torch.Tensor | None = None

    def inputs(self, step_number: int, position: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The chunk's batch, candidates and their prefix nodes."""
        runner, (chunk, places) = self.member.runner, self.steps[step_number][position]
        batch = runner.samples.batch(chunk, self.rows[self.offset:self.offset + len(chunk)])
        self.offset += len(chunk)
        negatives = self.negatives(places, runner.target_sem[chunk]) if self.member.loss_fn.num_negatives else None
        return (batch, *runner.candidates_of(batch, negatives))

    def loss(self, step_number: int, position: int, logits: torch.Tensor, candidates: torch.Tensor,
             nodes: torch.Tensor, ref_logp: torch.Tensor | None) -> torch.Tensor:
        """The chunk's loss, scaled for backward; its metrics and prefix losses added to the sums."""
        loss_fn, runner = self.member.loss_fn, self.member.runner
        step = self.steps[step_number]
        chunk_samples, step_samples = len(step[position][0]), sum(len(chunk) for chunk, _ in step)
        output = loss_fn(LossInputs(logits, candidates, nodes, ref_logp))  # losses upcast
        # a NaN must stop the trial before the epoch's checkpoint (the weights would be lost)
        self.watch.push(output.loss, lambda value, epoch=self.epoch, number=step_number + 1: (
            f"training loss became {value} in epoch {epoch} (loss {loss_fn.name!r}, lr {runner.config.train.lr}; "
            f"optimizer step {number} of {len(self.steps)}); stopping this trial"))
        for name, value in output.metrics.items():
            if value.numel() == 1:
                self.sums[name] += value.detach().to(torch.float64) * chunk_samples
        if output.prefix_losses is not None:
            contribution = output.prefix_losses.detach() * (chunk_samples / step_samples)
            self.prefix_sum = contribution if self.prefix_sum is None else self.prefix_sum + contribution
        self.sums["_samples"] += chunk_samples
        return output.loss * gradient_scale(chunk_samples, step_samples, runner.config.protocol)

    def optimizer_step(self, step_number: int, progress: Callable[[int, int], None] | None) -> None:
        member, train = self.member, self.member.runner.config.train
        if train.grad_clip:
            norm = torch.nn.utils.clip_grad_norm_(member.model.parameters(), train.grad_clip).detach()
            self.grad_norm_sum = norm if self.grad_norm_sum is None else self.grad_norm_sum + norm  # no host sync
            self.num_clipped_steps += 1
        member.optimizer.step()
        member.scheduler.step()
        self.done += sum(len(chunk) for chunk, _ in self.steps[step_number])
        if progress is not None:
            progress(self.done, len(self.local))
        if self.prefix_sum is not None:  # every rank applies the same adaptive-weight update: all ranks' mean
            prefix_sum, self.prefix_sum = average_over_ranks(self.prefix_sum), None
            member.loss_fn.after_optimizer_step(LossOutput(loss=prefix_sum.sum(), prefix_losses=prefix_sum))

    def metrics(self) -> dict[str, float]:
        self.watch.flush()
        num_samples = self.sums.pop("_samples")
        metrics = {f"train/{name}": float(total) / num_samples for name, total in self.sums.items()}
        metrics.setdefault("train/loss", float("nan"))
        metrics["train/num_samples"] = num_samples
        metrics["train/lr"] = self.member.scheduler.get_last_lr()[0]
        if self.grad_norm_sum is not None:  # the norm before clipping, mean over optimizer steps
            metrics["train/grad_norm"] = float(self.grad_norm_sum) / self.num_clipped_steps
        # the weights as they stand after the epoch (= the checkpointed state), not the epoch's average
        prefix_weights = getattr(self.member.loss_fn, "prefix_weights", None)
        for m, weight in enumerate(prefix_weights.weights.tolist() if prefix_weights is not None else [], start=1):
            metrics[f"train/apao_weight_m{m}"] = weight
        return metrics


def _stacked(tensors: list[torch.Tensor], fill: int) -> torch.Tensor:
    """Per-member (B, W_k[, ...]) tensors, left-padded along dim 1 with ``fill`` to the widest: (K, B, W, ...)."""
    width = max(t.shape[1] for t in tensors)
    return torch.stack([t if t.shape[1] == width else torch.cat(
        [t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill), t], dim=1) for t in tensors])


def _stacked_candidates(candidates: list[torch.Tensor]) -> torch.Tensor:
    """Per-member (B, C_k, T) candidates, each filled up to the largest C with copies of its positive (their
    logits are computed and dropped: a candidate's logits do not depend on the others'): (K, B, C, T)."""
    most = max(c.shape[1] for c in candidates)
    return torch.stack([c if c.shape[1] == most else torch.cat(
        [c, c[:, :1].expand(-1, most - c.shape[1], -1)], dim=1) for c in candidates])


def train_members(epoch: int, members: list[EpochMember], fused: Any,
                  progress: Callable[[int, int], None] | None = None) -> list[dict[str, float]]:
    """One epoch of each member, their optimizer steps in lockstep; each member's train/ metrics.

    One member (``fused`` None) runs its model alone, as a trial does (under DDP too). Several run as one
    batched model, ``fused`` (models/fused.FusedModels over the members' models, in this order): at each chunk
    the members' own batches (their seeds' orders and negatives) are padded to one width and stacked, the
    fused forward gives each member its logits, each member's loss is its own and one backward fills each
    member's gradients; then each member clips and steps on its own. Every member sees exactly the samples,
    negatives, losses and updates of its solo trial; what differs is dropout's stream (the members' draws
    come from one generator, seeded by the epoch and the members' seeds) and float rounding.
    """
    first = members[0].runner
    device, train = first.device, first.config.train
    for member in members:
        member.model.train()
    if len(members) == 1:
        # dropout draws from (seed, epoch, rank): the ranks draw their own masks (their tensors' shapes differ, so
        # their streams would part anyway), and a run resumed from rank 0's checkpoint draws on every rank what
        # the uninterrupted run drew
        torch.manual_seed(seed_of(train.seed, epoch, first.rank))
    else:
        torch.manual_seed(seed_of(epoch, *[member.runner.config.train.seed for member in members]))
    if fused is not None and any(member.reference is not None for member in members):
        raise ValueError("a fused cohort cannot train a loss that reads a frozen reference model")
    size = min(chunk_size(train.batch_size, member.loss_fn.num_negatives, device) for member in members)
    states = [_MemberEpoch(member, epoch, size) for member in members]
    if len({len(state.local) for state in states}) > 1:
        raise ValueError("the members of a fused cohort must train on equally many samples per epoch "
                         f"(here {sorted({len(state.local) for state in states})})")
    precision = autocast(train.precision, device)  # run_trial resolved 'auto' for this device
    for step_number, step in enumerate(states[0].steps):
        for member in members:
            member.optimizer.zero_grad(set_to_none=True)
        for position in range(len(step)):
            inputs = [state.inputs(step_number, position) for state in states]
            if fused is None:
                (state,), ((batch, candidates, nodes),) = states, inputs
                model = state.member.model
                is_last = position == len(step) - 1
                # gradients are all-reduced once per optimizer step, not per micro-batch
                sync = contextlib.nullcontext() if is_last or not hasattr(model, "no_sync") else model.no_sync()
                with sync:
                    with precision:
                        logits = model(batch.history_ids, batch.history_mask, candidates)      # (B, C, T, V)
                    state.loss(step_number, position, logits, candidates, nodes,
                               _reference_log_probs(state.member.reference, batch, candidates, precision)).backward()
                continue
            ids = _stacked([batch.history_ids for batch, _, _ in inputs], PAD_TOKEN)
            mask = _stacked([batch.history_mask for batch, _, _ in inputs], False)
            with precision:
                logits = fused(ids, mask, _stacked_candidates([c for _, c, _ in inputs]))  # (K, B, C, T, V)
            total = sum(state.loss(step_number, position, logits[k, :, :candidates.shape[1]], candidates, nodes, None)
                        for k, (state, (_, candidates, nodes)) in enumerate(zip(states, inputs)))
            total.backward()
        for state in states:
            state.optimizer_step(step_number, progress if len(states) == 1 else None)
        first.memory.step()
        if progress is not None and len(states) > 1:
            progress(states[0].done, len(states[0].local))
    return [state.metrics() for state in states]


def _reference_log_probs(reference: nn.Module | None, batch: Any, candidates: torch.Tensor,
                         precision: Any) -> torch.Tensor | None:
    """(B, C, T) label log-probs of the candidates under the frozen reference model, or None without one."""
    if reference is None:
        return None
    with torch.no_grad(), precision:
        ref_logits = reference(batch.history_ids, batch.history_mask, candidates)
    return label_log_probs(ref_logits, candidates)
