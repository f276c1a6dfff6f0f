"""Sources: where a dataset's raw text comes from, as the raw train and eval tables the pipeline reads.

A user's ``DataSource`` (``--dataset_name``/``--train_file``, or a recipe's ``name: datasets``
section) is whatever ``datasets`` loads; ``load_raw_splits`` returns its train and validation
tables (streams with ``streaming``). Where the data comes from, first match wins:

- ``train_file`` (and ``validation_file``): local files of a format ``datasets`` reads, picked by
  extension (``FILE_BUILDERS``), through ``load_dataset(<format>, data_files=...)``;
- ``dataset_name`` naming a local folder written by ``save_to_disk`` (it holds ``state.json`` or
  ``dataset_dict.json``): ``datasets.load_from_disk``;
- ``dataset_name`` naming any other local folder (laid out like a Hub dataset repository: data
  files, optionally a README with ``configs``): ``load_dataset(folder, config)``;
- ``dataset_name`` otherwise: a Hub dataset id, ``load_dataset(id, config, revision=...)``.

The validation set is the ``validation_split`` (or ``validation_file``), or, with
``validation_split_percentage``, that share of the train split drawn with the run's seed
(``train_test_split``, so the same seed gives the same rows on every process and every run;
with ``streaming``, the stream's first P% of documents: ``stream_holdout``).

The recipes' built-in datasets are sources too, each materialised once as a local
``documents.jsonl`` and read back with ``datasets`` (``builtin_documents``):

- ``stdlib-text``: the standard-library corpus of :mod:`qaccel.zoo.corpus`.
- ``local-text``: your own files (``dataset.data_files``): ``.jsonl``/``.json`` with one
  ``{"text": ...}`` object per line, or ``.txt`` files, one document per file.
- ``stdlib-topics``: a classification set drawn from the stdlib corpus (``topics.jsonl``):
  docstrings of eight package families, the label being the family a docstring comes from.

Every record carries ``split_key`` (:func:`qaccel.zoo.corpus.split_key`): a record belongs to the
eval split when ``split_key < eval_fraction`` (``split_by_key``), so the split depends only on the text.
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._settings import env_flag
from ..checkpoint import atomic_open, atomic_write_text
from .corpus import build_corpus, data_root, read_records, split_key
from .data_source import FILE_BUILDERS, DataSource

if TYPE_CHECKING:
    import datasets

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
    "BuiltinDocuments",
    "builtin_documents",
    "split_by_key",
    "fingerprint",
    "check_hub_dataset",
    "load_raw_splits",
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


# -- a recipe's built-in dataset, as a table ---------------------------------------------------


def fingerprint(*parts: Any) -> str:
    """A datasets cache key from JSON-able parts (a table's fingerprint, the tokenizer's digest, the settings).

    Every table derived from a source (built-in or a user's) is keyed with it, so that the other
    processes and the next run find it in the datasets cache.
    """
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class BuiltinDocuments:
    """The records of a built-in dataset as a ``datasets.Dataset``, in file order.

    Attributes:
        table: the records (``text``, ``split_key``; ``label`` for ``stdlib-topics``).
        sha256: pins the content (the records file's SHA-256, or the source's fingerprint).
        cache_dir: the datasets cache of every table derived from it.
        label_names: class names by label id (``stdlib-topics``), else ``None``.
    """

    table: datasets.Dataset
    sha256: str
    cache_dir: str
    label_names: list[str] | None


def builtin_documents(name: str, data_files: tuple[str, ...] | list[str], task: str) -> BuiltinDocuments:
    """A recipe's built-in dataset (``stdlib-text``, ``local-text``, ``stdlib-topics``), built on first use (seconds)."""
    import datasets

    source = text_source(name, data_files)
    cache_dir = str(source.directory / "hf_datasets")
    if task == "sequence-classification":
        topics = build_topics(source)
        table = datasets.load_dataset("json", data_files=str(topics.path), split="train", cache_dir=cache_dir)
        return BuiltinDocuments(table, hashlib.sha256(topics.path.read_bytes()).hexdigest(), cache_dir, list(topics.meta["label_names"]))
    table = datasets.load_dataset("json", data_files=str(source.documents), split="train", cache_dir=cache_dir)
    return BuiltinDocuments(table, source.fingerprint, cache_dir, None)


def split_by_key(table: datasets.Dataset, eval_fraction: float, base: str) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The train and eval records (``split_key >= eval_fraction`` and ``<``), cached under keys derived from ``base``."""
    eval_part = table.filter(lambda k: k < eval_fraction, input_columns="split_key", new_fingerprint=fingerprint(base, "eval", eval_fraction))
    train_part = table.filter(lambda k: k >= eval_fraction, input_columns="split_key", new_fingerprint=fingerprint(base, "train", eval_fraction))
    return train_part, eval_part


# -- a user's DataSource, through datasets ---------------------------------------------------


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or any(env_flag(name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _offline_help(name: str) -> str:
    return (
        f"--dataset_name={name!r} is a Hugging Face Hub dataset id, and the Hub cannot be used here "
        "(HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set, or the Hub is unreachable). Pass local data instead: "
        "files with --train_file/--validation_file (csv, json/jsonl, parquet, txt, arrow), or a folder to "
        f"--dataset_name (one written by `datasets.load_dataset({name!r}).save_to_disk(DIR)` where there is network, "
        "or a copy of the dataset repository)"
    )


def check_hub_dataset(source: DataSource) -> None:
    """Fail in seconds, before any collective, when a Hub dataset cannot be reached or does not exist.

    Raises:
        RuntimeError: the Hub is offline (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) or unreachable.
        ValueError: no such dataset or revision.
    """
    name = source.dataset_name
    if _hub_offline():
        raise RuntimeError(_offline_help(name))
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        HfApi().dataset_info(name, revision=source.dataset_revision, timeout=10)
    except RepositoryNotFoundError:
        raise ValueError(f"--dataset_name={name!r}: no such dataset on the Hub (or it is private: log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise ValueError(f"--dataset_revision={source.dataset_revision!r}: no such revision of {name!r}") from None
    except OSError as err:  # requests' ConnectionError and timeouts are OSErrors
        raise RuntimeError(f"{_offline_help(name)} ({type(err).__name__}: {err})") from None


def _builder(path: str, flag: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FILE_BUILDERS:
        raise ValueError(f"{flag}={path!r}: unknown file type {suffix or '(none)'!r}; allowed: {', '.join(FILE_BUILDERS)}")
    if not Path(path).expanduser().is_file():
        raise ValueError(f"{flag}={path!r}: no such file")
    return FILE_BUILDERS[suffix]


def _load_dict(source: DataSource) -> datasets.DatasetDict | datasets.IterableDatasetDict:
    """The dataset's splits; with ``source.streaming`` as ``IterableDataset``s (nothing converted or cached)."""
    import datasets

    streaming = source.streaming
    kind = source.kind
    if kind == "files":
        files = {"train": source.train_file}
        if source.validation_file is not None:
            files["validation"] = source.validation_file
        builders = {flag: _builder(path, f"--{flag}_file") for flag, path in files.items()}
        if len(set(builders.values())) > 1:
            raise ValueError(f"--train_file and --validation_file: must be of one format, got {builders['train']} and {builders['validation']}")
        return datasets.load_dataset(builders["train"], data_files={k: str(Path(v).expanduser()) for k, v in files.items()}, streaming=streaming)
    if kind == "saved":
        loaded = datasets.load_from_disk(str(Path(source.dataset_name).expanduser()))
        tables = loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded})
        return datasets.IterableDatasetDict({name: table.to_iterable_dataset() for name, table in tables.items()}) if streaming else tables
    return datasets.load_dataset(source.dataset_name, source.dataset_config_name, revision=source.dataset_revision, streaming=streaming)


