"""Starting Ray (local or an existing cluster) with the environment its processes need."""
from __future__ import annotations

import contextlib
import inspect
import os
import random
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
import importlib.util

from ...names import PLUGINS_ENV
from ...training.memory import ALLOCATOR_ENV, allocator_env
from .token_auth import TOKEN_FIX, enable_token_mode, is_refused_token, local_auth_notice_to_log, needs_token_mode

QUIET_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
                 "RAY_TRAIN_V2_ENABLED": "1", "RAY_AIR_NEW_OUTPUT": "0",
                 "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",  # else every worker line is printed twice
                 # no TensorBoard files: MLflow is the record (sweep.py keeps Tune's CSV and JSON loggers)
                 "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1"}
# Ray Train gives a trial's workers 60 s to start (placement group + torch import); on a machine busy
# with other work that is not enough, and each timeout costs a retry. A user's own value wins.
WORKER_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
WORKER_START_TIMEOUT_S = 300
# Ray Train starts a preemption watcher actor per trial (a process of its own) to checkpoint before a cloud
# node is drained; a Ray started on this machine has no node to drain. A cluster keeps Ray's default.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# Ray starts its workers at niceness +15: beside any ordinary process (niceness 0) on an oversubscribed CPU a
# trial then gets 36/1024 of the scheduler's weight, ~28x slower than the other process instead of an even
# share (27x measured on 2026-11-25, benchmarks/RESULTS.md). Workers of a Ray started here keep the driver's niceness (`nice ./apao sweep` still
# works, across login sessions too: match_session_niceness); a cluster keeps what its nodes were started with.
WORKER_NICENESS_ENV = "RAY_worker_niceness"
LOCAL_RAY_ENV = {PREEMPTION_WATCHER_ENV: "0", WORKER_NICENESS_ENV: "0"}
API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"  # where Ray's State API clients look first
RAY_TRAIN_LOG_LEVEL_ENV = "APAO_RAY_TRAIN_LOG_LEVEL"  # Ray Train's console log level (default WARNING)
# the driver's settings that Ray's processes read too; the plugins' modules travel with the code (code_runtime_env)
PASSED_ENV = (RAY_TRAIN_LOG_LEVEL_ENV, PLUGINS_ENV)
# what of the package folder never travels to the nodes (Python's caches: written per interpreter)
CODE_EXCLUDES = ["__pycache__", "*.pyc"]


def plugin_paths(names: str) -> list[str]:
    """The files or package folders of the top-level modules named in ``names`` ($APAO_PLUGINS, comma-separated)
    that are found here; a name not found is left to ``losses.import_plugins``, which names it."""
    paths = []
    for name in dict.fromkeys(part.strip().split(".")[0] for part in names.split(",") if part.strip()):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or [])
        if len(locations) == 1:
            paths.append(locations[0])
        elif spec.origin and spec.origin.endswith(".py"):
            paths.append(spec.origin)
    return paths


def code_runtime_env() -> dict[str, Any]:
    """The code every Ray worker of a study imports, the Ray way (runtime_env ``py_modules``): this apao_ray
    package folder and the $APAO_PLUGINS modules, zipped once per content, uploaded to the cluster and unpacked on
    each node (Ray caches it by content), so a node needs the Python dependencies installed, not this checkout."""
    package = str(Path(__file__).resolve().parents[2])
    modules = dict.fromkeys([package, *plugin_paths(os.environ.get(PLUGINS_ENV, ""))])  # a plugin inside apao_ray: once
    return {"py_modules": list(modules), "excludes": CODE_EXCLUDES}


AUTOGROUP_ENABLED, AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled"), Path("/proc/self/autogroup")
# Tune warns when one of its controller's steps takes over 0.5 s ("The `on_step_begin` operation took 0.906 s,
# which may be a performance bottleneck."). Where every CPU trains, its resource poll takes ~1 s: the full-protocol
# study on 2 vCPUs logged 393 such lines in ~16 h, while its trials report once per epoch (minutes). A study
# warns from 5 s on; a user's TUNE_WARN_THRESHOLD_S wins.
TUNE_WARN_ENV, TUNE_WARN_S = "TUNE_WARN_THRESHOLD_S", 5.0


