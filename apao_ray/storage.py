"""Where a study's run files live: a local directory, or any URI pyarrow's filesystems take (``s3://bucket/prefix``,
``gs://bucket/prefix``, ``hdfs://host/path``; an S3-compatible store through the standard AWS variables:
``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``).

A place is a *location*: a string, an absolute local path or a URI, that pickles into Ray configs and is given
as it is to Ray Tune and Ray Train as their ``storage_path`` (they resolve it with pyarrow as this module does).
A URI's options (``s3://bucket/prefix?endpoint_override=host:9000&scheme=http``) stay on every location under it.
Every read and write of a run's files (checkpoints, reports, failure records) goes through the functions here;
what must be a local file to be used (a checkpoint loaded by torch, logged to MLflow) is copied to a temporary
directory by ``local_copy`` (a local location is used in place). Local locations keep plain file semantics
(append, rename); on an object store a file is written whole.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # pyarrow is imported where a remote location is used
    import pyarrow.fs


def is_remote(location: str | Path) -> bool:
    """Whether ``location`` is a URI of a filesystem other than this machine's (``file://`` is local)."""
    return "://" in str(location) and not str(location).startswith("file://")


def _split_options(location: str) -> tuple[str, str]:
    """(the URI without its options, ``?options`` or "")."""
    path, _, options = location.partition("?")
    return path.rstrip("/"), f"?{options}" if options else ""


def absolute(location: str | Path) -> str:
    """``location`` in the one spelling every process agrees on: a URI without a trailing ``/``, or an absolute
    local path (``~`` expanded, relative to this process's working directory)."""
    text = str(location)
    if is_remote(text):
        return "".join(_split_options(text))
    return str(Path(text.removeprefix("file://")).expanduser().resolve())


def join(location: str | Path, *parts: str) -> str:
    """``location``/``parts``, a location of the same kind (a URI keeps its options)."""
    if is_remote(location):
        path, options = _split_options(str(location))
        return "/".join([path, *parts]) + options
    return str(Path(location, *parts))


def name(location: str | Path) -> str:
    """The last part of ``location`` (a directory's or file's name)."""
    return _split_options(str(location))[0].rsplit("/", 1)[-1]


def sibling(location: str | Path, other: str) -> str:
    """The location named ``other`` in the directory that holds ``location`` (a URI keeps its options)."""
    if not is_remote(location):
        return str(Path(location).with_name(other))
    path, options = _split_options(str(location))
    return f"{path.rsplit('/', 1)[0]}/{other}{options}"


def _resolve(location: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """(pyarrow filesystem, path on it) of a remote location; cached (an S3 filesystem asks for its bucket's
    region) while the AWS variables it was made under stay as they are."""
    return _resolve_under(location, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))


@functools.lru_cache(maxsize=256)
def _resolve_under(location: str, aws_variables: tuple[tuple[str, str], ...]) -> tuple[pyarrow.fs.FileSystem, str]:
    import pyarrow.fs

    return pyarrow.fs.FileSystem.from_uri(location)


def bucket(location: str) -> str:
    """The bucket (host) of a remote location, with the location's options: ``s3://bucket`` of ``s3://bucket/a/b``."""
    path, options = _split_options(location)
    scheme, rest = path.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0]}{options}"


