"""What reuses a trained model: load it and recommend (``inference``: ``Recommender``, ``load_local``), export it as
a Hugging Face directory (``export``, ``hf_generate``, the ``export`` command in ``export_command``), and serve it
over HTTP (``serve``, ``serve_app``). ``apao_ray.load_recommender`` is the one entry point most code needs.
Nothing here is imported by training or a study."""
