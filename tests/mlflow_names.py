"""The MLflow names a study logs, compared with tests/mlflow_names.json (tests/test_sweep.py's committed names)."""
from __future__ import annotations

from apao_ray.names import ENERGY, GPU_MEMORY
from conftest import ROOT

MLFLOW_NAMES = ROOT / "tests" / "mlflow_names.json"
UPDATE_NAMES_ENV = "APAO_UPDATE_MLFLOW_NAMES"
# names present or not by machine: tags MLflow adds from where a run starts (user, entry point, git checkout),
# and the cost metrics a machine may lack (energy without CodeCarbon, GPU memory without CUDA; also per method)
ENVIRONMENT_TAGS = ("mlflow.source.", "mlflow.user", "mlflow.git")
ENVIRONMENT_METRICS = tuple(name.split("/")[-1] for name in (ENERGY, GPU_MEMORY))
ENVIRONMENT_METRIC_PREFIXES = ("system/gpu_",)  # a GPU's use, sampled where a trial trains on CUDA


def logged_names(runs) -> dict[str, list[str]]:
    """The param, metric and tag names ``runs`` logged, each sorted, over all of them (values ignored)."""
    return {"params": sorted({name for run in runs for name in run.data.params}),
            "metrics": sorted({name for run in runs for name in run.data.metrics
                               if name.split("/")[-1] not in ENVIRONMENT_METRICS
                               and not name.startswith(ENVIRONMENT_METRIC_PREFIXES)}),
            "tags": sorted({name for run in runs for name in run.data.tags if not name.startswith(ENVIRONMENT_TAGS)})}


def names_diff(expected: dict[str, list[str]], found: dict[str, list[str]]) -> list[str]:
    """One line per section whose names differ: the names added and removed."""
    lines = []
    for section in sorted(expected.keys() | found.keys()):
        added = sorted(set(found.get(section, ())) - set(expected.get(section, ())))
        removed = sorted(set(expected.get(section, ())) - set(found.get(section, ())))
        if added or removed:
            lines.append(f"{section}: added {added}, removed {removed}")
    return lines
