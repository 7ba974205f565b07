"""What reuses a trained model without MLflow: load it and recommend (``inference``: ``Recommender``,
``load_local``) and the Hugging Face format (``export``, ``hf_generate``). ``tracking`` serves a ``Recommender``
as MLflow's pyfunc model, so nothing here imports ``tracking``; the commands that go through MLflow (``serve``,
``export``) are in ``serving``. ``apao_ray.load_recommender`` is the one entry point most code needs. Nothing here
is imported by training or a study."""
