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

# The paper authors' repository, pinned (docs/own-data.md); APAO_DATA_URL overrides
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
LEVEL_LETTERS = "abcdefghijklmnopqrstuvwxyz"  # the shipped files use 4 levels, a..d


@dataclass(frozen=True)
class DatasetFiles:
    """The files of one dataset. ``inter_path`` is ``<Name>.inter.json`` or, for a dataset directory,
    possibly an interactions table (CSV/TSV/Parquet); ``index_path`` is None until ``tokenize`` wrote one."""

    folder: str
    inter_path: Path
    index_path: Path | None
    item_path: Path | None = None

    @property
    def meta_path(self) -> Path | None:
        """The tokenizer's record beside its index (``X.index.rq-kmeans.meta.json``), when there is one."""
        if self.index_path is None:
            return None
        meta = index_meta_path(self.index_path)
        return meta if meta.is_file() else None

    @property
    def is_table(self) -> bool:
        return self.inter_path.suffix.lower() in TABLE_SUFFIXES

    def require_index(self) -> Path:
        if self.index_path is None:
            directory = self.inter_path.parent
            raise FileNotFoundError(f"{directory} has no semantic-ID index (<Name>.index.<method>.json); make one with: "
                                    f"python -m apao_ray tokenize --dataset {directory}")
        return self.index_path

    def checksums(self) -> dict[str, str]:
        paths = [self.inter_path, self.require_index(), *([self.meta_path] if self.meta_path else [])]
        return {p.name: sha256_of(p) for p in paths}


TABLE_SUFFIXES = (".csv", ".tsv", ".parquet")
META_SUFFIX = ".meta.json"


def index_meta_path(index_path: Path) -> Path:
    """``X.index.rq-kmeans.json`` -> ``X.index.rq-kmeans.meta.json``: the tokenizer's record (embedding
    source, levels, collisions) lives beside the index so that the index keeps the shipped format."""
    return index_path.with_name(index_path.name[:-len(".json")] + META_SUFFIX)


def is_dataset_path(name: str) -> bool:
    """A dataset given as a directory path (``./mine``, ``/data/mine``, ``~/mine``) rather than by name."""
    return isinstance(name, str) and (os.sep in name or "/" in name or name.startswith(("~", ".")))


def canonical_dataset(name: str) -> str:
    """What a config records: built-in and folder names lower-cased, paths made absolute."""
    if is_dataset_path(name):
        return str(Path(name).expanduser().resolve())
    return name.lower()


def dataset_label(name: str) -> str:
    """A plain name for experiment, run and model names: a path's folder name, lower-cased."""
    if is_dataset_path(name):
        label = re.sub(r"[^a-z0-9_.-]+", "-", Path(name).expanduser().resolve().name.lower()).strip("-.")
        return label or "dataset"
    return name.lower()


def _single(directory: Path, paths: list[Path], what: str, required: bool) -> Path | None:
    if len(paths) > 1:
        raise ValueError(f"{directory} holds several {what}: {sorted(p.name for p in paths)}; keep exactly one")
    if not paths and required:
        raise FileNotFoundError(f"{directory} holds no {what}")
    return paths[0] if paths else None


def locate_directory(path: str | os.PathLike) -> DatasetFiles:
    """A user's dataset directory: ``<Name>.inter.json`` or one interactions table (``.csv``, ``.tsv``,
    ``.parquet`` with user, item, timestamp columns); ``<Name>.index.<method>.json`` (absent until
    ``tokenize``); optional item texts ``<Name>.item.json`` or ``items.json``."""
    directory = Path(path).expanduser().resolve()
    if not directory.is_dir():
        raise FileNotFoundError(f"dataset directory {directory} does not exist (a --dataset with a path separator "
                                f"is a directory; built-in names are {known_dataset_names()})")
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    inter = [p for p in files if p.name.endswith(".inter.json")] + \
            [p for p in files if p.suffix.lower() in TABLE_SUFFIXES]
    inter_path = _single(directory, inter, f"interaction files (<Name>.inter.json or a table {list(TABLE_SUFFIXES)})",
                         required=True)
    index_path = _single(directory, [p for p in files if ".index." in p.name and p.name.endswith(".json")
                                     and not p.name.endswith(META_SUFFIX)], "semantic-ID index files", required=False)
    item_path = _single(directory, [p for p in files if p.name.endswith(".item.json") or p.name == "items.json"],
                        "item-text files (<Name>.item.json, items.json)", required=False)
    folder = inter_path.name[:-len(".inter.json")] if inter_path.name.endswith(".inter.json") else dataset_label(str(directory))
    return DatasetFiles(folder, inter_path, index_path, item_path)


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
    try:
        check_plain_name("dataset", name)
    except ValueError as error:
        if is_dataset_path(name):  # names stay inside the data dir; a path is read alone
            raise ValueError(f"{error}; a dataset directory path is read by itself, without --data-dir") from None
        raise
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
    """``{item: ["<a_1>", "<b_2>", "<c_3>", "<d_4>"]}`` -> item ids and (I, T) code indices.

    T is the first item's number of codes (4 in the shipped files; ``tokenize --levels`` may
    write others); every item must have T codes, level m's letter being the m-th of a..z.
    """
    raw = _read_json(path)
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: expected a non-empty JSON object {{item id: [4 codes]}}")
    first = next(iter(raw.values()))
    num_levels = len(first) if isinstance(first, list) and 1 <= len(first) <= len(LEVEL_LETTERS) else 4
    item_ids = [str(item) for item in raw]
    codes = np.empty((len(raw), num_levels), dtype=np.int64)
    letters = [f"'<{letter}_N>'" for letter in LEVEL_LETTERS[:num_levels]]
    expected = f"[{', '.join(letters)}] ({num_levels} codes, one per level, in order)"
    for row, (item, sem_id) in enumerate(raw.items()):
        if not isinstance(sem_id, list) or len(sem_id) != num_levels:
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
    return index_sequences(raw, item_index, path, index_path)


def index_sequences(raw: dict, item_index: dict[str, int], path: Path | str,
                    index_path: Path | str) -> tuple[list[str], list[np.ndarray]]:
    """``{user: [item ids in time order]}`` -> user ids and item-index sequences, each checked."""
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
