"""The one module that reads the private surface of Hugging Face ``datasets`` (style guide §9).

Checked against datasets 5.2.0 (:data:`DATASETS`). What is read, and why no public API does it:

- ``Dataset._fingerprint``: the hash ``datasets`` keeps of a table's content and history, the base
  of every derived table's cache key (``map(new_fingerprint=...)``). A user's map-style table is
  keyed from it, with the tokenizer's digest and the settings, so that every process and the next
  run reuse one cache; ``datasets`` offers no public accessor (``generate_fingerprint`` hashes the
  whole state instead, which is another key and, for an in-memory table, costs a pass over it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._upstream import PrivateSurface

if TYPE_CHECKING:
    import datasets

__all__ = ["DATASETS", "table_fingerprint"]

DATASETS = PrivateSurface("datasets", ("5.2.0",), "qaccel.zoo._datasets_internals")


def table_fingerprint(table: datasets.Dataset) -> str:
    """The fingerprint ``datasets`` holds for ``table`` (the cache key its derived tables build on)."""
    return DATASETS.get(table, "_fingerprint", "the cache key of a user's tokenized dataset")
