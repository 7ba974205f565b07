"""``python -m apao_ray serve MODEL_URI``: a logged recommender behind MLflow's own scoring server.

The model is downloaded as ``mlflow models serve -m MODEL_URI --env-manager local`` does, and MLflow's
scoring app (``mlflow.pyfunc.scoring_server``) runs under uvicorn (this interpreter's, so no PATH
lookup) behind ``RequestLimits``, which bounds what one request may cost before MLflow parses it.

    POST /invocations  {"dataframe_records": [{"history": ["12", "7", "301"]}], "params": {"k": 10}}
    -> {"predictions": [{"items": ["88", "5", ...], "scores": [-1.23, -2.01, ...]}]}

A bad request (unknown item ids, an empty history, no ``history`` column, k out of range, an unknown
param, more users than ``--max-users``, a body that is not JSON) gets HTTP 400 whose ``message`` names
the bad value and what is allowed; a body over ``--max-body-bytes`` gets 413 naming the limit, and
nothing of a body is ever echoed back. Item ids may be JSON strings or integers (``1503`` is item
``"1503"``). ``GET /ping`` says when it is up.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..cli.types import positive_int
from ..paths import add_tracking_uri_argument

MODEL_PATH_ENV = "APAO_SERVE_MODEL_PATH"
MAX_BODY_ENV = "APAO_SERVE_MAX_BODY_BYTES"
MAX_USERS_ENV = "APAO_SERVE_MAX_USERS"
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~1,000 users of 20-item histories take ~200 KB
DEFAULT_MAX_USERS = 1000
INPUT_KEYS = ("dataframe_records", "dataframe_split", "inputs", "instances")  # MLflow's JSON input layouts


class RequestError(ValueError):
    """A refused request: its HTTP status and MLflow-style error code."""

    def __init__(self, status: int, message: str, code: str = "INVALID_PARAMETER_VALUE") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def _histories(payload: dict[str, Any]) -> list[Any]:
    """The ``history`` values of a JSON request in any of MLflow's layouts (one per user)."""
    data = next((payload[key] for key in INPUT_KEYS if key in payload), None)
    if isinstance(data, dict) and isinstance(data.get("data"), list):  # dataframe_split: columns + rows
        column = data.get("columns", []).index("history") if "history" in data.get("columns", []) else None
        return [row[column] if column is not None and isinstance(row, list) and column < len(row) else None
                for row in data["data"]]
    if isinstance(data, dict):  # inputs as columns: {"history": [[...], ...]}
        histories = data.get("history")
        return histories if isinstance(histories, list) else []
    if isinstance(data, list):  # records: [{"history": [...]}, ...]
        return [row.get("history") if isinstance(row, dict) else None for row in data]
    return []


def check_request(payload: Any, allowed_params: dict[str, Any], max_users: int) -> Any:
    """The request with integer item ids made strings (the catalog's ids are strings; the dataset file
    may hold them as numbers); RequestError for unknown params or more than ``max_users`` users."""
    if not isinstance(payload, dict):
        raise RequestError(400, f"the body is a JSON {type(payload).__name__}; send an object with one of "
                                f"{list(INPUT_KEYS)} and optional params")
    params = payload.get("params", {})
    if not isinstance(params, dict):
        raise RequestError(400, f"params is a JSON {type(params).__name__}; send an object with {sorted(allowed_params)}")
    unknown = sorted(set(params) - set(allowed_params))
    if unknown:
        raise RequestError(400, f"unknown params {unknown}; allowed: {sorted(allowed_params)}")
    histories = _histories(payload)
    if len(histories) > max_users:
        raise RequestError(400, f"{len(histories):,} users in one request; at most {max_users:,} (serve --max-users): "
                                "send them in several requests")
    for history in histories:
        if isinstance(history, list):
            history[:] = [str(item) if isinstance(item, int) and not isinstance(item, bool) else item
                          for item in history]
    return payload


