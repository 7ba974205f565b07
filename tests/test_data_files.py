"""Dataset files: parsing with validation, name checks, where datasets are found, synthetic data.

Tests that touch files run in conftest's ``isolated``: a private cache, no $APAO_DATA_DIR, the
working directory in tmp_path and a dataset mirror on a closed loopback port, so nothing here
reads the user's files or the network.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from apao_ray import paths
from apao_ray.data import load_dataset
from apao_ray.data.files import CHECKSUMS, known_dataset_names, locate, parse_index, parse_interactions
from apao_ray.data.synthetic import make_synthetic
from datasets_helpers import SHARED_DATASETS, needs_shared

# a tiny valid dataset: 4 items, 3 users
GOOD_INDEX = {
    "i1": ["<a_0>", "<b_1>", "<c_0>", "<d_2>"],
    "i2": ["<a_0>", "<b_1>", "<c_0>", "<d_3>"],
    "i3": ["<a_1>", "<b_0>", "<c_1>", "<d_0>"],
    "i4": ["<a_1>", "<b_0>", "<c_1>", "<d_0>"],  # collides with i3
}
GOOD_INTER = {"u1": ["i1", "i2", "i3"], "u2": ["i3", "i1", "i2", "i4"], "u3": ["i4", "i4", "i1", "i2", "i3"]}


def write_dataset(root: Path, folder: str, index: object = None, inter: object = None, *,
                  index_text: str | None = None, inter_text: str | None = None) -> Path:
    directory = root / folder
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{folder}.index.rq-kmeans.json").write_text(
        index_text if index_text is not None else json.dumps(GOOD_INDEX if index is None else index))
    (directory / f"{folder}.inter.json").write_text(
        inter_text if inter_text is not None else json.dumps(GOOD_INTER if inter is None else inter))
    return directory


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- a good tiny dataset -------------------------------------------------------------------

def test_tiny_dataset_loads_with_exact_contents(isolated):
    write_dataset(isolated / "d", "tiny")
    dataset = load_dataset("tiny", data_dir=isolated / "d", allow_download=False)
    assert dataset.catalog.item_ids == ("i1", "i2", "i3", "i4")
    np.testing.assert_array_equal(dataset.catalog.item_codes, [[0, 1, 0, 2], [0, 1, 0, 3], [1, 0, 1, 0], [1, 0, 1, 0]])
    assert dataset.user_ids == ("u1", "u2", "u3")
    assert dataset.num_interactions == 12
    stats = dataset.stats()
    assert (stats["users"], stats["items"], stats["distinct_semantic_ids"]) == (3, 4, 3)
    assert (stats["colliding_semantic_ids"], stats["items_in_collisions"]) == (1, 2)
    assert stats["train_samples"] == 12 - 3 * 3
    # u3 = i4 i4 i1 i2 i3: test target i3 (index 2) after history i4 i4 i1 i2
    test = dataset.splits["test"]
    assert test.targets[2] == 2
    np.testing.assert_array_equal(test.histories[2, -4:], [3, 3, 0, 1])
    assert set(dataset.checksums) == {"tiny.inter.json", "tiny.index.rq-kmeans.json"}


def test_integer_item_ids_in_interactions_match_string_keys(isolated):
    # the real files list items as JSON numbers while the index keys are strings
    directory = write_dataset(isolated / "d", "ints", index={"0": GOOD_INDEX["i1"], "1": GOOD_INDEX["i2"]},
                              inter={"7": [0, 1, 0], "8": [1, "1", 0]})
    users, sequences = parse_interactions(directory / "ints.inter.json", {"0": 0, "1": 1}, "the index")
    assert users == ["7", "8"]
    assert [s.tolist() for s in sequences] == [[0, 1, 0], [1, 1, 0]]
    assert all(s.dtype == np.int64 for s in sequences)


# --- bad inputs: each error names the file, the key and what was expected -----------------

def test_malformed_index_json_reports_path_line_and_column(isolated):
    text = '{\n  "i1": ["<a_0>", "<b_0>", "<c_0>", "<d_0>"],\n  "i2": oops\n}'
    directory = write_dataset(isolated / "d", "bad", index_text=text)
    with pytest.raises(ValueError) as info:
        load_dataset("bad", data_dir=isolated / "d", allow_download=False)
    message = str(info.value)
    assert str(directory / "bad.index.rq-kmeans.json") in message
    assert "malformed JSON" in message and "line 3, column 9" in message


def test_malformed_interaction_json_reports_path_line_and_column(isolated):
    directory = write_dataset(isolated / "d", "bad", inter_text='{"u1": ["i1", "i2", "i3"],\n"u2": ["i1" "i2"]}')
    with pytest.raises(ValueError) as info:
        load_dataset("bad", data_dir=isolated / "d", allow_download=False)
    message = str(info.value)
    assert str(directory / "bad.inter.json") in message
    assert "line 2, column 13" in message


def test_non_utf8_file_names_the_file(isolated):
    directory = write_dataset(isolated / "d", "bad")
    (directory / "bad.inter.json").write_bytes(b'{"u1": ["\xff\xfe"]}')
    with pytest.raises(ValueError, match="bad.inter.json.*not UTF-8"):
        load_dataset("bad", data_dir=isolated / "d", allow_download=False)


def test_item_missing_from_index_names_user_item_and_index(isolated):
    inter = {**GOOD_INTER, "u9": ["i1", "i2", "ghost"]}
    directory = write_dataset(isolated / "d", "bad", inter=inter)
    with pytest.raises(ValueError) as info:
        load_dataset("bad", data_dir=isolated / "d", allow_download=False)
    message = str(info.value)
    assert "'u9'" in message and "'ghost'" in message
    assert str(directory / "bad.inter.json") in message
    assert str(directory / "bad.index.rq-kmeans.json") in message


@pytest.mark.parametrize("sem_id", [["<a_0>", "<b_1>", "<c_2>"], ["<a_0>", "<b_1>", "<c_2>", "<d_3>", "<e_4>"],
                                    "<a_0><b_1><c_2><d_3>"])
def test_semantic_id_with_wrong_number_of_codes(isolated, sem_id):
    directory = write_dataset(isolated / "d", "bad", index={**GOOD_INDEX, "odd": sem_id})
    with pytest.raises(ValueError) as info:
        parse_index(directory / "bad.index.rq-kmeans.json")
    message = str(info.value)
    assert str(directory / "bad.index.rq-kmeans.json") in message
    assert "'odd'" in message and "4 codes" in message


@pytest.mark.parametrize("sem_id, bad_code, level", [
    (["<b_1>", "<a_0>", "<c_2>", "<d_3>"], "<b_1>", 1),
    (["<a_1>", "<b_0>", "<d_2>", "<c_3>"], "<d_2>", 3),
    (["<a_1>", "<b_x>", "<c_2>", "<d_3>"], "<b_x>", 2),
    (["<a_1>", "<b_0>", "<c_2>", 3], "3", 4),
    (["<a_-1>", "<b_0>", "<c_2>", "<d_3>"], "<a_-1>", 1),
])
def test_code_at_wrong_level_or_malformed(isolated, sem_id, bad_code, level):
    directory = write_dataset(isolated / "d", "bad", index={**GOOD_INDEX, "odd": sem_id})
    with pytest.raises(ValueError) as info:
        load_dataset("bad", data_dir=isolated / "d", allow_download=False)
    message = str(info.value)
    assert str(directory / "bad.index.rq-kmeans.json") in message
    assert "'odd'" in message and bad_code in message and f"level {level}" in message


@pytest.mark.parametrize("index_text", ["[]", "{}", '"x"'])
def test_index_must_be_a_non_empty_object(isolated, index_text):
    write_dataset(isolated / "d", "bad", index_text=index_text)
    with pytest.raises(ValueError, match="bad.index.rq-kmeans.json: expected a non-empty JSON object"):
        load_dataset("bad", data_dir=isolated / "d", allow_download=False)


def test_user_with_fewer_than_three_interactions(isolated):
    directory = write_dataset(isolated / "d", "bad", inter={**GOOD_INTER, "short": ["i1", "i2"]})
    with pytest.raises(ValueError) as info:
        load_dataset("bad", data_dir=isolated / "d", allow_download=False)
    message = str(info.value)
    assert str(directory / "bad.inter.json") in message
    assert "'short'" in message and "2 interaction" in message and "at least 3" in message


def test_user_items_not_a_list(isolated):
    write_dataset(isolated / "d", "bad", inter={**GOOD_INTER, "weird": "i1 i2 i3"})
    with pytest.raises(ValueError, match="user 'weird' has str .*expected a list of item ids"):
        load_dataset("bad", data_dir=isolated / "d", allow_download=False)


def test_unknown_dataset_lists_known_names(isolated):
    with pytest.raises(ValueError) as info:
        load_dataset("nosuchdataset", data_dir=isolated / "d")
    message = str(info.value)
    assert "'nosuchdataset'" in message
    for name in ["office", "grocery", "beauty", "yelp", "synthetic"]:
        assert name in message
    assert known_dataset_names() == ["beauty", "grocery", "office", "synthetic", "yelp"]
    assert not (isolated / "cache").exists()  # no download was attempted


@pytest.mark.parametrize("name", ["../x", "a/b", "/etc", "..", "../Office", "a\\b", "", ".hidden", "x" * 200])
def test_names_that_could_escape_the_data_dir_are_rejected(isolated, name):
    before = snapshot(isolated)
    with pytest.raises(ValueError, match="plain name"):
        load_dataset(name, data_dir=isolated / "d")
    with pytest.raises(ValueError, match="plain name"):
        locate(name, isolated / "d")
    assert snapshot(isolated) == before


def test_escape_is_rejected_even_when_the_target_exists(isolated):
    # a real dataset one level up from the data dir must not be reachable through "../"
    write_dataset(isolated, "outside")
    (isolated / "d").mkdir()
    with pytest.raises(ValueError, match="plain name"):
        load_dataset("../outside", data_dir=isolated / "d", allow_download=False)


def test_non_string_name():
    with pytest.raises(ValueError, match="must be a string"):
        load_dataset(3)  # type: ignore[arg-type]


@needs_shared
def test_yelp_without_interaction_file_is_a_clear_error(isolated):
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("yelp", data_dir=SHARED_DATASETS)
    message = str(info.value)
    assert "Yelp.inter.json" in message and "does not publish" in message
    assert str(SHARED_DATASETS.resolve() / "Yelp") in message
    assert not (isolated / "cache").exists()  # not a download attempt


def test_missing_dataset_without_download(isolated):
    with pytest.raises(FileNotFoundError, match="'office' not found in"):
        load_dataset("office", data_dir=isolated / "d", allow_download=False)
    assert not (isolated / "cache").exists()


# --- nothing is half-loaded ------------------------------------------------------------------

def test_failing_load_leaves_no_state_and_no_files(isolated):
    directory = write_dataset(isolated / "d", "tiny")
    good = load_dataset("tiny", data_dir=isolated / "d", allow_download=False)
    assert good.stats()["users"] == 3
    # break the interactions; a later load must raise, not return the earlier result
    (directory / "tiny.inter.json").write_text(json.dumps({**GOOD_INTER, "u4": ["i1", "nope", "i2"]}))
    before = snapshot(isolated)
    with pytest.raises(ValueError, match="'nope'"):
        load_dataset("tiny", data_dir=isolated / "d", allow_download=False)
    assert snapshot(isolated) == before  # no partial files, no cache written
    assert not (isolated / "cache").exists()
    # the earlier Dataset is untouched and a fixed file loads the new contents
    assert good.stats()["users"] == 3
    (directory / "tiny.inter.json").write_text(json.dumps({**GOOD_INTER, "u4": ["i1", "i4", "i2"]}))
    assert load_dataset("tiny", data_dir=isolated / "d", allow_download=False).stats()["users"] == 4


# --- where datasets are found ----------------------------------------------------------------

def _office_with_users(root: Path, num_users: int) -> None:
    write_dataset(root, "Office", inter={f"u{k}": ["i1", "i2", "i3"] for k in range(num_users)})


def test_resolution_order_explicit_env_cwd_cache(isolated, monkeypatch):
    explicit, env_dir, cache = isolated / "explicit", isolated / "env", isolated / "cache" / "apao_ray" / "datasets"
    cwd_data = isolated / "data"
    for root, users in [(explicit, 1), (env_dir, 2), (cwd_data, 3), (cache, 4)]:
        _office_with_users(root, users)
    monkeypatch.setenv(paths.DATA_DIR_ENV, str(env_dir))

    def users(data_dir=None) -> int:
        return len(load_dataset("office", data_dir=data_dir, allow_download=False).user_ids)

    assert users(explicit) == 1
    assert users() == 2
    with pytest.raises(FileNotFoundError, match="'office' not found in .*empty"):  # never a silent fall-back
        users(isolated / "empty")
    monkeypatch.delenv(paths.DATA_DIR_ENV)
    assert users() == 3
    (isolated / "elsewhere").mkdir()
    monkeypatch.chdir(isolated / "elsewhere")  # no ./data here
    assert users() == 4
    assert locate("office").inter_path == cache / "Office" / "Office.inter.json"


def test_data_dir_candidates_and_download_dir(isolated, monkeypatch):
    cache = isolated / "cache" / "apao_ray" / "datasets"
    cwd_data = (isolated / "data").resolve()
    assert paths.data_dir_candidates() == [cwd_data, cache.resolve()]
    assert paths.download_dir() == cache
    monkeypatch.setenv(paths.DATA_DIR_ENV, str(isolated / "env"))
    assert paths.data_dir_candidates(isolated / "x") == [(isolated / "x").resolve()]  # searched alone
    assert paths.download_dir() == (isolated / "env").resolve()
    assert paths.download_dir(isolated / "x") == (isolated / "x").resolve()


def test_relative_data_dir_is_relative_to_cwd(isolated):
    _office_with_users(isolated / "rel", 5)
    assert len(load_dataset("office", data_dir="rel", allow_download=False).user_ids) == 5


@pytest.mark.parametrize("name", ["office", "Office", "OFFICE", "oFfIcE"])
def test_names_are_case_insensitive(isolated, name):
    _office_with_users(isolated / "d", 2)
    dataset = load_dataset(name, data_dir=isolated / "d", allow_download=False)
    assert dataset.name == "office" and len(dataset.user_ids) == 2


@needs_shared
def test_shared_office_checksums_match_the_pinned_ones(isolated):
    dataset = load_dataset("Office", data_dir=SHARED_DATASETS)
    assert dataset.checksums == CHECKSUMS["Office"]


# --- synthetic -------------------------------------------------------------------------------

def test_synthetic_is_deterministic_per_seed():
    first = make_synthetic(seed=3)
    second = make_synthetic(seed=3)
    other = make_synthetic(seed=4)
    assert first[0] == second[0] and first[2] == second[2]
    np.testing.assert_array_equal(first[1], second[1])
    assert len(first[3]) == len(second[3])
    for a, b in zip(first[3], second[3]):
        np.testing.assert_array_equal(a, b)
    differs = not np.array_equal(first[1], other[1]) or any(
        len(a) != len(b) or not np.array_equal(a, b) for a, b in zip(first[3], other[3]))
    assert differs


def test_synthetic_has_a_collision_and_valid_sequences():
    item_ids, codes, user_ids, sequences = make_synthetic(seed=0)
    assert codes.shape == (len(item_ids), 4)
    assert len(np.unique(codes, axis=0)) < len(item_ids)
    assert all(len(s) >= 5 and s.min() >= 0 and s.max() < len(item_ids) for s in sequences)
    assert len(user_ids) == len(sequences)
    with pytest.raises(ValueError, match="exceeds"):
        make_synthetic(num_items=20, level_sizes=(2, 2, 2, 2))


@pytest.mark.parametrize("name", ["synthetic", "SYNTHETIC"])
def test_load_synthetic_needs_no_files(isolated, name):
    a = load_dataset(name, synthetic_seed=1)
    b = load_dataset(name, synthetic_seed=1)
    c = load_dataset(name, synthetic_seed=2)
    assert a.name == "synthetic" and a.checksums == {}
    assert a.stats()["colliding_semantic_ids"] >= 1
    np.testing.assert_array_equal(a.splits["train"].histories, b.splits["train"].histories)
    assert a.stats() != c.stats() or not np.array_equal(a.splits["train"].targets, c.splits["train"].targets)
    assert snapshot(isolated) == {}
