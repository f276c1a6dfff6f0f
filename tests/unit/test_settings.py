"""``qaccel._settings``: the one reader behind every config class, the truth-value flags and the CLI flags.

References are independent of the reader: the word list in the docstring of Accelerate's ``str_to_bool``,
values written into the files here, and model-card front matter split and parsed by hand in this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import warnings
from pathlib import Path
from typing import Literal

import pytest
import yaml

from qaccel._settings import (
    SettingError,
    _files,
    add_config_flags,
    config_file_from_env,
    config_from_dict,
    config_from_env,
    config_to_dict,
    env_flag,
    field_help,
    parse_bool,
    parse_text,
    read_config_file,
)
from qaccel.fsdp import QSDPConfig
from qaccel.optim import OneBitAdamConfig, ZeroOneAdamConfig

CARDS = Path(__file__).resolve().parents[2] / "model_cards"
CONFIG_CLASSES = [QSDPConfig, ZeroOneAdamConfig, OneBitAdamConfig]
# accelerate/utils/environment.py, str_to_bool's docstring: "True values are y, yes, t, true, on, and 1;
# False value are n, no, f, false, off, and 0"
TRUE_WORDS = ["y", "yes", "t", "true", "on", "1"]
FALSE_WORDS = ["n", "no", "f", "false", "off", "0"]


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("QACCEL_QSDP_", "QACCEL_ZERO_ONE_ADAM_", "QACCEL_ONEBIT_ADAM_", "QACCEL_CONFIG_FILE", "QACCEL_RECIPE")):
            monkeypatch.delenv(name)
    return monkeypatch


# -- truth values --------------------------------------------------------------------------------


@pytest.mark.parametrize("word", TRUE_WORDS + [w.upper() for w in TRUE_WORDS] + [" On "])
def test_every_true_word_of_str_to_bool_is_true(word):
    assert parse_bool(word, key="K") is True


@pytest.mark.parametrize("word", FALSE_WORDS + [w.upper() for w in FALSE_WORDS] + [" off "])
def test_every_false_word_of_str_to_bool_is_false(word):
    assert parse_bool(word, key="K") is False


@pytest.mark.parametrize("value", ["maybe", "", "2", "yess", 2, 0.5, None])
def test_a_bad_truth_value_names_key_value_allowed_words_and_source(value):
    with pytest.raises(ValueError) as err:
        parse_bool(value, key="QSDPConfig.prefetch", source="QACCEL_QSDP_PREFETCH")
    message = str(err.value)
    assert message.startswith(f"QSDPConfig.prefetch={value!r} (from QACCEL_QSDP_PREFETCH): not a boolean; must be ")
    listed = set(re.findall(r"\w+", message.split("must be ", 1)[1]))
    assert set(TRUE_WORDS + FALSE_WORDS) <= listed


def test_env_flag_reads_unset_and_blank_as_the_default_and_refuses_nonsense():
    assert env_flag("X", {}) is False and env_flag("X", {"X": "  "}, default=True) is True
    assert env_flag("X", {"X": "on"}) is True and env_flag("X", {"X": "0"}) is False
    with pytest.raises(ValueError, match=r"^X='sometimes': not a boolean"):
        env_flag("X", {"X": "sometimes"})


def test_the_three_environment_flags_use_the_shared_truth_words(monkeypatch):
    from huggingface_hub import constants

    from qaccel.hub import push
    from qaccel.integration import _cpu_launch
    from qaccel.zoo import models

    assert _cpu_launch._forced_cpu({"ACCELERATE_USE_CPU": "t"}) is True  # a word only str_to_bool knows
    assert _cpu_launch._forced_cpu({"ACCELERATE_USE_CPU": "off"}) is False
    with pytest.raises(ValueError, match="ACCELERATE_USE_CPU='cpu'"):
        _cpu_launch._forced_cpu({"ACCELERATE_USE_CPU": "cpu"})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    for value, expected in (("On", True), ("no", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert models._hub_offline() is expected and push._offline() is expected
    monkeypatch.setenv("HF_HUB_OFFLINE", "maybe")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE='maybe'"):
        models._hub_offline()


# -- typed text ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "expected"),
    [
        (" 42 ", int, 42),
        ("1e-3", float, 0.001),
        ("group", str, "group"),
        ("yes", bool, True),
        ("nearest", Literal["stochastic", "nearest"], "nearest"),
        ("null", int | None, None),
        ("7", int | None, 7),
        ("0.8,0.99", tuple[float, float], (0.8, 0.99)),
        ("[0.8, 0.99]", tuple[float, float], (0.8, 0.99)),
        ("1,2,3", tuple[int, ...], (1, 2, 3)),
    ],
)
def test_text_becomes_the_field_type(text, kind, expected):
    value = parse_text(text, kind, key="C.k")
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(
    ("text", "kind", "pattern"),
    [
        ("x", int, r"^C\.k='x' \(from ENV_K\): not an int$"),
        ("1.5", int, r"not an int"),
        ("fast", float, r"not a number"),
        ("up", Literal["stochastic", "nearest"], r"must be one of stochastic, nearest"),
        ("0.9", tuple[float, float], r"must be 2 comma-separated values \(float, float\)"),
        ("maybe", bool, r"not a boolean"),
    ],
)
def test_bad_text_names_key_text_source_and_what_is_allowed(text, kind, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_text(text, kind, key="C.k", source="ENV_K")


# -- a config read through every layer -----------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Demo:
    steps: int = dataclasses.field(default=1, metadata={"help": "steps"})
    scale: float = dataclasses.field(default=1.0, metadata={"help": "scale"})
    enable_fast: bool = dataclasses.field(default=False, metadata={"help": "fast"})
    pair: tuple[float, float] = dataclasses.field(default=(0.0, 0.0), metadata={"help": "pair"})

    def __post_init__(self):
        # A config raises the structured SettingError; the reader adds the source by its key.
        if not isinstance(self.steps, int) or self.steps < 1:
            raise SettingError("steps", self.steps, "must be an int >= 1", owner="Demo")


def _demo(environ, **kwargs):
    return config_from_env(Demo, prefix="QACCEL_QSDP_", section="qsdp", environ=environ, **kwargs)


def test_precedence_is_argument_then_environment_then_file_then_default(tmp_path):
    path = tmp_path / "settings.yaml"
    path.write_text("qsdp: {steps: 3, scale: 3.0, pair: [0.5, 0.25]}\n")
    env = {"QACCEL_CONFIG_FILE": str(path), "QACCEL_QSDP_SCALE": "2.5", "QACCEL_QSDP_STEPS": "2", "OTHER": "x"}
    assert _demo(env, explicit={"steps": 9}) == Demo(steps=9, scale=2.5, pair=(0.5, 0.25))
    assert _demo(env) == Demo(steps=2, scale=2.5, pair=(0.5, 0.25))
    assert _demo({"QACCEL_CONFIG_FILE": str(path)}) == Demo(steps=3, scale=3.0, pair=(0.5, 0.25))
    assert _demo({}) == Demo()
    assert _demo({"QACCEL_QSDP_ENABLE_FAST": "on"}).enable_fast is True


def test_an_unknown_environment_name_lists_every_known_one():
    with pytest.raises(ValueError) as err:
        _demo({"QACCEL_QSDP_STEP": "2"})
    assert str(err.value).startswith("QACCEL_QSDP_STEP: not a Demo field; known names: ")
    known = str(err.value).split("known names: ")[1].split(", ")
    assert known == ["QACCEL_QSDP_STEPS", "QACCEL_QSDP_SCALE", "QACCEL_QSDP_ENABLE_FAST", "QACCEL_QSDP_PAIR"]


def test_a_field_error_names_the_source_of_that_value(tmp_path):
    with pytest.raises(ValueError, match=r"^Demo\.steps=0: must be an int >= 1 \(from QACCEL_QSDP_STEPS\)$"):
        _demo({"QACCEL_QSDP_STEPS": "0"})
    with pytest.raises(ValueError, match=r"^Demo\.steps=0: must be an int >= 1 \(from argument\)$"):
        _demo({}, explicit={"steps": 0})
    with pytest.raises(ValueError, match=r"Demo\.steps=0: .* \(from the caller\)$"):
        config_from_dict(Demo, {"steps": 0}, source="the caller")


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        ("qsdp:\n  steps: 0\n", r"Demo\.steps=0: .* \(from recipe {path}, key qsdp\.steps\)$"),
        ("qsdp:\n  stepz: 2\n", r"unknown keys \['stepz'\] \(from recipe {path}, key qsdp\.stepz\)"),
        ("qsdp: {{steps: 2\n", r"^recipe '{path}': invalid YAML: "),
        ("qsdpp: {{steps: 2}}\n", r"^recipe '{path}': unknown sections \['qsdpp'\]; known sections: qsdp, zero_one_adam, onebit_adam, diloco$"),
        ("qsdp: [1, 2]\n", r"the 'qsdp' section must be a mapping of Demo fields, got list$"),
    ],
    ids=["bad-value", "unknown-key", "invalid-yaml", "unknown-section", "section-not-a-mapping"],
)
def test_yaml_errors_name_the_file_and_the_key(content, pattern, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(content.format())
    with pytest.raises(ValueError, match=pattern.format(path=re.escape(str(path)))):
        _demo({}, config_file=path)


def test_a_missing_file_says_what_the_variable_names():
    with pytest.raises(ValueError, match="missing.yaml': no such file .*model_cards/gpt2-tiny.md"):
        _demo({}, config_file="missing.yaml")


def test_json_files_and_the_dict_round_trip(tmp_path):
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"qsdp": {"steps": 4, "pair": [1.0, 2.0]}}))
    config = _demo({}, config_file=path)
    assert config == Demo(steps=4, pair=(1.0, 2.0))
    assert config_to_dict(config) == {"steps": 4, "scale": 1.0, "enable_fast": False, "pair": [1.0, 2.0]}
    assert config_from_dict(Demo, json.loads(json.dumps(config_to_dict(config)))) == config


# -- model cards through QACCEL_CONFIG_FILE ------------------------------------------------------


def _card_front_matter(path: Path) -> dict:
    """The card's YAML front matter, split here by hand: the text between the first two '---' lines."""
    _, front, _ = path.read_text(encoding="utf-8").split("---\n", 2)
    return yaml.safe_load(front)


