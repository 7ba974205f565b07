"""Where a command's CPU time goes, by kind of process: the test suite's or a study's.

Runs the command in a new session and every 0.5 s reads the CPU time (user + system) of every process that
descends from it or shares its session (Ray's processes, the trials, MLflow servers, the studies' drivers);
a process's last reading counts, so the <= 0.5 s before each exit is missed. Prints the CPU-seconds per kind
of process and writes the readings as JSON, which ``--from-json`` reads again (to compare two runs).

    python benchmarks/suite_cpu.py --json-out /tmp/suite.json -- ./apao test -p no:cacheprovider
    python benchmarks/suite_cpu.py --from-json /tmp/suite.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

# (kind, substrings of the command line, any of which marks it), first match wins
KINDS = [
    ("the busy-Ray test's CPU hog", ("while time.time() < end", "# another Ray on the machine")),
    ("Ray workers (trial actors, idle workers)", ("default_worker.py", "ray::")),
    ("Ray's own processes", ("gcs_server", "raylet", "dashboard", "log_monitor", "autoscaler/_private/monitor.py",
                             "runtime_env/agent", "bin/ray start", "multiprocessing.forkserver",
                             "multiprocessing.resource_tracker")),
    ("py-cpuinfo (CodeCarbon's CPU name)", ("cpuinfo.py",)),
    ("pytest-xdist workers (in-process tests)", ("exec(eval(sys.stdin",)),
    ("sweep drivers", ("studies/sweep.py", "apao_ray sweep")),
    ("train drivers (apao train)", ("studies/train.py", "apao_ray train")),
    ("plan probes", (".study.probe",)),
    ("MLflow servers and best.py", ("mlflow", "uvicorn", "gunicorn", "studies/best.py")),
    ("other apao_ray commands", ("-m apao_ray",)),
]


def kind(command: str) -> str:
    return next((name for name, marks in KINDS if any(mark in command for mark in marks)), "other")


def poll(command: list[str], interval: float) -> tuple[list[list], float, int]:
    """[pid, last CPU seconds, command line] of every process of the command's tree or session; wall; rc."""
    tick = os.sysconf("SC_CLK_TCK")
    process = subprocess.Popen(command, start_new_session=True)
    root, seen = process.pid, {}
    started = time.time()
    while process.poll() is None:
        parent, stats = {}, {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                text = open(f"/proc/{name}/stat").read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2:].split()
            pid = int(name)
            parent[pid] = int(fields[1])
            stats[pid] = ((int(fields[11]) + int(fields[12])) / tick, int(fields[19]), int(fields[3]))
        for pid, (cpu, start, session) in stats.items():
            ancestor = pid
            while session != root and ancestor not in (root, 0, 1) and ancestor in parent:
                ancestor = parent[ancestor]
            if session != root and ancestor != root:
                continue
            entry = seen.setdefault((pid, start), [pid, cpu, ""])
            entry[1] = cpu
            if not entry[2]:
                try:
                    entry[2] = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:300]
                except OSError:
                    pass
        time.sleep(interval)
    return list(seen.values()), time.time() - started, process.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from-json", help="print the table of readings written by an earlier run")
    parser.add_argument("--json-out", default="suite_cpu.json", help="where the readings go (default %(default)s)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between readings (default %(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.from_json:
        readings, wall, rc = json.load(open(args.from_json)), None, None
    elif command:
        readings, wall, rc = poll(command, args.interval)
        with open(args.json_out, "w") as f:
            json.dump(readings, f)
    else:
        parser.error("give a command after -- or --from-json FILE")
    totals, counts = collections.defaultdict(float), collections.Counter()
    for _, cpu, line in readings:
        totals[kind(line)] += cpu
        counts[kind(line)] += 1
    head = f"exit {rc}, wall {wall:.1f} s, " if wall is not None else ""
    print(f"{head}CPU {sum(totals.values()):.1f} s over {len(readings)} processes")
    print(f"| kind of process | processes | CPU s |\n|---|---|---|")
    for name, total in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"| {name} | {counts[name]} | {total:.1f} |")
    return 0 if rc in (0, None) else rc


if __name__ == "__main__":
    sys.exit(main())
