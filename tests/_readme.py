"""The README's text and fenced blocks, and its opening snippet before and after the one-line switch.

Shared by ``tests/unit/test_readme.py`` (every command and import the README shows is real) and
``tests/e2e/test_readme_snippet.py`` (the snippet runs under torchrun).
"""

from __future__ import annotations

import re

from tests._commands import REPO

__all__ = ["README", "fenced_blocks", "readme_text", "snippet"]

README = REPO / "README.md"


def readme_text() -> str:
    """README.md as it is on disk."""
    return README.read_text(encoding="utf-8")


def fenced_blocks(lang: str) -> list[str]:
    """The bodies of the README's fenced blocks of language ``lang``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", readme_text(), flags=re.M | re.S)


def snippet(version: str) -> str:
    """The opening diff as the file before (``-`` lines) or after (``+`` lines) the switch."""
    (diff,) = fenced_blocks("diff")
    drop = "+" if version == "before" else "-"
    return "".join(line[1:] + "\n" for line in diff.splitlines() if line[:1] in ("", " ", "+", "-") and line[:1] != drop)
