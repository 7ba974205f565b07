"""A trial's weights across data-parallel ranks and stages: the model behind its wrapper, rank 0's values on
every rank, and the frozen reference a second stage reads."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The model behind a data-parallel wrapper (the model itself in one process)."""
    return model.module if hasattr(model, "module") else model


def from_rank0(value: int) -> int:
    """Rank 0's ``value`` on every data-parallel rank (``value`` itself in one process); a collective."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.long)  # gloo; under NCCL the process group's device is needed
    if torch.distributed.get_backend() == "nccl":
        tensor = tensor.cuda()
    torch.distributed.broadcast(tensor, src=0)
    return int(tensor.item())


def broadcast_from_rank0(model: nn.Module) -> None:
    """Copies rank 0's weights to every data-parallel rank (no-op in one process)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for tensor in unwrap(model).state_dict().values():  # views of the parameters and buffers
            torch.distributed.broadcast(tensor, src=0)


def frozen_copy(model: nn.Module, weights: dict[str, Any]) -> nn.Module:
    """A copy of ``model`` holding ``weights``, in eval mode and without gradients: a loss's reference."""
    reference = copy.deepcopy(model)
    reference.load_state_dict(weights)
    reference.eval().requires_grad_(False)
    return reference
