"""data/shipped.py: a trial's dataset from the files the driver shipped where the node lacks them (or holds other
ones), from the node's own files where they are the same, and a one-line refusal naming the node where neither."""
from __future__ import annotations

import numpy as np
import pytest

from apao_ray.config import DataConfig
from apao_ray.data.shipped import load_trial_dataset, pack, unpack
from test_study_nodisk import write_dataset


def _same(a, b) -> bool:
    return a.name == b.name and a.user_ids == b.user_ids and a.catalog.item_ids == b.catalog.item_ids and all(
        np.array_equal(getattr(a.splits[s], f), getattr(b.splits[s], f)) for s in a.splits
        for f in ("histories", "targets", "users"))


@pytest.mark.parametrize("by_path", [False, True])
def test_a_dataset_missing_or_changed_on_the_node_loads_from_the_shipped_files(tmp_path, by_path):
    write_dataset(tmp_path / "data", "tiny")
    config = (DataConfig(dataset=str(tmp_path / "data" / "tiny")) if by_path
              else DataConfig(dataset="tiny", data_dir=str(tmp_path / "data")))
    here = load_trial_dataset(config)
    shipped = pack(config)
    assert shipped.checksums == here.checksums and shipped.num_bytes > 10_000
    assert here.data_dir is None or here.data_dir == str(tmp_path / "data")
    # the node's own files with the same checksums: read in place
    assert load_trial_dataset(config, shipped).data_dir == here.data_dir
    inter = tmp_path / "data" / "tiny" / "tiny.inter.json"
    inter.write_text(inter.read_text().replace('"u0": [', '"u0": ["1", ', 1))  # another version of the file
    changed = load_trial_dataset(config, shipped, node="10.0.0.2")
    assert _same(changed, here) and changed.checksums == shipped.checksums
    inter.unlink()  # no file at the driver's path on this node
    assert _same(load_trial_dataset(config, shipped, node="10.0.0.2"), here)
    with pytest.raises(FileNotFoundError, match=r"^on node 10\.0\.0\.2: .*tiny.*; nothing was shipped by the study's driver$"):
        load_trial_dataset(config, None, node="10.0.0.2")


def test_the_node_copy_is_written_once_and_rewritten_when_damaged(tmp_path):
    write_dataset(tmp_path / "data", "tiny")
    shipped = pack(DataConfig(dataset="tiny", data_dir=str(tmp_path / "data")))
    base = unpack(shipped, tmp_path / "cache")
    index = base / "tiny" / "tiny.index.rq-kmeans.json"
    written = index.stat().st_mtime_ns
    assert unpack(shipped, tmp_path / "cache") == base and index.stat().st_mtime_ns == written
    index.write_text("{}")
    assert unpack(shipped, tmp_path / "cache") == base and index.read_bytes() == shipped.files[index.name]


def test_the_synthetic_dataset_is_generated_on_each_node_not_shipped():
    assert pack(DataConfig(dataset="synthetic")) is None
