"""Render the measured figures of README.md, BENCHMARKS.md, docs/ and the model cards from their sources.

A figure is written once: in the JSON a benchmark wrote (``docs/bench/*.json``) or in the code that defines
it (``qaccel/checkpoint/_layout.py`` for the checkpoint's files). A document shows it inside a marked block::

    <!-- rendered: NAME from docs/bench/comm.json -->
    ...what the renderer NAME makes of its sources...
    <!-- end rendered: NAME -->

``python -m qaccel.bench.docs_render`` rewrites every marked block (its begin marker included, so the
sources it names are always the renderer's); ``--check`` rewrites nothing and exits 1 naming each stale
block, which is what ``tests/unit/test_rendered_docs.py`` asserts on the repository. A block's prose lives
with its renderer (``_docs_blocks.py``, ``_docs_readme.py``); the text around the blocks is the documents' own.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ._docs_blocks import BLOCKS, Sources

__all__ = ["DOCUMENTS", "StaleBlock", "render_text", "render_document", "stale_blocks", "render_all", "main"]

logger = logging.getLogger(__name__)

#: the documents whose marked blocks are rendered, as globs under the repository root
DOCUMENTS = ("README.md", "BENCHMARKS.md", "docs/*.md", "model_cards/*.md")

# NAME or NAME(arg,arg); the sources after "from" are rewritten from the registry on every render
_BLOCK = re.compile(
    r"^<!-- rendered: (?P<spec>[\w-]+(?:\([^)\s]*\))?) from [^\n]*?-->\n(?P<body>.*?)^<!-- end rendered: (?P<end>[^\s]+) -->$",
    re.DOTALL | re.MULTILINE,
)
_SPEC = re.compile(r"^(?P<name>[\w-]+)(?:\((?P<args>[^)]*)\))?$")


@dataclass(frozen=True)
class StaleBlock:
    """A marked block whose text differs from what its renderer makes of its sources now."""

    document: str
    spec: str

    def __str__(self) -> str:
        return f"{self.document}: block '{self.spec}' is stale (run: python -m qaccel.bench.docs_render)"


def _parse_spec(spec: str, where: str) -> tuple[str, tuple[str, ...]]:
    match = _SPEC.match(spec)
    name = match["name"] if match else spec
    if not match or name not in BLOCKS:
        raise ValueError(f"{where}: rendered block '{spec}': unknown renderer; known: {', '.join(sorted(BLOCKS))}")
    args = tuple(a for a in (match["args"] or "").split(",") if a)
    return name, args


def render_text(text: str, sources: Sources, where: str = "<text>") -> str:
    """``text`` with every marked block re-rendered from ``sources``.

    Raises:
        ValueError: a block names an unknown renderer or argument, or its end marker names another block.
    """

    def one(match: re.Match) -> str:
        spec = match["spec"]
        if match["end"] != spec:
            raise ValueError(f"{where}: rendered block '{spec}' ends with 'end rendered: {match['end']}'; expected '{spec}'")
        name, args = _parse_spec(spec, where)
        block = BLOCKS[name]
        body = block.render(sources, args).rstrip("\n")
        named = ", ".join(block.sources(args))
        return f"<!-- rendered: {spec} from {named} -->\n{body}\n<!-- end rendered: {spec} -->"

    return _BLOCK.sub(one, text)


def _documents(root: Path) -> list[Path]:
    found: list[Path] = []
    for pattern in DOCUMENTS:
        found += sorted(root.glob(pattern))
    return found


def render_document(path: Path, sources: Sources) -> tuple[str, str]:
    """``(old, new)`` text of one document."""
    old = path.read_text(encoding="utf-8")
    return old, render_text(old, sources, str(path.relative_to(sources.root)))


def stale_blocks(root: str | Path) -> list[StaleBlock]:
    """Every marked block under ``root`` whose text is not what its renderer makes of its sources now."""
    sources = Sources(Path(root))
    stale = []
    for path in _documents(sources.root):
        old, new = render_document(path, sources)
        if old == new:
            continue
        where = str(path.relative_to(sources.root))
        old_blocks = {m["spec"]: m.group(0) for m in _BLOCK.finditer(old)}
        new_blocks = {m["spec"]: m.group(0) for m in _BLOCK.finditer(new)}
        stale += [StaleBlock(where, spec) for spec in old_blocks if old_blocks[spec] != new_blocks.get(spec)]
    return stale


def render_all(root: str | Path) -> list[str]:
    """Rewrite every document under ``root`` whose blocks are stale; returns the documents written."""
    sources = Sources(Path(root))
    written = []
    for path in _documents(sources.root):
        old, new = render_document(path, sources)
        if old != new:
            path.write_text(new, encoding="utf-8")
            written.append(str(path.relative_to(sources.root)))
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m qaccel.bench.docs_render [--check] [--root DIR]``: 0 fresh or rewritten, 1 stale under --check."""
    parser = argparse.ArgumentParser(prog="python -m qaccel.bench.docs_render", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="repository root holding README.md, BENCHMARKS.md and docs/bench/ (default: .)")
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 and name every stale block")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not (root / "docs" / "bench").is_dir():
        parser.error(f"--root {args.root}: no docs/bench/ folder there; pass the repository root")
    try:
        if args.check:
            stale = stale_blocks(root)
            for block in stale:
                print(block, file=sys.stderr)
            return 1 if stale else 0
        for document in render_all(root):
            print(f"rendered {document}", file=sys.stderr)
    except (ValueError, OSError) as exc:
        print(f"docs_render: {exc}", file=sys.stderr)
        return 1
    except KeyError as exc:  # a JSON without a field its renderer reads: an older or hand-made report
        print(f"docs_render: a benchmark JSON has no field {exc}; re-run the benchmark that writes it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
