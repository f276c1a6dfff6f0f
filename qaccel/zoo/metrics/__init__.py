"""Evaluation metrics that load without the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import evaluate

__all__ = ["ACCURACY_SCRIPT", "load_accuracy_metric"]

ACCURACY_SCRIPT = Path(__file__).with_name("accuracy.py")


def load_accuracy_metric(**kwargs) -> evaluate.EvaluationModule:
    """The accuracy metric, loaded by path from the script shipped in this package.

    ``kwargs`` go to ``evaluate.load`` (e.g. ``process_id``/``num_process`` for distributed use).
    """
    import evaluate

    return evaluate.load(str(ACCURACY_SCRIPT), **kwargs)
