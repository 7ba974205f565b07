"""K models of one architecture run as one batched model (a fused trial cohort).

:class:`FusedModels` stacks the members' parameters (``torch.stack`` at each call, so each member keeps its own
``nn.Module``, optimizer and checkpoint, and the stack's backward hands each member its own gradients) and runs
the architecture once over all members with ``torch.func.vmap(functional_call(...))``: one kernel per
operator for K members instead of K, the horizontal fusion of HFTA (Wang et al., MLSys'21) by torch's own
batching rules.

The CPU kernels that make a lone model fast read data on the host or are autograd Functions without batching
rules (the packed history pass and row groups, models/packing.py; the dropout kernels and the unfused
attention, models/dropout.py). While a fused call runs, :func:`fused_active` is true and those places take
torch's generic ops instead: the padded history pass, one attention product over all columns, ``F.dropout``.
The same functions of the inputs, at more arithmetic on a CPU (where the fused path is measured against
separate trials before it is used: benchmarks/bench_cohort.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.func import functional_call, vmap

_FUSED = contextvars.ContextVar("apao_fused_models", default=False)


def fused_active() -> bool:
    """Whether a :class:`FusedModels` call is running (the models' CPU-only kernels step aside)."""
    return _FUSED.get()


@contextlib.contextmanager
def _fused() -> Iterator[None]:
    token = _FUSED.set(True)
    try:
        yield
    finally:
        _FUSED.reset(token)


def _attention_backend(device: torch.device) -> contextlib.AbstractContextManager:
    """SDPA's math backend on a CPU (its fused CPU kernel has no gradient for a batched bias); else the default."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.MATH)


class FusedModels:
    """``models[k](*inputs[k])`` for every member k, as one vmapped call.

    Args:
        models: K >= 1 modules of one architecture (same parameter names and shapes), all in the same mode.

    Calling it with tensors stacked on a leading member axis, ``(K, ...)`` each, returns the outputs stacked
    the same way. Dropout draws differ between members (``randomness="different"``), from torch's generator.
    """

    def __init__(self, models: Sequence[nn.Module]) -> None:
        if not models:
            raise ValueError("a fused cohort needs at least one model")
        shapes = [{name: tuple(p.shape) for name, p in m.named_parameters()} for m in models]
        if any(shape != shapes[0] for shape in shapes[1:]):
            raise ValueError("the models of a fused cohort must share one architecture (parameter names and shapes)")
        self.models = list(models)
        self._base = copy.deepcopy(models[0]).to("meta")  # the architecture; its tensors are the stacked ones

    def __len__(self) -> int:
        return len(self.models)

    def _stacked(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        members = [(dict(m.named_parameters()), dict(m.named_buffers())) for m in self.models]
        params = {name: torch.stack([p[name] for p, _ in members]) for name in members[0][0]}
        buffers = {name: torch.stack([b[name] for _, b in members]) for name in members[0][1]}
        return params, buffers

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        self._base.train(self.models[0].training)
        params, buffers = self._stacked()

        def member(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
            return functional_call(self._base, (p, b), args)

        with _fused(), _attention_backend(inputs[0].device):
            return vmap(member, randomness="different")(params, buffers, *inputs)