def quiet_slow_step_warnings() -> float:
    """Raises Tune's slow-step warning threshold to ``TUNE_WARN_S`` unless the user set ``TUNE_WARN_ENV``; Tune
    reads that variable when ray.tune is first imported, which in a study happens before Ray starts, so the
    threshold is also set where Tune keeps it. Returns the threshold in force."""
    from ray.tune.utils.util import warn_if_slow

    if TUNE_WARN_ENV not in os.environ:
        os.environ[TUNE_WARN_ENV] = str(TUNE_WARN_S)  # for processes started from here
        warn_if_slow.DEFAULT_THRESHOLD = TUNE_WARN_S
    return warn_if_slow.DEFAULT_THRESHOLD


def match_session_niceness() -> str | None:
    """Gives this login session's scheduling group this process's niceness, where that lowers its priority.

    Under Linux's autogroup scheduling (on in many distributions' kernels) niceness orders processes only
    inside one session: a study started with `nice -n 10` (or `setsid nice ...` in the background) still took an
    even share of the CPUs from a test suite run in another terminal, and on 2 vCPUs halved it (2026-11-28).
    The group's niceness is only ever raised, never lowered, and only when this process is niced; it applies to
    the whole session (the terminal's shell and what else runs there) until the session ends.

    Returns:
        What was changed, for the console, or None (not niced, no autogroups, already as nice, not allowed).
    """
    niceness = os.nice(0)
    try:
        if niceness <= 0 or AUTOGROUP_ENABLED.read_text().strip() != "1":
            return None
        group, _, current = AUTOGROUP.read_text().split()               # "/autogroup-133 nice 0"
        if int(current) >= niceness:
            return None
        AUTOGROUP.write_text(str(niceness))
    except (OSError, ValueError):
        return None
    return (f"niceness {niceness}: this login session's scheduling group ({group[1:]}) set to niceness {niceness} too, "
            "for the rest of the session")


