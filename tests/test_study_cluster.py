"""A study on a Ray cluster as docs/running.md's recipe runs one: the recipe's node commands as typed (Ray's token
authentication on, as a user has it), trial drivers pinned to the nodes that carry a resource (``--driver-resource``),
the refusals a driver meets (trials of one study on both nodes: tests/test_study_nodisk.py). The KubeRay manifest is
checked, not run."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from apao_ray.study.cluster.ray_cluster import stable_free_port
from apao_ray.study.run.trial import DRIVER_RESOURCE_SHARE, Resources
from conftest import ROOT, run_script
from test_study_reliability import _children, mlflow_server  # noqa: F401 - a fixture

RAY = str(Path(sys.executable).with_name("ray"))


def _alive_nodes(address: str, env: dict, resource: str | None = None) -> list[str]:
    """The IDs of the cluster's live nodes (those carrying ``resource`` where given); in Ray's token mode where the
    head asks for the token this machine holds, as a study's driver joins (Ray's own client would not send it)."""
    carries = f" and n['Resources'].get({resource!r})" if resource else ""
    try:
        listing = subprocess.run([sys.executable, "-c", "import json, ray; from apao_ray.study.cluster import token_auth as t;"
                                  f"t.needs_token_mode({address!r}) and t.enable_token_mode();"
                                  f"ray.init(address={address!r}, logging_level='ERROR');"
                                  f"print('nodes', json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']{carries}]))"],
                                 capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    except subprocess.TimeoutExpired:  # a node still starting on a loaded machine: the caller asks again
        return []
    # its own line: Ray's log lines (a raylet's, forwarded) may come after it on stdout
    lines = [line for line in listing.stdout.splitlines() if line.startswith("nodes [")]
    return json.loads(lines[-1][len("nodes "):]) if listing.returncode == 0 and lines else []


CLUSTER_SECTION = "## A Ray cluster and a shared MLflow server"


def cluster_recipe() -> list[str]:
    """The commands of docs/running.md's cluster section as a reader types them (continuations joined)."""
    from test_documented_commands import _candidate_lines

    text = (ROOT / "docs" / "running.md").read_text()
    start = text.index("```bash", text.index(CLUSTER_SECTION))
    block = text[start:text.index("\n```\n", start) + 5]
    return [line for line in _candidate_lines(block) if line and not line.startswith("#")]


def recipe_command(words: str) -> str:
    """The recipe's one command that contains ``words``."""
    (line,) = [line for line in cluster_recipe() if words in line]
    return line


