"""The Tune driver: the Tuner over trial actors (driver, trial), the pruned trials' tests, the repeats.

Three of its modules moved out on 2026-11-28 (the searcher and the scheduler to ``search/``, the run callbacks to
``record/``). Tune pickles them into a study's saved state by module path, so a study saved before the move finds
them under their old names here (``MOVED``): the same module objects, imported only when such a state is restored.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

MOVED = {"optuna_storage": "..search.optuna_storage", "scheduler": "..search.scheduler",
         "live_callbacks": "..record.live_callbacks"}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``apao_ray.study.run.<old name>`` -> the module it moved to (no second copy of its classes)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        package, _, short = name.rpartition(".")
        return importlib.util.spec_from_loader(name, self) if package == __name__ and short in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name.rpartition(".")[2]], __name__)

    def exec_module(self, module: ModuleType) -> None:  # the import system gave it the alias's spec: its own back
        module.__spec__ = importlib.util.spec_from_file_location(module.__name__, module.__file__)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
