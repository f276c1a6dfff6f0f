"""``metrics.jsonl``: one JSON object per logged optimizer step, written by the main process."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "read_metrics"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible instead of failing the run
    return value


class MetricsLog:
    """Appends lines to ``OUTPUT_DIR/metrics.jsonl``; a resumed run first drops lines past its step.

    Each line is flushed as it is written, so a crash loses at most the step in flight.
    """

    def __init__(self, path: str | os.PathLike, *, enabled: bool, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.enabled = enabled
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:  # keep the history up to the checkpoint; later lines are redone by this run
            kept = [row for row in read_metrics(self.path) if row.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in kept))

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps({k: _jsonable(v) for k, v in row.items()}, sort_keys=True) + "\n")
            fh.flush()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All rows of a ``metrics.jsonl`` (missing file: none)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
