"""Screenshots of what a user looks at after a study, taken the way a user opens them.

Runs a small --smoke study (tiger x {ce, apao_pointwise}, 4 trials, 3 epochs) into a temporary directory,
serves its MLflow store (``mlflow server``, job execution off) and its Optuna storage (``optuna-dashboard``)
on 127.0.0.1, opens each page in headless Chromium and writes into ``docs/``:

  mlflow_runs_table.png     the link the study prints: the runs table with its metric columns
  mlflow_study_page.png     the study's parent run: the answer table in its description, 1600 px wide
  mlflow_child_run.png      an APAO trial's run: its params, metrics and logged models
  mlflow_prefix_recall.png  that trial's per-prefix recall chart (one line per selection rule)
  mlflow_model_page.png     that trial's logged model: its params and test metrics
  mlflow_registered_model.png  the registered @best version: its description and tags
  optuna_dashboard.png      optuna-dashboard's study page: the named objective, what it says of importance
  optuna_dashboard_note.png  its note page: the study's answer table
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
    """Runs the study and ``best`` (which registers each method's best trial); returns the study's stdout (the
    table, the Optuna summary, the MLflow link)."""
    command = [sys.executable, "-m", "apao_ray", "sweep", "--smoke", "--epochs", "3", "--lr", "2e-3",
               "--output-dir", str(directory / "runs"), "--tracking-uri", f"sqlite:///{directory}/mlflow.db"]
    print("running", " ".join(command[1:]), file=sys.stderr)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"the study failed:\n{result.stderr[-3000:]}")
    best = subprocess.run([sys.executable, "-m", "apao_ray", "best", "--tracking-uri", f"sqlite:///{directory}/mlflow.db"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # registers each method's @best
    if best.returncode != 0:
        raise RuntimeError(f"best failed:\n{best.stderr[-3000:]}")
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


@contextmanager
def study_servers(directory: Path, stdout: str) -> Iterator[tuple[str, str, str]]:
    """Serves the study's MLflow store (``mlflow server``, job execution off) and its Optuna storage
    (``optuna-dashboard``) on 127.0.0.1 until the block ends; yields the runs link the study printed (pointed at
    that server), the MLflow server's and optuna-dashboard's base URLs."""
    link = re.search(r"then open (http://\S+)", stdout)
    dashboard = re.search(r"optuna-dashboard (sqlite:///\S+)", stdout)
    if not link or not dashboard:
        raise RuntimeError(f"the study printed no MLflow link or optuna-dashboard command:\n{stdout[-2000:]}")
    mlflow_port, optuna_port = free_port(), free_port()
    mlflow_base, optuna_base = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{optuna_port}"
    dashboard_binary = shutil.which("optuna-dashboard") or str(Path(sys.executable).parent / "optuna-dashboard")
    with serving([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{directory}/mlflow.db",
                  "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"],
                 f"{mlflow_base}/health", {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}), \
            serving([dashboard_binary, dashboard.group(1), "--host", "127.0.0.1", "--port", str(optuna_port)],
                    f"{optuna_base}/api/meta"):
        yield link.group(1).replace("http://127.0.0.1:5000", mlflow_base), mlflow_base, optuna_base


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
        runs_url, mlflow_base, optuna_base = stack.enter_context(study_servers(directory, stdout))
        browser = stack.enter_context(Browser(width=1600, height=1000))
        take_screenshots(browser, directory, runs_url, mlflow_base, optuna_base)
    return 0


def open_mlflow_ui(browser: Browser, mlflow_base: str) -> None:
    """Opens the MLflow UI's origin and sets its remembered choices (the assistant panel closed), then loads the
    app again so that it reads them: a fresh browser's first visit opens the panel over a third of the page."""
    browser.open(mlflow_base, wait_for="Experiments", settle=2)
    browser.set_local_storage(MLFLOW_BROWSER_STATE)
    browser.call("Page.reload")
    browser.wait_for_text("Experiments")
    time.sleep(1)


def study_page_layout(browser: Browser, mlflow_base: str, experiment_id: str, parent_run_id: str) -> dict:
    """Opens the study's parent run as its link does, at the browser's width; returns the answer table's header
    cells (``headers``: the description's table that has a verdict column), where that table ends
    (``table_right``, px), where "About this run" begins (``about_left``) and the view's width (``width``)."""
    browser.open(f"{mlflow_base}/#/experiments/{experiment_id}/runs/{parent_run_id}?workflowType=machine_learning",
                 wait_for="About this run", settle=3)
    return browser.evaluate("""(() => {
        const answer = [...document.querySelectorAll('table')].find(
            t => [...t.querySelectorAll('th')].some(th => th.innerText.trim() === 'verdict'));
        const about = [...document.querySelectorAll('*')].find(
            e => e.childElementCount === 0 && (e.textContent || '').trim() === 'About this run');
        return {headers: answer ? [...answer.querySelectorAll('th')].map(th => th.innerText.trim()) : [],
                table_right: answer ? answer.getBoundingClientRect().right : null,
                about_left: about ? about.getBoundingClientRect().left : null, width: window.innerWidth};
    })()""")


def study_pages(directory: Path, stdout: str, width: int = 1600) -> dict:
    """What a user sees of a finished study in a browser ``width`` px wide: the parent run's page
    (``study_page_layout``) and whether optuna-dashboard's study page shows the study's note (``note_shown``:
    its note page holds the answer table's header and first method)."""
    from apao_ray.tracking import Tracker

    tracker = Tracker(f"sqlite:///{directory}/mlflow.db", "apao-synthetic")
    (parent,) = tracker.client.search_runs([tracker.experiment_id], "tags.`apao.role` = 'study'")
    method_row = next(line for line in parent.data.tags["mlflow.note.content"].splitlines()
                      if line.startswith("| tiger/"))
    first_method = method_row.split("|")[1].strip()
    with study_servers(directory, stdout) as (_, mlflow_base, optuna_base), Browser(width=width, height=1000) as browser:
        open_mlflow_ui(browser, mlflow_base)
        facts = study_page_layout(browser, mlflow_base, tracker.experiment_id, parent.info.run_id)
        browser.open(f"{optuna_base}/dashboard/studies/1/note", settle=2)
        try:
            browser.wait_for_text(first_method, timeout=20)
        except TimeoutError:
            pass
        text = browser.evaluate("document.body.innerText")
        facts["note_shown"] = "verdict" in text and first_method in text
    return facts


def take_screenshots(browser: Browser, directory: Path, runs_url: str, mlflow_base: str, optuna_base: str) -> None:
    from apao_ray.tracking import Tracker

    tracker = Tracker(f"sqlite:///{directory}/mlflow.db", "apao-synthetic")
    children = tracker.child_runs(filter_string="attributes.status = 'FINISHED'")
    apao = max((run for run in children if run.data.tags["loss"] == "apao_pointwise"),
               key=lambda run: run.data.metrics["best/val/ndcg_at_10"])
    model_id = apao.data.tags["apao.model_uri"].removeprefix("models:/")  # the trial's own rule's model
    experiment = tracker.experiment_id
    (parent,) = tracker.client.search_runs([experiment], "tags.`apao.role` = 'study'")

    def open_mlflow(url: str, wait_for: str) -> None:
        # a new hash is no new page load: a reload here would drop the runs table's shared view (the UI
        # reads it only when the URL holds no search facets, and it writes them into the URL)
        for _ in range(3):
            browser.open(url, wait_for=wait_for, settle=3)
            if ASSISTANT_TEXT not in browser.evaluate("document.body.innerText"):
                return
            open_mlflow_ui(browser, mlflow_base)
        raise RuntimeError(f"the MLflow assistant panel stays open on {url}")

    open_mlflow_ui(browser, mlflow_base)  # the origin whose storage the UI reads
    browser.resize(2300, 560)  # every column of the view: the parent's per-method results, then each trial's
    open_mlflow(runs_url, "study synthetic-study")
    browser.evaluate("document.querySelector('.ag-row button')?.click()")  # the study row's expander
    browser.wait_for_text("tiger/ce")
    time.sleep(1.5)
    save(browser, "mlflow_runs_table.png")

    browser.resize(1600, 1000)
    layout = study_page_layout(browser, mlflow_base, experiment, parent.info.run_id)
    print(f"study page: answer table ends at {layout['table_right']:.0f} px of {layout['width']}", file=sys.stderr)
    save(browser, "mlflow_study_page.png")

    browser.resize(1600, 1900)  # down to its logged models
    open_mlflow(f"{mlflow_base}/#/experiments/{experiment}/runs/{apao.info.run_id}?workflowType=machine_learning",
                "Parameters")
    save(browser, "mlflow_child_run.png")

    browser.resize(1600, 1000)
    open_mlflow(f"{mlflow_base}/#/experiments/{experiment}/runs/{apao.info.run_id}/artifacts/prefix_recall.png"
                "?workflowType=machine_learning",
                "prefix_recall.png")
    save(browser, "mlflow_prefix_recall.png")

    browser.resize(1600, 1100)
    open_mlflow(f"{mlflow_base}/#/experiments/{experiment}/models/{model_id}?workflowType=machine_learning",
                "Metrics")
    save(browser, "mlflow_model_page.png")

    registered = tracker.client.search_model_versions("name = 'apao-synthetic-tiger-apao_pointwise'")
    if registered:  # sweep registers each method's best trial as @best
        version = max(registered, key=lambda v: int(v.version))
        open_mlflow(f"{mlflow_base}/#/models/{version.name}/versions/{version.version}", "Tags")
        save(browser, "mlflow_registered_model.png")

    browser.resize(1600, 1700)
    browser.open(f"{optuna_base}/dashboard/studies/1", wait_for="val/ndcg_at_10", settle=3)
    save(browser, "optuna_dashboard.png")
    browser.resize(1600, 1000)
    browser.open(f"{optuna_base}/dashboard/studies/1/note", wait_for="verdict", settle=2)
    save(browser, "optuna_dashboard_note.png")
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
