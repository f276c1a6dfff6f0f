"""Text sources of the recipes' datasets, each materialised once as a local ``documents.jsonl``.

- ``stdlib-text``: the standard-library corpus of :mod:`qaccel.zoo.corpus`.
- ``local-text``: your own files (``dataset.data_files``): ``.jsonl``/``.json`` with one
  ``{"text": ...}`` object per line, or ``.txt`` files, one document per file.
- ``stdlib-topics``: a classification set drawn from the stdlib corpus (``topics.jsonl``):
  docstrings of eight package families, the label being the family a docstring comes from.

Every record carries ``split_key`` (:func:`qaccel.zoo.corpus.split_key`): a record belongs to the
eval split when ``split_key < eval_fraction``, so the split depends only on the text.
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint import atomic_open, atomic_write_text
from .corpus import build_corpus, data_root, read_records, split_key

__all__ = [
    "TOPIC_FAMILIES",
    "MIN_TOPIC_WORDS",
    "TextSource",
    "TopicsFiles",
    "stdlib_source",
    "local_source",
    "text_source",
    "build_topics",
    "train_texts",
]

# Package families present in every CPython build (tkinter and idlelib are separate packages on
# some Linux distributions, distutils and lib2to3 are gone from 3.12/3.13), well populated, and
# about distinct subjects. A bag-of-words logistic regression reaches about 79% eval accuracy
# on Python 3.11 (chance: 12.5%): learnable, not trivial.
TOPIC_FAMILIES = ("asyncio", "email", "http", "importlib", "logging", "multiprocessing", "unittest", "xml")
MIN_TOPIC_WORDS = 8  # shorter docstrings ("Return the loop.") carry too little to classify
TOPICS_FILE = "topics.jsonl"
TOPICS_META_FILE = "topics.json"
LOCAL_FORMAT_VERSION = 1


@dataclass(frozen=True)
class TextSource:
    """A materialised text source.

    Attributes:
        name: ``stdlib-text`` or ``local-text``.
        directory: its cache folder (tokenizers and the datasets cache live below it).
        documents: the ``documents.jsonl`` file (``id``, ``source``, ``kind``, ``text``, ``split_key``).
        fingerprint: pins the content (the corpus's SHA-256 for ``stdlib-text``; a hash of the
            input files' paths, sizes and modification times for ``local-text``); keys every
            derived cache.
    """

    name: str
    directory: Path
    documents: Path
    fingerprint: str


@dataclass(frozen=True)
class TopicsFiles:
    """The ``stdlib-topics`` records and their description (label names, cap, class counts)."""

    path: Path
    meta: dict[str, Any]


def stdlib_source() -> TextSource:
    """The standard-library corpus, built on first use."""
    files = build_corpus()
    return TextSource("stdlib-text", files.directory, files.documents, files.meta["files"][files.documents.name]["sha256"])


def _expand(patterns: tuple[str, ...] | list[str]) -> list[Path]:
    paths: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not matches:
            raise ValueError(f"dataset.data_files: {pattern!r} matches no file")
        paths.extend(Path(m).resolve() for m in matches)
    for path in paths:
        if path.suffix not in (".jsonl", ".json", ".txt"):
            raise ValueError(f"dataset.data_files: {str(path)!r}: unsupported file type; use .jsonl/.json (one {{'text': ...}} per line) or .txt (one document per file)")
    return paths


def _local_records(paths: list[Path]) -> Iterator[dict[str, Any]]:
    for path in paths:
        if path.suffix == ".txt":
            text = path.read_text(encoding="utf-8").strip()
            if text:
                yield {"id": str(path), "source": path.name, "kind": "file", "text": text}
            continue
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                item = json.loads(line)
                if not isinstance(item, dict) or not isinstance(item.get("text"), str):
                    raise ValueError(f"{path}:{number}: expected a JSON object with a string 'text' field")
                if item["text"].strip():
                    yield {"id": f"{path}:{number}", "source": path.name, "kind": "line", "text": item["text"]}


def local_source(data_files: tuple[str, ...] | list[str]) -> TextSource:
    """Your files as a text source, materialised under ``<data root>/local-<key>``.

    The key hashes each file's resolved path, size and modification time, so editing a file
    rebuilds the source.
    """
    paths = _expand(data_files)
    key_text = json.dumps([LOCAL_FORMAT_VERSION] + [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths])
    directory = data_root() / f"local-{hashlib.sha256(key_text.encode()).hexdigest()[:12]}"
    documents = directory / "documents.jsonl"
    if not documents.is_file():
        count = 0
        with atomic_open(documents) as handle:  # streamed: the corpus need not fit in memory
            for record in _local_records(paths):
                handle.write(json.dumps({**record, "split_key": split_key(record["text"])}, ensure_ascii=False) + "\n")
                count += 1
            if count == 0:
                raise ValueError(f"dataset.data_files {list(data_files)}: no non-empty document found")
    # the key already pins every input file; hashing a large corpus on every load would be slow
    fingerprint = hashlib.sha256(f"{key_text}|{documents.stat().st_size}".encode()).hexdigest()
    return TextSource("local-text", directory, documents, fingerprint)


def text_source(dataset_name: str, data_files: tuple[str, ...] | list[str] = ()) -> TextSource:
    """The text source behind a recipe's dataset (``stdlib-topics`` draws on ``stdlib-text``)."""
    if dataset_name in ("stdlib-text", "stdlib-topics"):
        return stdlib_source()
    if dataset_name == "local-text":
        return local_source(data_files)
    raise ValueError(f"dataset.name={dataset_name!r}: unknown; valid: stdlib-text, stdlib-topics, local-text")


def train_texts(source: TextSource, eval_fraction: float) -> list[str]:
    """The texts of the train split, in file order (what a tokenizer is trained on)."""
    return [r["text"] for r in read_records(source.documents) if r["split_key"] >= eval_fraction]


def _selection_key(text: str) -> bytes:
    # independent of split_key, so that capping a class does not favour either split
    return hashlib.sha256(("select:" + text).encode("utf-8")).digest()


def build_topics(source: TextSource | None = None) -> TopicsFiles:
    """Write (once) and return the ``stdlib-topics`` records.

    Each record: ``text`` (a docstring of at least ``MIN_TOPIC_WORDS`` words), ``label`` (index in
    ``TOPIC_FAMILIES``), ``source`` (its module, e.g. ``email.message``), ``id`` and ``split_key``.
    Every class is capped at the size of the smallest one (the docstrings kept are those with the
    lowest ``sha256("select:" + text)``), so the classes are exactly balanced. Records are ordered
    by that selection key, which mixes the classes (a ``max_train_examples`` prefix stays balanced).
    """
    source = stdlib_source() if source is None else source
    path = source.directory / TOPICS_FILE
    meta_path = source.directory / TOPICS_META_FILE
    if path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("corpus_sha256") == source.fingerprint:
            return TopicsFiles(path, meta)
    by_family: dict[str, list[dict[str, Any]]] = {family: [] for family in TOPIC_FAMILIES}
    for record in read_records(source.documents):
        family = record["source"].split(".")[0]
        if record["kind"] == "docstring" and family in by_family and len(record["text"].split()) >= MIN_TOPIC_WORDS:
            by_family[family].append(record)
    available = {family: len(items) for family, items in by_family.items()}
    cap = min(available.values())
    selected = []
    for label, family in enumerate(TOPIC_FAMILIES):
        for record in sorted(by_family[family], key=lambda r: _selection_key(r["text"]))[:cap]:
            selected.append({"id": record["id"], "source": record["source"], "text": record["text"], "label": label, "split_key": record["split_key"]})
    selected.sort(key=lambda r: _selection_key(r["text"]))
    atomic_write_text(path, "\n".join(json.dumps(r, ensure_ascii=False) for r in selected) + "\n")
    meta = {
        "corpus_sha256": source.fingerprint,
        "label_names": list(TOPIC_FAMILIES),
        "min_words": MIN_TOPIC_WORDS,
        "available_per_class": available,
        "per_class": cap,
        "num_examples": len(selected),
        "label_counts": dict(Counter(TOPIC_FAMILIES[r["label"]] for r in selected)),
    }
    atomic_write_text(meta_path, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return TopicsFiles(path, meta)
