"""A plain interactions table (CSV, TSV or Parquet; one row per interaction) -> time-ordered
item sequences, after the paper's five-core filter.

Columns: a user column (``user`` or ``user_id``), an item column (``item``, ``item_id`` or
``parent_asin``) and a time column (``timestamp``, ``time`` or ``ts``; numbers, or dates
pandas can parse). Repeated interactions are kept (the shipped files keep them too).

Five-core (the paper's preprocessing, like the shipped files): users and items with fewer
than ``min_interactions`` interactions are removed, repeatedly, until none is left; each
removal can push others under the threshold. ``min_interactions`` is 5 by default, is
recorded by ``tokenize`` in the index's meta file, and is read back from there when the
dataset loads, so training sees the items that were tokenized.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_MIN_INTERACTIONS = 5
USER_COLUMNS = ("user", "user_id")
ITEM_COLUMNS = ("item", "item_id", "parent_asin")
TIME_COLUMNS = ("timestamp", "time", "ts")


@dataclass(frozen=True)
class TableSequences:
    """Sequences read from a table.

    Attributes:
        sequences: user id -> item ids in time order (ties keep file order).
        num_rows: rows in the file.
        num_rows_kept: rows left after the five-core filter.
        min_interactions: the filter's threshold.
    """

    sequences: dict[str, list[str]]
    num_rows: int
    num_rows_kept: int
    min_interactions: int

    def describe(self) -> str:
        return (f"{self.min_interactions}-core: users and items with < {self.min_interactions} interactions removed "
                f"until none is left; {self.num_rows_kept:,} of {self.num_rows:,} rows kept")


def _column(path: Path, columns: list[str], choices: tuple[str, ...], what: str) -> str:
    lower = {str(c).lower(): c for c in columns}
    for choice in choices:
        if choice in lower:
            return lower[choice]
    raise ValueError(f"{path}: no {what} column; expected one of {list(choices)}, found columns {columns}")


def read_table(path: Path):
    """The table as a pandas DataFrame of strings (ids) and the original time column."""
    import pandas as pd  # lazy: pandas, only for a table; every Ray worker imports data

    try:
        if path.suffix.lower() == ".parquet":
            return pd.read_parquet(path)
        return pd.read_csv(path, sep="\t" if path.suffix.lower() == ".tsv" else ",", dtype=str,
                           keep_default_na=False)
    except (ValueError, OSError, pd.errors.ParserError) as error:
        raise ValueError(f"{path}: cannot read as a {path.suffix} table: {error}") from None


def five_core(users, items, min_interactions: int):
    """Boolean mask of the rows kept by the iterated k-core filter (pandas Series of ids in)."""
    keep = np.ones(len(users), dtype=bool)
    while True:
        user_counts = users[keep].value_counts()
        item_counts = items[keep].value_counts()
        is_dense = (users.map(user_counts).fillna(0).to_numpy() >= min_interactions) & \
                   (items.map(item_counts).fillna(0).to_numpy() >= min_interactions)
        new_keep = keep & is_dense
        if new_keep.sum() == keep.sum():
            return keep
        keep = new_keep


def table_sequences(path: Path, min_interactions: int = DEFAULT_MIN_INTERACTIONS) -> TableSequences:
    """Reads ``path`` and returns each user's item ids in time order after the k-core filter."""
    import pandas as pd  # lazy: pandas, only for a table; every Ray worker imports data

    if not isinstance(min_interactions, int) or min_interactions < 3:
        raise ValueError(f"min_interactions={min_interactions!r} must be an integer >= 3 (each user needs training, "
                         "validation and test targets); the paper uses 5")
    frame = read_table(path)
    columns = [str(c) for c in frame.columns]
    user_col = _column(path, columns, USER_COLUMNS, "user")
    item_col = _column(path, columns, ITEM_COLUMNS, "item")
    time_col = _column(path, columns, TIME_COLUMNS, "timestamp")
    users, items = frame[user_col].astype(str), frame[item_col].astype(str)
    times = pd.to_numeric(frame[time_col], errors="coerce")
    if times.isna().any():  # not numbers: dates, then
        try:
            times = pd.to_datetime(frame[time_col], errors="raise", utc=True, format="mixed")
        except (ValueError, TypeError) as error:
            bad = frame[time_col][pd.to_numeric(frame[time_col], errors="coerce").isna()].iloc[0]
            raise ValueError(f"{path}: column {time_col!r} holds {bad!r}, which is neither a number nor a date "
                             f"({error})") from None
    keep = five_core(users, items, min_interactions)
    if not keep.any():
        raise ValueError(f"{path}: no interactions left after the {min_interactions}-core filter "
                         f"({len(frame):,} rows); lower --min-interactions (>= 3)")
    kept = pd.DataFrame({"user": users[keep], "item": items[keep], "time": times[keep]})
    kept = kept.sort_values(["user", "time"], kind="stable")  # stable: ties keep file order
    sequences = {user: group.tolist() for user, group in kept.groupby("user", sort=True)["item"]}
    return TableSequences(sequences, len(frame), int(keep.sum()), min_interactions)
