"""apao_ray: distributed hyperparameter studies for generative recommendation with APAO.

Imports nothing heavy at package import; the public entry points load lazily::

    import apao_ray
    result = apao_ray.run_study(apao_ray.StudySpec(dataset="office", budget="2h"))
    result.table          # best trial per (backbone, loss), a pandas DataFrame
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["StudyResult", "StudySpec", "load_recommender", "plan_study", "run_study", "__version__"]
# public name -> the module that defines it, imported on first use (torch, ray and mlflow stay unloaded)
_LAZY = {"StudySpec": "apao_ray.study.spec", "StudyResult": "apao_ray.study.api", "run_study": "apao_ray.study.api",
         "plan_study": "apao_ray.study.api"}


def load_recommender(model_uri: str, **kwargs: Any) -> Any:
    """Loads a trained model logged by a study; see :func:`apao_ray.inference.load_recommender`."""
    from .inference import load_recommender as _load

    return _load(model_uri, **kwargs)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'apao_ray' has no attribute {name!r}")