def check_ray_address(address: str | None, timeout: float = 5.0) -> bool:
    """Fails in seconds, naming the address, when a ``host:port`` Ray head does not answer
    (``ray.init`` itself retries for a minute) or refuses this machine for its token (token_auth.py).
    ``auto``, ``local`` and ``ray://`` pass through.

    Returns:
        Whether joining it takes Ray's token mode (the head asks for the token this machine holds).
    """
    if not address or address in ("auto", "local") or "://" in address:
        return False
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Ray address {address!r} must be HOST:PORT (the head's GCS port, 6379 by default), "
                         "'auto' or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        raise ConnectionError(f"Ray address {address!r} is unreachable ({error}); start the head with "
                              f"`ray start --head --port {port}` or fix --address / $RAY_ADDRESS") from None
    return needs_token_mode(address, timeout)


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Ray's workers listen on 10002-19999 (ray.init's default worker ports); its other processes bind port 0,
# i.e. a port of the kernel's ephemeral range. A dashboard port between the two cannot be taken by them
# between our choice and the dashboard's bind (in CI one was: "address already in use", the study failed).
RAY_WORKER_PORTS_END = 19999
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def stable_free_port(attempts: int = 64) -> int:
    """A loopback TCP port free now, above Ray's worker ports and below the kernel's ephemeral range
    (where no process that asks the OS for any port can be given it); any free port where that gap is
    unknown or full."""
    try:
        ephemeral_start = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return free_port()
    candidates = range(RAY_WORKER_PORTS_END + 1, ephemeral_start)
    for port in random.sample(candidates, min(attempts, len(candidates))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


@contextlib.contextmanager
def agent_port_chosen_by_the_os() -> Iterator[None]:
    """While it lasts, a local Ray's dashboard agent serves HTTP on a port the OS picks, not on Ray's fixed 52365.

    ``ray.init`` offers no argument for that port (``ray start --dashboard-agent-listen-port`` does), and with a
    second Ray on the machine (two studies, a study beside `apao train`, a test suite's parallel workers) the
    agent of the later one found 52365 taken, retried for ~3.3 s while its raylet waited to register, then ran
    without its HTTP server (its port recorded as -1): 7.3 s to start instead of 4.2-5.7 (AVX2 EPYC, 2 vCPUs,
    2026-11-28). Ray's own multi-node test cluster leaves the port unset for its added nodes, which its start-up
    turns into 0 (any free port); this leaves it unset the same way, by RayParams' default."""
    from ray._private.parameter import RayParams

    init = RayParams.__init__
    with_defaults = [name for name, parameter in inspect.signature(init).parameters.items()
                     if parameter.default is not inspect.Parameter.empty]
    defaults = init.__defaults__
    if "dashboard_agent_listen_port" not in with_defaults or len(with_defaults) != len(defaults or ()):
        yield  # another Ray's signature: its own default
        return
    changed = list(defaults)
    changed[with_defaults.index("dashboard_agent_listen_port")] = None
    init.__defaults__ = tuple(changed)
    try:
        yield
    finally:
        init.__defaults__ = defaults


def init_ray(address: str | None = None, num_cpus: int | None = None, dashboard: bool = True) -> None:
    """Joins ``address`` (a running cluster) or starts a local Ray, once per process.

    ``dashboard`` False starts the local Ray without its dashboard: 12 processes holding ~1.1 GiB RSS beside a
    study on 2 vCPUs, ~1.5 CPU-s to start. `apao train` keeps it (Ray Train's placement-group cleaner reads its
    State API); a study's trials, trained in Tune's actors, do not need it. A cluster keeps its own."""
    local = not address or address == "local"
    ray_env = {**QUIET_RAY_ENV, WORKER_START_TIMEOUT_ENV: str(WORKER_START_TIMEOUT_S),
               **(LOCAL_RAY_ENV if local else {})}
    for key, value in ray_env.items():
        os.environ.setdefault(key, value)
    quiet_slow_step_warnings()
    import ray

    if ray.is_initialized():
        return
    if check_ray_address(address):
        enable_token_mode()  # the head wants the token this machine holds: Ray sends it in token mode only
    if local and (matched := match_session_niceness()):
        print(f"{matched}, so it yields to work in other sessions as nice asks (Linux autogroups)",
              file=sys.stderr)
    passed = [*ray_env, *(k for k in PASSED_ENV if k in os.environ)]
    # the allocator is found on this machine; on a cluster, whose nodes may lack tcmalloc, auto keeps to glibc
    allocator = os.environ.get(ALLOCATOR_ENV) or ("auto" if local else "glibc-cached")
    runtime_env = {**code_runtime_env(),
                   "env_vars": {**{k: os.environ[k] for k in passed}, **allocator_env(allocator)}}
    try:
        if not local:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        elif not dashboard:
            with agent_port_chosen_by_the_os(), local_auth_notice_to_log(session_log):
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env,
                         log_to_driver=True)
        else:
            # the dashboard (bound to 127.0.0.1) serves the State API, which Ray Train's placement-group
            # cleaner needs to free the workers of a stopped run (and without which it waits 12 s per run). With
            # another Ray on the machine (a studies/train.py run, a second study) the cleaner cannot
            # tell which one is ours and dies, the stopped trial's CPUs are never freed and the next
            # trial's workers never start: name our dashboard to every process of this job.
            port = stable_free_port()
            runtime_env["env_vars"][API_SERVER_ENV] = f"http://127.0.0.1:{port}"
            # address "local": a new Ray of our own. ray.init() with no address joins the newest cluster
            # that `ray start` recorded in /tmp/ray/ray_current_cluster (another user's study, or a dead
            # one whose GCS it then waits on for minutes)
            with agent_port_chosen_by_the_os(), local_auth_notice_to_log(session_log):
                context = ray.init(address="local", num_cpus=num_cpus, include_dashboard=True,
                                   dashboard_host="127.0.0.1", dashboard_port=port, runtime_env=runtime_env,
                                   log_to_driver=True)
            if context.dashboard_url and not context.dashboard_url.endswith(f":{port}"):
                print(f"warning: Ray's dashboard took {context.dashboard_url}, not port {port} (taken meanwhile); "
                      "with another Ray on this machine, pruned trials may not free their CPUs", file=sys.stderr)
    except ConnectionError as error:
        if is_refused_token(error):  # an address check_ray_address cannot ask (auto, RAY_ADDRESS's cluster)
            raise ConnectionError(f"the Ray cluster at address {address!r} refused this machine's Ray token or "
                                  f"its absence: set RAY_AUTH_MODE=token and {TOKEN_FIX}") from None
        raise ConnectionError(f"cannot reach the Ray cluster at address {address!r}: {error}") from None


def session_log() -> str | None:
    """A file among the logs of the Ray session this process started or joined (None where Ray hides them)."""
    try:
        from ray._private.worker import _global_node

        return os.path.join(_global_node.get_logs_dir_path(), "apao_driver.log")
    except (ImportError, AttributeError):
        return None


def cluster_cpus() -> float:
    """CPUs of the whole Ray cluster joined (the local machine's when Ray runs locally)."""
    import ray

    return float(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