@pytest.mark.parametrize("name", ["gpt2-tiny", "gpt2-124m-w4g4"])
def test_a_model_card_gives_its_qsdp_settings(name, clean_env):
    card = CARDS / f"{name}.md"
    expected = _card_front_matter(card)["method"]["qsdp"]
    assert expected  # the card has settings to compare
    config = QSDPConfig.from_env({"QACCEL_CONFIG_FILE": str(card)})
    assert config == QSDPConfig(**expected)
    clean_env.setenv("QACCEL_CONFIG_FILE", str(card))
    assert QSDPConfig.from_env() == QSDPConfig(**expected)


def test_the_w4g4_card_is_not_the_default():
    # Guards the comparison above against passing by default: this card's bits differ from QSDPConfig()'s.
    assert QSDPConfig(**_card_front_matter(CARDS / "gpt2-124m-w4g4.md")["method"]["qsdp"]) != QSDPConfig()


def test_a_model_card_gives_its_optimizer_settings(clean_env):
    card = CARDS / "bert-tiny.md"
    method = _card_front_matter(card)["method"]
    config = ZeroOneAdamConfig.from_env({"QACCEL_CONFIG_FILE": str(card)})
    for key, value in method["zero_one_adam"].items():
        assert getattr(config, key) == (tuple(value) if isinstance(value, list) else value), key
    assert OneBitAdamConfig.from_env({}, recipe=card).freeze_step == method["onebit_adam"]["freeze_step"]


