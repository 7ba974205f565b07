"""Checkpoint directories: everything needed to continue a trial exactly where it stopped.

A checkpoint directory holds ``state.pt`` (model, optimizer, scheduler, loss state such as the
adaptive weights, torch RNG, epoch, early-stopping state, the metric history), ``best_model.pt``
(weights of the best validation epoch so far, so the final test never needs an older
checkpoint), ``reference_model.pt`` in a preference stage, ``trial_config.json``, and ``manifest.json``
(written last: every file's size and SHA-256). Every reader goes through ``load_checkpoint``,
``latest_checkpoint_in`` or ``newest_checkpoint_at``, which verify against the manifest: a checkpoint that does not
load is set aside (``damaged-<name>``), said in one line, and the newest one that loads is used, on a local disk as
on an object store (``storage``).
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import numpy as np

from .. import storage
from ..data.files import sha256_of

STATE_FILE = "state.pt"
BEST_MODEL_FILE = "best_model.pt"
REFERENCE_MODEL_FILE = "reference_model.pt"
CONFIG_FILE = "trial_config.json"
FINAL_METRICS_FILE = "final_metrics.json"
CATALOG_FILE = "catalog.npz"
MANIFEST_FILE = "manifest.json"  # written last: every file's size and SHA-256
RULE_MODEL_PREFIX = "model_by_"  # a final checkpoint's weights of the epoch each other selection rule keeps
SET_ASIDE_FILE = "set_aside.txt"  # marks the place of a checkpoint set aside as damaged
DAMAGED_PREFIX = "damaged-"  # a damaged checkpoint's new name: no reader's pattern matches it
RESTARTS = "training starts again from the first epoch"  # a run none of whose checkpoints loads
Location = TypeVar("Location", str, Path)  # a checkpoint's place: a local directory, or a location (``storage``)
# how long a trial waits for its storage to take a checkpoint (an object store's outage, a full disk being cleared)
STORAGE_WAIT_ENV = "APAO_STORAGE_WAIT_S"
STORAGE_WAIT_S = 600.0
Result = TypeVar("Result")


class StorageUnavailableError(OSError):
    """A run's storage refused its checkpoints for longer than ``STORAGE_WAIT_ENV`` allows."""


def with_storage_retries(action: Callable[[], Result], location: str, what: str,
                         say: Callable[[str], None]) -> Result:
    """Runs ``action`` (an idempotent read or write of ``what`` at ``location``), trying again on OSError with
    growing pauses (1 s to 30 s) for up to ``$APAO_STORAGE_WAIT_S`` seconds: a storage outage of a few minutes
    costs a trial that long, not a restart. ``say`` gets one line when the storage first refuses and one when it
    takes the write.

    Raises:
        StorageUnavailableError: naming ``location``, how long it refused and the last error, and what to do.
    """
    wait = float(os.environ.get(STORAGE_WAIT_ENV) or STORAGE_WAIT_S)
    started, pause, failure = time.monotonic(), 1.0, None
    while True:
        try:
            result = action()
        except OSError as error:
            reason = " ".join(str(error).split())[:300]
            waited = time.monotonic() - started
            if waited >= wait:
                raise StorageUnavailableError(
                    f"storage {location} refused {what} for {waited:.0f} s (the last time: {reason}); the trial's "
                    "checkpoints kept there stay: once the storage takes writes, re-run the same command with "
                    "--resume --retry-failed") from None
            if failure is None:
                say(f"storage {location} refused {what} ({reason}); trying again for up to {wait:.0f} s "
                    f"(${STORAGE_WAIT_ENV})")
            failure = reason
            time.sleep(min(pause, max(0.0, wait - waited)))
            pause = min(2 * pause, 30.0)
            continue
        if failure is not None:
            say(f"storage {location} took {what} after {time.monotonic() - started:.0f} s; the trial goes on")
        return result


