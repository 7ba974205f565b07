"""What a Ray of its own costs each study, against joining one running cluster: the numbers behind the
test-suite time target's "the end-to-end tests share one local Ray cluster where they can".

Three measurements, each in fresh processes, alternated over ``--repeats`` rounds (medians printed):
- ``local``: a driver starts a local Ray as a study does (``address="local"``, no dashboard), runs one task,
  shuts it down. Wall time per phase and CPU: the driver's own and its reaped children's (Ray's processes; a
  lower bound: the workers, orphaned when their raylet stops, are not counted).
- ``join``: the same driver joins a ``ray start --head`` cluster started once for the rounds.
- ``cluster``: that cluster's processes (one session; Linux ``/proc``): the CPU they took to come up, and
  their CPU per minute while idle over ``--idle-seconds``.
A shared cluster saves a study the ``local`` costs less the ``join`` ones, and spends its idle CPU for as long
as it is up: between the studies that use it, to the end of the session.

    python benchmarks/bench_ray_start.py --repeats 3 --json-out benchmarks/results/ray_start_<machine>.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DRIVER = r"""
import json, os, resource, sys, time
start = time.time()
import ray
address = sys.argv[1]
if address == "local":
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
else:
    ray.init(address=address, logging_level="ERROR")
up = time.time()
ray.get(ray.remote(num_cpus=1)(lambda: os.getpid()).remote())
ran = time.time()
ray.shutdown()
done = time.time()
me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"init_s": up - start, "task_s": ran - up, "shutdown_s": done - ran, "wall_s": done - start,
                  "driver_cpu_s": me.ru_utime + me.ru_stime, "children_cpu_s": children.ru_utime + children.ru_stime}))
"""
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
       "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def driver(address: str) -> dict:
    done = subprocess.run([sys.executable, "-c", DRIVER, address], capture_output=True, text=True, env=ENV,
                          timeout=300, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def session_cpu(sid: int) -> tuple[float, int]:
    """CPU seconds (user + system) of every live process of session ``sid``, and how many there are."""
    ticks, count = 0, 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of stat (session), 4th after the command
            ticks, count = ticks + int(fields[11]) + int(fields[12]), count + 1
    return ticks / os.sysconf("SC_CLK_TCK"), count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    from apao_ray.hardware import cpu_description
    from apao_ray.study.cluster.ray_cluster import stable_free_port

    port = stable_free_port()  # outside the range Ray's own processes bind port 0 in
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             f"--port={port}", "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats"],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.time() + 120
        while subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{address}', logging_level='ERROR')"],
                             env=ENV, capture_output=True, timeout=120).returncode != 0:
            assert head.poll() is None and time.time() < deadline, "the head node did not come up"
            time.sleep(1)
        time.sleep(5)  # its start-up settles
        start_cpu, processes = session_cpu(head.pid)
        rows: dict[str, list[dict]] = {"local": [], "join": []}
        for _ in range(args.repeats):
            for kind in rows:
                rows[kind].append(driver("local" if kind == "local" else address))
        before, _ = session_cpu(head.pid)
        time.sleep(args.idle_seconds)
        after, _ = session_cpu(head.pid)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
    result = {"cpu": cpu_description(), "repeats": args.repeats,
              **{kind: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for kind, runs in rows.items()},
              "cluster": {"processes": processes, "start_cpu_s": start_cpu,
                          "idle_cpu_s_per_min": (after - before) * 60 / args.idle_seconds}}
    print(f"CPU: {result['cpu']}; medians of {args.repeats}")
    print(f"{'':6} {'init s':>7} {'task s':>7} {'shutdown s':>10} {'wall s':>7} {'driver CPU s':>12} {'children CPU s':>14}")
    for kind in rows:
        r = result[kind]
        print(f"{kind:6} {r['init_s']:7.2f} {r['task_s']:7.2f} {r['shutdown_s']:10.2f} {r['wall_s']:7.2f} "
              f"{r['driver_cpu_s']:12.2f} {r['children_cpu_s']:14.2f}")
    cluster = result["cluster"]
    print(f"cluster: {cluster['processes']} processes, {cluster['start_cpu_s']:.1f} CPU-s to come up, "
          f"{cluster['idle_cpu_s_per_min']:.2f} CPU-s per minute idle")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
