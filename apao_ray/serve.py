"""``python -m apao_ray serve MODEL_URI``: a logged recommender behind MLflow's own scoring server.

Runs ``mlflow models serve -m MODEL_URI --env-manager local`` with this environment's ``bin``
first on PATH: MLflow starts the server as a ``uvicorn`` command looked up on PATH, so a bare
``.venv/bin/mlflow models serve`` outside the activated environment fails (exit 127).

    POST /invocations  {"dataframe_records": [{"history": ["12", "7", "301"]}], "params": {"k": 10}}
    -> {"predictions": [{"items": ["88", "5", ...], "scores": [-1.23, -2.01, ...]}]}

A bad request (unknown item ids, an empty history, no ``history`` column, k out of range) gets
HTTP 400 whose ``message`` names the bad value and what is allowed. ``GET /ping`` says when it is up.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .paths import add_tracking_uri_argument


def serve_command(model_uri: str, host: str, port: int, workers: int) -> list[str]:
    """MLflow's own command line for the scoring server, run by this interpreter."""
    return [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "--env-manager", "local",
            "--host", host, "--port", str(port), "--workers", str(workers)]


def _run(args: argparse.Namespace) -> int:
    from .tracking import TRACKING_URI_ENV, check_tracking_uri, require_model, resolve_tracking_uri

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be between 0 and 65535")
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers} must be >= 1")
    tracking_uri = resolve_tracking_uri(args.tracking_uri)
    check_tracking_uri(tracking_uri)
    require_model(args.model_uri, tracking_uri)  # fail here, naming the URI, not in a server's traceback
    # not resolve(): a venv's python is a symlink to the base interpreter, whose bin has no uvicorn
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, TRACKING_URI_ENV: tracking_uri,
           "PATH": os.pathsep.join(filter(None, [bin_dir, os.environ.get("PATH")]))}
    print(f"[apao] serving {args.model_uri} at http://{args.host}:{args.port}/invocations (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    command = serve_command(args.model_uri, args.host, args.port, args.workers)
    os.execve(command[0], command, env)  # MLflow's CLI takes over this process: signals reach it directly
    return 0  # not reached


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``serve`` to ``python -m apao_ray``."""
    parser = subparsers.add_parser("serve", help="a logged model behind MLflow's scoring server (POST /invocations)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_uri", metavar="MODEL_URI", help="models:/<name>@best, runs:/<run id>/model, or a "
                        "downloaded model directory (one holding an MLmodel file)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default %(default)s; "
                        "0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=5001, help="port (default %(default)s; an MLflow UI "
                        "usually holds 5000)")
    parser.add_argument("--workers", type=int, default=1, help="server processes, each holding the model "
                        "(default %(default)s)")
    add_tracking_uri_argument(parser, "where a models:/ or runs:/ URI is looked up")
    parser.set_defaults(handler=_run)
