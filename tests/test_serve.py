"""``python -m apao_ray serve MODEL_URI``: MLflow's real scoring server recommends what load_recommender does,
and a bad request gets HTTP 400 whose message names the bad value."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from apao_ray.study.runner import stable_free_port
from conftest import ROOT, mlflow_sqlite, run_script, train_tiny

pytestmark = pytest.mark.e2e  # trains a tiny model and starts MLflow's scoring server: ~1 minute on 2 CPUs
MODEL_NAME = "apao-synthetic-tiger-ce"


@pytest.fixture(scope="module")
def registered(synthetic, tmp_path_factory):
    """A tiny TIGER logged and registered as ``models:/apao-synthetic-tiger-ce@best`` in a fresh SQLite store."""
    from apao_ray.tracking import Tracker

    root = tmp_path_factory.mktemp("serve")
    checkpoint = train_tiny("tiger", root / "trial", synthetic)
    tracker = Tracker(mlflow_sqlite(root), "apao-synthetic")
    run_id = tracker.start_run("tiger/ce", {})
    model_uri = tracker.log_recommender(run_id, checkpoint, list(synthetic.catalog.item_ids[:3]))
    tracker.end_run(run_id)
    tracker.register_best(model_uri, MODEL_NAME)
    return {"tracking_uri": tracker.tracking_uri, "model_uri": f"models:/{MODEL_NAME}@best", "dir": root}


@pytest.fixture(scope="module")
def server(registered):
    """``python -m apao_ray serve models:/...@best`` on a free port; killed (its whole process group) afterwards."""
    port = stable_free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": registered["tracking_uri"]}
    log = open(registered["dir"] / "server.log", "w+")
    process = subprocess.Popen([sys.executable, "-m", "apao_ray", "serve", registered["model_uri"], "--port", str(port)],
                               cwd=registered["dir"], env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # its own group: MLflow's CLI and its uvicorn die together
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=2):
                    break
            except OSError:
                log.seek(0)
                assert process.poll() is None, f"the server exited {process.returncode}:\n{log.read()[-3000:]}"
                assert time.time() < deadline, f"{url}/ping did not answer in 180 s:\n{log.read()[-3000:]}"
                time.sleep(0.5)
        yield url
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
                process.wait(timeout=20)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/invocations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_the_server_recommends_what_load_recommender_does(server, registered, synthetic):
    import mlflow

    from apao_ray.inference import load_recommender

    split = synthetic.splits["test"]
    histories = [[synthetic.catalog.item_ids[i] for i in split.histories[row] if i >= 0] for row in (0, 7, 19)]
    status, body = post(server, {"dataframe_records": [{"history": h} for h in histories], "params": {"k": 5}})
    assert status == 200, body
    mlflow.set_tracking_uri(registered["tracking_uri"])
    expected = load_recommender(registered["model_uri"]).recommend(histories, k=5)
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