class RequestLimits:
    """ASGI middleware in front of MLflow's app: reads a POST /invocations body up to ``max_body_bytes``
    (413 beyond), parses it once (400 for bad JSON, nothing echoed), applies ``check_request`` and hands
    MLflow the checked body; MLflow's error answers lose the request's data it puts in them (``without_echo``)."""

    def __init__(self, app: Any, allowed_params: dict[str, Any], max_body_bytes: int, max_users: int) -> None:
        self.app, self.allowed_params = app, allowed_params
        self.max_body_bytes, self.max_users = max_body_bytes, max_users

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != "/invocations" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        try:
            body = await self._read(scope, receive)
            content_type = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1").split(";")[0].strip()
            if content_type != "application/json":
                raise RequestError(415, f"content type {content_type!r}; send application/json",
                                   "INVALID_PARAMETER_VALUE")
            try:
                payload = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                where = f"at character {error.pos}" if isinstance(error, json.JSONDecodeError) else "(not UTF-8)"
                raise RequestError(400, f"the body is not valid JSON {where}: {type(error).__name__}") from None
            body = json.dumps(check_request(payload, self.allowed_params, self.max_users)).encode()
        except RequestError as error:
            return await _answer(send, error.status, {"error_code": error.code, "message": str(error)})
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if sent:  # after the body, what the server sends next (a disconnect)
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, without_echo(send))

    async def _read(self, scope: dict, receive: Any) -> bytes:
        too_large = RequestError(413, f"request body over the limit of {self.max_body_bytes:,} bytes (serve "
                                      "--max-body-bytes); send fewer users per request", "REQUEST_LIMIT_EXCEEDED")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large  # refused before reading it
        chunks, size = [], 0
        while True:
            message = await receive()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)


# MLflow's scoring server puts the request's data in front of a model's error (``Failed to predict data '<the
# histories>'. \nError: <the model's message>``): what follows the marker is the whole of what the model said
ECHO_MARKER = "\nError: "


def without_echo(send: Any) -> Any:
    """``send`` for MLflow's app whose error answers (status >= 400, JSON) keep only the model's own message of
    ``Failed to predict data '<data>'. \nError: <message>``: nothing of a request is echoed back."""
    held: dict[str, Any] = {}

    async def send_checked(message: dict) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            held["start"], held["body"] = message, b""  # answered once the whole body is here
            return
        if "start" not in held or message["type"] != "http.response.body":
            return await send(message)
        held["body"] += message.get("body", b"")
        if message.get("more_body"):
            return
        try:
            content = json.loads(held["body"])
        except (json.JSONDecodeError, UnicodeDecodeError):
            content = None
        if isinstance(content, dict) and isinstance(content.get("message"), str) and ECHO_MARKER in content["message"]:
            content["message"] = content["message"].split(ECHO_MARKER, 1)[1]
            return await _answer(send, held["start"]["status"], content)
        await send(held["start"])
        await send({"type": "http.response.body", "body": held["body"]})

    return send_checked


async def _answer(send: Any, status: int, content: dict) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def limited_app() -> RequestLimits:
    """The app the server process runs (``serve_app.py``), configured by the environment ``_run`` sets."""
    from ..tracking import SERVED_PARAMS, scoring_app  # lazy: mlflow; every command's parser imports this module

    return RequestLimits(scoring_app(os.environ[MODEL_PATH_ENV]), SERVED_PARAMS,
                         int(os.environ.get(MAX_BODY_ENV, DEFAULT_MAX_BODY_BYTES)),
                         int(os.environ.get(MAX_USERS_ENV, DEFAULT_MAX_USERS)))


def serve_command(host: str, port: int, workers: int) -> list[str]:
    """uvicorn running ``apao_ray.serving.serve_app:app`` in this interpreter."""
    return [sys.executable, "-m", "uvicorn", "apao_ray.serving.serve_app:app", "--host", host, "--port", str(port),
            "--workers", str(workers)]


def _run(args: argparse.Namespace) -> int:
    # lazy: mlflow; every command's parser imports this module
    from ..tracking import TRACKING_URI_ENV, check_tracking_uri, download_model, require_model, resolve_tracking_uri

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be between 0 and 65535")
    tracking_uri = resolve_tracking_uri(args.tracking_uri)
    check_tracking_uri(tracking_uri)
    require_model(args.model_uri, tracking_uri)  # fail here, naming the URI, not in a server's traceback
    env = {**os.environ, TRACKING_URI_ENV: tracking_uri, MODEL_PATH_ENV: download_model(args.model_uri, tracking_uri),
           MAX_BODY_ENV: str(args.max_body_bytes), MAX_USERS_ENV: str(args.max_users)}
    print(f"[apao] serving {args.model_uri} at http://{args.host}:{args.port}/invocations (Ctrl-C stops)",
          file=sys.stderr, flush=True)
    command = serve_command(args.host, args.port, args.workers)
    os.execve(command[0], command, env)  # uvicorn takes over this process: signals reach it directly
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
    parser.add_argument("--workers", type=positive_int, default=1, help="server processes, each holding the model "
                        "(default %(default)s)")
    parser.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body; a larger one gets HTTP 413 (default %(default)s)")
    parser.add_argument("--max-users", type=positive_int, default=DEFAULT_MAX_USERS,
                        help="most users (histories) in one request; more get HTTP 400 (default %(default)s)")
    add_tracking_uri_argument(parser, "where a models:/ or runs:/ URI is looked up")
    parser.set_defaults(handler=_run)
