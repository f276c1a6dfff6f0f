"""JSON output shared by the subcommands."""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCHEMA_VERSION = 1


def emit(report: dict, json_path: str | None = None) -> None:
    """Print ``report`` as JSON on stdout and, if asked, write it atomically to ``json_path``."""
    report = {"schema_version": SCHEMA_VERSION, **report}
    text = json.dumps(report, indent=2, sort_keys=True, default=str)
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(path)
    sys.stdout.write(text + "\n")


def format_table(rows: list[dict[str, str]], columns: tuple[str, ...]) -> str:
    """``rows`` as a plain-text table: upper-case headers, columns padded to their widest cell."""
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip()]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in columns).rstrip() for r in rows]
    return "\n".join(lines) + "\n"


def report_usage_error(command: str, error: BaseException) -> int:
    """Bad input to ``qaccel <command>``: one line on stderr, exit status 2 (``QACCEL_DEBUG=1``: the traceback too)."""
    from .._errors import report_bad_input

    return report_bad_input(f"qaccel {command}", error)
