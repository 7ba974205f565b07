"""A dataset's files carried from the study's driver to the nodes that train, so that no node needs the files at
the driver's path: the driver reads them once (``pack``, a few MB for the shipped datasets), Ray's object store
carries them, and a trial loads its dataset (``load_trial_dataset``) from the local files where they are there
with the same SHA-256, else from a copy of the carried bytes in the node's temporary directory (``unpack``).
The synthetic dataset is generated where it is used: nothing is carried.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..config import DataConfig
from . import Dataset, load_dataset
from .files import SYNTHETIC, DatasetFiles, is_dataset_path, locate, locate_directory, sha256_of

CACHE_FOLDER = "apao-datasets"  # under the node's temporary directory: the carried files, one folder per content


@dataclass(frozen=True, eq=False)
class ShippedFiles:
    """A dataset's files as bytes.

    Attributes:
        dataset: the dataset as the trials' config names it (a name, or an absolute directory path).
        folder: the directory the files sit in (``Office``; a dataset directory's own name).
        files: file name -> bytes.
        checksums: file name -> SHA-256 of the bytes (``Dataset.checksums`` of the files).
    """

    dataset: str
    folder: str
    files: dict[str, bytes]
    checksums: dict[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """One SHA-256 over every file's name and checksum: names the node-local copy."""
        text = "\n".join(f"{name} {digest}" for name, digest in sorted(self.checksums.items()))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def num_bytes(self) -> int:
        return sum(len(data) for data in self.files.values())


def _files_of(config: DataConfig) -> DatasetFiles:
    """Where ``config``'s dataset files are on this machine, as load_dataset finds them (never downloading)."""
    by_path = is_dataset_path(config.dataset) and not config.data_dir
    return locate_directory(config.dataset) if by_path else locate(config.dataset, config.data_dir,
                                                                    allow_download=False)


def _paths(files: DatasetFiles) -> list[Path]:
    return [files.inter_path, files.require_index(), *([files.meta_path] if files.meta_path else [])]


def pack(config: DataConfig) -> ShippedFiles | None:
    """The files of ``config``'s dataset, read whole (None for the synthetic dataset, which each node generates)."""
    if config.dataset.lower() == SYNTHETIC:
        return None
    files = _files_of(config)
    contents = {path.name: path.read_bytes() for path in _paths(files)}
    return ShippedFiles(config.dataset, files.inter_path.parent.name, contents,
                        {name: hashlib.sha256(data).hexdigest() for name, data in contents.items()})


def unpack(shipped: ShippedFiles, root: str | os.PathLike | None = None) -> Path:
    """The carried files in ``root/<digest>/<folder>/`` (``root``: this node's temporary directory's
    ``CACHE_FOLDER``), written once per content and reused while their checksums hold; returns ``root/<digest>``."""
    base = Path(root or Path(tempfile.gettempdir()) / CACHE_FOLDER) / shipped.digest[:24]
    target = base / shipped.folder
    if all((target / name).is_file() and sha256_of(target / name) == digest
           for name, digest in shipped.checksums.items()):
        return base
    base.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=base))
    for name, data in shipped.files.items():
        (staging / name).write_bytes(data)
    shutil.rmtree(target, ignore_errors=True)
    try:
        os.replace(staging, target)  # whole or not at all; another trial of this node may have won the race
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return base


def _has_same_files(config: DataConfig, shipped: ShippedFiles) -> bool:
    try:
        files = _files_of(config)
        return {path.name: sha256_of(path) for path in _paths(files)} == shipped.checksums
    except (FileNotFoundError, ValueError):
        return False


def load_trial_dataset(config: DataConfig, shipped: ShippedFiles | None = None, node: str = "this node") -> Dataset:
    """The dataset a trial trains on: read where ``config`` says when those files are here with the checksums of
    ``shipped`` (or nothing was shipped: the synthetic dataset, a run without a driver to ship it), else from the
    shipped bytes. Never downloads: the command that started the trial found the files.

    Raises:
        FileNotFoundError: in one line, naming the missing files and ``node``, where nothing was shipped.
        ValueError: a file that does not parse, naming it.
    """
    def load(name: str, data_dir: str | None) -> Dataset:
        return load_dataset(name, data_dir, config.max_history, config.synthetic_seed, allow_download=False)

    if shipped is None and config.dataset.lower() != SYNTHETIC:
        try:
            _files_of(config)
        except (FileNotFoundError, ValueError) as error:  # ValueError: a dataset name found nowhere
            raise FileNotFoundError(f"on node {node}: {error}; nothing was shipped by the study's driver") from None
    if shipped is None or _has_same_files(config, shipped):
        return load(config.dataset, config.data_dir)
    base = unpack(shipped)
    if is_dataset_path(shipped.dataset):
        return load(str(base / shipped.folder), None)
    return load(shipped.dataset, str(base))
