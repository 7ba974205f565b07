"""``uvicorn apao_ray.serving.serve_app:app``: what ``python -m apao_ray serve`` runs in the server process
(MLflow's scoring app for the model in ``$APAO_SERVE_MODEL_PATH`` behind ``serve.RequestLimits``)."""
from .serve import limited_app

app = limited_app()
