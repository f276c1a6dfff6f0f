"""The one module that reads Accelerate's private surface (style guide §9).

Checked against accelerate 1.15.0 (:data:`ACCELERATE`). What is read, and why no public API does it:

- ``Accelerator._optimizers``: every optimizer ``prepare`` returned, across all ``prepare`` calls
  (``accelerator.py``). A model and its optimizer may be prepared in different calls, and 0/1 Adam's
  DDP hook needs both, so :func:`prepared_optimizers` looks at all of them.

A name an Accelerate release dropped raises a ``RuntimeError`` naming it, the installed version and
the checked ones.
"""

from __future__ import annotations

from typing import Any

from .._upstream import PrivateSurface

__all__ = ["ACCELERATE", "prepared_optimizers"]

ACCELERATE = PrivateSurface("accelerate", ("1.15.0",), __name__)


def prepared_optimizers(accelerator: Any) -> list[Any]:
    """The ``AcceleratedOptimizer`` objects of every ``prepare`` call so far, in preparation order.

    Raises:
        RuntimeError: this Accelerate keeps no ``Accelerator._optimizers``.
    """
    purpose = "finding a prepared 1-bit optimizer and its DDP model across prepare calls"
    return list(ACCELERATE.get(accelerator, "_optimizers", purpose, owner="Accelerator"))
