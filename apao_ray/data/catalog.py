"""Item catalog: semantic IDs, level-specific tokens and the prefix trie held as arrays.

The trie is stored per depth: node ids at depth m are the distinct length-m prefixes
(depth 0 has the single root node 0). ``child_node[m][node, code]`` is the node id at depth
m+1 reached by appending ``code`` at level m, or -1 when that prefix is not in the catalog.
At depth T the node id is the index of a distinct semantic ID (a "leaf"). Every query
(valid next codes for a batch of prefixes, the next node) is one fancy-indexing operation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported by tensors(): a study's driver reads catalogs without torch
    import torch

NUM_LEVELS = 4
PAD_TOKEN = 0
EOS_TOKEN = 1
BOS_TOKEN = 2
NUM_SPECIAL_TOKENS = 3


@dataclass(frozen=True, eq=False)
class CatalogTensors:
    """Torch copies of the trie tables, on one device, for decoding, MSL and negatives.

    Attributes:
        child_node: per depth m, (num_nodes[m], level_sizes[m]) int64, -1 = no such prefix.
        leaf_prefix_nodes: (U, T+1) int64, node id of each semantic ID's length-m prefix.
        token_offsets: (T,) int64, token id of code 0 at each level.
        num_distinct_prefixes: (T,) float, P_m = distinct length-m prefixes.
    """

    child_node: tuple[torch.Tensor, ...]
    leaf_prefix_nodes: torch.Tensor
    token_offsets: torch.Tensor
    num_distinct_prefixes: torch.Tensor
    level_sizes: tuple[int, ...]
    vocab_size: int

    def valid_next(self, depth: int, nodes: torch.Tensor) -> torch.Tensor:
        """(...,) node ids at ``depth`` -> (..., level_sizes[depth]) bool of valid next codes."""
        return self.child_node[depth][nodes] >= 0

    def next_node(self, depth: int, nodes: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Node ids at depth+1 after appending ``codes`` (level-``depth`` code indices)."""
        return self.child_node[depth][nodes, codes]

    def semantic_id_tokens(self) -> torch.Tensor:
        """(U, T) token ids of every semantic ID, in semantic-ID index order.

        Read off the trie: the code of leaf u at level m is the column of ``child_node[m]`` at its
        length-m prefix node that leads to its length-(m+1) prefix node.
        """
        import torch  # lazy: the module stays torch-free for the driver; these tables exist only where torch is loaded

        nodes = self.leaf_prefix_nodes                                           # (U, T+1)
        columns = []
        for m, table in enumerate(self.child_node):
            is_child = table[nodes[:, m]] == nodes[:, m + 1].unsqueeze(1)        # (U, S_m)
            columns.append(is_child.long().argmax(dim=1) + self.token_offsets[m])
        return torch.stack(columns, dim=1)                                       # (U, T)


