"""Signals and scheduling around a study's driver and its local Ray: a stop signal's handler, niceness and
autogroups, thread caps, a busy second Ray. A study stopped by SIGINT to its process group and by SIGTERM to
its driver alone, then resumed, is tests/test_sweep.py's fixture. Real Ray, a real SQLite MLflow store, real
signals, the --smoke configuration."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import SWEEP, mlflow_sqlite, run_script


@pytest.mark.e2e
def test_the_local_rays_workers_run_at_the_drivers_niceness_and_its_dashboard_starts_when_asked():
    """Ray starts workers at niceness +15, which beside an ordinary process on a busy CPU leaves a trial
    ~1/28 of a core instead of an even share; the product's local Ray keeps the driver's niceness. Run under
    `nice -n 3`: workers must be at 3 (relative to the driver), and at 3 + 5 when the user sets Ray's own variable.
    The same two Rays: a study's (no dashboard, ~1.1 GiB saved) and `apao train`'s (a dashboard on loopback).
    Both start while another process holds Ray's fixed dashboard-agent port, as a second Ray on the machine
    does: their agents must serve on a port of their own, not wait ~3.3 s for that one and run without it."""
    import subprocess

    from conftest import ROOT

    code = ("import os, sys, ray, ray._private.worker as w; from apao_ray.study.cluster.ray_cluster import init_ray; "
            "init_ray(None, num_cpus=1, dashboard=sys.argv[1] == 'on'); "
            "print(os.nice(0), ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote()), "
            "repr(w.get_dashboard_url()), w.global_worker.node.dashboard_agent_listen_port); ray.shutdown()")
    group = Path("/proc/self/autogroup")  # "/autogroup-208 nice 0"; absent or empty where autogroups are not

    def session_group():
        return group.read_text().strip() if group.exists() else None

    ours = session_group()
    with socket.socket() as another_ray:
        with contextlib.suppress(OSError):  # already held where another Ray runs here: the same situation
            another_ray.bind(("0.0.0.0", 52365))  # Ray's DEFAULT_DASHBOARD_AGENT_LISTEN_PORT
            another_ray.listen()
        for user_value, dashboard, expected in ((None, "off", "3 3 ''"), ("5", "on", "3 8 '127.0.0.1:")):
            env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
            if user_value is not None:
                env["RAY_worker_niceness"] = user_value
            # a session of its own: a niced run gives its session's scheduling group its niceness (autogroups),
            # and the suite's session must keep its own
            result = subprocess.run(["nice", "-n", "3", sys.executable, "-c", code, dashboard], cwd=ROOT, env=env,
                                    capture_output=True, text=True, timeout=180, start_new_session=True)
            assert result.returncode == 0, result.stderr[-3000:]
            line = result.stdout.split("\n")[-2].strip()
            assert line.startswith(expected), (user_value, result.stdout, result.stderr[-2000:])
            agent_port = int(line.split()[-1])
            assert agent_port > 0 and agent_port != 52365, (line, "the agent has no HTTP port of its own")
    assert session_group() == ours  # the suite's session untouched


@pytest.mark.skipif(not os.access("/proc/self/autogroup", os.W_OK) or shutil.which("setsid") is None,
                    reason="no Linux autogroups here (or no setsid)")
def test_a_niced_run_gives_its_own_session_its_niceness_and_never_raises_a_groups_priority():
    """Under autogroups `nice` alone orders processes only inside one session; the driver carries its niceness
    to its session's group. In a session of its own (setsid), so the suite's own session keeps its weight:
    a process at niceness 3 sets the group to 3; a group already at 5 stays 5; an un-niced one is left alone."""
    import subprocess

    from conftest import ROOT

    code = ("import sys; from apao_ray.study.cluster.ray_cluster import AUTOGROUP, match_session_niceness as m; "
            "open(AUTOGROUP, 'w').write(sys.argv[1]) if sys.argv[1] != '-' else None; "
            "said = m(); print(said is not None, AUTOGROUP.read_text().split()[-1])")
    enabled = Path("/proc/sys/kernel/sched_autogroup_enabled")
    if not enabled.exists() or enabled.read_text().strip() != "1" or not Path("/proc/self/autogroup").read_text().strip():
        pytest.skip("autogroup scheduling is off on this kernel")
    for nice, preset, expected in (("3", "-", "True 3"), ("3", "5", "False 5"), ("0", "-", "False 0")):
        result = subprocess.run(["setsid", "nice", "-n", nice, sys.executable, "-c", code, preset], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == expected, (nice, preset, result.stdout, result.stderr)


def test_a_study_raises_tunes_slow_step_warning_threshold_unless_the_user_set_one():
    """Tune warns of any controller step over 0.5 s (every step, where all CPUs train) and reads its variable when
    ray.tune is imported, which in a study comes before Ray starts: the threshold is raised where Tune keeps it; a
    user's TUNE_WARN_THRESHOLD_S wins."""
    import os
    import subprocess

    from conftest import ROOT

    code = ("import os, ray.tune; from ray.tune.utils.util import warn_if_slow as w; "
            "from apao_ray.study.cluster.ray_cluster import quiet_slow_step_warnings as q; "
            "print(w.DEFAULT_THRESHOLD, q(), w('step').threshold, os.environ['TUNE_WARN_THRESHOLD_S'])")
    env = {k: v for k, v in os.environ.items() if k != "TUNE_WARN_THRESHOLD_S"}
    for user, expected in ((None, "0.5 5.0 5.0 5.0"), ("0.25", "0.25 0.25 0.25 0.25")):
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                                env={**env, **({"TUNE_WARN_THRESHOLD_S": user} if user else {})})
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip() == expected, (user, result.stdout)


