"""MLflow: the only package that imports it. ``store`` (where runs go), ``runs`` (``Tracker``),
``models`` (the logged pyfunc model); the names the rest of the code uses are re-exported here."""
from __future__ import annotations

# RecommenderModel stays importable as apao_ray.tracking.RecommenderModel: models logged before the
# split pickled that path, and MLflow unpickles it when it loads them
from .models import (MODEL_NAME, SERVED_PARAMS, ModelLogging, RecommenderModel, download_model,
                     load_checkpoint_dir_from_model, require_model, scoring_app)
from .runs import (DATASET_CONTEXT_TAG, EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, PARENT_TAG, Tracker, dataset_entity,
                   dataset_record)
from .store import (TRACKING_URI_ENV, check_tracking_uri, default_artifact_location, experiment_name,
                    experiment_names, flatten, quiet_mlflow, redact, require_database_driver, resolve_tracking_uri,
                    studies_in, study_experiment, tracking_at)

__all__ = ["DATASET_CONTEXT_TAG", "EXPERIMENT_KIND", "EXPERIMENT_KIND_TAG", "MODEL_NAME", "PARENT_TAG",
           "SERVED_PARAMS", "TRACKING_URI_ENV", "ModelLogging", "RecommenderModel", "Tracker",
           "check_tracking_uri", "dataset_entity", "dataset_record", "default_artifact_location",
           "download_model", "experiment_name", "experiment_names", "flatten", "load_checkpoint_dir_from_model",
           "quiet_mlflow", "redact", "require_database_driver", "require_model", "resolve_tracking_uri",
           "scoring_app", "studies_in", "study_experiment", "tracking_at"]
