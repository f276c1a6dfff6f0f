"""Evaluation metrics that load without the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import evaluate

__all__ = ["ACCURACY_SCRIPT", "F1_SCRIPT", "load_accuracy_metric", "load_f1_metric", "load_classification_metrics"]

ACCURACY_SCRIPT = Path(__file__).with_name("accuracy.py")
F1_SCRIPT = Path(__file__).with_name("f1.py")


def load_accuracy_metric(**kwargs) -> evaluate.EvaluationModule:
    """The accuracy metric, loaded by path from the script shipped in this package.

    ``kwargs`` go to ``evaluate.load`` (e.g. ``process_id``/``num_process`` for distributed use).
    """
    import evaluate

    return evaluate.load(str(ACCURACY_SCRIPT), **kwargs)


def load_f1_metric(**kwargs) -> evaluate.EvaluationModule:
    """The F1 metric (binary, macro or micro), loaded by path from the script shipped in this package."""
    import evaluate

    return evaluate.load(str(F1_SCRIPT), **kwargs)


def load_classification_metrics(*, with_f1: bool) -> evaluate.EvaluationModule:
    """Accuracy, plus binary F1 of class 1 when ``with_f1`` (GLUE's MRPC/QQP report), as one module.

    ``add_batch``/``compute`` work as on a single metric; ``compute`` returns ``{"accuracy": ...}``
    and, with F1, ``"f1"`` too.
    """
    import evaluate

    if not with_f1:
        return load_accuracy_metric()
    return evaluate.combine([load_accuracy_metric(), load_f1_metric()])
