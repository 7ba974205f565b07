"""One training epoch: shuffled micro-batches, per-epoch negatives, gradient accumulation."""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..config import TrialConfig
from ..data import CatalogTensors, Dataset, collate
from ..data.batches import group_by_length
from ..losses import sample_negatives
from ..losses.base import LossInputs, LossOutput
from .memory import MemoryReleaser
from ..models.base import label_log_probs
from ..protocol import gradient_scale, with_end_token
from .evaluation import select_users
from .precision import autocast


# On a GPU a micro-batch defaults to 1024 samples (config.default_micro_batch), but a loss with negatives scores
# 1+N candidates per sample: there a micro-batch is run in chunks of at most this many candidates. 256 samples x
# 101 candidates peaked at 7.7 GiB (TIGER) and 11.6 GiB (Llama) of an H200 (benchmarks/RESULTS.md, session 19);
# 1024 x 201 would need ~8x that. On a CPU the micro-batch is the chunk (a worker's memory cap decides there).
GPU_CANDIDATES_PER_CHUNK = 256 * 101


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the trial stops with this reason."""


def chunk_size(batch_size: int, num_negatives: int, device: torch.device) -> int:
    """Samples per forward/backward within a micro-batch: all of it, except on a GPU where its candidates
    would exceed ``GPU_CANDIDATES_PER_CHUNK`` (the gradients are the same: chunks accumulate)."""
    if device.type != "cuda" or not num_negatives:
        return batch_size
    return max(1, min(batch_size, GPU_CANDIDATES_PER_CHUNK // (1 + num_negatives)))


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
        self.memory = MemoryReleaser()  # keeps a worker's resident memory near what it holds

    def _candidates(self, batch: Any, num_negatives: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Positive first, then negatives: tokens (B, 1+N, T or T+1 with EOS) and prefix nodes (B, 1+N, T+1)."""
        sem = batch.target_sem[:, None]                                                      # (B, 1)
        if num_negatives:
            negatives = sample_negatives(batch.target_sem.cpu(), len(self.sem_tokens), num_negatives, generator)
            sem = torch.cat([sem, negatives.to(self.device)], dim=1)                         # (B, 1+N)
        return with_end_token(self.sem_tokens[sem], self.config.protocol.label_eos), self.tensors.leaf_prefix_nodes[sem]

    def train_epoch(self, epoch: int, model: nn.Module, loss_fn: Any, optimizer: torch.optim.Optimizer,
                    scheduler: Any, reference: nn.Module | None,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """One pass over this rank's shuffled share of the training samples.

        ``progress(samples_done, samples_total)`` is called after every optimizer step.
        """
        train = self.config.train
        model.train()
        rng = np.random.default_rng([train.seed, epoch])
        order = rng.permutation(self.indices)
        local = order[self.rank::self.world_size][:self.per_rank]
        split = self.dataset.splits["train"]
        if train.group_by_length:
            local = group_by_length(local, split.history_lengths, train.batch_size, rng)
        generator = torch.Generator().manual_seed(train.seed * 1_000_003 + epoch * 101 + self.rank)
        precision = autocast(train.precision, self.device)  # run_trial resolved 'auto' for this device
        sums: dict[str, float] = defaultdict(float)
        grad_norm_sum, num_steps = None, 0
        step_size = train.batch_size * self.accumulation
        size = chunk_size(train.batch_size, loss_fn.num_negatives, self.device)
        for start in range(0, len(local), step_size):
            step_indices = local[start:start + step_size]
            chunks = [step_indices[i:i + size] for i in range(0, len(step_indices), size)]
            optimizer.zero_grad(set_to_none=True)
            prefix_sum = None
            for position, chunk in enumerate(chunks):
                batch = collate(self.dataset.catalog, split, chunk, self.item_tokens).to(self.device)
                candidates, nodes = self._candidates(batch, loss_fn.num_negatives, generator)
                is_last = position == len(chunks) - 1
                # gradients are all-reduced once per optimizer step, not per micro-batch
                sync = contextlib.nullcontext() if is_last or not hasattr(model, "no_sync") else model.no_sync()
                with sync:
                    with precision:
                        logits = model(batch.history_ids, batch.history_mask, candidates)     # (B, C, T, V)
                    ref_logp = None
                    if reference is not None:
                        with torch.no_grad(), precision:
                            ref_logits = reference(batch.history_ids, batch.history_mask, candidates)
                        ref_logp = label_log_probs(ref_logits, candidates)                   # (B, C, T)
                    output = loss_fn(LossInputs(logits, candidates, nodes, ref_logp))  # losses upcast
                    loss_value = float(output.loss.detach())
                    if not math.isfinite(loss_value):  # the weights would be lost: stop now, not at the epoch's end
                        raise NonFiniteLossError(
                            f"training loss became {loss_value} in epoch {epoch} (loss {loss_fn.name!r}, lr {train.lr}; "
                            f"optimizer step {start // step_size + 1} of {-(-len(local) // step_size)}); "
                            "stopping this trial")
                    (output.loss * gradient_scale(len(chunk), len(step_indices), self.config.protocol)).backward()
                weight = len(chunk)
                for name, value in output.metrics.items():
                    if value.numel() == 1:
                        sums[name] += float(value) * weight
                if output.prefix_losses is not None:
                    contribution = output.prefix_losses.detach() * (len(chunk) / len(step_indices))
                    prefix_sum = contribution if prefix_sum is None else prefix_sum + contribution
                sums["_samples"] += weight
            if train.grad_clip:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip).detach()
                grad_norm_sum = norm if grad_norm_sum is None else grad_norm_sum + norm  # no host sync per step
                num_steps += 1
            optimizer.step()
            scheduler.step()
            self.memory.step()
            if progress is not None:
                progress(start + len(step_indices), len(local))
            if prefix_sum is not None:
                if self.world_size > 1 and torch.distributed.is_initialized():
                    # every rank must apply the same adaptive-weight update
                    torch.distributed.all_reduce(prefix_sum, op=torch.distributed.ReduceOp.AVG)
                loss_fn.after_optimizer_step(LossOutput(loss=prefix_sum.sum(), prefix_losses=prefix_sum))
        num_samples = sums.pop("_samples")
        metrics = {f"train/{name}": total / num_samples for name, total in sums.items()}
        metrics.setdefault("train/loss", float("nan"))
        metrics["train/num_samples"] = num_samples
        metrics["train/lr"] = scheduler.get_last_lr()[0]
        if grad_norm_sum is not None:  # the norm before clipping, mean over optimizer steps
            metrics["train/grad_norm"] = float(grad_norm_sum) / num_steps
        # the weights as they stand after the epoch (= the checkpointed state), not the epoch's average
        prefix_weights = getattr(loss_fn, "prefix_weights", None)
        for m, weight in enumerate(prefix_weights.weights.tolist() if prefix_weights is not None else [], start=1):
            metrics[f"train/apao_weight_m{m}"] = weight
        return metrics
