"""``python -m apao_ray serve MODEL_URI``: MLflow's real scoring server recommends what load_recommender does,
and a bad request gets HTTP 400 whose message names the bad value."""
from __future__ import annotations

import json

import pytest

from conftest import post, register_tiny, run_script, serving

pytestmark = pytest.mark.e2e  # trains a tiny model and starts MLflow's scoring server: ~1 minute on 2 CPUs
MODEL_NAME = "apao-synthetic-tiger-ce"
MAX_BODY_BYTES, MAX_USERS = 65536, 40  # small limits: the tests reach them cheaply


@pytest.fixture(scope="module")
def registered(synthetic, tmp_path_factory):
    """A tiny TIGER logged and registered as ``models:/apao-synthetic-tiger-ce@best`` in a fresh SQLite store."""
    return register_tiny(tmp_path_factory.mktemp("serve"), synthetic)


@pytest.fixture(scope="module")
def server(registered):
    with serving(registered, "--max-body-bytes", str(MAX_BODY_BYTES), "--max-users", str(MAX_USERS)) as url:
        yield url


def test_the_server_recommends_what_load_recommender_does(server, registered, synthetic):
    import mlflow

    from apao_ray import load_recommender

    split = synthetic.splits["test"]
    histories = [[synthetic.catalog.item_ids[i] for i in split.histories[row] if i >= 0] for row in (0, 7, 19)]
    status, body = post(server, {"dataframe_records": [{"history": h} for h in histories], "params": {"k": 5}})
    assert status == 200, body
    mlflow.set_tracking_uri(registered["tracking_uri"])  # as a user's code points MLflow at a store
    try:
        expected = load_recommender(registered["model_uri"]).recommend(histories, k=5)
    finally:
        mlflow.set_tracking_uri(None)
    assert [row["items"] for row in body["predictions"]] == [[item for item, _ in row] for row in expected]
    assert [len(row["scores"]) for row in body["predictions"]] == [5, 5, 5]
    for row, mine in zip(body["predictions"], expected):
        assert row["scores"] == pytest.approx([score for _, score in mine], abs=1e-4)
        assert row["scores"] == sorted(row["scores"], reverse=True)


@pytest.mark.parametrize("body, named", [
    ({"dataframe_records": [{"history": ["ghost-item"]}]}, "'ghost-item'"),
    ({"dataframe_records": [{"history": []}]}, "history 0 is empty"),
    ({"dataframe_records": [{"items": ["1"]}]}, "missing inputs ['history']"),
    ({"dataframe_records": [{"history": ["1"]}], "params": {"k": 0}}, "k=0"),
    ({"dataframe_records": [{"history": ["1"]}], "params": {"k": 100000}}, "k=100000"),
])
def test_a_bad_request_is_a_400_whose_message_names_the_bad_value(server, body, named):
    status, answer = post(server, body)
    assert status == 400, answer
    assert named in answer["message"], answer["message"]


def test_an_unknown_model_fails_naming_its_uri(registered):
    done = run_script(["-m", "apao_ray", "serve", "models:/no-such-model@best", "--tracking-uri",
                       registered["tracking_uri"]], cwd=registered["dir"], timeout=120)
    assert done.returncode == 2, done.stderr
    assert "models:/no-such-model@best" in done.stderr and MODEL_NAME in done.stderr, done.stderr
    # from code alike: the URI, what the store holds and how a best model gets registered, not MLflow's traceback
    from apao_ray import load_recommender

    with pytest.raises(ValueError, match=r"model 'models:/no-such-model@best' not found in sqlite:///.*Registered "
                                         rf"models: \['{MODEL_NAME}'\].*`\S*apao\S*( -m apao_ray)? best` registers"):
        load_recommender("models:/no-such-model@best", tracking_uri=registered["tracking_uri"])
    with pytest.raises(ValueError, match="model 'no-such-dir': no such directory"):
        load_recommender("no-such-dir", tracking_uri=registered["tracking_uri"])


def test_load_recommender_finds_the_store_as_the_commands_do(registered, tmp_path, monkeypatch):
    """No ``tracking_uri=``: ``$MLFLOW_TRACKING_URI``, else ./mlflow.db, as ``best`` and ``serve`` look; a directory
    with no store gets an error naming the Python argument (not a command's flag) and no stray mlflow.db."""
    import mlflow

    from apao_ray import load_recommender

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(None)  # a user's fresh process: no store chosen (another test in this worker may have)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"no MLflow database at .*mlflow.db; pass tracking_uri= \(the store's URI\)"):
        load_recommender(registered["model_uri"])
    assert not (tmp_path / "mlflow.db").exists()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered["tracking_uri"])
    from_variable = load_recommender(registered["model_uri"]).recommend([["1", "2"]], k=3)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(registered["dir"])
    from_directory = load_recommender(registered["model_uri"]).recommend([["1", "2"]], k=3)
    explicit = load_recommender(registered["model_uri"], tracking_uri=registered["tracking_uri"])
    assert from_variable == from_directory == explicit.recommend([["1", "2"]], k=3)