def test_limit_threads_caps_both_torch_pools_and_the_thread_env_of_a_fresh_worker():
    """In a fresh process, as a Ray Train worker starts: torch's intra-op and inter-op pools and the
    OpenMP/MKL/OpenBLAS variables all take the reserved CPU count (torch defaults to every core)."""
    import subprocess

    from conftest import ROOT

    code = ("import os, torch; from apao_ray.training.worker import limit_threads, THREAD_ENV_VARS; limit_threads(1); "
            "print(torch.get_num_threads(), torch.get_num_interop_threads(), *(os.environ[v] for v in THREAD_ENV_VARS))")
    env = {key: value for key, value in os.environ.items() if not key.endswith("_NUM_THREADS")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**env, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1"] * 5, result.stdout


BUSY_RAY = """
import sys, time
import ray
ray.init(address="local", num_cpus=1, include_dashboard=False)  # another Ray on the machine, as a studies/train.py run is
print("ready", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:  # and one core kept busy
    pass
"""


@pytest.mark.e2e
def test_beside_a_busy_ray_process_pruned_trials_free_their_cpus_and_are_tested_on_their_best_checkpoint(tmp_path):
    """Three APAO-pointwise trials one after the other, ASHA's rung at epoch 1, while another process runs
    its own Ray and keeps a core busy (bounded in time). The paper's setting runs first; a trial below it
    at epoch 1 is pruned and must free its CPU for the next (Ray Train's placement-group cleaner cannot
    find its cluster among two unless told), is recorded as pruned, and is tested on its best checkpoint.
    Every trial trains on one intra-op and one inter-op thread, the CPU it reserved."""
    import subprocess

    busy = subprocess.Popen([sys.executable, "-c", BUSY_RAY, "500"], stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline().strip() == "ready"
        uri = mlflow_sqlite(tmp_path)
        result = run_script([SWEEP, "--smoke", "--losses", "apao_pointwise", "--num-samples", "3", "--epochs", "3",
                             "--asha-grace-period", "1", "--max-concurrent", "1", "--cpus-per-trial", "1",
                             "--output-dir", str(tmp_path / "runs"),
                             # the paper's beta (0.3) runs first; the others draw beta up to 1000, which the
                             # epoch-1 rung must cut (a prefix loss 1000x CE swamps the next-item signal)
                             "--beta", "0.3:1000", "--tracking-uri", uri], cwd=tmp_path, timeout=540)
    finally:
        busy.terminate()  # Ray's SIGTERM handler exits and shuts its processes down
        busy.wait(timeout=60)
    assert result.returncode == 0, result.stderr[-4000:]
    from apao_ray.tracking import Tracker

    tracker = Tracker(uri, "apao-synthetic")
    children = tracker.child_runs()
    pruned = [run for run in children if run.info.status == "KILLED"]
    assert len(children) == 3 and pruned, [run.data.tags["apao.outcome"] for run in children]
    for run in pruned:
        epoch = int(run.data.tags["apao.pruned_epoch"])
        assert run.data.tags["apao.outcome"] == f"pruned at epoch {epoch}"
        # every epoch up to the pruning is logged (Tune marks the stopped epoch's report done=True)
        assert [step for step, _ in tracker.metric_history(run.info.run_id, "val/ndcg_at_10")] == list(range(1, epoch + 1))
        tested = tracker.metric_history(run.info.run_id, "test/ndcg_at_10")
        assert len(tested) == 1 and 1 <= tested[0][0] <= epoch  # the best epoch before pruning
        assert run.data.tags["apao.tested_on"] == f"its best checkpoint before pruning (epoch {tested[0][0]})"
    for run in children:
        assert run.data.metrics["perf/torch_threads"] == run.data.metrics["perf/torch_interop_threads"] == 1
        # the worker's scratch directory is gone, also where the scheduler killed the worker
        trial_id = run.data.tags["apao.trial_id"]
        assert not list(Path(tempfile.gettempdir()).glob(f"apao-worker-train-trial_id_{trial_id}-*")), trial_id
    assert "pruned at epoch" in result.stderr


def _handler_exiting(code: int):
    def handler(signum, frame):  # as Ray's: a SIGINT handler that exits (Ray Train's fit), a SIGTERM one (ray.init)
        sys.exit(code)
    return handler


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 1), (signal.SIGTERM, 15)])
def test_a_stop_signal_ends_a_train_run_as_interrupted_whatever_handler_exits(signum, code):
    """`train` exits 130 / 143 on SIGINT / SIGTERM although Ray's handlers end its fit with SystemExit(1 or 15)."""
    from apao_ray.study.cluster.interrupt import RunInterrupted, stop_signals_end_the_run

    sigterm_before = signal.getsignal(signal.SIGTERM)
    previous = signal.signal(signal.SIGINT, _handler_exiting(code))  # SIGTERM: the context's own handler unwinds
    try:
        with pytest.raises(RunInterrupted) as stopped, stop_signals_end_the_run():
            os.kill(os.getpid(), signum)
            for _ in range(100):  # the handler runs between bytecodes of the main thread
                time.sleep(0.01)
        assert stopped.value.signum == signum and str(stopped.value) == signal.Signals(signum).name
        with pytest.raises(SystemExit) as other, stop_signals_end_the_run():  # an exit no signal caused stays one
            sys.exit(3)
        assert other.value.code == 3
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGTERM) is sigterm_before and signal.set_wakeup_fd(-1) == -1  # both restored
