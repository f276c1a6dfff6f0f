"""A fast lexical scan of Python source: docstrings and comment lines, without building an AST.

``ast.parse`` and ``tokenize`` over the ~12 MB of the standard library take 20 s of CPU or more
on a small machine (they create a Python object per node or token); the corpus needs only the
strings and comments. One compiled regular expression finds every string literal and comment
(both are self-delimiting in valid Python: a quote or ``#`` outside them always starts one), and
a short walk over each ``def``/``class`` header finds the ``:`` that ends it. A string literal
that is the first statement of a module, class or function body is its docstring, exactly as
the compiler defines it. tests/unit/test_zoo_corpus.py checks the result against ``ast``.

Known difference from ``ast``: a docstring written as implicitly concatenated literals
(``"a" "b"``) is not recognised (none exists in the standard library).
"""

from __future__ import annotations

import ast
import bisect
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Docstring", "CommentLine", "scan_tokens", "docstrings", "comment_lines"]

# Unrolled-loop bodies ([^q\\]*(?:\\.[^q\\]*)*) keep the scan linear.
_TRIPLE_DQ = r'"""[^"\\]*(?:(?:\\.|"(?!""))[^"\\]*)*"""'
_TRIPLE_SQ = r"'''[^'\\]*(?:(?:\\.|'(?!''))[^'\\]*)*'''"
_SINGLE_DQ = r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'
_SINGLE_SQ = r"'[^'\\\n]*(?:\\.[^'\\\n]*)*'"
_TOKEN = re.compile(
    r"(?P<string>(?P<prefix>(?<!\w)(?:[rR][bBfF]?|[bBfF][rR]?|[uU]))?"
    rf"(?:{_TRIPLE_DQ}|{_TRIPLE_SQ}|{_SINGLE_DQ}|{_SINGLE_SQ}))"
    r"|(?P<comment>#[^\n]*)",
    re.DOTALL,
)
_HEADER = re.compile(r"^([ \t]*)(?:async[ \t]+)?(?:def|class)[ \t]+(\w+)", re.MULTILINE)
_BLANK = " \t\r\n\f\\"  # a backslash continuation may sit between a header and its docstring


@dataclass(frozen=True)
class Docstring:
    """A docstring: the qualified name it documents (``"<module>"`` for the module) and its text."""

    qualname: str
    line: int
    text: str


@dataclass(frozen=True)
class CommentLine:
    """A comment that is alone on its line (no code before it): 1-based line and text after ``#``."""

    line: int
    text: str


@dataclass(frozen=True)
class _Token:
    start: int
    end: int
    kind: str  # "string" or "comment"
    prefix: str


def scan_tokens(source: str) -> list[_Token]:
    """Every string literal and comment of ``source``, in order."""
    tokens = []
    for match in _TOKEN.finditer(source):
        kind = "string" if match.group("string") is not None else "comment"
        tokens.append(_Token(match.start(), match.end(), kind, (match.group("prefix") or "").lower()))
    return tokens


class _Cursor:
    """Skips blanks and comments; knows whether a position lies inside a literal or comment."""

    def __init__(self, source: str, tokens: list[_Token]) -> None:
        self.source = source
        self.tokens = tokens
        self.starts = [t.start for t in tokens]
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", source)]

    def line_of(self, pos: int) -> int:
        """1-based line number of ``pos``."""
        return bisect.bisect_right(self.line_starts, pos)

    def token_at(self, pos: int) -> _Token | None:
        """The token starting exactly at ``pos``."""
        i = bisect.bisect_left(self.starts, pos)
        return self.tokens[i] if i < len(self.tokens) and self.tokens[i].start == pos else None

    def inside_token(self, pos: int) -> bool:
        i = bisect.bisect_right(self.starts, pos) - 1
        return i >= 0 and self.tokens[i].start < pos < self.tokens[i].end

    def skip_blank(self, pos: int) -> int:
        """The first position at or after ``pos`` that is neither blank nor inside a comment."""
        n = len(self.source)
        while pos < n:
            if self.source[pos] in _BLANK:
                pos += 1
                continue
            token = self.token_at(pos)
            if token is not None and token.kind == "comment":
                pos = token.end
                continue
            break
        return pos

    def header_end(self, pos: int) -> int | None:
        """Position just after the ``:`` that ends a def/class header starting at ``pos``."""
        depth = 0
        n = len(self.source)
        while pos < n:
            char = self.source[pos]
            if char in "\"'#" or char.isalpha():
                token = self.token_at(pos)  # a literal (maybe prefixed: r"...") or a comment
                if token is not None:
                    pos = token.end
                    continue
            if char in "([{":
                depth += 1
            elif char in ")]}":
                depth -= 1
            elif char == ":" and depth == 0:
                return pos + 1
            pos += 1
        return None

    def docstring_at(self, pos: int) -> str | None:
        """The docstring whose literal starts at ``pos``, if the statement there is a lone string."""
        token = self.token_at(pos)
        if token is None or token.kind != "string" or "f" in token.prefix or "b" in token.prefix:
            return None
        after = token.end
        while after < len(self.source) and self.source[after] in " \t":
            after += 1
        if after < len(self.source) and self.source[after] not in "\r\n#;":
            return None  # e.g. "...".format(x), an attribute access, or implicit concatenation
        value = ast.literal_eval(self.source[token.start : token.end])
        return inspect.cleandoc(value) if isinstance(value, str) else None


def docstrings(source: str, tokens: list[_Token] | None = None) -> Iterator[Docstring]:
    """The module, class and function docstrings of ``source``, in source order."""
    tokens = scan_tokens(source) if tokens is None else tokens
    cursor = _Cursor(source, tokens)
    first = cursor.skip_blank(0)
    text = cursor.docstring_at(first)
    if text:
        yield Docstring("<module>", cursor.line_of(first), text)
    stack: list[tuple[int, str]] = []  # (indent width, name) of the enclosing defs/classes
    for match in _HEADER.finditer(source):
        if cursor.inside_token(match.start(2)):
            continue  # a "def" inside a string literal or comment
        indent = len(match.group(1).expandtabs(8))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        qualname = ".".join([name for _, name in stack] + [match.group(2)])
        stack.append((indent, match.group(2)))
        end = cursor.header_end(match.end())
        if end is None:
            continue
        start = cursor.skip_blank(end)
        text = cursor.docstring_at(start)
        if text:
            yield Docstring(qualname, cursor.line_of(start), text)


def comment_lines(source: str, tokens: list[_Token] | None = None) -> Iterator[CommentLine]:
    """Comments with nothing but indentation before them on their line."""
    tokens = scan_tokens(source) if tokens is None else tokens
    cursor = _Cursor(source, tokens)
    for token in tokens:
        if token.kind != "comment":
            continue
        line_start = source.rfind("\n", 0, token.start) + 1
        if source[line_start : token.start].strip():
            continue
        body = source[token.start + 1 : token.end].rstrip("\r")
        yield CommentLine(cursor.line_of(token.start), body[1:] if body.startswith(" ") else body)
