"""apao_ray/paths.py: the commands a study prints run as printed, from any directory."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

from apao_ray.paths import apao_command, tool_command


def test_a_printed_apao_command_runs_from_another_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"  # a plain shell: no venv on PATH
    done = subprocess.run([*shlex.split(apao_command()), "best", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--study-name" in done.stdout


def test_a_tool_not_installed_yet_is_named_where_its_extra_installs_it(tmp_path):
    """The printed optuna-dashboard line must work once the printed install ran: the environment's scripts
    folder, never a bare name that a shell without the venv on PATH cannot find."""
    assert tool_command("apao-no-such-tool") == shlex.quote(str(Path(sysconfig.get_path("scripts")) / "apao-no-such-tool"))
    mlflow = shlex.split(tool_command("mlflow"))
    assert Path(mlflow[0]).is_absolute() and Path(mlflow[0]).parent in {Path(sys.executable).parent,
                                                                          Path(sysconfig.get_path("scripts"))}
    done = subprocess.run([*mlflow, "--version"], cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "mlflow" in done.stdout.lower(), done.stderr[-2000:]
