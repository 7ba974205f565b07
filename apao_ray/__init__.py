"""apao_ray: distributed hyperparameter studies for generative recommendation with APAO.

Imports nothing heavy at package import; the public entry points load lazily.
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["load_recommender", "__version__"]


def load_recommender(model_uri: str, **kwargs: Any) -> Any:
    """Loads a trained model logged by a study; see :func:`apao_ray.inference.load_recommender`."""
    from .inference import load_recommender as _load

    return _load(model_uri, **kwargs)