def save_checkpoint(directory: str | os.PathLike, state: dict[str, Any], best_model_state: dict[str, Any],
                    trial_config: dict[str, Any], reference_state: dict[str, Any] | None = None) -> Path:
    """Writes a checkpoint atomically: into ``<dir>.tmp`` first, sealed (``seal_checkpoint``), then renamed."""
    import torch  # lazy, as every torch use here: the study's driver finds and verifies checkpoints without it

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(state, tmp / STATE_FILE)
    torch.save(best_model_state, tmp / BEST_MODEL_FILE)
    if reference_state is not None:
        torch.save(reference_state, tmp / REFERENCE_MODEL_FILE)
    (tmp / CONFIG_FILE).write_text(json.dumps(trial_config, indent=2, sort_keys=True))
    seal_checkpoint(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


def seal_checkpoint(directory: str | os.PathLike) -> None:
    """Writes the manifest (every file's size and SHA-256, read back from the disk) last, atomically: a checkpoint
    whose manifest is missing or disagrees with its files was cut short or damaged. Called again after files are
    added (a final checkpoint's metrics, tables and catalog)."""
    directory = Path(directory)
    files = {path.name: {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
             for path in sorted(directory.iterdir()) if path.is_file() and path.name not in (MANIFEST_FILE, SET_ASIDE_FILE)}
    tmp = directory / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    os.replace(tmp, directory / MANIFEST_FILE)


class DamagedCheckpointError(RuntimeError):
    """A checkpoint directory that does not load: cut short, altered or incomplete (``reason`` says how)."""

    def __init__(self, directory: str | os.PathLike, reason: str) -> None:
        super().__init__(f"checkpoint {directory} does not load: {reason}")
        self.directory, self.reason = directory, reason


def check_checkpoint(directory: str | os.PathLike) -> None:
    """Verifies a checkpoint against its manifest; one written before manifests (none there) is verified by
    loading its weights and config.

    Raises:
        DamagedCheckpointError: naming the first file that is missing, of the wrong size or altered.
    """
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:
        manifest = None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DamagedCheckpointError(directory, f"its {MANIFEST_FILE} is unreadable ({error})") from None
    if manifest is None:
        if is_set_aside(directory):
            raise DamagedCheckpointError(directory, f"set aside earlier ({(directory / SET_ASIDE_FILE).read_text().strip()})")
        for name in (STATE_FILE, BEST_MODEL_FILE, CONFIG_FILE):  # written before manifests: it must load
            _load_file(directory, name)
        return
    for name, expected in manifest.items():
        path = directory / name
        if not path.is_file():
            raise DamagedCheckpointError(directory, f"{name} is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise DamagedCheckpointError(directory, f"{name} has {size} bytes, {expected['bytes']} were written")
        if sha256_of(path) != expected["sha256"]:
            raise DamagedCheckpointError(directory, f"{name} differs from what was written (its SHA-256)")


# a remote checkpoint -> its manifest's text when a copy of it was verified in this process: the finders of a
# trial's checkpoint are asked several times (is it there, then log it), and a copy is a download
_VERIFIED_REMOTE: dict[str, str] = {}


def check_checkpoint_at(location: str | os.PathLike) -> None:
    """``check_checkpoint`` of a location (``storage``): a remote checkpoint is verified in a local copy, once per
    manifest.

    Raises:
        DamagedCheckpointError: naming ``location`` and what is wrong.
    """
    if not storage.is_remote(location):
        return check_checkpoint(location)
    manifest = storage.read_text(storage.join(location, MANIFEST_FILE))
    if manifest is not None and _VERIFIED_REMOTE.get(str(location)) == manifest:
        return None
    with storage.local_copy(location) as local:
        try:
            check_checkpoint(local)
        except DamagedCheckpointError as error:
            raise DamagedCheckpointError(location, error.reason) from None
    if manifest is not None:
        _VERIFIED_REMOTE[str(location)] = manifest
    return None


def _load_file(directory: Path, name: str) -> Any:
    """One file of a checkpoint, loaded; any failure to read it is a DamagedCheckpointError naming it."""
    path = directory / name
    try:
        if name.endswith(".json"):
            return json.loads(path.read_text())
        import torch

        # the state holds optimizer and RNG state (not only tensors): the project's own files
        return torch.load(path, map_location="cpu", weights_only=name != STATE_FILE)
    except FileNotFoundError:
        raise DamagedCheckpointError(directory, f"{name} is missing") from None
    except Exception as error:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError...
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise DamagedCheckpointError(directory, f"{name} does not load ({first_line})") from None


def load_checkpoint(directory: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """Returns (state, best_model_state, reference_state or None), verified (``check_checkpoint``).

    Raises:
        DamagedCheckpointError: the checkpoint does not load.
    """
    directory = Path(directory)
    check_checkpoint(directory)
    state = _load_file(directory, STATE_FILE)
    best = _load_file(directory, BEST_MODEL_FILE)
    reference = _load_file(directory, REFERENCE_MODEL_FILE) if (directory / REFERENCE_MODEL_FILE).exists() else None
    return state, best, reference


def rule_model_file(rule: str) -> str:
    """``model_by_val_loss.pt``: in a final checkpoint, the weights of the epoch selection rule ``rule`` keeps (spelt
    as ``selection.rule_name`` spells it), for every rule but the trial's own (its weights are ``best_model.pt``)."""
    return f"{RULE_MODEL_PREFIX}{rule}.pt"


def rule_checkpoint(final_dir: str | os.PathLike, rule: str, directory: str | os.PathLike) -> Path:
    """A final checkpoint in ``directory`` whose kept model is the one ``rule`` keeps: ``final_dir``'s files with that
    rule's weights as ``best_model.pt`` and no other rule's, sealed; whatever loads a final checkpoint (the logged
    model, ``load_recommender``, ``serve``, ``export``) then loads that rule's model.

    Raises:
        ValueError: ``final_dir`` holds no weights of ``rule``, naming the rules it holds.
    """
    final_dir, directory = Path(final_dir), Path(directory)
    weights = final_dir / rule_model_file(rule)
    if not weights.is_file():
        held = sorted(p.name[len(RULE_MODEL_PREFIX):-3] for p in final_dir.glob(rule_model_file("*")))
        raise ValueError(f"checkpoint {final_dir} holds no weights of selection rule {rule!r}; it holds {held}")
    directory.mkdir(parents=True, exist_ok=True)
    for path in final_dir.iterdir():
        if path.is_file() and not path.name.startswith(RULE_MODEL_PREFIX) and path.name != BEST_MODEL_FILE:
            shutil.copy2(path, directory / path.name)
    shutil.copy2(weights, directory / BEST_MODEL_FILE)
    seal_checkpoint(directory)
    return directory


def is_set_aside(directory: str | os.PathLike) -> bool:
    """A place kept for a checkpoint that was set aside (``set_aside``), with nothing loadable in it; a location."""
    return storage.exists(storage.join(directory, SET_ASIDE_FILE)) and not storage.exists(
        storage.join(directory, MANIFEST_FILE))


def set_aside(directory: str | os.PathLike, reason: str) -> str:
    """Renames a damaged checkpoint (a location: a local directory or one on an object store) to ``damaged-<name>``
    beside it (kept, never deleted); returns the new location.

    An empty directory marked ``SET_ASIDE_FILE`` keeps its place: Ray Train's record of a run lists its
    checkpoints by path and refuses to restore a run whose listed checkpoint is gone.
    """
    base = storage.name(directory)
    target = storage.sibling(directory, DAMAGED_PREFIX + base)
    for count in itertools.count(2):
        if not storage.exists(target):
            break
        target = storage.sibling(directory, f"{DAMAGED_PREFIX}{base}-{count}")
    storage.move_dir(directory, target)
    storage.write_text(storage.join(directory, SET_ASIDE_FILE), f"{reason}; moved to {storage.name(target)}\n")
    return target


def newest_loadable(candidates: Iterable[Location], say: Callable[[str], None] | None,
                    if_none: str = "none before it loads") -> Location | None:
    """The newest of ``candidates`` (locations, sorted oldest first) that loads. Each damaged one newer than it is
    set aside and said in one line (``say``) naming it, why, and which one is used instead (``if_none`` when none
    loads); with ``say`` None they are only skipped (another process, rank 0 of the same run, sets them aside)."""
    chosen, damaged = None, []
    for directory in reversed(list(candidates)):
        if is_set_aside(directory):  # said when it was set aside
            continue
        try:
            check_checkpoint_at(directory)
        except DamagedCheckpointError as error:
            damaged.append((directory, error.reason))
            continue
        chosen = directory
        break
    then = f"using {storage.name(chosen)}" if chosen else if_none
    for directory, reason in damaged if say is not None else ():
        if storage.exists(directory) and not is_set_aside(directory):  # not already moved by another reader
            say(f"checkpoint {directory} does not load ({reason}): set aside as "
                f"{storage.name(set_aside(directory, reason))}; {then}")
    return chosen


def checkpoints_in(root: str | os.PathLike, up_to_epoch: int | None = None, final: bool | None = None) -> list[Path]:
    """The ``epoch_XXXX`` and ``epoch_XXXX_final`` checkpoint directories under ``root`` (any depth), oldest first;
    ``up_to_epoch`` keeps those of that epoch or before, ``final`` only final (True) or per-epoch (False) ones."""
    found = []
    for path in Path(root).glob("**/epoch_[0-9][0-9][0-9][0-9]*"):
        name = path.name.removeprefix("epoch_")
        epoch, is_final = name[:4], name[4:] == "_final"
        if not path.is_dir() or name[4:] not in ("", "_final") or (final is not None and is_final != final):
            continue
        if up_to_epoch is None or int(epoch) <= up_to_epoch:
            found.append(path)
    return sorted(found, key=lambda path: path.name)


def latest_checkpoint_in(root: str | os.PathLike, say: Callable[[str], None] | None, if_none: str = "none before "
                         "it loads", **which: Any) -> Path | None:
    """The newest checkpoint under ``root`` that loads (``checkpoints_in`` selects with ``which``), damaged newer
    ones set aside (``newest_loadable``)."""
    return newest_loadable(checkpoints_in(root, **which), say, if_none)


def newest_checkpoint_at(run: str | os.PathLike, say: Callable[[str], None] | None, up_to_epoch: int | None = None,
                         final: bool = False) -> str | None:
    """The newest final (``final``) or per-epoch checkpoint of a run directory (a location, ``storage``), at or
    before ``up_to_epoch``, that loads: damaged newer ones set aside, saying so (``newest_loadable``), on a local
    disk as on an object store (where each is verified in a local copy)."""
    if not storage.is_remote(run):
        found = latest_checkpoint_in(run, say, up_to_epoch=up_to_epoch, final=final)
        return str(found) if found else None
    matches = [location for location in storage.find(run, "epoch_*_final" if final else "epoch_[0-9][0-9][0-9][0-9]",
                                                     recursive=True)
               if up_to_epoch is None or int(storage.name(location)[len("epoch_"):][:4]) <= up_to_epoch]
    return newest_loadable(sorted(matches, key=storage.name), say)


def say_on_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def save_catalog(directory: str | os.PathLike, item_ids: tuple[str, ...], item_codes: Any) -> None:
    """Stores the item catalog beside the weights so a saved model recommends on its own."""
    np.savez_compressed(Path(directory) / CATALOG_FILE, item_ids=np.asarray(item_ids, dtype=str), item_codes=item_codes)


def load_catalog_arrays(directory: str | os.PathLike) -> tuple[list[str], Any]:
    with np.load(Path(directory) / CATALOG_FILE) as arrays:
        return [str(i) for i in arrays["item_ids"]], arrays["item_codes"]
