"""The offline stdlib corpus: extraction matches ast/tokenize, builds are deterministic and recorded."""

import ast
import hashlib
import inspect
import io
import json
import platform
import sysconfig
import tokenize
from collections import Counter

import pytest

from qaccel.checkpoint import atomic_open
from qaccel.zoo import _pysource
from qaccel.zoo.corpus import _python_files, build_corpus, corpus_dir, read_records, split_key


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "zoo-data"  # shared with the other zoo test modules
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QACCEL_DATA_DIR", str(root))
        files = build_corpus()
        yield files, read_records(files.documents)


def _reference_docstrings(source: str) -> list[str]:
    tree = ast.parse(source)
    found = [ast.get_docstring(tree)] if ast.get_docstring(tree) else []
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            found.append(ast.get_docstring(node))
    return found


def _reference_comments(source: str) -> list[tuple[int, str]]:
    lines = source.splitlines()
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1][: tok.start[1]].strip():
            body = tok.string[1:]
            found.append((tok.start[0], body[1:] if body.startswith(" ") else body))
    return found


def test_scanner_matches_ast_and_tokenize_on_stdlib_files():
    files = _python_files(__import__("pathlib").Path(sysconfig.get_paths()["stdlib"]))[::12]
    assert len(files) > 40
    for path in files:
        source = path.read_text(encoding="utf-8")
        tokens = _pysource.scan_tokens(source)
        got = [d.text for d in _pysource.docstrings(source, tokens)]
        assert Counter(got) == Counter(_reference_docstrings(source)), path
        assert [(c.line, c.text) for c in _pysource.comment_lines(source, tokens)] == _reference_comments(source), path


EDGE_CASES = "\n".join(
    [
        "#!/usr/bin/env python",
        "# a module comment",
        '"""Module doc with a # hash and a \'quote\'."""',
        "import re",
        "",
        'x = "def fake():  # not a def, not a comment"',
        'y = f"{x}"  # trailing comment',
        "",
        "class Outer(Base, metaclass=Meta):",
        "    # a comment before the docstring",
        '    r"""Outer doc \\d+."""',
        "",
        '    def method(self, a=lambda: 1, b={"k": 2}, c=x[1:2]) -> dict[str, int]:',
        '        """Method doc."""',
        "",
        "        def inner():",
        '            "Inner doc."',
        "",
        '    async def run(self): "One-line async doc."',
        "",
        "def not_doc():",
        '    "{} formatted".format(1)',
        "",
        "def fstring():",
        '    f"""not a docstring {x}"""',
        "",
        'def annotated(a: "str: with colon" = ":") -> None:',
        "    \'\'\'Single-quoted triple doc, with \"quotes\" and \\\'\'\' escapes.\'\'\'",
        "",
        '@decorator(":")',
        "def decorated():",
        '    """Decorated doc."""',
        "",
    ]
)


def test_scanner_edge_cases_against_ast():
    got = [(d.qualname, d.text) for d in _pysource.docstrings(EDGE_CASES)]
    assert Counter(text for _, text in got) == Counter(_reference_docstrings(EDGE_CASES))
    assert dict(got) == {
        "<module>": "Module doc with a # hash and a 'quote'.",
        "Outer": "Outer doc \\d+.",
        "Outer.method": "Method doc.",
        "Outer.method.inner": "Inner doc.",
        "Outer.run": "One-line async doc.",
        "annotated": "Single-quoted triple doc, with \"quotes\" and ''' escapes.",
        "decorated": "Decorated doc.",
    }
    assert [(c.line, c.text) for c in _pysource.comment_lines(EDGE_CASES)] == _reference_comments(EDGE_CASES)


