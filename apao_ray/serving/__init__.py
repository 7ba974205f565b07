"""A logged model put to work through MLflow: ``serve`` (MLflow's scoring app behind request limits: ``serve``,
``serve_app``) and the ``export`` command (``export_command``: a logged model as a Hugging Face directory, whose
format is ``reuse.export``). Above ``tracking`` (they resolve ``models:/`` URIs) and ``reuse`` (what they load);
imported by nothing but the command line."""