def _start_node(command: str, env: dict) -> subprocess.Popen:
    """A `ray start --block` command line run by bash (its variables and quoting as a reader's shell reads them),
    in a session of its own, so that the teardown stops these nodes only (`ray stop` would stop every Ray on the
    machine, a study running beside the tests included)."""
    return subprocess.Popen(["bash", "-c", command], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _stop_nodes(nodes: list[subprocess.Popen]) -> None:
    """SIGTERM to every node at once, then SIGKILL to what is left."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        for node in nodes:
            if node.poll() is None:
                try:
                    os.killpg(node.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.time() + wait
        for node in nodes:
            try:
                node.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        if all(node.poll() is not None for node in nodes):
            return


@pytest.fixture
def two_node_cluster(request, tmp_path_factory, monkeypatch):
    """docs/running.md's cluster recipe on this machine: its token step, head and worker node commands as typed
    (2 logical CPUs each; the worker carries the recipe's trial_driver resource), torn down afterwards. Ray's token
    authentication is on as a user has it: the token in a HOME of the test's own (the user's ~/.ray is never
    touched) and neither RAY_AUTH_MODE nor the suite's own token set (those are for its local Rays), so the test's
    drivers join as the recipe's driver does. A test's indirect parameter ``{"worker": wrap}`` runs the worker
    node's command line as ``wrap(command)`` (test_study_nodisk.py: in a mount namespace of its own)."""
    wrap_worker = getattr(request, "param", {}).get("worker", lambda command: command)
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    # a node that gets SIGTERM drains for 30 s first (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S): nothing to drain here
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
           "PATH": f"{Path(RAY).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # the recipe's `ray` is ours
    port = stable_free_port()
    address = f"127.0.0.1:{port}"

    def as_here(line: str) -> str:
        return line.replace("<head>", "127.0.0.1").replace("6379", str(port))

    token = subprocess.run(["bash", "-c", as_here(recipe_command("ray get-auth-token"))], env=env,
                           capture_output=True, text=True, timeout=120)
    assert token.returncode == 0 and (home / ".ray" / "auth_token").stat().st_mode & 0o077 == 0, token.stderr
    nodes: list[subprocess.Popen] = []
    try:
        for line, options, count in ((recipe_command("ray start --head"),
                                      ["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                                       f"--dashboard-port={stable_free_port()}"], 1),
                                     (recipe_command("ray start --address"), [], 2)):
            # the command as typed, then what keeps it in the foreground on this machine's share of the CPUs
            command = f"{as_here(line)} --block --disable-usage-stats --num-cpus=2 " + " ".join(options)
            command = wrap_worker(command) if count == 2 else command
            # a node whose raylet has not registered 30 s after it started gives up (Ray's fixed wait): on a loaded
            # machine (load average 22 on 2 CPUs) a worker node did, so each node has two tries
            for attempt in (1, 2):
                nodes.append(_start_node(command, env))
                deadline = time.time() + 180
                while len(alive := _alive_nodes(address, env)) < count and nodes[-1].poll() is None:
                    assert time.time() < deadline, f"the Ray node `{line}` did not join in 180 s"
                    time.sleep(2)
                if len(alive) >= count:
                    break
                assert attempt == 1, nodes[-1].communicate()[1][-3000:]
                _stop_nodes(nodes[-1:])  # what the failed start left in its session
        yield address, set(alive)
    finally:
        _stop_nodes(nodes)


def test_a_trials_placement_is_its_reservation_plus_the_driver_resource():
    """Tune's public PlacementGroupFactory, one bundle: a one-worker trial's CPUs, GPUs and memory cap; a
    data-parallel trial's driver sliver; with --driver-resource, a share of that resource added to either."""
    solo = Resources(1, 0.5, 0.25, 2 ** 30)
    assert Resources.placement(solo.tune_resources()).bundles == [{"CPU": 0.5, "GPU": 0.25, "memory": 2.0 ** 30}]
    assert Resources.placement(Resources(3, 1.0).tune_resources(), "trial_driver").bundles == [
        {"CPU": 0.01, "trial_driver": DRIVER_RESOURCE_SHARE}]


def test_the_workers_code_is_the_package_folder_and_the_plugin_modules_never_the_checkout_on_pythonpath(monkeypatch):
    """What Ray's runtime_env carries to every node (a node needs neither the checkout nor apao_ray installed): the
    package folder once, each $APAO_PLUGINS module's file or package folder, Python's caches left out."""
    from apao_ray.study.cluster.ray_cluster import code_runtime_env

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    monkeypatch.setenv("APAO_PLUGINS", "test_toy_loss, apao_ray.losses.apao,yaml.loader,no_such_module")
    env = code_runtime_env()
    assert env["py_modules"] == [str(ROOT / "apao_ray"), str(ROOT / "tests" / "test_toy_loss.py"),
                                 str(Path(yaml.__file__).parent)]
    assert "__pycache__" in env["excludes"] and "env_vars" not in env


def test_a_refused_token_is_told_from_an_unreachable_cluster_in_rays_chained_errors():
    """ray.init's ConnectionError hides the cause two levels down (a RuntimeError whose text holds the
    AuthenticationError): found there, whichever way it was chained; a cluster that is simply down is not one."""
    from apao_ray.study.cluster.token_auth import is_refused_token

    def chained(cause: BaseException) -> ConnectionError:
        try:
            try:
                raise cause
            except Exception as error:
                raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from error
        except ConnectionError as error:
            return error

    assert is_refused_token(chained(RuntimeError("Failed to connect to GCS. Last connection error: ... "
                                                 "AuthenticationError: RPC error: InvalidAuthToken: missing")))
    assert not is_refused_token(chained(RuntimeError("Failed to connect to GCS: Connection refused")))


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
    trial trains) ran on the worker node. Three trials of 1 CPU at once on 2-CPU nodes: unpinned, one node
    cannot hold them all and both train (tests/test_study_nodisk.py's four trials); pinned, the third waits.
    A sweep that keeps token mode off, one that holds no token, and a train run that keeps token mode off are
    refused in one line naming the fix, before anything starts."""
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
    sweep = [str(ROOT / words[1]), *words[2:], "--smoke", "--num-samples", "2", "--max-concurrent", "3"]

    train = [str(ROOT / "studies" / "train.py"), "--smoke", "--address", address, "--output-dir", str(tmp_path)]
    refusals = ((sweep, {"RAY_AUTH_MODE": "disabled"}, "RAY_AUTH_MODE=disabled here: unset RAY_AUTH_MODE"),
                (sweep, {"HOME": str(tmp_path)}, "this machine holds none: put the head's token in"),
                (train, {"RAY_AUTH_MODE": "disabled"}, "RAY_AUTH_MODE=disabled here: unset RAY_AUTH_MODE"))
    with ThreadPoolExecutor(len(refusals)) as pool:  # side by side: each is a Python start and one refused connection
        results = list(pool.map(lambda case: run_script(case[0], cwd=tmp_path, timeout=300, env=case[1]), refusals))
    for refused, (_, _, fix) in zip(results, refusals):
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
    assert len(children) == 3 and all(c.info.status == "FINISHED" for c in children.values())
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
