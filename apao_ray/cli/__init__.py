"""The command line: ``commands`` (``main``: ``python -m apao_ray ...``, every subcommand) and the argparse value types every
command's parser uses (``types``). Imported lazily: ``apao_ray.cli.types`` alone loads nothing else."""
from __future__ import annotations

import importlib
from typing import Any

_MAIN_NAMES = ("main", "build_parser", "PASS_THROUGH", "REGISTERED")


def __getattr__(name: str) -> Any:  # `from apao_ray.cli import main` without importing the dispatcher eagerly
    if name in _MAIN_NAMES:
        return getattr(importlib.import_module(f"{__name__}.commands"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
