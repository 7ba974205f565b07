"""Screenshots of what a user looks at after a study, taken the way a user opens them.

Runs a small --smoke study (tiger x {ce, apao_pointwise}, 4 trials, 3 epochs) into a temporary directory,
serves its MLflow store (``mlflow server``, job execution off) and its Optuna storage (``optuna-dashboard``)
on 127.0.0.1, opens each page in headless Chromium and writes into ``docs/``:

  mlflow_runs_table.png     the link the study prints: the runs table with its metric columns
  mlflow_child_run.png      an APAO trial's run: its params, metrics and logged model
  mlflow_model_page.png     that trial's logged model: its params and test metrics
  optuna_dashboard.png      optuna-dashboard's study page: the named objective, what it says of importance
  optuna_dashboard_trial.png  its trials page: the CE baseline's trial (no knobs) with its attributes

    ./apao python docs/make_screenshots.py [--study-dir DIR]   (a study this script ran in DIR is reused)

Needs chromium (``apt-get install chromium``) and optuna-dashboard (``pip install -e '.[dashboard]'``). Run it
under the shared lock on a shared machine: the study trains for a minute or two.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser import Browser  # noqa: E402

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
MAX_BYTES = 300_000
# the MLflow UI's remembered choices (its useLocalStorage keys, "<key>_v<version>"): without them a fresh
# browser opens the assistant panel over a third of the page on its first visit
ASSISTANT_TEXT = "Ask questions about your"  # the open assistant panel's greeting
MLFLOW_BROWSER_STATE = {"mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True, "mlflow.assistant.panelOpen_v1": False}


def run_study(directory: Path) -> str:
    """Runs the study; returns its stdout (the table, the Optuna summary, the MLflow link)."""
    command = [sys.executable, "-m", "apao_ray", "sweep", "--smoke", "--epochs", "3", "--lr", "2e-3",
               "--output-dir", str(directory / "runs"), "--tracking-uri", f"sqlite:///{directory}/mlflow.db"]
    print("running", " ".join(command[1:]), file=sys.stderr)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"the study failed:\n{result.stderr[-3000:]}")
    (directory / "stdout.txt").write_text(result.stdout)
    return result.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(command: list[str], health_url: str, env: dict[str, str] | None = None) -> Iterator[None]:
    """Runs a server until the block ends; waits until ``health_url`` answers 200."""
    process = subprocess.Popen(command, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(health_url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[2:4]} did not start: {process.stderr.read()[-2000:] if process.stderr else ''}")
            time.sleep(0.5)
        yield
    finally:
        process.terminate()  # its own session: the server's workers go with it
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)


def save(browser: Browser, name: str) -> None:
    path = DOCS / name
    size = browser.screenshot(str(path))
    print(f"{path.relative_to(ROOT)}: {size // 1000} KB", file=sys.stderr)
    if size > MAX_BYTES:
        raise RuntimeError(f"{path} is {size} bytes, over {MAX_BYTES}: make the window smaller")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study-dir", type=Path, help="where to run the study (default: a temporary directory); "
                        "one that holds a study this script ran is reused")
    args = parser.parse_args(argv)
    if shutil.which("optuna-dashboard") is None and not (Path(sys.executable).parent / "optuna-dashboard").exists():
        parser.error("optuna-dashboard is not installed: pip install -e '.[dashboard]'")
    with ExitStack() as stack:
        directory = args.study_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="apao-shots-")))
        directory.mkdir(parents=True, exist_ok=True)
        stdout = (directory / "stdout.txt").read_text() if (directory / "stdout.txt").exists() else run_study(directory)
        link = re.search(r"then open (http://\S+)", stdout)
        dashboard = re.search(r"optuna-dashboard (sqlite:///\S+)", stdout)
        if not link or not dashboard:
            raise RuntimeError(f"the study printed no MLflow link or optuna-dashboard command:\n{stdout[-2000:]}")
        mlflow_port, optuna_port = free_port(), free_port()
        mlflow_base = f"http://127.0.0.1:{mlflow_port}"
        stack.enter_context(serving(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{directory}/mlflow.db",
             "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"],
            f"{mlflow_base}/health", {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}))
        dashboard_binary = shutil.which("optuna-dashboard") or str(Path(sys.executable).parent / "optuna-dashboard")
        stack.enter_context(serving([dashboard_binary, dashboard.group(1), "--host", "127.0.0.1",
                                     "--port", str(optuna_port)], f"http://127.0.0.1:{optuna_port}/api/meta"))
        browser = stack.enter_context(Browser(width=1600, height=1000))
        take_screenshots(browser, directory, link.group(1).replace("http://127.0.0.1:5000", mlflow_base),
                         mlflow_base, f"http://127.0.0.1:{optuna_port}")
    return 0


def take_screenshots(browser: Browser, directory: Path, runs_url: str, mlflow_base: str, optuna_base: str) -> None:
    from apao_ray.tracking import Tracker

    tracker = Tracker(f"sqlite:///{directory}/mlflow.db", "apao-synthetic")
    children = tracker.child_runs(filter_string="attributes.status = 'FINISHED'")
    apao = max((run for run in children if run.data.tags["loss"] == "apao_pointwise"),
               key=lambda run: run.data.metrics["best/val/ndcg_at_10"])
    (model,) = apao.outputs.model_outputs
    experiment = tracker.experiment_id

    def close_assistant() -> None:
        """A fresh browser's first visit opens the assistant panel and remembers it: the choice is overwritten
        and the app loaded again, so that it reads the choice."""
        browser.set_local_storage(MLFLOW_BROWSER_STATE)
        browser.call("Page.reload")
        browser.wait_for_text("Experiments")
        time.sleep(1)

    def open_mlflow(url: str, wait_for: str) -> None:
        # a new hash is no new page load: a reload here would drop the runs table's shared view (the UI
        # reads it only when the URL holds no search facets, and it writes them into the URL)
        for _ in range(3):
            browser.open(url, wait_for=wait_for, settle=3)
            if ASSISTANT_TEXT not in browser.evaluate("document.body.innerText"):
                return
            browser.open(mlflow_base, wait_for="Experiments", settle=1)
            close_assistant()
        raise RuntimeError(f"the MLflow assistant panel stays open on {url}")

    browser.open(mlflow_base, wait_for="Experiments", settle=2)  # the origin whose storage the UI reads
    close_assistant()
    browser.resize(2300, 560)  # every column of the view: the parent's per-method results, then each trial's
    open_mlflow(runs_url, "study synthetic-study")
    browser.evaluate("document.querySelector('.ag-row button')?.click()")  # the study row's expander
    browser.wait_for_text("tiger/ce")
    time.sleep(1.5)
    save(browser, "mlflow_runs_table.png")

    browser.resize(1600, 1900)  # down to its logged model
    open_mlflow(f"{mlflow_base}/#/experiments/{experiment}/runs/{apao.info.run_id}?workflowType=machine_learning",
                "Parameters")
    save(browser, "mlflow_child_run.png")

    browser.resize(1600, 1100)
    open_mlflow(f"{mlflow_base}/#/experiments/{experiment}/models/{model.model_id}?workflowType=machine_learning",
                "Metrics")
    save(browser, "mlflow_model_page.png")

    browser.resize(1600, 1700)
    browser.open(f"{optuna_base}/dashboard/studies/1", wait_for="val/ndcg_at_10", settle=3)
    save(browser, "optuna_dashboard.png")
    import optuna

    trials = optuna.load_study(study_name="apao-synthetic/synthetic-study", storage=f"sqlite:///{directory}/optuna.db").trials
    baseline = next(trial.number for trial in trials if trial.user_attrs.get("loss") == "ce")
    browser.resize(1600, 1000)
    browser.open(f"{optuna_base}/dashboard/studies/1/trials", wait_for="mlflow_run_id", settle=1)
    browser.click_text(f"Trial {baseline}", selector="span, p, div")
    browser.wait_for_text(f"Trial {baseline} (trial_id=")
    time.sleep(1)
    save(browser, "optuna_dashboard_trial.png")


if __name__ == "__main__":
    sys.exit(main())
