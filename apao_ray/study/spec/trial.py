"""A trial's config from the inputs ``sweep`` and ``train`` share (``StudySpec``'s ``trial`` group: data, schedule,
model size, compute), built in one place: ``setup.trial_base`` for every trial of a study, ``train`` for one run.
A field added to that group reaches a trial through here whichever command set it."""
from __future__ import annotations

from typing import Any

from ...config import TINY_MODEL, DataConfig, LossConfig, ModelConfig, TrainConfig, TrialConfig
from ...data.files import canonical_dataset


def trial_config(inputs: Any, loss: LossConfig, *, seed: int, workers: int = 1, use_gpu: bool = False,
                 data_dir: str | None = None, backbone: str | None = None, **train: Any) -> TrialConfig:
    """``inputs``: a ``StudySpec`` or ``train``'s parsed flags (the same names). ``workers``: a trial's data-parallel
    workers, each taking a micro-batch per optimizer step (the effective batch is at least their sum); ``train``:
    the study's own ``TrainConfig`` fields (``retention_users``)."""
    one_step = (inputs.batch_size or 0) * workers
    schedule = TrainConfig(epochs=inputs.epochs, patience=inputs.patience, batch_size=inputs.batch_size,
                           effective_batch_size=max(inputs.effective_batch_size, one_step), lr=inputs.lr,
                           num_workers=workers, beam_size=inputs.beam_size, seed=seed,
                           max_train_samples=inputs.max_train_samples, eval_max_users=inputs.eval_max_users,
                           precision=inputs.precision, group_by_length=inputs.group_by_length, use_gpu=use_gpu,
                           full_sort_test=inputs.full_sort_test, test_every_epoch=inputs.test_every_epoch, **train)
    model = ModelConfig(**({"backbone": backbone} if backbone else {}), **(TINY_MODEL if inputs.model_size == "tiny" else {}))
    return TrialConfig(DataConfig(dataset=canonical_dataset(inputs.dataset), data_dir=data_dir), model, loss, schedule)
