"""Semantic IDs for a new catalog: ``python -m apao_ray tokenize --dataset PATH``.

Item vectors (``embeddings``) -> residual k-means codes (``quantize``) -> the index file in the
shipped format (``{item: ["<a_i>", "<b_j>", ...]}``) and, beside it, a meta file recording the
embedding source, the quantizer settings and the collision report (the index itself stays
exactly the shipped format, so every reader of those files reads it).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..cli.types import int_at_least, non_negative_int, positive_int
from ..data.files import LEVEL_LETTERS, _read_json, index_meta_path, locate_directory
from ..data.tables import table_sequences
from .embeddings import DEFAULT_ENCODER, describe_source, item_vectors
from .quantize import QuantizerReport, report, semantic_ids

__all__ = ["tokenize", "register", "semantic_ids", "report", "QuantizerReport"]
METHOD = "rq-kmeans"


def dataset_item_ids(files, min_interactions: int) -> list[str]:
    """Items of the (filtered) interactions: item-text file order first, then first appearance."""
    if files.is_table:
        sequences = table_sequences(files.inter_path, min_interactions).sequences.values()
    else:
        raw = _read_json(files.inter_path)
        if not isinstance(raw, dict):
            raise ValueError(f"{files.inter_path}: expected a JSON object {{user id: [item ids in time order]}}")
        sequences = raw.values()
    seen = dict.fromkeys(str(item) for items in sequences for item in items)
    if files.item_path is not None:
        ordered = [item for item in _read_json(files.item_path) if item in seen]
        seen = dict.fromkeys([*ordered, *seen])
    return list(seen)


def linear_algebra() -> list[str]:
    """The BLAS and OpenMP libraries this process computes with and their threads, e.g. ``openblas 0.3.30
    (Haswell), 2 threads``: the codes depend on them (see quantize), so the meta file records them."""
    from threadpoolctl import threadpool_info  # scikit-learn's own dependency

    return sorted({f"{pool['internal_api']} {pool.get('version') or ''}".rstrip()
                   + (f" ({pool['architecture']})" if pool.get("architecture") else "")
                   + f", {pool['num_threads']} threads" for pool in threadpool_info()})


def tokenize(dataset: str, num_levels: int = 4, num_codes: int = 256, embeddings: str | None = None,
             encoder: str = DEFAULT_ENCODER, seed: int = 0, should_disambiguate: bool = False,
             min_interactions: int = 5, output: str | None = None, should_overwrite: bool = False) -> dict:
    """Writes ``<dir>/<Name>.index.rq-kmeans.json`` (+ ``.meta.json``) for a dataset directory.

    Returns:
        The meta record: paths, embedding source, settings, ``QuantizerReport`` fields, CPU seconds.
    """
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    files = locate_directory(dataset)
    target = Path(output).resolve() if output else (files.index_path or
                                                     files.inter_path.parent / f"{files.folder}.index.{METHOD}.json")
    if target.exists() and not should_overwrite:
        raise ValueError(f"{target} exists; pass --overwrite to replace it (or --output another file)")
    item_ids = dataset_item_ids(files, min_interactions)
    vectors, description, num_without_text = item_vectors(item_ids, files.item_path, Path(embeddings) if embeddings
                                                          else None, encoder, seed)
    codes = semantic_ids(vectors, num_levels, num_codes, seed, should_disambiguate)
    quality = report(codes)
    index = {item: [f"<{LEVEL_LETTERS[m]}_{int(c)}>" for m, c in enumerate(row)] for item, row in zip(item_ids, codes)}
    meta = {
        "method": METHOD, "embedding": describe_source(description, num_without_text), "levels": num_levels,
        "codes": num_codes, "seed": seed, "disambiguation_level": should_disambiguate, "kmeans": "scikit-learn lloyd",
        "linear_algebra": linear_algebra(),
        "min_interactions": min_interactions if files.is_table else None, "items": len(item_ids),
        **quality.__dict__,
        "cpu_seconds": round(time.process_time() - start_cpu, 2), "wall_seconds": round(time.perf_counter() - start_wall, 2),
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(index))  # the shipped files' layout: one line, ", " and ": " separators
    index_meta_path(target).write_text(json.dumps(meta, indent=2) + "\n")
    return {"index": str(target), "meta": str(index_meta_path(target)), **meta}


def _run(args: argparse.Namespace) -> int:
    result = tokenize(args.dataset, args.levels, args.codes, args.embeddings, args.encoder, args.seed,
                      args.disambiguate, args.min_interactions, args.output, args.overwrite)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"wrote {result['index']} ({result['items']:,} items, {result['levels']} levels of up to "
          f"{result['codes']} codes)\n  embeddings: {result['embedding']}")
    print(f"  codes used per level: {result['codes_used_per_level']}; largest bucket per level (items sharing "
          f"a prefix): {result['largest_bucket_per_level']}")
    print(f"  collisions: {result['colliding_semantic_ids']} semantic IDs shared by {result['items_in_collisions']} "
          f"items ({result['distinct_semantic_ids']:,} distinct IDs)"
          + ("" if args.disambiguate or not result["colliding_semantic_ids"] else "; --disambiguate makes every ID unique"))
    print(f"  {result['cpu_seconds']:.1f} s CPU, {result['wall_seconds']:.1f} s wall; meta: {result['meta']}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``tokenize`` to ``python -m apao_ray``."""
    parser = subparsers.add_parser(
        "tokenize", help="semantic IDs for a dataset directory (residual k-means over item vectors)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, help="dataset directory: <Name>.inter.json or an interactions "
                        "table (.csv/.tsv/.parquet: user, item, timestamp), and item texts (<Name>.item.json or items.json)")
    parser.add_argument("--levels", type=positive_int, default=4, help="code levels per semantic ID (default 4, as the paper)")
    parser.add_argument("--codes", type=int_at_least(2), default=256, help="codes per level (default 256, as the paper)")
    parser.add_argument("--embeddings", help="item vectors: .npy (rows in the item-text file's order) or .parquet "
                        "(item column + embedding list or numeric columns); default: computed from the item texts")
    parser.add_argument("--encoder", default=DEFAULT_ENCODER, help=f"text encoder when no --embeddings: "
                        f"{DEFAULT_ENCODER!r} (default; TF-IDF + truncated SVD, scikit-learn, no download) or a "
                        "sentence-transformers model name already on this machine (pip install 'apao_ray[st]')")
    parser.add_argument("--disambiguate", action="store_true", help="make the last level a counter among items "
                        "sharing the other levels (TIGER), so that no two items share an ID (default: off; "
                        "collisions are reported)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="k-means and SVD seed (default 0): the same "
                        "IDs again on this machine; another machine's BLAS may give others (share the index file)")
    parser.add_argument("--min-interactions", type=int_at_least(3), default=5, help="k of the k-core filter on an interactions "
                        "table (default 5, the paper's five-core); recorded, and used again when the dataset loads")
    parser.add_argument("--output", help="index file to write (default <dir>/<Name>.index.rq-kmeans.json, or the "
                        "directory's existing index with --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing index file")
    parser.add_argument("--json", action="store_true", help="print the meta record as JSON")
    parser.set_defaults(handler=_run)
