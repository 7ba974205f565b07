"""The published numbers the report and the grid set ours beside, read from ``field.csv`` (one row per published
figure: dataset, backbone, method, our loss name where it is one of ours, Recall/NDCG at 10 and 20 where published,
the source, and how its split or protocol differs from ours).

``TABLE1`` is the APAO paper's Table 1 (SPEC §6): test Recall@10 / NDCG@10 with beam 20 after the paper's schedule,
keyed by (dataset, backbone, loss).
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

FIELD_FILE = Path(__file__).with_name("field.csv")
APAO_SOURCE = "APAO (Yu et al., KDD'26), Table 1"


@dataclass(frozen=True)
class Published:
    """One published result (a row of ``field.csv``); a metric the source does not report is None."""

    dataset: str
    backbone: str
    method: str
    loss: str
    recall_at_10: float | None
    recall_at_20: float | None
    ndcg_at_10: float | None
    ndcg_at_20: float | None
    source: str
    note: str


def _number(text: str) -> float | None:
    return float(text) if text.strip() else None


def load_field(path: str | Path = FIELD_FILE) -> tuple[Published, ...]:
    with open(path, newline="") as handle:
        return tuple(Published(row["dataset"], row["backbone"], row["method"], row["loss"],
                               *(_number(row[k]) for k in ("recall_at_10", "recall_at_20", "ndcg_at_10", "ndcg_at_20")),
                               row["source"], row["note"]) for row in csv.DictReader(handle))


FIELD = load_field()
# (dataset, backbone, loss) -> (Recall@10, NDCG@10)
TABLE1: dict[tuple[str, str, str], tuple[float, float]] = {
    (row.dataset, row.backbone, row.loss): (row.recall_at_10, row.ndcg_at_10)
    for row in FIELD if row.source == APAO_SOURCE}
# Table 4 (TIGER, Office, one A100): seconds per epoch
SECONDS_PER_EPOCH_A100 = {"ce": 15, "apao_pointwise": 15, "sdpo": 199, "apao_pairwise": 163}


def table1(dataset: str, backbone: str, loss: str) -> tuple[float, float] | None:
    return TABLE1.get((dataset.lower(), backbone, loss))


def field_for(dataset: str) -> list[Published]:
    """Every published figure on ``dataset`` (any case), in the file's order."""
    return [row for row in FIELD if row.dataset == dataset.lower()]


def field_table(datasets: list[str]) -> list[str]:
    """Markdown: every published figure on ``datasets`` (``field.csv``), each with its source's number, then the
    sources and how each differs from ours; a metric a source does not give is ``-``."""
    header = ["dataset", "backbone", "method", "R@10", "R@20", "N@10", "N@20", "source"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    sources: dict[tuple[str, str], int] = {}
    for dataset in sorted({d.lower() for d in datasets}):
        for row in field_for(dataset):
            number = sources.setdefault((row.source, row.note), len(sources) + 1)
            values = ["-" if v is None else f"{v:.4f}" for v in (row.recall_at_10, row.recall_at_20, row.ndcg_at_10,
                                                                row.ndcg_at_20)]
            lines.append("| " + " | ".join([row.dataset, row.backbone, row.method, *values, f"[{number}]"]) + " |")
    if not sources:
        return []
    return [*lines, "", *(f"[{number}] {source}: {note}." for (source, note), number in sources.items())]
