"""Collating samples into model inputs: array slicing and padding, nothing per token in Python.

Layout shared by both backbones: the history's code tokens followed by EOS, left-padded with
PAD to the longest history in the batch, so every row's last real token sits at column L-1.
The encoder-decoder reads it as the encoder input; the decoder-only model reads it as the
sequence prefix and generates the target after it (:meth:`Batch.decoder_only_inputs`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator

import numpy as np
import torch

from .catalog import EOS_TOKEN, PAD_TOKEN, Catalog
from .splits import Split


@dataclass
class Batch:
    """One batch of samples.

    Attributes:
        history_ids: (B, L) history code tokens then EOS, left-padded with PAD.
        history_mask: (B, L) bool, True on real tokens.
        labels: (B, T) target item's code tokens.
        target_items: (B,) target item index.
        target_sem: (B,) target semantic-ID index.
        sample_index: (B,) index of each sample in its split.
    """

    history_ids: torch.Tensor
    history_mask: torch.Tensor
    labels: torch.Tensor
    target_items: torch.Tensor
    target_sem: torch.Tensor
    sample_index: torch.Tensor

    def __len__(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(**{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})

    def decoder_only_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decoder-only layout: history + target in one sequence, loss on the target only.

        Returns:
            input_ids (B, L + T), attention_mask (B, L + T) bool, and labels (B, L + T) with
            -100 everywhere except at the positions whose next token is a target code
            (the usual shifted causal-LM convention: labels[:, j] is predicted at j - 1).
        """
        num_rows, num_levels = self.labels.shape
        input_ids = torch.cat([self.history_ids, self.labels], dim=1)             # (B, L+T)
        attention_mask = torch.cat([self.history_mask, torch.ones_like(self.labels, dtype=torch.bool)], 1)
        labels = torch.full_like(input_ids, -100)
        labels[:, -num_levels:] = self.labels
        return input_ids, attention_mask, labels


def encode_histories(item_tokens: np.ndarray, histories: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Lh) item indices, left-padded with -1 -> history_ids and history_mask, both (B, Lh*T + 1)."""
    num_rows, max_len = histories.shape
    num_levels = item_tokens.shape[1]
    hist_tokens = np.where(histories[..., None] >= 0, item_tokens[np.maximum(histories, 0)], PAD_TOKEN)  # (B, Lh, T)
    eos = np.full((num_rows, 1), EOS_TOKEN, dtype=np.int64)
    history_ids = torch.from_numpy(np.concatenate([hist_tokens.reshape(num_rows, max_len * num_levels), eos], 1))
    return history_ids, history_ids != PAD_TOKEN


def collate(catalog: Catalog, split: Split, indices: np.ndarray, item_tokens: np.ndarray | None = None) -> Batch:
    """Builds the batch of ``split``'s samples ``indices``; padded to the longest history."""
    indices = np.asarray(indices, dtype=np.int64)
    tokens = catalog.item_tokens if item_tokens is None else item_tokens      # (I, T)
    max_len = max(int(split.history_lengths[indices].max()), 1)
    history_ids, history_mask = encode_histories(tokens, split.histories[indices, -max_len:])
    targets = split.targets[indices]
    return Batch(
        history_ids=history_ids,
        history_mask=history_mask,
        labels=torch.from_numpy(tokens[targets]),
        target_items=torch.from_numpy(targets),
        target_sem=torch.from_numpy(catalog.item_sem[targets]),
        sample_index=torch.from_numpy(indices),
    )


class ResidentSplit:
    """A split's samples held on one device, for training: a batch is gathered there from its indices.

    :func:`collate` builds a batch on the host and copies it over, per batch; on an accelerator that copy
    (from pageable memory) can wait for the device's queue to drain, so the host no longer prepares the next
    batch while the device trains this one. Here the histories, targets and token tables are copied once,
    and a batch is a gather from them by indices that are already on the device (``batch(indices, rows)``).
    The batch equals ``collate``'s (integer gathers, the same padding).
    """

    def __init__(self, catalog: Catalog, split: Split, device: torch.device | str,
                 item_tokens: np.ndarray | None = None) -> None:
        tokens = catalog.item_tokens if item_tokens is None else item_tokens                 # (I, T)
        self.device = torch.device(device)
        self.history_lengths = split.history_lengths                 # host: a batch's width needs no sync
        self.histories = torch.as_tensor(split.histories, device=self.device)               # (S, H)
        self.targets = torch.as_tensor(split.targets, device=self.device)                   # (S,)
        self.item_tokens = torch.as_tensor(tokens, device=self.device)                       # (I, T)
        self.item_sem = torch.as_tensor(catalog.item_sem, device=self.device)               # (I,)

    def batch(self, indices: np.ndarray, rows: torch.Tensor) -> Batch:
        """The batch of samples ``indices`` (host, for the width), ``rows`` the same indices on the device."""
        max_len = max(int(self.history_lengths[indices].max()), 1)
        histories = self.histories[rows, -max_len:]                                          # (B, Lh)
        num_rows, num_levels = len(indices), self.item_tokens.shape[1]
        tokens = self.item_tokens[histories.clamp(min=0)]                                    # (B, Lh, T)
        tokens = tokens.masked_fill(histories[..., None] < 0, PAD_TOKEN).reshape(num_rows, max_len * num_levels)
        eos = torch.full((num_rows, 1), EOS_TOKEN, dtype=tokens.dtype, device=self.device)
        history_ids = torch.cat([tokens, eos], dim=1)                                        # (B, Lh*T + 1)
        targets = self.targets[rows]
        return Batch(history_ids=history_ids, history_mask=history_ids != PAD_TOKEN,
                     labels=self.item_tokens[targets], target_items=targets, target_sem=self.item_sem[targets],
                     sample_index=rows)


def group_by_length(order: np.ndarray, lengths: np.ndarray, batch_size: int, rng: np.random.Generator,
                    window_batches: int = 64) -> np.ndarray:
    """Reorders a shuffled sample order so that each batch holds histories of similar length.

    Batches pad to their longest history; in a random batch of 128 that is almost always the
    maximum, while the typical history is much shorter (Office: mean 8 of 20 items). Within each
    window of ``window_batches`` batches the samples are sorted by length and cut into batches;
    then the order of all batches is shuffled. Still a permutation of ``order``, still a
    function of ``rng``'s state.
    """
    window = batch_size * window_batches
    batches: list[np.ndarray] = []
    for start in range(0, len(order), window):
        chunk = order[start:start + window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches.extend(chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size))
    return np.concatenate([batches[i] for i in rng.permutation(len(batches))]) if batches else order


def iter_batches(catalog: Catalog, split: Split, batch_size: int, *, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = False, indices: np.ndarray | None = None) -> Iterator[Batch]:
    """Yields batches over ``indices`` (default: the whole split), shuffled with ``seed`` if asked."""
    order = np.arange(len(split)) if indices is None else np.asarray(indices, dtype=np.int64)
    if shuffle:
        order = np.random.default_rng(seed).permutation(order)
    item_tokens = catalog.item_tokens  # computed once per pass, not per batch
    stop = len(order) - (len(order) % batch_size if drop_last else 0)
    for start in range(0, stop, batch_size):
        yield collate(catalog, split, order[start:start + batch_size], item_tokens)