def test_a_body_over_the_limit_is_a_413_naming_it_and_nothing_is_echoed(server):
    body = b'{"dataframe_records": [{"history": ["' + b"x" * (MAX_BODY_BYTES + 10) + b'"]}]}'  # also malformed
    status, answer = post(server, body)
    assert status == 413, answer
    assert f"{MAX_BODY_BYTES:,} bytes" in answer["message"] and "xxxx" not in json.dumps(answer)


def test_malformed_json_is_a_400_that_echoes_nothing(server):
    status, answer = post(server, b'{"dataframe_records": [{"history": ["secret-token-1", ')
    assert status == 400 and "not valid JSON" in answer["message"], answer
    assert "secret-token-1" not in json.dumps(answer)


def test_item_ids_may_be_json_integers_as_in_the_dataset_file(server, synthetic):
    split = synthetic.splits["test"]
    history = [synthetic.catalog.item_ids[i] for i in split.histories[3] if i >= 0]
    assert all(item.isdigit() for item in history)  # the synthetic catalog's ids are integers in its file
    as_strings = post(server, {"dataframe_records": [{"history": history}], "params": {"k": 5}})
    as_integers = post(server, {"dataframe_split": {"columns": ["history"], "data": [[[int(i) for i in history]]]},
                                "params": {"k": 5}})
    assert as_strings[0] == as_integers[0] == 200, (as_strings, as_integers)
    assert as_integers[1]["predictions"] == as_strings[1]["predictions"]


def test_an_unknown_param_is_refused_with_the_allowed_names(server):
    status, answer = post(server, {"dataframe_records": [{"history": ["1"]}], "params": {"topk": 5}})
    assert status == 400, answer
    assert "unknown params ['topk']; allowed: ['k', 'skip_unknown']" in answer["message"]


def test_more_users_than_the_cap_is_a_clear_400(server):
    status, answer = post(server, {"dataframe_records": [{"history": ["1"]}] * (MAX_USERS + 1)})
    assert status == 400, answer
    assert f"{MAX_USERS + 1} users in one request; at most {MAX_USERS}" in answer["message"]
    status, answer = post(server, {"dataframe_records": [{"history": ["1"]}] * MAX_USERS, "params": {"k": 1}})
    assert status == 200 and len(answer["predictions"]) == MAX_USERS, answer


def test_a_refused_history_is_not_echoed_and_the_message_is_the_models_own(server, registered, synthetic):
    """MLflow's scoring server prefixes a model's error with ``Failed to predict data '<the request's data>'``:
    the answer carries the model's message alone, the one ``recommend`` raises, and nothing of the history sent."""
    from apao_ray import load_recommender

    known = [synthetic.catalog.item_ids[i] for i in synthetic.splits["test"].histories[5] if i >= 0]
    history = [*known, "ghost-item"]
    status, answer = post(server, {"dataframe_records": [{"history": history}], "params": {"k": 5}})
    assert status == 400, answer
    with pytest.raises(ValueError) as raised:
        load_recommender(registered["model_uri"], tracking_uri=registered["tracking_uri"]).recommend([history], k=5)
    assert answer["message"] == str(raised.value), answer
    assert str(known)[1:-1] not in json.dumps(answer) and "Failed to predict" not in json.dumps(answer), answer
    # a history whose items are no ids at all (numbers with a fraction): refused, and not echoed either
    status, answer = post(server, {"dataframe_records": [{"history": [1.5, 2.25]}]})
    assert status == 400 and "1.5" not in json.dumps(answer) and "2.25" not in json.dumps(answer), answer


def test_the_server_returns_every_item_of_a_shared_semantic_id(server, synthetic):
    """Items 398 and 399 share one semantic ID: asked for every ID (k = 399), the server returns all 400 items, the
    two side by side with one score."""
    catalog = synthetic.catalog
    (shared,) = catalog.collisions().values()
    history = [catalog.item_ids[i] for i in synthetic.splits["test"].histories[2] if i >= 0]
    status, body = post(server, {"dataframe_records": [{"history": history}],
                                 "params": {"k": catalog.num_semantic_ids}})
    assert status == 200, body
    (row,) = body["predictions"]
    assert sorted(row["items"]) == sorted(catalog.item_ids)
    at = row["items"].index(shared[0])
    assert row["items"][at + 1] == shared[1] and row["scores"][at] == row["scores"][at + 1]
