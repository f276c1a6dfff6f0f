"""Accuracy as an ``evaluate`` metric script that ships inside qaccel.

``evaluate.load("accuracy")`` fetches its script from the Hugging Face Hub (and imports
scikit-learn), which an offline machine cannot do; this file is loaded by path instead:
``evaluate.load("<this file>")``, see ``qaccel.zoo.load_accuracy_metric``. Same name, inputs
and output as the Hub's metric: ``{"accuracy": fraction correct}`` (or the count of correct
predictions with ``normalize=False``), optionally weighted by ``sample_weight``.
"""

import datasets
import evaluate

_DESCRIPTION = "Accuracy: the fraction of predictions equal to their references."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): true labels.
    normalize (bool): True (default): the (weighted) fraction correct; False: the (weighted) count.
    sample_weight (list of float, optional): a weight per example.
Returns:
    accuracy (float): the fraction correct in [0, 1], or the count if normalize is False.
Examples:
    >>> metric = evaluate.load("path/to/accuracy.py")
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'accuracy': 0.6666666666666666}
"""


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        if len(predictions) != len(references):
            raise ValueError(f"accuracy: {len(predictions)} predictions but {len(references)} references")
        weights = [1.0] * len(predictions) if sample_weight is None else [float(w) for w in sample_weight]
        if len(weights) != len(predictions):
            raise ValueError(f"accuracy: {len(weights)} sample weights for {len(predictions)} predictions")
        correct = sum(w for p, r, w in zip(predictions, references, weights, strict=True) if p == r)
        if not normalize:
            return {"accuracy": float(correct)}
        total = sum(weights)
        return {"accuracy": float(correct / total) if total else 0.0}
