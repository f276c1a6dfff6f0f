"""The shipped accuracy metric, loaded by path with the Hub offline, against hand counts."""

import pytest

from qaccel.zoo import load_accuracy_metric


@pytest.fixture(scope="module")
def accuracy():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield load_accuracy_metric()


def test_accuracy_is_the_fraction_correct(accuracy):
    predictions = [0, 2, 1, 1, 3, 0, 2]
    references = [0, 1, 1, 1, 3, 2, 2]
    # by hand: positions 0, 2, 3, 4, 6 agree -> 5 of 7
    assert accuracy.compute(predictions=predictions, references=references) == {"accuracy": pytest.approx(5 / 7)}
    assert accuracy.compute(predictions=predictions, references=references, normalize=False) == {"accuracy": 5.0}
    weights = [1, 1, 1, 1, 1, 3, 1]  # the one weighted example is wrong: 5 of 9
    assert accuracy.compute(predictions=predictions, references=references, sample_weight=weights) == {"accuracy": pytest.approx(5 / 9)}


def test_accuracy_accumulates_batches(accuracy):
    accuracy.add_batch(predictions=[1, 1], references=[1, 0])
    accuracy.add_batch(predictions=[4], references=[4])
    assert accuracy.compute() == {"accuracy": pytest.approx(2 / 3)}


def test_accuracy_rejects_mismatched_weights(accuracy):
    with pytest.raises(ValueError, match="2 sample weights for 3 predictions"):
        accuracy.compute(predictions=[1, 2, 3], references=[1, 2, 3], sample_weight=[1, 1])
