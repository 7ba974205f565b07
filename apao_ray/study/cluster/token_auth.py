"""Ray's token authentication, as a driver joining a cluster meets it.

Ray (2.59 on) turns token authentication on for a local Ray and writes the token to ``~/.ray/auth_token``; a
later ``ray start --head`` on that machine then requires it from every node and driver. Ray itself sends the
token only where ``RAY_AUTH_MODE=token``, never for an explicit address, and a refused driver retries for
~20 s and then says "Failed to connect", the cause hidden. Here the head is asked first (one GCS call, ms):
a cluster that wants a token this machine holds is joined in token mode; one that refuses it, or wants one this
machine lacks, is refused in one line naming the fix.

Where Ray reads the token: ``$RAY_AUTH_TOKEN``, else the file ``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

AUTH_MODE_ENV, TOKEN_ENV, TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
DEFAULT_TOKEN_FILE = "~/.ray/auth_token"
# any GCS call does: the GCS checks the token before it answers. An empty request is a valid protobuf message
PROBE_METHOD = "/ray.rpc.NodeInfoGcsService/GetClusterId"
TOKEN_FIX = (f"put the head's token in {DEFAULT_TOKEN_FILE} (mode 600) or ${TOKEN_ENV} (`ray get-auth-token` on "
             "the head prints it); docs/running.md, 'A Ray cluster'")
# Ray's logger that warns "Token authentication is enabled for this Ray cluster" at every local ray.init
AUTH_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"


def token_source() -> str:
    """Where Ray would read this machine's token from, in its order."""
    if os.environ.get(TOKEN_ENV):
        return f"${TOKEN_ENV}"
    return os.environ.get(TOKEN_PATH_ENV) or DEFAULT_TOKEN_FILE


def held_token_metadata() -> tuple[tuple[str, str], ...]:
    """This machine's Ray token as gRPC metadata (Ray's own loader, whatever RAY_AUTH_MODE says); empty without one."""
    try:
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:  # another Ray: no token auth, or another API for it
        return ()
    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()  # the environment may have changed since Ray first looked
    try:
        return tuple(loader.get_token_for_http_header(ignore_auth_mode=True).items())
    except Exception:  # noqa: BLE001 - an unreadable token file is no token; the message names where to put one
        return ()


def _answers(address: str, metadata: tuple[tuple[str, str], ...], timeout: float) -> bool | None:
    """True when the GCS at ``address`` answers, False when it refuses the token (or its absence), None when the
    question could not be asked (no gRPC, the head not answering in time: ray.init then says what it finds)."""
    try:
        import grpc
    except ImportError:
        return None
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(PROBE_METHOD)(b"", timeout=timeout, metadata=metadata)
        except grpc.RpcError as error:
            return False if error.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return True


def needs_token_mode(address: str, timeout: float = 5.0) -> bool:
    """Whether joining the Ray head at ``address`` (HOST:PORT, answering) takes Ray's token mode, which this
    machine's token then passes.

    Raises:
        ConnectionError: one line: the head wants a token and this machine has none, has another, or keeps
            token mode off (``RAY_AUTH_MODE``), naming the fix.
    """
    mode = os.environ.get(AUTH_MODE_ENV)
    metadata = held_token_metadata()
    if mode == "token" and not metadata:
        raise ConnectionError(f"{AUTH_MODE_ENV}=token but this machine holds no Ray token: {TOKEN_FIX}")
    if _answers(address, (), timeout) is not False:
        return False  # no token asked for (or nothing learnt: Ray's own error follows)
    where = f"the Ray cluster at {address!r} requires its token (Ray token authentication)"
    if mode not in (None, "token"):
        raise ConnectionError(f"{where} and {AUTH_MODE_ENV}={mode} here: unset {AUTH_MODE_ENV} or set "
                              f"{AUTH_MODE_ENV}=token, and {TOKEN_FIX}")
    if not metadata:
        raise ConnectionError(f"{where} and this machine holds none: {TOKEN_FIX}")
    if _answers(address, metadata, timeout) is False:
        raise ConnectionError(f"{where} and refused this machine's ({token_source()}): {TOKEN_FIX}")
    return True


def enable_token_mode() -> None:
    """Ray's token mode for this process and those it starts, as Ray's own ``ray.init()`` sets it for a local
    cluster (the variable, and Ray's cached config re-read: Ray may be imported already)."""
    os.environ[AUTH_MODE_ENV] = "token"
    try:
        from ray._raylet import Config
    except ImportError:
        return
    Config.initialize("")


def is_refused_token(error: BaseException) -> bool:
    """Whether a failed ``ray.init`` failed on the cluster's token (Ray hides it as the cause of a cause)."""
    while error is not None:
        if type(error).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextmanager
def local_auth_notice_to_log(log_path_of_session) -> Iterator[None]:
    """While a local Ray starts: Ray's "Token authentication is enabled for this Ray cluster" warning, printed at
    every start where ``RAY_AUTH_MODE`` is unset, goes to ``log_path_of_session()`` (a file among the Ray
    session's logs), not to the terminal. Every other warning prints as before."""
    held: list[str] = []

    def divert(record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING and record.getMessage().startswith("Token authentication is"):
            held.append(record.getMessage())
            return False
        return True

    logger = logging.getLogger(AUTH_SETUP_LOGGER)
    logger.addFilter(divert)
    try:
        yield
    finally:
        logger.removeFilter(divert)
        path = log_path_of_session() if held else None
        if path:
            with open(path, "a") as log:
                log.writelines(f"{message}\n" for message in held)