def test_a_bad_value_in_a_card_names_the_card_and_the_method_key(tmp_path):
    text = (CARDS / "gpt2-tiny.md").read_text(encoding="utf-8")
    assert "qsdp: {weight_bits: 8, grad_bits: 8}" in text
    card = tmp_path / "gpt2-tiny.md"
    card.write_text(text.replace("qsdp: {weight_bits: 8, grad_bits: 8}", "qsdp: {weight_bits: 9, grad_bits: 8}"))
    with pytest.raises(ValueError, match=rf"weight_bits=9: .*\(from recipe {card}, key method\.qsdp\.weight_bits\)$"):
        QSDPConfig.from_env({"QACCEL_CONFIG_FILE": str(card)})
    card.write_text("no front matter\n")
    with pytest.raises(ValueError, match="must start with a '---' line"):
        QSDPConfig.from_env({"QACCEL_CONFIG_FILE": str(card)})


def test_a_recipe_yaml_reads_its_method_section(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "method": {"name": "qsdp", "qsdp": {"grad_bits": 4}}}))
    assert read_config_file(path) == ({"qsdp": {"grad_bits": 4}}, "method.")
    assert QSDPConfig.from_file(path) == QSDPConfig(grad_bits=4)


# -- the deprecated QACCEL_RECIPE ----------------------------------------------------------------


