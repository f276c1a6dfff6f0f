"""``TrainingSettings``: the recipe's training values with the flags on top, typed, recorded in checkpoints as before."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from qaccel.training import TrainingSettings

# The training flags of qaccel.train in the order checkpoints have recorded them (extra["training"]), written out.
RECORDED_ORDER = (
    "max_steps", "per_device_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay",
    "warmup_steps", "lr_scheduler", "seed", "save_steps", "eval_steps", "mixed_precision",
)  # fmt: skip
RECIPE = SimpleNamespace(
    max_steps=40, per_device_batch_size=8, gradient_accumulation_steps=2, learning_rate=3e-4, weight_decay=0.0, warmup_steps=4,
    lr_scheduler="cosine", seed=0, save_steps=40, eval_steps=10, mixed_precision="no", mlm_probability=None,
)  # fmt: skip


def test_flags_given_override_the_recipe_and_flags_not_given_keep_it():
    flags = {"max_steps": 5, "learning_rate": None, "seed": 3, "eval_steps": 0, "output_dir": "x"}  # None: not given; 0 is a value
    settings = TrainingSettings.from_recipe(RECIPE, flags)
    assert settings.to_dict() == {
        "max_steps": 5, "per_device_batch_size": 8, "gradient_accumulation_steps": 2, "learning_rate": 3e-4, "weight_decay": 0.0,
        "warmup_steps": 4, "lr_scheduler": "cosine", "seed": 3, "save_steps": 40, "eval_steps": 0, "mixed_precision": "no",
    }  # fmt: skip
    assert tuple(settings.to_dict()) == RECORDED_ORDER
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_steps = 6


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [("max_steps", "5", "an int"), ("seed", True, "an int"), ("learning_rate", "1e-3", "a number"), ("weight_decay", False, "a number"),
     ("lr_scheduler", 3, "a string"), ("save_steps", 2.0, "an int")],
)  # fmt: skip
def test_a_wrong_type_is_refused_naming_the_key(key, value, allowed):
    with pytest.raises(TypeError) as err:
        TrainingSettings.from_recipe(RECIPE, {key: value})
    assert str(err.value) == f"TrainingSettings.{key}={value!r}: must be {allowed} (from --{key} or the recipe's training.{key})"


def test_an_int_rate_is_kept_as_given_so_the_checkpoint_records_it_unchanged():
    settings = TrainingSettings.from_recipe(RECIPE, {"weight_decay": 0, "learning_rate": 1})
    assert json.dumps(settings.to_dict()["weight_decay"]) == "0" and json.dumps(settings.learning_rate) == "1"


def test_to_dict_round_trips_and_from_dict_names_unknown_and_missing_keys():
    settings = TrainingSettings.from_recipe(RECIPE, {})
    assert TrainingSettings.from_dict(json.loads(json.dumps(settings.to_dict()))) == settings
    values = {**settings.to_dict(), "max_step": 3}
    del values["seed"]
    with pytest.raises(ValueError, match=r"unknown keys \['max_step'\], missing keys \['seed'\]; the keys are max_steps, "):
        TrainingSettings.from_dict(values)


def test_check_inputs_records_the_recipe_values_with_the_flags_in_the_run_state(tmp_path):
    pytest.importorskip("datasets")
    import yaml

    from qaccel.train import check_inputs, parse_args
    from qaccel.zoo import load_recipe

    inputs = check_inputs(parse_args(["--recipe", "gpt2-tiny", "--max_steps", "7", "--learning_rate", "0.01", "--output_dir", str(tmp_path)]))
    # the reference: the recipe file's own training: section, read as YAML front matter
    recipe_training = yaml.safe_load(load_recipe("gpt2-tiny").path.read_text().split("---")[1])["training"]
    assert set(recipe_training) == set(RECORDED_ORDER)  # every key is written in this recipe
    recorded = inputs.run_state(7, 0, None)["extra"]["training"]
    assert recorded == {**{name: recipe_training[name] for name in RECORDED_ORDER}, "max_steps": 7, "learning_rate": 0.01}
    assert tuple(recorded) == RECORDED_ORDER and inputs.settings.to_dict() == recorded