def load_raw_splits(source: DataSource, *, seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """The raw train and validation tables of ``source`` (columns as the data has them).

    With ``source.streaming`` they are ``datasets.IterableDataset``s, and with
    ``validation_split_percentage`` the validation table is ``None``: ``user_stream`` holds out the head.

    Raises:
        ValueError: a missing file or split (naming the splits there are).
        RuntimeError: a Hub id while offline.
    """
    if source.kind == "hub" and _hub_offline():
        raise RuntimeError(_offline_help(source.dataset_name))
    tables = _load_dict(source)
    train_split = "train" if source.kind == "files" else source.train_split
    where = source.train_file or source.dataset_name
    if train_split not in tables:
        raise ValueError(f"--train_split={train_split!r}: no such split in {where!r}; its splits: {', '.join(tables)}")
    train = tables[train_split]
    if source.validation_split_percentage is not None:
        if source.streaming:  # run_clm's `train[:P%]`: needs the stream's size or the tokenizer (stream_holdout)
            return train, None
        parts = train.train_test_split(test_size=source.validation_split_percentage / 100, seed=seed, shuffle=True)
        return parts["train"], parts["test"]
    validation_split = "validation" if source.kind == "files" else source.validation_split
    if validation_split not in tables:
        splits = f"--validation_split={validation_split!r}: no such split in {where!r}; its splits: {', '.join(tables)}. Pick one with --validation_split,"
        what = f"--train_file={where!r}: has no validation set;" if source.kind == "files" else splits
        carve = "hold out the stream's first P% of documents" if source.streaming else "carve a random P% out of the train split"
        raise ValueError(f"{what} pass --validation_file, or {carve} with --validation_split_percentage P")
    return train, tables[validation_split]