def test_corpus_content_is_real_stdlib_text(corpus):
    _, records = corpus
    by_id = {r["id"]: r for r in records}
    assert by_id["json/__init__.py:dumps"]["text"] == inspect.getdoc(json.dumps)
    assert by_id["json/__init__.py:dumps"]["source"] == "json" and by_id["json/__init__.py:dumps"]["kind"] == "docstring"
    from pydoc_data.topics import topics

    assert by_id["topics:assert"]["text"] == topics["assert"].strip()
    assert not any(r["id"].split("/")[0] in ("test", "site-packages") for r in records)
    texts = [r["text"] for r in records]
    assert len(set(texts)) == len(texts), "exact repeats are dropped"
    kinds = Counter(r["kind"] for r in records)
    assert kinds["docstring"] > 1000 and kinds["comment"] > 1000 and kinds["topic"] > 50
    assert sum(len(t) for t in texts) > 2_000_000  # several MB of text


def test_provenance_record(corpus):
    files, records = corpus
    meta = json.loads((files.directory / "meta.json").read_text())
    assert meta == files.meta
    assert meta["files"]["documents.jsonl"]["sha256"] == hashlib.sha256(files.documents.read_bytes()).hexdigest()
    assert meta["files"]["documents.jsonl"]["bytes"] == files.documents.stat().st_size
    assert meta["num_documents"] == len(records)
    assert meta["num_characters"] == sum(len(r["text"]) for r in records)
    assert meta["documents_by_kind"] == dict(Counter(r["kind"] for r in records))
    assert meta["python_version"] == platform.python_version()
    assert meta["stdlib"] == sysconfig.get_paths()["stdlib"]
    assert files.directory.name.startswith(f"py{platform.python_version()}-")
    assert files.directory == corpus_dir()


def test_rebuilding_elsewhere_gives_identical_bytes(corpus, tmp_path):
    files, _ = corpus
    again = build_corpus(tmp_path)
    assert again.documents.read_bytes() == files.documents.read_bytes()


def test_a_built_corpus_is_reused_and_a_damaged_one_rebuilt(tmp_path, monkeypatch):
    from qaccel.zoo import corpus as corpus_module

    calls = []

    def extract():
        calls.append(1)
        return [corpus_module.Document("a.py:<module>", "a", "docstring", "Alpha text."), corpus_module.Document("topics:b", "pydoc_data.topics", "topic", "Beta.")]

    monkeypatch.setattr(corpus_module, "extract_documents", extract)
    first = build_corpus(tmp_path)
    original, stamp = first.documents.read_bytes(), first.documents.stat().st_mtime_ns
    assert [r["text"] for r in read_records(first.documents)] == ["Alpha text.", "Beta."]
    assert first.meta["num_documents"] == 2 and first.meta["num_characters"] == len("Alpha text.") + len("Beta.")
    assert build_corpus(tmp_path).documents.stat().st_mtime_ns == stamp and len(calls) == 1
    with first.documents.open("ab") as handle:
        handle.write(b"{}\n")
    assert build_corpus(tmp_path).documents.read_bytes() == original and len(calls) == 2


def test_split_keys_are_the_text_hash_and_the_split_is_stable(corpus):
    _, records = corpus
    for record in records[:: len(records) // 50]:
        digest = hashlib.sha256(record["text"].encode("utf-8")).digest()
        assert record["split_key"] == int.from_bytes(digest[:8], "big") / 2**64 == split_key(record["text"])
    small = {r["id"] for r in records if r["split_key"] < 0.02}
    large = {r["id"] for r in records if r["split_key"] < 0.05}
    assert small < large  # growing eval_fraction only moves documents from train to eval
    n = len(records)
    assert abs(len(small) - 0.02 * n) < 5 * (0.02 * 0.98 * n) ** 0.5


def test_atomic_open_leaves_no_partial_file(tmp_path):
    target = tmp_path / "sub" / "file.txt"
    with pytest.raises(RuntimeError):
        with atomic_open(target) as handle:
            handle.write("half")
            raise RuntimeError("crash mid-write")
    assert not target.exists() and list(target.parent.iterdir()) == []
    with atomic_open(target) as handle:
        handle.write("whole")
    assert target.read_text() == "whole" and [p.name for p in target.parent.iterdir()] == ["file.txt"]
