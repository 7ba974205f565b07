"""``python -m apao_ray export``: a trained model as a Hugging Face ``transformers`` directory (the format
itself, and how weights map, is :mod:`apao_ray.reuse.export`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from .. import load_recommender
from ..reuse.export import FORMATS, export_hf
from ..reuse.export import __doc__ as EXPORT_DOC
from ..paths import add_tracking_uri_argument


def _run(args: argparse.Namespace) -> int:
    # lazy: mlflow; every `python -m apao_ray` command builds the parser that imports this module
    from ..tracking import require_model, resolve_tracking_uri

    if args.format not in FORMATS:
        raise ValueError(f"--format {args.format!r} is not known; choose from {list(FORMATS)}")
    try:  # lazy: transformers, an optional extra, checked when asked for
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("export --format hf needs transformers: pip install 'apao_ray[hf]'") from None
    if Path(args.to).is_file():
        raise ValueError(f"--to {args.to}: is a file; give a directory to write (created)")
    tracking_uri = resolve_tracking_uri(args.tracking_uri)
    if not Path(args.model).is_dir():  # an MLflow URI: fail naming it, before MLflow creates an empty store
        require_model(args.model, tracking_uri)
    recommender = load_recommender(args.model, tracking_uri=tracking_uri)  # fp32, as the server and load_recommender
    directory = export_hf(recommender, args.to)
    kind = "T5ForConditionalGeneration" if recommender.config.model.backbone == "tiger" else "LlamaForCausalLM"
    print(f"wrote {directory}: {kind} ({recommender.catalog.num_items:,} items); load it with "
          f"transformers.{kind}.from_pretrained({str(directory)!r}), recommend with {directory}/recommend_hf.py")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``export`` to ``python -m apao_ray``."""
    parser = subparsers.add_parser("export", help="a trained model as a Hugging Face transformers directory",
                                   description=EXPORT_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="models:/<name>@best, runs:/<id>/model, or a final "
                        "checkpoint directory (train_runs/.../epoch_XXXX_final)")
    parser.add_argument("--to", required=True, help="directory to write (created)")
    parser.add_argument("--format", default="hf", help=f"one of {list(FORMATS)} (default hf)")
    add_tracking_uri_argument(parser, "where a models:/ or runs:/ URI is looked up")
    parser.set_defaults(handler=_run)
