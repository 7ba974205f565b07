"""apao_ray: distributed hyperparameter studies for generative recommendation with APAO.

Imports nothing heavy at package import; the public entry points load lazily::

    import apao_ray
    result = apao_ray.run_study(apao_ray.StudySpec(dataset="office", budget="2h"))
    result.table          # best trial per (backbone, loss), a pandas DataFrame
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

__version__ = "0.1.0"
__all__ = ["StudyResult", "StudySetup", "StudySpec", "load_recommender", "plan_study", "prepare", "run_study",
           "__version__"]
# public name -> the module that defines it, imported on first use (torch, ray and mlflow stay unloaded)
_LAZY = {"StudySpec": "apao_ray.study.spec.study", "StudyResult": "apao_ray.study.api", "run_study": "apao_ray.study.api",
         "plan_study": "apao_ray.study.api", "prepare": "apao_ray.study.setup", "StudySetup": "apao_ray.study.setup"}


def load_recommender(model_uri: str, device: str = "cpu", precision: str | None = None,
                     tracking_uri: str | None = None) -> Any:
    """Loads a model logged by a study (an ``inference.Recommender``): an MLflow URI (``runs:/<id>/model``,
    ``models:/<name>@best``, looked up in ``tracking_uri``, default MLflow's), a local final-checkpoint directory or
    an ``export --format hf`` directory. ``precision`` (fp32/bf16/auto, or ``trial``: the trial's own) defaults to
    fp32, what the export and the served model decode in. Here, above both: MLflow (tracking) serves a
    Recommender (inference), so inference itself never imports tracking."""
    from .reuse.inference import Recommender, load_local  # lazy: torch; `import apao_ray` stays torch-free (test_api)

    if Path(model_uri).is_dir():
        return load_local(model_uri, device, precision)
    from .tracking import load_checkpoint_dir_from_model  # lazy: mlflow, only for a models:/ or runs:/ URI

    return Recommender.from_checkpoint(load_checkpoint_dir_from_model(model_uri, tracking_uri), device, precision)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'apao_ray' has no attribute {name!r}")
