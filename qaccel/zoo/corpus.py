"""An offline, licence-clean text corpus built from the running Python's own standard library.

Training recipes need real text, but nothing may be downloaded. Every Python installation ships
several MB of English prose under the PSF licence: the docstrings of its modules, classes and
functions, its source comments, and the language reference topics in ``pydoc_data.topics``. This
module extracts them (deterministically, in sorted file order), writes them once to a cache folder
and records where they came from in ``meta.json``.

Cache layout (``QACCEL_DATA_DIR``, default ``~/.cache/qaccel/data``)::

    <root>/py<version>-<key>/documents.jsonl   one JSON object per document (see Document)
    <root>/py<version>-<key>/meta.json         provenance: Python, stdlib path, sha256, counts
    <root>/py<version>-<key>/tokenizers/       tokenizers trained on this corpus
    <root>/py<version>-<key>/hf_datasets/      the datasets library's cache for this corpus

``key`` hashes the full ``sys.version``, the stdlib path and the extraction rules' version, so a
different interpreter or a change of the rules never reads a stale corpus. Files are written to a
temporary name and renamed into place, and ``meta.json`` is written last: several ranks may build
the corpus at the same time, each produces identical bytes, and a reader only ever sees complete
files.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import sys
import sysconfig
import tokenize
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..checkpoint import atomic_write_text, file_sha256
from ._pysource import CommentLine, comment_lines, docstrings, scan_tokens

__all__ = [
    "CORPUS_FORMAT_VERSION",
    "DATA_DIR_ENV",
    "Document",
    "CorpusFiles",
    "data_root",
    "corpus_dir",
    "extract_documents",
    "build_corpus",
    "read_records",
    "split_key",
]

CORPUS_FORMAT_VERSION = 1
DATA_DIR_ENV = "QACCEL_DATA_DIR"
DOCUMENTS_FILE = "documents.jsonl"
META_FILE = "meta.json"
DOCUMENT_KINDS = ("docstring", "comment", "topic")

# Folders that hold tests, vendored wheels, third-party packages or demo scripts, not library prose.
SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "_bundled", "lib-dynload", "turtledemo"}
)
MIN_COMMENT_WORDS = 5  # shorter comment blocks are mostly markers (XXX, noqa, pragma) or code


@dataclass(frozen=True)
class Document:
    """One text of the corpus.

    Attributes:
        id: where it comes from: ``path/in/stdlib.py:Qual.name`` for a docstring (``:<module>`` for
            the module's own), ``path.py#L<line>`` for a comment block, ``topics:<name>`` for a topic.
        source: the dotted module it belongs to (``email.message``); ``pydoc_data.topics`` for topics.
        kind: ``docstring``, ``comment`` or ``topic``.
        text: the cleaned text (``inspect.cleandoc`` rules for docstrings, ``#`` stripped for comments).
    """

    id: str
    source: str
    kind: str
    text: str


@dataclass(frozen=True)
class CorpusFiles:
    """Where a built corpus lives and its provenance record (the content of ``meta.json``)."""

    directory: Path
    documents: Path
    meta: dict[str, Any]


def split_key(text: str) -> float:
    """A number in [0, 1) fixed by the text alone (its SHA-256), used to split train from eval.

    A document goes to eval when ``split_key(text) < eval_fraction``. The key depends on nothing
    but the text, so the split survives re-ordering, new documents and other Python versions, and
    two identical texts always land on the same side (no train/eval leak through duplicates).
    """
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def data_root() -> Path:
    """``$QACCEL_DATA_DIR`` if set, else ``~/.cache/qaccel/data``."""
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qaccel" / "data"


def _stdlib_path() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_dir(root: Path | None = None) -> Path:
    """The cache folder of this interpreter's corpus: ``<root>/py<version>-<key>``."""
    root = data_root() if root is None else Path(root)
    key_text = f"{CORPUS_FORMAT_VERSION}|{sys.version}|{_stdlib_path()}"
    key = hashlib.sha256(key_text.encode("utf-8")).hexdigest()[:12]
    return root / f"py{platform.python_version()}-{key}"


# -- extraction ------------------------------------------------------------------------------


def _python_files(stdlib: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        # config-3.x-<platform> holds the build's Makefile and a few generated scripts
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py") and not f.startswith("test_"))
    return sorted(files, key=lambda p: p.relative_to(stdlib).as_posix())


def _module_name(relative: str) -> str:
    parts = relative.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _read_source(path: Path) -> str:
    raw = path.read_bytes()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    return raw.decode(encoding)


def _comment_blocks(comments: list[CommentLine], relative: str, module: str) -> Iterator[Document]:
    """Runs of whole-line comments on consecutive lines, joined into one document each."""
    block: list[CommentLine] = []

    def flush() -> Iterator[Document]:
        if block and block[0].line <= 2 and block[0].text.startswith(("!", "-*-")):
            block.pop(0)  # shebang or coding line
        text = "\n".join(c.text for c in block).strip()
        words = text.split()
        # mostly words, not commented-out code
        if len(words) >= MIN_COMMENT_WORDS and sum(w.isalpha() for w in words) * 2 >= len(words):
            yield Document(f"{relative}#L{block[0].line}", module, "comment", text)

    for comment in comments:
        if block and comment.line != block[-1].line + 1:
            yield from flush()
            block = []
        block.append(comment)
    if block:
        yield from flush()


def _topics() -> Iterator[Document]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield Document(f"topics:{name}", "pydoc_data.topics", "topic", text)


def extract_documents(stdlib: Path | None = None) -> list[Document]:
    """All corpus documents of the standard library at ``stdlib`` (default: this interpreter's).

    Order: files sorted by path; within a file, its docstrings in source order, then its comment
    blocks; then the reference topics sorted by name. An exact repeat of an earlier text is
    dropped (the first occurrence is kept).
    """
    stdlib = _stdlib_path() if stdlib is None else Path(stdlib)
    documents: list[Document] = []
    seen: set[str] = set()

    def add(doc: Document) -> None:
        if doc.text not in seen:
            seen.add(doc.text)
            documents.append(doc)

    for path in _python_files(stdlib):
        relative = path.relative_to(stdlib).as_posix()
        module = _module_name(relative)
        try:
            source = _read_source(path)
        except (SyntaxError, UnicodeDecodeError):
            continue  # an undecodable file (a bad coding cookie)
        tokens = scan_tokens(source)
        for doc in docstrings(source, tokens):
            add(Document(f"{relative}:{doc.qualname}", module, "docstring", doc.text))
        for doc in _comment_blocks(list(comment_lines(source, tokens)), relative, module):
            add(doc)
    for doc in _topics():
        add(doc)
    return documents


# -- the cache -------------------------------------------------------------------------------


def build_corpus(root: Path | None = None, *, force: bool = False) -> CorpusFiles:
    """Extract the corpus into its cache folder once and return its files and provenance.

    An existing, complete corpus (``meta.json`` present and the file's SHA-256 matching it) is
    reused unless ``force``. The first build scans about 700 files (a few seconds).
    """
    directory = corpus_dir(root)
    documents_path = directory / DOCUMENTS_FILE
    meta_path = directory / META_FILE
    if not force and meta_path.is_file() and documents_path.is_file():
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("files", {}).get(DOCUMENTS_FILE, {}).get("sha256") == file_sha256(documents_path):
            return CorpusFiles(directory, documents_path, meta)
    documents = extract_documents()
    lines = [json.dumps({**asdict(doc), "split_key": split_key(doc.text)}, ensure_ascii=False) for doc in documents]
    atomic_write_text(documents_path, "\n".join(lines) + "\n")
    kinds = Counter(doc.kind for doc in documents)
    chars = Counter()
    for doc in documents:
        chars[doc.kind] += len(doc.text)
    meta = {
        "format_version": CORPUS_FORMAT_VERSION,
        "python_version": platform.python_version(),
        "python": sys.version,
        "implementation": platform.python_implementation(),
        "stdlib": str(_stdlib_path()),
        "licence": "PSF-2.0 (text of the Python standard library: docstrings, comments, pydoc_data.topics)",
        "num_documents": len(documents),
        "num_characters": sum(chars.values()),
        "documents_by_kind": {kind: kinds.get(kind, 0) for kind in DOCUMENT_KINDS},
        "characters_by_kind": {kind: chars.get(kind, 0) for kind in DOCUMENT_KINDS},
        "files": {DOCUMENTS_FILE: {"sha256": file_sha256(documents_path), "bytes": documents_path.stat().st_size}},
    }
    atomic_write_text(meta_path, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return CorpusFiles(directory, documents_path, meta)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (for the corpus: ``id``, ``source``, ``kind``, ``text``,
    ``split_key``), in file order."""
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
