"""F1 as an ``evaluate`` metric script that ships inside qaccel.

``evaluate.load("f1")`` fetches its script from the Hugging Face Hub and imports scikit-learn;
this file is loaded by path instead (see ``qaccel.zoo.metrics.load_f1_metric``). Same name,
inputs and output as the Hub's metric for its ``average="binary"`` (default, the F1 of the class
``pos_label``, as GLUE reports MRPC and QQP), ``"macro"`` and ``"micro"`` settings: ``{"f1": value}``.
A class that is never predicted has precision 0, a class that never occurs recall 0; F1 is then 0
(scikit-learn's ``zero_division=0``).
"""

import datasets
import evaluate

_DESCRIPTION = "F1: the harmonic mean of precision and recall."
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): true labels.
    pos_label (int): the positive class for average="binary" (default 1).
    average (str): "binary" (default), "macro" (unweighted mean over the classes present in
        predictions or references) or "micro" (global counts, equal to accuracy for one label per example).
Returns:
    f1 (float): in [0, 1].
Examples:
    >>> metric = evaluate.load("path/to/f1.py")
    >>> metric.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 1])
    {'f1': 0.5}
"""


def _f1(tp: int, fp: int, fn: int) -> float:
    denominator = 2 * tp + fp + fn
    return 2 * tp / denominator if denominator else 0.0


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, pos_label=1, average="binary"):
        if len(predictions) != len(references):
            raise ValueError(f"f1: {len(predictions)} predictions but {len(references)} references")
        pairs = list(zip(predictions, references, strict=True))

        def counts(label):
            tp = sum(1 for p, r in pairs if p == label and r == label)
            fp = sum(1 for p, r in pairs if p == label and r != label)
            fn = sum(1 for p, r in pairs if p != label and r == label)
            return tp, fp, fn

        if average == "binary":
            return {"f1": float(_f1(*counts(pos_label)))}
        labels = sorted(set(predictions) | set(references))
        if average == "macro":
            return {"f1": float(sum(_f1(*counts(label)) for label in labels) / len(labels)) if labels else 0.0}
        if average == "micro":
            totals = [sum(c) for c in zip(*(counts(label) for label in labels), strict=True)] if labels else [0, 0, 0]
            return {"f1": float(_f1(*totals))}
        raise ValueError(f"f1: average={average!r}: must be one of 'binary', 'macro', 'micro'")
