"""Dataset files: which exist, where they are found, download with checksums, parsing with
validation. Nothing is half-loaded: every check runs before a Dataset is built.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..paths import check_plain_name, data_dir_candidates, download_dir

# The paper authors' repository, pinned (shared/datasets/README.md); APAO_DATA_URL overrides
# the base (a mirror, or a loopback server in tests).
DATA_URL_ENV = "APAO_DATA_URL"
DEFAULT_DATA_URL = "https://raw.githubusercontent.com/yuyq18/APAO/aa08fcfab4ad306a536a1fde648042972a292bbe/data"

# dataset key -> folder name, then file name -> SHA-256 (None: not published upstream)
DATASETS: dict[str, str] = {"office": "Office", "grocery": "Grocery", "beauty": "Beauty", "yelp": "Yelp"}
CHECKSUMS: dict[str, dict[str, str | None]] = {
    "Office": {
        "Office.inter.json": "10f983c76de3d2443ae68bf50bc6231962ab493f4d08c7e716e2f183ae70d698",
        "Office.index.rq-kmeans.json": "6c06fd85972bfa297f66e9597057fa6797886d1483e3f0aaed7be87fb7ddd1f9",
    },
    "Grocery": {
        "Grocery.inter.json": "62c210e03bf86775a847faf8c9850c5cda7eeafa6cd5854900e5b78407b538b9",
        "Grocery.index.rq-kmeans.json": "4ed40e0ed6da04146c3611070008513546bdb1dd99111b5b2ed0bf065d046906",
    },
    "Beauty": {
        "Beauty.inter.json": "8809584b8b78fa6561771c88911ed65bd716fc9926fca1e581e6a1ab578ccfd5",
        "Beauty.index.rq-kmeans.json": "75ec4c78aba505cec7503a5e5ada1f2eee4ebfa7eefb5a0988978677b4089aea",
    },
    "Yelp": {
        "Yelp.inter.json": None,
        "Yelp.index.rq-kmeans.json": "f7c751f8a21087c3e6d7d6f5706e891af2811b3431f905bc64a5e4d8d2606c30",
    },
}
SYNTHETIC = "synthetic"
_CODE = re.compile(r"^<([a-z])_(\d{1,6})>$")
LEVEL_LETTERS = "abcd"


@dataclass(frozen=True)
class DatasetFiles:
    folder: str
    inter_path: Path
    index_path: Path

    def checksums(self) -> dict[str, str]:
        return {p.name: sha256_of(p) for p in (self.inter_path, self.index_path)}


def known_dataset_names() -> list[str]:
    return sorted([*DATASETS, SYNTHETIC])


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_name(name: str) -> str:
    """Dataset name (any case) -> its folder; custom datasets keep their own plain name."""
    check_plain_name("dataset", name)
    return DATASETS.get(name.lower(), name)


def _files_in(directory: Path, folder: str) -> DatasetFiles:
    return DatasetFiles(folder, directory / folder / f"{folder}.inter.json",
                        directory / folder / f"{folder}.index.rq-kmeans.json")


def locate(name: str, data_dir: str | os.PathLike | None = None, *, allow_download: bool = True) -> DatasetFiles:
    """Finds a dataset's files (explicit dir, $APAO_DATA_DIR, ./data, user cache), else downloads."""
    folder = folder_name(name)
    searched = data_dir_candidates(data_dir)
    for directory in searched:
        files = _files_in(directory, folder)
        if files.inter_path.is_file() and files.index_path.is_file():
            return files
    if folder not in CHECKSUMS:
        raise ValueError(f"unknown dataset {name!r}: not one of {known_dataset_names()} and no folder "
                         f"{folder!r} with {folder}.inter.json in {[str(d) for d in searched]}")
    missing = [f for f, digest in CHECKSUMS[folder].items() if digest is None]
    if missing:
        raise FileNotFoundError(f"dataset {name!r} needs {missing}, which the paper's repository does not "
                                f"publish; put the file under one of {[str(d / folder) for d in searched]}")
    if not allow_download:
        raise FileNotFoundError(f"dataset {name!r} not found in {[str(d) for d in searched]} (no "
                                f"{folder}/{folder}.inter.json and {folder}.index.rq-kmeans.json there)")
    target = download_dir(data_dir)
    download(folder, target)
    return _files_in(target, folder)


