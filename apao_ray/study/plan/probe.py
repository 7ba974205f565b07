"""The timing probe behind a study's plan: ``python -m apao_ray.study.plan.probe CONFIG_JSON THREADS``.

Runs the real model and loss of one trial config for ~8 s of optimizer steps and one validation
batch, and prints one JSON line (seconds per training sample, per validation user, peak memory).
A subprocess of its own, so the peak memory is the trial's alone and the driver stays light.
"""
from __future__ import annotations

import json
import resource
import sys
import time

from ...training.memory import allocator_in_use
from .probe_cache import PROBE_MAX_STEPS, PROBE_SECONDS, PROBE_STEPS, PROBE_TRIAL_SHARE
from ...config import TrialConfig


class _Enough(Exception):
    """Ends the probe's training early."""


def run_probe(config_dict: dict, threads: int, steps: int = PROBE_STEPS, min_seconds: float = PROBE_SECONDS,
              max_seconds: float = 30.0, trial_share: float = PROBE_TRIAL_SHARE) -> dict:
    """Trains at least ``steps`` timed optimizer steps and until ``min_seconds`` of them have passed
    (at most PROBE_MAX_STEPS, one epoch, or, once one step is timed, ``max_seconds`` or ``trial_share`` of
    the samples the trial trains on in all its epochs: a probe never costs a small trial much of its own
    time), then times one validation batch."""
    import numpy as np
    import torch

    from ...data import load_dataset
    from ...losses import build_loss
    from ...models import build_model
    from ...training.evaluation import evaluate_split
    from ...training.precision import resolve_precision
    from ...training.steps import EpochRunner

    torch.set_num_threads(max(1, threads))
    config = TrialConfig.from_dict(config_dict)
    dataset = load_dataset(config.data.dataset, config.data.data_dir, config.data.max_history,
                           config.data.synthetic_seed, allow_download=False)  # the driver found the files
    trial_samples = config.train.epochs * min(len(dataset.splits["train"]),
                                              config.train.max_train_samples or len(dataset.splits["train"]))
    device = torch.device("cuda" if config.train.use_gpu and torch.cuda.is_available() else "cpu")
    train = config.train.replace(precision=resolve_precision(config.train.precision, device),
                                 effective_batch_size=config.train.batch_size,  # one optimizer step per micro-batch
                                 num_workers=1,  # one worker's rate, in this process
                                 max_train_samples=(max(steps, PROBE_MAX_STEPS) + 1) * config.train.batch_size,
                                 retention_users=0)
    config = config.replace(train=train, loss=config.loss.replace(pretrain_ce_epochs=0).to_dict())
    tensors = dataset.catalog.tensors(device)
    torch.manual_seed(0)
    model = build_model(config.model, dataset.catalog.vocab_size, dataset.catalog.num_levels).to(device)
    loss_fn = build_loss(config.loss, tensors)
    reference = None
    if loss_fn.needs_reference:  # preference losses score a frozen reference too
        import copy

        reference = copy.deepcopy(model).eval().requires_grad_(False)
    runner = EpochRunner(config, dataset, tensors, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stamps: list[float] = []
    cut_for = []

    def synced_now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()  # the clock must see the GPU's work
        return time.perf_counter()

    def step_done(done: int, total: int) -> None:
        stamps.append(synced_now())
        timed = stamps[-1] - stamps[0]
        if len(stamps) >= 2 and timed > max_seconds:
            raise _Enough  # a slow config (pairwise, many negatives): one timed step is enough
        if len(stamps) >= 2 and (len(stamps) - 1) * train.batch_size >= trial_share * trial_samples:
            cut_for.extend([config_dict["train"]["epochs"], config_dict["train"].get("max_train_samples")])
            raise _Enough  # a short trial: its plan needs no more precision than this
        if len(stamps) > steps and timed >= min_seconds:
            raise _Enough  # a sustained rate, not the first steps' burst

    try:
        runner.train_epoch(1, model, loss_fn, optimizer, scheduler, reference, step_done)
    except _Enough:
        pass
    if len(stamps) < 2:
        raise ValueError(f"dataset {config.data.dataset!r} has too few training samples for a probe of "
                         f"{steps + 1} batches of {train.batch_size}")
    samples = (len(stamps) - 1) * train.batch_size  # the first step is a warm-up
    train_s_per_sample = (stamps[-1] - stamps[0]) / samples
    split = dataset.splits["valid"]
    users = np.arange(min(len(split), train.eval_batch_size))
    evaluate_split(model, dataset, "valid", tensors, train, device, users[:8])  # warm-up
    start = synced_now()
    evaluate_split(model, dataset, "valid", tensors, train, device, users)
    eval_s_per_user = (synced_now() - start) / len(users)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    return {"train_s_per_sample": train_s_per_sample, "eval_s_per_user": eval_s_per_user, "peak_bytes": int(peak),
            "precision": train.precision, "threads": threads, "device": device.type, "timed_samples": samples,
            "allocator": allocator_in_use(), "cut_for": cut_for or None}


if __name__ == "__main__":
    print(json.dumps(run_probe(json.loads(sys.argv[1]), int(sys.argv[2]))))