@dataclass(frozen=True, eq=False)
class Catalog:
    """Items, their semantic IDs and the trie. Build with :meth:`from_codes`.

    Attributes:
        item_ids: (I,) external item ids, as strings, in catalog order.
        item_codes: (I, T) int64 code index per level.
        level_sizes: number of codes at each level (max code + 1).
        item_sem: (I,) index of each item's semantic ID in ``sem_codes``.
        sem_codes: (U, T) distinct semantic IDs, lexicographically sorted.
        sem_items: (U,) representative item (the first in catalog order) of each semantic ID.
        leaf_prefix_nodes: (U, T+1) node id of each semantic ID's length-m prefix, m = 0..T.
        child_node: per depth, (num_nodes[m], level_sizes[m]) int64 table (-1 = invalid).
    """

    item_ids: tuple[str, ...]
    item_codes: np.ndarray
    level_sizes: tuple[int, ...]
    item_sem: np.ndarray
    sem_codes: np.ndarray
    sem_items: np.ndarray
    leaf_prefix_nodes: np.ndarray
    child_node: tuple[np.ndarray, ...]
    item_index: dict[str, int] = field(repr=False)

    @classmethod
    def from_codes(cls, item_ids: list[str], item_codes: np.ndarray) -> "Catalog":
        """Builds the catalog from item ids and their (I, T) per-level code indices."""
        item_codes = np.asarray(item_codes, dtype=np.int64)
        if item_codes.ndim != 2 or item_codes.shape[0] != len(item_ids) or len(item_ids) == 0:
            raise ValueError(f"item_codes must be (num_items={len(item_ids)}, T), got {item_codes.shape}")
        if (item_codes < 0).any():
            raise ValueError("semantic ID codes must be >= 0")
        num_levels = item_codes.shape[1]
        level_sizes = tuple(int(item_codes[:, m].max()) + 1 for m in range(num_levels))
        sem_codes, item_sem = np.unique(item_codes, axis=0, return_inverse=True)
        item_sem = item_sem.reshape(-1)
        sem_items = np.full(len(sem_codes), -1, dtype=np.int64)
        # first item (catalog order) of each semantic ID: write in reverse so the first wins
        sem_items[item_sem[::-1]] = np.arange(len(item_ids))[::-1]
        # prefix node ids: distinct rows of sem_codes[:, :m] (sorted order keeps them contiguous)
        num_sem = len(sem_codes)
        leaf_prefix_nodes = np.zeros((num_sem, num_levels + 1), dtype=np.int64)
        for m in range(1, num_levels + 1):
            is_new = np.ones(num_sem, dtype=bool)
            is_new[1:] = (sem_codes[1:, :m] != sem_codes[:-1, :m]).any(axis=1)
            leaf_prefix_nodes[:, m] = np.cumsum(is_new) - 1
        child_node = []
        for m in range(num_levels):
            num_nodes = int(leaf_prefix_nodes[:, m].max()) + 1
            table = np.full((num_nodes, level_sizes[m]), -1, dtype=np.int64)
            table[leaf_prefix_nodes[:, m], sem_codes[:, m]] = leaf_prefix_nodes[:, m + 1]
            child_node.append(table)
        return cls(
            item_ids=tuple(item_ids), item_codes=item_codes, level_sizes=level_sizes,
            item_sem=item_sem.astype(np.int64), sem_codes=sem_codes.astype(np.int64),
            sem_items=sem_items, leaf_prefix_nodes=leaf_prefix_nodes, child_node=tuple(child_node),
            item_index={item: i for i, item in enumerate(item_ids)},
        )

    # --- sizes ---------------------------------------------------------------------------
    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    @property
    def num_levels(self) -> int:
        return len(self.level_sizes)

    @property
    def num_semantic_ids(self) -> int:
        return len(self.sem_codes)

    @property
    def num_distinct_prefixes(self) -> np.ndarray:
        """(T,) P_m, the number of distinct length-m prefixes, m = 1..T."""
        return self.leaf_prefix_nodes[:, 1:].max(axis=0) + 1

    # --- tokens --------------------------------------------------------------------------
    @property
    def token_offsets(self) -> np.ndarray:
        """(T,) token id of code 0 at each level; level-m code c is token offsets[m] + c."""
        return NUM_SPECIAL_TOKENS + np.concatenate([[0], np.cumsum(self.level_sizes)[:-1]]).astype(np.int64)

    @property
    def vocab_size(self) -> int:
        return NUM_SPECIAL_TOKENS + sum(self.level_sizes)

    @property
    def item_tokens(self) -> np.ndarray:
        """(I, T) token ids of every item's semantic ID."""
        return self.item_codes + self.token_offsets

    @property
    def sem_tokens(self) -> np.ndarray:
        """(U, T) token ids of every distinct semantic ID."""
        return self.sem_codes + self.token_offsets

    def tokens_to_codes(self, tokens: np.ndarray) -> np.ndarray:
        """(..., T) token ids -> (..., T) code indices; raises on a token at the wrong level."""
        codes = np.asarray(tokens) - self.token_offsets
        if (codes < 0).any() or (codes >= np.asarray(self.level_sizes)).any():
            raise ValueError("token ids are not level-specific codes of this catalog")
        return codes

    # --- trie ----------------------------------------------------------------------------
    def valid_next(self, depth: int, nodes: np.ndarray) -> np.ndarray:
        """(...,) node ids at ``depth`` -> (..., level_sizes[depth]) bool of valid next codes."""
        return self.child_node[depth][nodes] >= 0

    def prefix_nodes(self, codes: np.ndarray) -> np.ndarray:
        """(..., m) code prefixes -> (...,) node ids at depth m, -1 where not in the catalog."""
        codes = np.asarray(codes, dtype=np.int64)
        nodes = np.zeros(codes.shape[:-1], dtype=np.int64)
        for m in range(codes.shape[-1]):
            valid = nodes >= 0
            in_range = valid & (codes[..., m] < self.level_sizes[m]) & (codes[..., m] >= 0)
            nxt = np.full_like(nodes, -1)
            nxt[in_range] = self.child_node[m][nodes[in_range], codes[..., m][in_range]]
            nodes = nxt
        return nodes

    def collisions(self) -> dict[tuple[int, ...], list[str]]:
        """Semantic IDs shared by several items: code tuple -> the items' ids."""
        counts = np.bincount(self.item_sem, minlength=self.num_semantic_ids)
        report: dict[tuple[int, ...], list[str]] = {}
        for sem in np.flatnonzero(counts > 1):
            items = np.flatnonzero(self.item_sem == sem)
            report[tuple(int(c) for c in self.sem_codes[sem])] = [self.item_ids[i] for i in items]
        return report

    def tensors(self, device: torch.device | str = "cpu") -> CatalogTensors:
        import torch  # lazy: as in semantic_id_tokens

        return CatalogTensors(
            child_node=tuple(torch.as_tensor(t, device=device) for t in self.child_node),
            leaf_prefix_nodes=torch.as_tensor(self.leaf_prefix_nodes, device=device),
            token_offsets=torch.as_tensor(self.token_offsets, device=device),
            num_distinct_prefixes=torch.as_tensor(self.num_distinct_prefixes, dtype=torch.float32, device=device),
            level_sizes=self.level_sizes,
            vocab_size=self.vocab_size,
        )
