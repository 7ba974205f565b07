"""Item vectors for the quantizer: from a user's file, from a sentence-transformers model found
locally, or (default, no download) TF-IDF over the item texts reduced by truncated SVD.

Every source returns ``(vectors, description)``; the description goes into the index's meta
file so a catalog says what its semantic IDs were built from.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..data.files import _read_json

TEXT_FIELDS = ("title", "brand", "categories", "description")
DEFAULT_ENCODER = "tfidf-svd"
DEFAULT_DIMENSIONS = 128


def read_item_texts(path: Path) -> dict[str, str]:
    """``{item id: {"title", "brand", "categories", "description"}}`` (``<Name>.item.json``) -> one
    text per item, its fields joined in that order; fields may be strings or lists of strings."""
    raw = _read_json(path)
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: expected a non-empty JSON object {{item id: {{{', '.join(TEXT_FIELDS)}}}}}")
    texts = {}
    for item, record in raw.items():
        if not isinstance(record, dict):
            raise ValueError(f"{path}: item {item!r} has {type(record).__name__} {str(record)[:60]!r}; expected an "
                             f"object with some of the fields {list(TEXT_FIELDS)}")
        parts = []
        for name in TEXT_FIELDS:
            value = record.get(name) or ""
            parts.append(" ".join(map(str, value)) if isinstance(value, list) else str(value))
        texts[str(item)] = " . ".join(p for p in parts if p)
    return texts


def tfidf_svd(texts: list[str], dimensions: int = DEFAULT_DIMENSIONS, seed: int = 0) -> tuple[np.ndarray, str]:
    """(I, D) L2-normalised LSA vectors: TF-IDF (words and bigrams, sublinear tf) then truncated SVD."""
    # lazy: scikit-learn, only when tokenizing; every command's parser imports this package
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.preprocessing import normalize

    vectorizer = TfidfVectorizer(sublinear_tf=True, ngram_range=(1, 2), min_df=2, max_features=100_000,
                                 stop_words="english")
    try:
        matrix = vectorizer.fit_transform(texts)                                  # (I, vocabulary) sparse
    except ValueError:  # every word below min_df (a tiny catalog): keep all words
        vectorizer.set_params(min_df=1)
        matrix = vectorizer.fit_transform(texts)
    dimensions = max(1, min(dimensions, matrix.shape[1] - 1, len(texts) - 1))
    vectors = TruncatedSVD(dimensions, algorithm="randomized", n_iter=7, random_state=seed).fit_transform(matrix)
    description = (f"tfidf-svd: TF-IDF over item {'/'.join(TEXT_FIELDS)} ({matrix.shape[1]:,} terms, "
                   f"1-2 grams, sublinear tf) -> truncated SVD to {dimensions} dims, seed {seed}, L2-normalised")
    return normalize(vectors).astype(np.float32), description


def sentence_encoder(texts: list[str], name: str) -> tuple[np.ndarray, str]:
    """Vectors from a sentence-transformers model that is already on this machine (never downloaded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a missing model is an error, not a download
    try:
        from sentence_transformers import SentenceTransformer  # lazy: an optional extra
    except ImportError:
        raise ValueError(f"--encoder {name!r} needs sentence-transformers: pip install 'apao_ray[st]' (or use the "
                         f"default {DEFAULT_ENCODER!r}, which needs no download)") from None
    try:
        model = SentenceTransformer(name, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"sentence-transformers model {name!r} is not available locally ({error}); download it "
                         f"first or use --encoder {DEFAULT_ENCODER}") from None
    vectors = model.encode(texts, batch_size=64, normalize_embeddings=True, show_progress_bar=False)
    return np.asarray(vectors, dtype=np.float32), f"sentence-transformers {name} over item {'/'.join(TEXT_FIELDS)}"


def read_vectors(path: Path, item_ids: list[str], text_order: list[str] | None) -> tuple[np.ndarray, str]:
    """Vectors from a file, rows matched to ``item_ids``.

    ``.parquet``: an ``item`` (or ``item_id``) column and either an ``embedding`` list column or
    numeric columns. ``.npy``: an (I, D) array whose rows follow the item-text file's order
    (``text_order``), or ``item_ids`` order when there is no item-text file.
    """
    path = Path(path)
    if path.suffix == ".npy":
        array = np.load(path, allow_pickle=False)
        order = text_order or item_ids
        if array.ndim != 2 or len(array) != len(order):
            raise ValueError(f"{path}: shape {array.shape}; expected ({len(order)}, D), one row per item in the "
                             f"{'item-text file' if text_order else 'dataset'}'s order")
        by_id = dict(zip(order, array))
    elif path.suffix == ".parquet":
        import pandas as pd  # lazy: only for a Parquet file

        frame = pd.read_parquet(path)
        id_column = next((c for c in ("item", "item_id") if c in frame.columns), None)
        if id_column is None:
            raise ValueError(f"{path}: no 'item' or 'item_id' column; found {list(frame.columns)}")
        if "embedding" in frame.columns:
            rows = np.stack([np.asarray(v, dtype=np.float32) for v in frame["embedding"]])
        else:
            rows = frame.drop(columns=[id_column]).select_dtypes("number").to_numpy(np.float32)
        by_id = dict(zip(frame[id_column].astype(str), rows))
    else:
        raise ValueError(f"--embeddings {str(path)!r}: expected a .npy or .parquet file")
    missing = [item for item in item_ids if item not in by_id]
    if missing:
        raise ValueError(f"{path}: no vector for {len(missing)} item(s) of the dataset, e.g. {missing[:5]}")
    vectors = np.stack([by_id[item] for item in item_ids]).astype(np.float32)
    if not np.isfinite(vectors).all():
        raise ValueError(f"{path}: vectors contain NaN or infinite values")
    return vectors, f"file {path.name} ({vectors.shape[1]} dims)"


def item_vectors(item_ids: list[str], item_path: Path | None, embeddings: Path | None, encoder: str,
                 seed: int = 0) -> tuple[np.ndarray, str, int]:
    """(I, D) vectors for ``item_ids``, their description and how many items had no text."""
    texts = read_item_texts(item_path) if item_path else None
    if embeddings is not None:
        vectors, description = read_vectors(embeddings, item_ids, list(texts) if texts else None)
        return vectors, description, 0
    if texts is None:
        raise ValueError("no item texts (<Name>.item.json or items.json) in the dataset directory; add one, or pass "
                         "--embeddings FILE (.npy or .parquet item vectors)")
    ordered = [texts.get(item, "") for item in item_ids]
    num_without_text = sum(not text for text in ordered)
    if encoder == DEFAULT_ENCODER:
        vectors, description = tfidf_svd(ordered, seed=seed)
    else:
        vectors, description = sentence_encoder(ordered, encoder)
    return vectors, description, num_without_text


def describe_source(description: str, num_without_text: int) -> str:
    return description + (f"; {num_without_text} item(s) without text" if num_without_text else "")
