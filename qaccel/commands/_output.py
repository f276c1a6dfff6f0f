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
