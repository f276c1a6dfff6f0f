"""Where a benchmark's PNG goes, and a headless pyplot for drawing it."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

__all__ = ["png_path", "headless_pyplot", "save_figure"]


def png_path(args: argparse.Namespace) -> str | None:
    """``--png`` if given, else the ``--json`` path with a .png suffix, else None (no plot)."""
    json_path = getattr(args, "json_path", None)
    return args.png or (str(Path(json_path).with_suffix(".png")) if json_path else None)


def headless_pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (imported lazily: only plotting needs it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, png: str) -> None:
    """Write ``fig`` to ``png`` (creating its folder) and release it."""
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    headless_pyplot().close(fig)
