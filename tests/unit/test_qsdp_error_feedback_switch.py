"""``grad_error_feedback`` reads truth values as every on/off field does: on is the float32 store, off is None.

The same from every source (keyword, ``from_env`` keyword and variable, ``from_dict``, a YAML
recipe, the ``--qsdp_grad_error_feedback`` flag), and the stored value is the dtype's name, so
``to_dict`` (checkpoints, cards, reports) keeps its shape.
"""

from __future__ import annotations

import pytest
import torch

from qaccel.fsdp import QSDPConfig

# docs/qsdp.md, "Error feedback": float32, or bfloat16 at half the memory; on without a dtype: float32
EXPLICIT_DEFAULT = QSDPConfig(grad_error_feedback="float32")


@pytest.fixture(autouse=True)
def _no_qsdp_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("QACCEL_QSDP_") or name in ("QACCEL_CONFIG_FILE", "QACCEL_RECIPE"):
            monkeypatch.delenv(name)


def _from_flag(value: str) -> QSDPConfig:
    from qaccel.train import QSDP_FIELDS, flag_section, parse_args
    from qaccel.training.methods import plan_method

    args = parse_args(["--recipe", "gpt2-tiny", "--output_dir", "unused", "--qsdp_grad_error_feedback", value])
    plan = plan_method(
        "qsdp", recipe_method="qsdp", recipe_qsdp={}, flag_qsdp=flag_section(args, "qsdp_", QSDP_FIELDS),
        recipe_onebit={}, flag_onebit={}, learning_rate=1e-3, weight_decay=0.0, launch_parallelism=None,
    )  # fmt: skip
    return plan.qsdp


def _from_yaml_recipe(text: str, tmp_path) -> QSDPConfig:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"qsdp:\n  grad_error_feedback: {text}\n")
    return QSDPConfig.from_file(path)


ON = {
    "keyword True": lambda tmp_path: QSDPConfig(grad_error_feedback=True),
    "keyword 1": lambda tmp_path: QSDPConfig(grad_error_feedback=1),
    "keyword ' Yes '": lambda tmp_path: QSDPConfig(grad_error_feedback=" Yes "),
    "from_env keyword": lambda tmp_path: QSDPConfig.from_env({}, grad_error_feedback=True),
    "from_env variable": lambda tmp_path: QSDPConfig.from_env({"QACCEL_QSDP_GRAD_ERROR_FEEDBACK": "true"}),
    "from_env variable on": lambda tmp_path: QSDPConfig.from_env({"QACCEL_QSDP_GRAD_ERROR_FEEDBACK": "on"}),
    "from_dict": lambda tmp_path: QSDPConfig.from_dict({"grad_error_feedback": True}),
    "yaml recipe true": lambda tmp_path: _from_yaml_recipe("true", tmp_path),
    "flag": lambda tmp_path: _from_flag("true"),
}
OFF = {
    "keyword False": lambda tmp_path: QSDPConfig(grad_error_feedback=False),
    "keyword 0": lambda tmp_path: QSDPConfig(grad_error_feedback=0),
    "from_env variable no": lambda tmp_path: QSDPConfig.from_env({"QACCEL_QSDP_GRAD_ERROR_FEEDBACK": "no"}),
    "from_dict": lambda tmp_path: QSDPConfig.from_dict({"grad_error_feedback": False}),
    "yaml recipe false": lambda tmp_path: _from_yaml_recipe("false", tmp_path),
    "flag": lambda tmp_path: _from_flag("false"),
}


@pytest.mark.parametrize("source", sorted(ON))
def test_true_means_the_float32_store(source, tmp_path):
    config = ON[source](tmp_path)
    assert config == EXPLICIT_DEFAULT
    assert config.grad_error_feedback == "float32"  # the name, as a checkpoint or card stores it
    assert config.error_feedback_dtype() is torch.float32
    assert config.to_dict()["grad_error_feedback"] == "float32"
    assert QSDPConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("source", sorted(OFF))
def test_false_means_off(source, tmp_path):
    config = OFF[source](tmp_path)
    assert config == QSDPConfig()  # off is the default
    assert config.grad_error_feedback is None and config.error_feedback_dtype() is None


def test_a_dtype_name_still_picks_the_store():
    assert QSDPConfig(grad_error_feedback=" BFloat16 ").error_feedback_dtype() is torch.bfloat16


@pytest.mark.parametrize("value", [2, "fp16", "maybe"])
def test_anything_else_is_refused_naming_what_is_allowed(value):
    with pytest.raises(ValueError, match=r"grad_error_feedback=.*must be one of float32, bfloat16, or off .*, or on \(True"):
        QSDPConfig(grad_error_feedback=value)


def test_true_still_needs_quantized_gradients():
    with pytest.raises(ValueError, match=r"grad_error_feedback: needs grad_bits in \[2, 8\]"):
        QSDPConfig(grad_error_feedback=True, grad_bits=None)