def download(folder: str, target_dir: Path, base_url: str | None = None, timeout: float = 60.0) -> None:
    """Downloads every file of ``folder``, checks its SHA-256 and moves it in atomically.

    All files are fetched and verified into a temporary directory first, so a failed or corrupt
    download leaves nothing behind in ``target_dir``.
    """
    base_url = (base_url or os.environ.get(DATA_URL_ENV) or DEFAULT_DATA_URL).rstrip("/")
    destination = target_dir / folder
    destination.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=destination, prefix=".download-") as tmp:
            fetched = []
            for file_name, expected in CHECKSUMS[folder].items():
                url = f"{base_url}/{folder}/{file_name}"
                part = Path(tmp) / file_name
                try:
                    with urllib.request.urlopen(url, timeout=timeout) as response, open(part, "wb") as out:
                        for block in iter(lambda: response.read(1 << 20), b""):
                            out.write(block)
                except (urllib.error.URLError, OSError) as error:
                    raise ConnectionError(f"could not download {url}: {error}; without a network, put the "
                                          f"files in {destination} or pass --data-dir / set APAO_DATA_DIR") from error
                actual = sha256_of(part)
                if actual != expected:
                    raise ValueError(f"checksum mismatch for {url}: got sha256 {actual}, expected {expected}; "
                                     "nothing was written")
                fetched.append(part)
            for part in fetched:
                os.replace(part, destination / part.name)  # atomic within one filesystem
    finally:
        try:
            destination.rmdir()  # a failed download leaves no empty folder behind
        except OSError:
            pass


def _read_json(path: Path) -> object:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: malformed JSON at line {error.lineno}, column {error.colno}: {error.msg}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None


def parse_index(path: Path) -> tuple[list[str], np.ndarray]:
    """``{item: ["<a_1>", "<b_2>", "<c_3>", "<d_4>"]}`` -> item ids and (I, 4) code indices."""
    raw = _read_json(path)
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: expected a non-empty JSON object {{item id: [4 codes]}}")
    item_ids = [str(item) for item in raw]
    codes = np.empty((len(raw), len(LEVEL_LETTERS)), dtype=np.int64)
    expected = "['<a_N>', '<b_N>', '<c_N>', '<d_N>'] (4 codes, one per level, in order)"
    for row, (item, sem_id) in enumerate(raw.items()):
        if not isinstance(sem_id, list) or len(sem_id) != len(LEVEL_LETTERS):
            raise ValueError(f"{path}: item {item!r} has semantic ID {sem_id!r}; expected {expected}")
        for level, code in enumerate(sem_id):
            match = _CODE.match(code) if isinstance(code, str) else None
            if match is None or match.group(1) != LEVEL_LETTERS[level]:
                raise ValueError(f"{path}: item {item!r} has code {code!r} at level {level + 1} of {sem_id!r}; "
                                 f"expected {expected}")
            codes[row, level] = int(match.group(2))
    return item_ids, codes


def parse_interactions(path: Path, item_index: dict[str, int], index_path: Path | str) -> tuple[list[str], list[np.ndarray]]:
    """``{user: [item, ...]}`` in time order -> user ids and item-index sequences (>= 3 each)."""
    raw = _read_json(path)
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: expected a non-empty JSON object {{user id: [item ids in time order]}}")
    users, sequences = [], []
    for user, items in raw.items():
        if not isinstance(items, list):
            raise ValueError(f"{path}: user {user!r} has {type(items).__name__} {items!r}; expected a list of item ids")
        if len(items) < 3:
            raise ValueError(f"{path}: user {user!r} has {len(items)} interaction(s); at least 3 are needed "
                             "(training, validation and test targets)")
        try:
            sequences.append(np.fromiter((item_index[str(i)] for i in items), dtype=np.int64, count=len(items)))
        except KeyError as error:
            raise ValueError(f"{path}: user {user!r} interacted with item {error.args[0]!r}, which is missing "
                             f"from the semantic-ID index {index_path}") from None
        users.append(str(user))
    return users, sequences
