"""The paper's datasets for the tests that read them: where they are (``SHARED_DATASETS``: ``$APAO_DATA_DIR``, else
``../shared/datasets`` beside the checkout) and one way to skip, saying where they were looked for, where they are
absent (a user's clone has no ``../shared/``)."""
from __future__ import annotations

import pytest

from conftest import SHARED_DATASETS


def has_shared(dataset: str = "Office") -> bool:
    """Whether ``dataset``'s interactions file is in SHARED_DATASETS."""
    return (SHARED_DATASETS / dataset / f"{dataset}.inter.json").is_file()


def shared_absent_reason(dataset: str = "Office") -> str:
    return f"shared datasets not found at {SHARED_DATASETS} (no {dataset}/{dataset}.inter.json)"


# the mark of a test (or, as ``pytestmark``, a module) that reads Office from SHARED_DATASETS
needs_shared = pytest.mark.skipif(not has_shared(), reason=shared_absent_reason())


def require_shared(dataset: str = "Office") -> None:
    """Skip the calling test or fixture where ``dataset`` is absent from SHARED_DATASETS."""
    if not has_shared(dataset):
        pytest.skip(shared_absent_reason(dataset))
