"""Downloading a dataset for real, from a loopback HTTP mirror of ../shared/datasets.

The mirror is a ThreadingHTTPServer on 127.0.0.1 (port 0) serving a tmp copy laid out as
``<Name>/<file>``; $APAO_DATA_URL points at it. Every failure must leave nothing behind in the
download target: no partial file, no temp dir, no empty dataset folder.
"""
from __future__ import annotations

import functools
import hashlib
import shutil
import socket
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from apao_ray import paths
from apao_ray.data import files, load_dataset
from apao_ray.data.files import CHECKSUMS, download
from datasets_helpers import SHARED_DATASETS, needs_shared

pytestmark = needs_shared
OFFICE_FILES = list(CHECKSUMS["Office"])  # inter, then index: the order download fetches them


class _QuietHandler(SimpleHTTPRequestHandler):
    requests: list[str]

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.requests.append(self.path)
        super().do_GET()

    def log_message(self, *args):  # keep test output quiet
        pass


class Mirror:
    """A loopback HTTP server over ``root``; records the paths it was asked for."""

    def __init__(self, root: Path):
        self.root = root
        self.requests: list[str] = []
        handler = type("Handler", (_QuietHandler,), {"requests": self.requests})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
        self.thread.start()

    def corrupt(self, file_name: str, position: int = 1000) -> None:
        path = self.root / "Office" / file_name
        data = bytearray(path.read_bytes())
        data[position] ^= 0x01  # one byte changed
        path.write_bytes(bytes(data))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Private cache, no $APAO_DATA_DIR, empty cwd, loopback traffic never through a proxy."""
    for var in ["http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv(paths.DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path


@pytest.fixture
def mirror(tmp_path, monkeypatch, env):
    root = tmp_path / "mirror"
    (root / "Office").mkdir(parents=True)
    for name in OFFICE_FILES:
        shutil.copyfile(SHARED_DATASETS / "Office" / name, root / "Office" / name)
    server = Mirror(root)
    monkeypatch.setenv(files.DATA_URL_ENV, server.url)
    yield server
    server.close()


def cache_root(env: Path) -> Path:
    return env / "cache" / "apao_ray" / "datasets"


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*")] if root.exists() else []


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_missing_dataset_is_downloaded_into_the_cache_and_loads(mirror, env):
    dataset = load_dataset("office")
    stats = dataset.stats()
    assert (stats["users"], stats["items"], stats["interactions"]) == (4905, 2420, 53258)
    assert stats["distinct_semantic_ids"] == 2415 and stats["train_samples"] == 38543
    target = cache_root(env) / "Office"
    assert sorted(p.name for p in files_under(target)) == sorted(OFFICE_FILES)  # no temp dir left
    for name in OFFICE_FILES:
        assert sha256(target / name) == CHECKSUMS["Office"][name]
    assert sorted(mirror.requests) == sorted(f"/Office/{name}" for name in OFFICE_FILES)
    assert dataset.checksums == CHECKSUMS["Office"]
    # a second load finds the cached copy and does not download again
    assert load_dataset("OFFICE").stats()["users"] == 4905
    assert len(mirror.requests) == len(OFFICE_FILES)


def test_download_goes_to_the_explicit_data_dir(mirror, env):
    explicit = env / "explicit"
    assert load_dataset("office", data_dir=explicit).stats()["items"] == 2420
    assert sorted(p.name for p in files_under(explicit / "Office")) == sorted(OFFICE_FILES)
    assert not cache_root(env).exists()


def test_download_goes_to_apao_data_dir(mirror, env, monkeypatch):
    monkeypatch.setenv(paths.DATA_DIR_ENV, str(env / "from_env"))
    assert load_dataset("office").stats()["items"] == 2420
    assert sorted(p.name for p in files_under(env / "from_env" / "Office")) == sorted(OFFICE_FILES)
    assert not cache_root(env).exists()


@pytest.mark.parametrize("bad_file", OFFICE_FILES)
def test_corrupt_download_raises_and_leaves_no_files(mirror, env, bad_file):
    mirror.corrupt(bad_file)
    with pytest.raises(ValueError) as info:
        load_dataset("office")
    message = str(info.value)
    assert "checksum mismatch" in message and bad_file in message
    assert CHECKSUMS["Office"][bad_file] in message
    assert files_under(cache_root(env)) == []  # no partial file, no temp dir, no empty folder


def test_corrupt_download_into_existing_dir_keeps_other_contents(mirror, env):
    target = env / "target"
    (target / "Other").mkdir(parents=True)
    (target / "Other" / "keep.txt").write_text("x")
    mirror.corrupt(OFFICE_FILES[1])
    with pytest.raises(ValueError, match="checksum mismatch"):
        download("Office", target, base_url=mirror.url)
    assert sorted(files_under(target)) == [target / "Other", target / "Other" / "keep.txt"]


@pytest.mark.parametrize("missing", ["all", OFFICE_FILES[1]])
def test_http_404_is_a_connection_error_and_leaves_nothing(mirror, env, missing):
    for name in OFFICE_FILES if missing == "all" else [missing]:
        (mirror.root / "Office" / name).unlink()
    with pytest.raises(ConnectionError) as info:
        load_dataset("office")
    message = str(info.value)
    first_missing = OFFICE_FILES[0] if missing == "all" else missing
    assert f"{mirror.url}/Office/{first_missing}" in message and "404" in message
    assert "APAO_DATA_DIR" in message  # says how to do without a network
    assert files_under(cache_root(env)) == []


def test_closed_port_is_a_connection_error_and_leaves_nothing(env, monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv(files.DATA_URL_ENV, url)
    with pytest.raises(ConnectionError) as info:
        load_dataset("office")
    assert f"{url}/Office/{OFFICE_FILES[0]}" in str(info.value)
    assert files_under(cache_root(env)) == []
    with pytest.raises(ConnectionError):
        download("Office", env / "target", base_url=url, timeout=5)
    assert files_under(env / "target") == []


def test_allow_download_false_never_contacts_the_mirror(mirror, env):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_dataset("office", allow_download=False)
    assert mirror.requests == []
    assert files_under(cache_root(env)) == []


@pytest.mark.parametrize("where", ["the driver's directory", "none"])
def test_a_trial_never_downloads_and_names_where_it_looked(mirror, env, where):
    """What a Ray worker runs (run_trial) with the files missing: the trial fails naming the directory,
    and nothing is asked of the mirror, whether the driver gave a directory or (an old config) none."""
    from apao_ray.config import DataConfig, ModelConfig, TrainConfig, TrialConfig
    from apao_ray.training.hooks import TrainingHooks
    from apao_ray.training.loop import run_trial
    from apao_ray.config import TINY_MODEL

    gone = env / "moved-away"
    gone.mkdir()
    config = TrialConfig(DataConfig(dataset="office", data_dir=str(gone) if where != "none" else None),
                         ModelConfig(**TINY_MODEL), train=TrainConfig(epochs=1, max_train_samples=64, eval_max_users=8,
                                                                      retention_users=0, precision="fp32"))
    with pytest.raises(FileNotFoundError, match=str(gone) if where != "none" else str(cache_root(env))):
        run_trial(config, TrainingHooks(env / "run", verbose=False))
    assert mirror.requests == []
    assert files_under(cache_root(env)) == []
