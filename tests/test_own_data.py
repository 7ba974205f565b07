"""A user's own dataset directory (--dataset PATH): the three-file format, an interactions table
with the five-core filter, their errors, and `data stats` on them."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from apao_ray.data import load_dataset
from apao_ray.data.tables import five_core, table_sequences
from conftest import ROOT
from datasets_helpers import SHARED_DATASETS, needs_shared as needs_office  # test_semantic_ids.py imports it so

OFFICE = SHARED_DATASETS / "Office"
INDEX = {"i1": ["<a_0>", "<b_0>", "<c_0>", "<d_0>"], "i2": ["<a_0>", "<b_1>", "<c_0>", "<d_0>"],
         "i3": ["<a_1>", "<b_0>", "<c_0>", "<d_0>"], "i4": ["<a_1>", "<b_1>", "<c_0>", "<d_0>"]}


def office_as_table(directory, *, with_index: bool = True):
    """Office's interactions as a CSV (user, item, timestamp; rows shuffled, so order must come from
    the timestamps), its item texts renamed to items.json, and optionally its index."""
    directory.mkdir(parents=True)
    inter = json.loads((OFFICE / "Office.inter.json").read_text())
    rows = [(f"u{user}", str(item), 1_000_000 + 10 * position) for user, items in inter.items()
            for position, item in enumerate(items)]
    frame = pd.DataFrame(rows, columns=["user_id", "item", "timestamp"]).sample(frac=1.0, random_state=0)
    frame.to_csv(directory / "interactions.csv", index=False)
    shutil.copy(OFFICE / "Office.item.json", directory / "items.json")
    if with_index:
        shutil.copy(OFFICE / "Office.index.rq-kmeans.json", directory / "mine.index.rq-kmeans.json")
    return directory


def test_five_core_is_iterated_until_stable():
    users = pd.Series(["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["d"] * 2)
    items = pd.Series(["x", "y", "z", "x", "y", "z", "x", "y", "w", "z", "w"])
    # k=3: user d and item w (2 rows each) go; then c (x, y) and z (a, b) have 2 and go; then a and b (x, y)
    # have 2 and go: nothing is left, which only an iterated filter finds (one pass keeps a, b, c)
    assert not five_core(users, items, 3).any()
    # k=2 keeps everyone: every user and item has >= 2 rows
    assert five_core(users, items, 2).all()


def test_table_orders_by_timestamp_and_filters(tmp_path):
    rows = [("u1", f"i{n % 2 + 1}", 100 - n) for n in range(6)] + [("u2", "i1", 5), ("u2", "i9", 6)]
    pd.DataFrame(rows, columns=["user", "item", "timestamp"]).to_csv(tmp_path / "t.csv", index=False)
    table = table_sequences(tmp_path / "t.csv", min_interactions=3)
    # u2 has 2 rows -> gone; i9 then has none; u1's rows reversed into time order
    assert table.sequences == {"u1": ["i2", "i1", "i2", "i1", "i2", "i1"]}
    assert (table.num_rows, table.num_rows_kept) == (8, 6)
    assert "3-core" in table.describe()


@pytest.mark.parametrize("columns, message", [
    (["uid", "item", "timestamp"], "no user column; expected one of \\['user', 'user_id'\\]"),
    (["user", "item", "when"], "no timestamp column"),
])
def test_table_missing_column_names_what_is_expected_and_found(tmp_path, columns, message):
    pd.DataFrame([["a", "b", 1]], columns=columns).to_csv(tmp_path / "t.csv", index=False)
    with pytest.raises(ValueError, match=message) as info:
        table_sequences(tmp_path / "t.csv")
    assert str(columns) in str(info.value) and "t.csv" in str(info.value)


def test_table_bad_timestamp_and_bad_core(tmp_path):
    pd.DataFrame([["a", "b", "yesterday-ish"]] * 5, columns=["user", "item", "timestamp"]).to_csv(
        tmp_path / "t.csv", index=False)
    with pytest.raises(ValueError, match="'yesterday-ish', which is neither a number nor a date"):
        table_sequences(tmp_path / "t.csv")
    with pytest.raises(ValueError, match="min_interactions=2 must be an integer >= 3"):
        table_sequences(tmp_path / "t.csv", min_interactions=2)


def test_directory_errors_name_the_directory_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no interaction files"):
        load_dataset(str(tmp_path / "empty"))
    pd.DataFrame([["a", "i1", 1]], columns=["user", "item", "timestamp"]).to_csv(tmp_path / "empty" / "x.csv")
    with pytest.raises(FileNotFoundError, match="python -m apao_ray tokenize --dataset"):
        load_dataset(str(tmp_path / "empty"))
    (tmp_path / "empty" / "y.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"several interaction files.*x.csv.*y.parquet"):
        load_dataset(str(tmp_path / "empty"))


def test_three_file_directory_loads_with_checksums(tmp_path):
    directory = tmp_path / "Shop"
    directory.mkdir()
    (directory / "shop.index.rq-kmeans.json").write_text(json.dumps(INDEX))
    (directory / "shop.inter.json").write_text(json.dumps({"u1": ["i1", "i2", "i3"], "u2": ["i2", "i3", "i4", "i1"]}))
    dataset = load_dataset(str(directory))
    assert dataset.name == "shop"  # the folder's name, lower-cased: experiment apao-shop
    assert dataset.catalog.num_items == 4 and len(dataset.splits["train"]) == 1
    assert set(dataset.checksums) == {"shop.inter.json", "shop.index.rq-kmeans.json"}
    (directory / "shop.inter.json").write_text(json.dumps({"u1": ["i1", "i2", "ghost"]}))
    with pytest.raises(ValueError, match="'ghost', which is missing from the semantic-ID index"):
        load_dataset(str(directory))


@needs_office
def test_office_as_a_table_gives_office(tmp_path):
    directory = office_as_table(tmp_path / "mine")
    office, mine = load_dataset("office", data_dir=SHARED_DATASETS), load_dataset(str(directory))
    # Office is already five-core: the filter drops nothing, and the timestamps restore every sequence
    assert mine.num_interactions == office.num_interactions == 53_258
    assert mine.notes["filter"].endswith("53,258 of 53,258 rows kept")
    assert sorted(mine.user_ids) == sorted(f"u{u}" for u in office.user_ids)
    for name in ("train", "valid", "test"):
        assert len(mine.splits[name]) == len(office.splits[name])
    assert set(mine.checksums) == {"interactions.csv", "mine.index.rq-kmeans.json"}
    # a stricter core drops users and items, and says so
    strict = load_dataset(str(directory), min_interactions=10)
    assert strict.num_interactions < office.num_interactions and "10-core" in strict.notes["filter"]


@needs_office
def test_data_stats_cli_on_a_directory(tmp_path):
    directory = office_as_table(tmp_path / "mine")
    result = subprocess.run([sys.executable, "-m", "apao_ray", "data", "stats", "--dataset", str(directory)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "dataset mine" in result.stdout and "4,905" in result.stdout and "5-core" in result.stdout
    (directory / "mine.index.rq-kmeans.json").unlink()
    result = subprocess.run([sys.executable, "-m", "apao_ray", "data", "stats", "--dataset", str(directory)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2 and "apao_ray tokenize --dataset" in result.stderr