def test_qaccel_recipe_still_works_and_warns_once_naming_the_replacement(tmp_path, clean_env):
    _files._warn_deprecated_config_file_env.cache_clear()
    path = tmp_path / "old.yaml"
    path.write_text("qsdp: {weight_bits: 6}\nzero_one_adam: {var_freeze_step: 5}\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert QSDPConfig.from_env({"QACCEL_RECIPE": str(path)}).weight_bits == 6
        assert ZeroOneAdamConfig.from_env({"QACCEL_RECIPE": str(path)}).var_freeze_step == 5
    deprecations = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(deprecations) == 1
    assert "QACCEL_RECIPE is deprecated" in str(deprecations[0].message)
    assert "QACCEL_CONFIG_FILE" in str(deprecations[0].message)


def test_qaccel_config_file_wins_over_qaccel_recipe(tmp_path):
    new, old = tmp_path / "new.yaml", tmp_path / "old.yaml"
    new.write_text("qsdp: {weight_bits: 4}\n")
    old.write_text("qsdp: {weight_bits: 6}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert config_file_from_env({"QACCEL_CONFIG_FILE": str(new), "QACCEL_RECIPE": str(old)}) == str(new)
        assert QSDPConfig.from_env({"QACCEL_CONFIG_FILE": str(new), "QACCEL_RECIPE": str(old)}).weight_bits == 4
    assert config_file_from_env({}) is None


# -- help texts and flags ------------------------------------------------------------------------


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_config_field_has_a_help_text(cls):
    for f in dataclasses.fields(cls):
        assert isinstance(f.metadata.get("help"), str) and len(f.metadata["help"].strip()) > 10, f.name
        assert field_help(cls, f.name) == f.metadata["help"]


def _flag_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}


def test_generated_flags_carry_the_field_help_and_say_which_class_owns_them():
    parser = argparse.ArgumentParser()
    assert add_config_flags(parser, "qsdp_", QSDPConfig) == tuple(f.name for f in dataclasses.fields(QSDPConfig))
    names = add_config_flags(parser, "zoadam_", ZeroOneAdamConfig, OneBitAdamConfig)
    helps = _flag_helps(parser)
    for f in dataclasses.fields(QSDPConfig):
        assert helps[f"--qsdp_{f.name}"] == f.metadata["help"]
    zero_one = {f.name: f for f in dataclasses.fields(ZeroOneAdamConfig)}
    one_bit = {f.name: f for f in dataclasses.fields(OneBitAdamConfig)}
    assert set(names) == set(zero_one) | set(one_bit)
    assert helps["--zoadam_lr"] == zero_one["lr"].metadata["help"]
    assert helps["--zoadam_var_freeze_step"] == zero_one["var_freeze_step"].metadata["help"] + " (ZeroOneAdamConfig only)"
    assert helps["--zoadam_freeze_step"] == one_bit["freeze_step"].metadata["help"] + " (OneBitAdamConfig only)"


def test_the_training_cli_shows_every_field_help(capsys):
    from qaccel import train

    with pytest.raises(SystemExit) as done:
        train.parse_args(["--help"])
    assert done.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for cls, prefix in ((QSDPConfig, "--qsdp_"), (ZeroOneAdamConfig, "--zoadam_"), (OneBitAdamConfig, "--zoadam_")):
        for f in dataclasses.fields(cls):
            assert prefix + f.name in shown
            assert " ".join(f.metadata["help"].split()) in shown, f.name


def test_flags_pass_on_only_what_is_given_and_the_config_judges_the_value():
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags(parser, "qsdp_", QSDPConfig)
    add_config_flags(parser, "zoadam_", ZeroOneAdamConfig, OneBitAdamConfig)
    args = vars(parser.parse_args(["--qsdp_weight_bits", "9", "--qsdp_grad_bits", "off", "--zoadam_betas", "0.8,0.9"]))
    assert args == {"qsdp_weight_bits": "9", "qsdp_grad_bits": "off", "zoadam_betas": (0.8, 0.9)}
    with pytest.raises(ValueError, match=r"^QSDPConfig\.weight_bits=9: must be an int in \[2, 8\], or off.* \(from argument\)$"):
        QSDPConfig.from_env({}, weight_bits=args["qsdp_weight_bits"])
    assert QSDPConfig.from_env({}, grad_bits=args["qsdp_grad_bits"]).grad_bits is None
    assert ZeroOneAdamConfig.from_env({}, betas=args["zoadam_betas"]).betas == (0.8, 0.9)
    with pytest.raises(argparse.ArgumentError, match=r"ZeroOneAdamConfig\.var_freeze_step='ten': not an int"):
        parser.parse_args(["--zoadam_var_freeze_step", "ten"])