def _remote_path(location: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem and path of a remote location, resolved once per bucket (host) and joined from there."""
    root = bucket(location)
    path = _split_options(location)[0].split("://", 1)[1].partition("/")[2]
    filesystem, root_path = _resolve(root)
    return filesystem, "/".join(part for part in (root_path.rstrip("/"), path.rstrip("/")) if part)


def _file_info(location: str):
    filesystem, path = _remote_path(location)
    return filesystem.get_file_info(path)


def exists(location: str | Path) -> bool:
    if not is_remote(location):
        return Path(location).exists()
    import pyarrow.fs

    return _file_info(str(location)).type != pyarrow.fs.FileType.NotFound


def is_dir(location: str | Path) -> bool:
    if not is_remote(location):
        return Path(location).is_dir()
    import pyarrow.fs

    return _file_info(str(location)).type == pyarrow.fs.FileType.Directory


def read_text(location: str | Path) -> str | None:
    """The file's text, None if there is no such file."""
    if not is_remote(location):
        path = Path(location)
        return path.read_text() if path.is_file() else None
    if not exists(location):
        return None
    filesystem, path = _remote_path(str(location))
    with filesystem.open_input_stream(path, compression=None) as handle:
        return handle.read().decode()


def write_text(location: str | Path, text: str) -> None:
    """Writes the file whole (its directory made where needed)."""
    if not is_remote(location):
        Path(location).parent.mkdir(parents=True, exist_ok=True)
        Path(location).write_text(text)
        return
    filesystem, path = _remote_path(str(location))
    with filesystem.open_output_stream(path, compression=None) as handle:
        handle.write(text.encode())


def append_text(location: str | Path, text: str) -> None:
    """Appends to the file (made where missing): in place on a local disk; read and written whole on an object
    store, which has no append (a run's few-KB reports file)."""
    if not is_remote(location):
        Path(location).parent.mkdir(parents=True, exist_ok=True)
        with open(location, "a") as handle:
            handle.write(text)
        return
    write_text(location, (read_text(location) or "") + text)


def delete(location: str | Path) -> None:
    """Removes a file or a directory with what it holds; nothing if there is none."""
    if not is_remote(location):
        path = Path(location)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        return
    import pyarrow.fs

    filesystem, path = _remote_path(str(location))
    info = filesystem.get_file_info(path)
    if info.type == pyarrow.fs.FileType.Directory:
        filesystem.delete_dir(path)
    elif info.type == pyarrow.fs.FileType.File:
        filesystem.delete_file(path)


def find(location: str | Path, pattern: str, recursive: bool = False, directories: bool = True) -> list[str]:
    """The directories (or files, ``directories=False``) under ``location`` whose name matches ``pattern`` (a
    shell glob), as locations, sorted; in every subdirectory with ``recursive``. None where there is no
    ``location``."""
    if not is_remote(location):
        root = Path(location)
        matches = root.rglob(pattern) if recursive else root.glob(pattern)
        return sorted(str(path) for path in matches if path.is_dir() == directories)
    import pyarrow.fs

    filesystem, path = _remote_path(str(location))
    wanted = pyarrow.fs.FileType.Directory if directories else pyarrow.fs.FileType.File
    infos = filesystem.get_file_info(pyarrow.fs.FileSelector(path, recursive=recursive, allow_not_found=True))
    return sorted(join(location, *info.path[len(path):].strip("/").split("/")) for info in infos
                  if info.type == wanted and fnmatch.fnmatchcase(info.base_name, pattern))


def _copy_tree(source: str, destination: str, source_fs: pyarrow.fs.FileSystem,
               destination_fs: pyarrow.fs.FileSystem) -> None:
    import pyarrow.fs

    pyarrow.fs.copy_files(source, destination, source_filesystem=source_fs, destination_filesystem=destination_fs)


def move_dir(location: str | Path, new_location: str | Path) -> None:
    """Renames the directory ``location`` to ``new_location`` (same filesystem, which must not exist yet): at once on
    a local disk; on an object store, which has no rename, copied whole and then removed."""
    if not is_remote(location):
        os.replace(location, new_location)
        return
    filesystem, path = _remote_path(str(location))
    _copy_tree(path, _remote_path(str(new_location))[1], filesystem, filesystem)
    filesystem.delete_dir(path)


def download(location: str | Path, local_dir: str | Path) -> Path:
    """Copies the directory ``location`` into ``local_dir`` (made; what is there stays) and returns it; a missing
    ``location`` copies nothing."""
    import pyarrow.fs

    local = Path(local_dir)
    local.mkdir(parents=True, exist_ok=True)
    if not is_remote(location):
        if Path(location).is_dir():
            shutil.copytree(location, local, dirs_exist_ok=True)
        return local
    if is_dir(location):
        filesystem, path = _remote_path(str(location))
        _copy_tree(path, str(local), filesystem, pyarrow.fs.LocalFileSystem())
    return local


def file_stats(local_dir: str | Path) -> dict[str, tuple[int, int]]:
    """Each file under ``local_dir`` (relative path) -> (size, modification time in ns): what ``mirror`` compares."""
    root = Path(local_dir)
    return {str(path.relative_to(root)): (stat.st_size, stat.st_mtime_ns) for path in sorted(root.rglob("*"))
            if path.is_file() and (stat := path.stat())}


def mirror(local_dir: str | Path, location: str | Path, synced: dict[str, tuple[int, int]] | None = None) -> None:
    """Makes the remote directory ``location`` hold what ``local_dir`` holds: files that are new or changed are
    uploaded (a checkpoint's files, a grown reports file), files gone locally are removed there (a checkpoint past
    those kept). A checkpoint's files go up before any removal, so an interrupted mirror leaves the older
    checkpoints in place.

    ``synced``: each file's ``file_stats`` when it was last downloaded or uploaded, kept by the caller across calls
    and updated here; a file rewritten since (a checkpoint written again under its name after a restart, its
    manifest the same size) goes up even where its size did not change. Without it, a changed size decides."""
    import pyarrow.fs

    filesystem, root = _remote_path(str(location))
    local_root = Path(local_dir)
    remote = {info.path[len(root):].strip("/"): info.size for info in filesystem.get_file_info(
        pyarrow.fs.FileSelector(root, recursive=True, allow_not_found=True)) if info.type == pyarrow.fs.FileType.File}
    local = file_stats(local_root)
    for relative, stats in local.items():
        if remote.get(relative) != stats[0] or (synced is not None and synced.get(relative) != stats):
            filesystem.create_dir(f"{root}/{relative}".rsplit("/", 1)[0])
            with open(local_root / relative, "rb") as source, \
                    filesystem.open_output_stream(f"{root}/{relative}", compression=None) as target:
                shutil.copyfileobj(source, target, 1 << 20)
            if synced is not None:
                synced[relative] = stats
    for relative in sorted(set(remote) - set(local)):
        filesystem.delete_file(f"{root}/{relative}")
        if synced is not None:
            synced.pop(relative, None)
    for directory in sorted({relative.rsplit("/", 1)[0] for relative in set(remote) - set(local) if "/" in relative},
                            reverse=True):  # a removed checkpoint's (object stores keep directory markers)
        if not (local_root / directory).exists():
            with contextlib.suppress(OSError):
                filesystem.delete_dir(f"{root}/{directory}")


@contextlib.contextmanager
def local_copy(location: str | Path) -> Iterator[Path]:
    """The directory ``location`` as a local path: itself where it is local, else a temporary copy, removed after."""
    if not is_remote(location):
        yield Path(location)
        return
    with tempfile.TemporaryDirectory(prefix="apao-download-") as tmp:
        yield download(location, Path(tmp) / name(location))
