"""The published numbers (apao_ray/analysis/field.csv): every row sourced, the paper's Table 1 whole and equal to
docs/SPEC.md §6, and every loss it names one the registry knows."""
from __future__ import annotations

import re
from pathlib import Path

from apao_ray.analysis.paper import APAO_SOURCE, FIELD, TABLE1, field_for, field_table, table1
from apao_ray.losses import LOSSES

SPEC = Path(__file__).resolve().parents[1] / "docs" / "SPEC.md"


def test_every_row_has_a_source_a_note_and_a_number():
    assert FIELD and all(row.source and row.note and (row.recall_at_10 or row.ndcg_at_10) for row in FIELD)
    assert all(row.loss in LOSSES for row in FIELD if row.loss)
    # Table 1: 7 TIGER and 6 Llama methods (no Llama MSL) on 4 datasets
    assert len(TABLE1) == sum(row.source == APAO_SOURCE for row in FIELD) == 52


def test_table1_equals_the_spec():
    rows = re.findall(r"^\| (TIGER|Llama) \| (\S+) \| (.+) \|$", SPEC.read_text(), re.M)
    names = {"CE": "ce", "APAO-pointwise": "apao_pointwise", "APAO-pairwise": "apao_pairwise"}
    assert len(rows) == 6
    for backbone, method, cells in rows:
        for dataset, cell in zip(("office", "grocery", "beauty"), cells.split(" | ")):
            recall, ndcg = (float(x) for x in cell.split(" / "))
            assert table1(dataset.title(), backbone.lower(), names[method]) == (recall, ndcg)


def test_the_table_cites_each_source_once():
    lines = field_table(["Beauty"])
    assert sum(line.startswith("[") for line in lines) == 3  # the APAO paper, TIGER's paper, RPG
    assert "| beauty | rpg | RPG | 0.0809 | - | 0.0464 | - | [3] |" in lines
    assert field_for("nowhere") == [] and field_table(["nowhere"]) == []
