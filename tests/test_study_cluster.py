"""A study on a Ray cluster as docs/running.md's recipe runs one: Ray's token authentication, trial drivers
pinned to the nodes that carry a resource (``--driver-resource``), the refusals a driver meets. The cluster is
test_study_reliability.py's (the recipe's node commands, token auth on); the KubeRay manifest is checked, not run."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
import yaml

from apao_ray.study.run.trial import DRIVER_RESOURCE_SHARE, Resources
from conftest import ROOT, run_script
from test_study_reliability import (SWEEP, _alive_nodes, _children, mlflow_server, recipe_command,  # noqa: F401
                                    two_node_cluster)


def test_a_trials_placement_is_its_reservation_plus_the_driver_resource():
    """Tune's public PlacementGroupFactory, one bundle: a one-worker trial's CPUs, GPUs and memory cap; a
    data-parallel trial's driver sliver; with --driver-resource, a share of that resource added to either."""
    solo = Resources(1, 0.5, 0.25, 2 ** 30)
    assert Resources.placement(solo.tune_resources()).bundles == [{"CPU": 0.5, "GPU": 0.25, "memory": 2.0 ** 30}]
    assert Resources.placement(Resources(3, 1.0).tune_resources(), "trial_driver").bundles == [
        {"CPU": 0.01, "trial_driver": DRIVER_RESOURCE_SHARE}]


@pytest.mark.parametrize("name", ["CPU", "memory", "two words", "a-b"])
def test_a_driver_resource_that_is_not_a_custom_resource_name_is_refused(name):
    from apao_ray import StudySpec

    with pytest.raises(ValueError, match=f"--driver-resource {name!r} must name a custom Ray resource"):
        StudySpec(driver_resource=name)
    assert StudySpec(driver_resource="trial_driver").driver_resource == "trial_driver"


def test_the_kuberay_rayjob_runs_the_recipes_study_and_says_it_is_not_run_here():
    """docs/kuberay-rayjob.yaml: a RayJob whose entrypoint is a sweep that parses, pinned to the worker group that
    carries the driver resource, its token auth on; marked as an example this project does not run."""
    text = (ROOT / "docs" / "kuberay-rayjob.yaml").read_text()
    assert "not run here" in text.split("apiVersion")[0].lower()
    job = yaml.safe_load(text)
    assert job["kind"] == "RayJob" and job["apiVersion"].startswith("ray.io/")
    entrypoint = shlex.split(job["spec"]["entrypoint"])
    (script,) = [word for word in entrypoint if word.endswith("studies/sweep.py")]
    sweep = entrypoint[entrypoint.index(script) + 1:]
    from apao_ray.study.cli.sweep import build_parser

    args = build_parser().parse_args(sweep)
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster.get("authOptions", {}).get("mode") == "token"
    groups = cluster["workerGroupSpecs"]
    carriers = [g for g in groups if args.driver_resource in str(g["rayStartParams"].get("resources", ""))]
    assert args.driver_resource and len(carriers) == 1 and len(groups) == 2


@pytest.mark.e2e
def test_the_docs_cluster_recipe_pins_trial_drivers_and_refuses_a_driver_without_the_token(tmp_path, two_node_cluster,
                                                                                          mlflow_server):
    """The recipe's nodes (token auth on, the worker carrying trial_driver) and its driver command, a smoke study
    in place of the recipe's study size, against an MLflow server: every trial's driver (where a one-worker
    trial trains) ran on the worker node. Without pinning, Ray places these two trials on one node, the one
    its driver joined through (the head). A driver that keeps token mode off, and one that holds no token,
    are refused in one line naming the fix, before anything starts."""
    address, node_ids = two_node_cluster
    port, _ = mlflow_server
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    (carrier,) = _alive_nodes(address, env, "trial_driver")
    assert carrier in node_ids and len(node_ids) == 2
    driver = recipe_command("studies/sweep.py --address")  # the line that joins the cluster; the next sizes the study
    words = shlex.split(driver.split(" --dataset ")[0]
                        .replace("<head>:6379", address).replace("127.0.0.1:5000", f"127.0.0.1:{port}")
                        .replace("/shared", str(tmp_path)))
    assert words[:2] == ["python", "studies/sweep.py"]
    sweep = [str(ROOT / words[1]), *words[2:], "--smoke", "--num-samples", "1", "--max-concurrent", "2"]

    for refused_env, fix in (({"RAY_AUTH_MODE": "disabled"}, "RAY_AUTH_MODE=disabled here: unset RAY_AUTH_MODE"),
                             ({"HOME": str(tmp_path)}, "this machine holds none: put the head's token in")):
        refused = run_script(sweep, cwd=tmp_path, timeout=300, env=refused_env)
        errors = [line for line in refused.stderr.splitlines() if "error:" in line]
        assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-3000:]
        assert f"the Ray cluster at '{address}' requires its token" in errors[0] and fix in errors[0], errors
        assert "~/.ray/auth_token" in errors[0] and "cannot reach" not in refused.stderr
        assert "Traceback" not in refused.stderr and "InvalidAuthToken" not in refused.stderr

    result = run_script(sweep, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Token authentication is" not in result.stderr
    from apao_ray.tracking import Tracker

    children = _children(Tracker(f"http://127.0.0.1:{port}", "apao-synthetic"))
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children.values())
    assert {c.data.tags["apao.node_id"] for c in children.values()} == {carrier}


@pytest.mark.e2e
def test_a_local_rays_token_notice_goes_to_its_session_log_not_the_terminal(tmp_path):
    """Where RAY_AUTH_MODE is unset, Ray warns "Token authentication is enabled for this Ray cluster" at every
    local start: a study's local Ray writes it among the session's logs instead. Its token goes to the test's
    own HOME (a local Ray in token mode makes one there)."""
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    code = ("import ray, ray._private.worker as w; from apao_ray.study.cluster.ray_cluster import init_ray, "
            "session_log; init_ray(None, num_cpus=1, dashboard=False); print(session_log()); ray.shutdown()")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**env, "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Token authentication is" not in result.stderr + result.stdout
    log = result.stdout.strip().splitlines()[-1]
    assert "Token authentication is enabled for this Ray cluster" in open(log).read()
    assert (tmp_path / ".ray" / "auth_token").exists()
