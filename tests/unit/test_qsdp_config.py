"""QSDPConfig: validation messages, precedence (argument > env > recipe > default), round trips."""

import json

import pytest
import torch

from qaccel.fsdp import QSDPConfig


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"weight_bits": 12}, r"QSDPConfig\.weight_bits=12: must be an int in \[2, 8\], or off: None, False, 32 or 'off'"),
        ({"weight_bits": "eight"}, r"QSDPConfig\.weight_bits='eight': must be an int in \[2, 8\], or off"),
        ({"grad_bits": 1}, r"QSDPConfig\.grad_bits=1: must be an int in \[2, 8\]"),
        ({"grad_bucket_size": 0}, r"QSDPConfig\.grad_bucket_size=0: must be an int in \[1, "),
        ({"weight_meta_dtype": "float16"}, r"QSDPConfig\.weight_meta_dtype='float16': must be one of float32, bfloat16"),
        ({"rounding": "up"}, r"QSDPConfig\.rounding='up': must be one of stochastic, nearest"),
        ({"seed": -1}, r"QSDPConfig\.seed=-1: must be an int in \[0, "),
        ({"master_weights": "fp32"}, r"QSDPConfig\.master_weights='fp32': must be one of fresh, quantized"),
        ({"master_weights": "quantized", "weight_bits": None}, r"master_weights='quantized': requires weight_bits"),
        ({"unit_min_numel": -5}, r"QSDPConfig\.unit_min_numel=-5: must be an int >= 0"),
        ({"grad_rotation": "fft"}, r"QSDPConfig\.grad_rotation='fft': must be one of none, hadamard"),
        ({"master_weights": "quantized", "weight_rotation": "hadamard"}, r"master_weights='quantized' with weight_rotation='hadamard'"),
        ({"grad_error_feedback": "int8"}, r"QSDPConfig\.grad_error_feedback='int8': must be one of float32, bfloat16, or off"),
        ({"grad_error_feedback": "float32", "grad_bits": "off"}, r"grad_error_feedback: needs grad_bits in \[2, 8\]"),
    ],
)
def test_bad_values_name_key_value_and_allowed(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        QSDPConfig(**kwargs)


def test_wrong_type_is_type_error():
    with pytest.raises(TypeError, match=r"QSDPConfig\.weight_bits=True"):
        QSDPConfig(weight_bits=True)  # YAML's `on` / `yes`: no bit width
    with pytest.raises(TypeError, match=r"QSDPConfig\.grad_bits=8\.0"):
        QSDPConfig(grad_bits=8.0)


def test_config_is_frozen_and_keyword_only():
    config = QSDPConfig()
    with pytest.raises(AttributeError):
        config.weight_bits = 4
    with pytest.raises(TypeError):
        QSDPConfig(8, 8)


def test_per_bit_defaults_and_explicit_codec_fields():
    w8 = QSDPConfig(weight_bits=8, grad_bits=4).weight_codec()
    g4 = QSDPConfig(weight_bits=8, grad_bits=4).grad_codec()
    assert (w8.bits, w8.bucket_size, w8.meta_dtype) == (8, 1024, torch.float32)
    assert (g4.bits, g4.bucket_size, g4.meta_dtype) == (4, 128, torch.bfloat16)
    explicit = QSDPConfig(weight_bits=6, weight_bucket_size=256, weight_meta_dtype="float32", rounding="nearest").weight_codec()
    assert (explicit.bits, explicit.bucket_size, explicit.meta_dtype, explicit.rounding) == (6, 256, torch.float32, "nearest")
    assert QSDPConfig(weight_bits=None, grad_bits=None).weight_codec() is None
    assert QSDPConfig(weight_bits=None, grad_bits=None).grad_codec() is None


def test_dict_round_trip_and_unknown_keys():
    config = QSDPConfig(weight_bits=4, grad_bits=None, seed=7, master_weights="quantized", unit_min_numel=0)
    assert QSDPConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match=r"unknown keys \['wbits'\]"):
        QSDPConfig.from_dict({"wbits": 4})


def test_env_parsing_and_precedence(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("qsdp:\n  weight_bits: 6\n  grad_bits: 6\n  seed: 3\nzero_one_adam:\n  lr: 1.0\n")
    env = {
        "QACCEL_QSDP_GRAD_BITS": "off",
        "QACCEL_QSDP_WEIGHT_BUCKET_SIZE": "256",
        "QACCEL_QSDP_WEIGHT_META_DTYPE": "bfloat16",
        "QACCEL_CONFIG_FILE": str(recipe),
        "UNRELATED": "x",
    }
    config = QSDPConfig.from_env(env, seed=11)
    # argument > env > recipe > default
    assert config.seed == 11
    assert config.grad_bits is None
    assert config.weight_bits == 6
    assert config.weight_bucket_size == 256 and config.weight_meta_dtype == "bfloat16"
    assert config.master_weights == "fresh"
    assert QSDPConfig.from_env({}) == QSDPConfig()
    assert QSDPConfig.from_file(recipe, grad_bits=8) == QSDPConfig(weight_bits=6, grad_bits=8, seed=3)


def test_env_errors_name_the_variable(tmp_path):
    with pytest.raises(ValueError, match=r"QACCEL_QSDP_WEIGHT_BIT: unknown QSDP setting; known names: .*QACCEL_QSDP_WEIGHT_BITS"):
        QSDPConfig.from_env({"QACCEL_QSDP_WEIGHT_BIT": "4"})
    with pytest.raises(ValueError, match=r"QSDPConfig\.weight_bits=12: .* \(from QACCEL_QSDP_WEIGHT_BITS\)"):
        QSDPConfig.from_env({"QACCEL_QSDP_WEIGHT_BITS": "12"})
    with pytest.raises(ValueError, match=r"QSDPConfig\.seed='abc': must be an int .* \(from QACCEL_QSDP_SEED\)"):
        QSDPConfig.from_env({"QACCEL_QSDP_SEED": "abc"})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"qsdp": {"grad_bits": 9}}))
    with pytest.raises(ValueError, match=r"grad_bits=9: .*\(from recipe .*bad\.json, key qsdp\.grad_bits\)"):
        QSDPConfig.from_env({"QACCEL_CONFIG_FILE": str(bad)})
    with pytest.raises(ValueError, match="no such file"):
        QSDPConfig.from_file(tmp_path / "missing.yaml")


# --------------------------------------------------------------------------------------------
# One set of spellings everywhere (issue 9, point 10): code, QACCEL_QSDP_* and recipe files.
OFF_SPELLINGS = [None, False, 32, "off", "OFF", " Off ", "none", "None", "false", "FALSE", "32"]
AUTO_SPELLINGS = [None, "auto", "AUTO", "none", ""]


def _from_python(field, value, tmp_path):
    return QSDPConfig(**{field: value})


def _from_env(field, value, tmp_path):
    return QSDPConfig.from_env({f"QACCEL_QSDP_{field.upper()}": value})


def _from_yaml_recipe(field, value, tmp_path):
    import yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"qsdp": {field: value}}))
    assert yaml.safe_load(path.read_text())["qsdp"][field] == value  # the file holds this very value
    return QSDPConfig.from_env({"QACCEL_CONFIG_FILE": str(path)})


def _from_json_recipe(field, value, tmp_path):
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps({"qsdp": {field: value}}))
    return QSDPConfig.from_file(path)


SOURCES = {"python": _from_python, "env": _from_env, "yaml": _from_yaml_recipe, "json": _from_json_recipe}


def matrix(spellings):
    """(source, spelling) pairs; an environment variable can only hold the string spellings."""
    return [
        pytest.param(source, spelling, id=f"{source}-{spelling!r}")
        for source in SOURCES
        for spelling in spellings
        if source != "env" or isinstance(spelling, str)
    ]


@pytest.mark.parametrize(("source", "spelling"), matrix(OFF_SPELLINGS))
@pytest.mark.parametrize("field", ["weight_bits", "grad_bits"])
def test_every_off_spelling_switches_the_path_off_from_every_source(field, spelling, source, tmp_path):
    config = SOURCES[source](field, spelling, tmp_path)
    assert getattr(config, field) is None
    assert (config.weight_codec() if field == "weight_bits" else config.grad_codec()) is None
    assert config == QSDPConfig(**{field: None})


@pytest.mark.parametrize(("source", "spelling"), matrix([4, "4", " 4 "]))
def test_a_bit_width_means_the_same_from_every_source(spelling, source, tmp_path):
    assert SOURCES[source]("weight_bits", spelling, tmp_path).weight_bits == 4


@pytest.mark.parametrize(("source", "spelling"), matrix(AUTO_SPELLINGS))
@pytest.mark.parametrize("field", ["weight_bucket_size", "grad_meta_dtype"])
def test_every_auto_spelling_means_the_per_bit_default_from_every_source(field, spelling, source, tmp_path):
    config = SOURCES[source](field, spelling, tmp_path)
    assert getattr(config, field) is None
    assert config.weight_codec().bucket_size == 1024 and config.grad_codec().meta_dtype == torch.float32


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_the_same_bad_value_is_refused_from_every_source_naming_it(source, tmp_path):
    with pytest.raises(ValueError, match=r"QSDPConfig\.weight_bits='of': must be an int in \[2, 8\], or off"):
        SOURCES[source]("weight_bits", "of", tmp_path)
    with pytest.raises((ValueError, TypeError), match=r"QSDPConfig\.grad_bits=(1|'1'): must be an int in \[2, 8\]"):
        SOURCES[source]("grad_bits", "1", tmp_path)


def test_differences_name_each_changed_field():
    saved = QSDPConfig(weight_bits=8, grad_bits=4, seed=1)
    assert saved.differences(QSDPConfig(weight_bits=8, grad_bits=4, seed=1)) == {}
    assert saved.differences(QSDPConfig(weight_bits="off", grad_bits=4, seed=2)) == {"weight_bits": (8, None), "seed": (1, 2)}


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_low_bit_fields_mean_the_same_from_every_source(source, tmp_path):
    rotation = SOURCES[source]("grad_rotation", "Hadamard", tmp_path)
    assert rotation.grad_rotation == "hadamard" and rotation.grad_codec().rotation == "hadamard"
    assert rotation.weight_codec().rotation == "none"
    feedback = SOURCES[source]("grad_error_feedback", "bfloat16", tmp_path)
    assert feedback.error_feedback_dtype() == torch.bfloat16
    for spelling in ("off", "none", "false"):
        assert SOURCES[source]("grad_error_feedback", spelling, tmp_path).error_feedback_dtype() is None


def test_presets_are_the_settings_they_name_and_overrides_win():
    from qaccel.fsdp.config import PRESETS

    assert QSDPConfig.preset("w8g8") == QSDPConfig()  # the defaults are the 8-bit preset
    low = QSDPConfig.preset("w3g2-nearest")
    assert (low.weight_bits, low.grad_bits, low.rounding) == (3, 2, "nearest")
    assert low.grad_codec().bucket_size == 128 and low.grad_codec().meta_dtype == torch.bfloat16  # per-bit defaults
    assert QSDPConfig.preset("w2g2-nearest", seed=7, grad_bits=3).grad_bits == 3
    tuned = QSDPConfig.preset("w4g4-nearest-grad-hadamard")  # the fine-tuning preset rotates the gradients only
    assert (tuned.grad_codec().rotation, tuned.weight_codec().rotation, tuned.weight_codec().rounding) == ("hadamard", "none", "nearest")
    for name, entry in PRESETS.items():
        config = QSDPConfig.preset(name)
        assert all(getattr(config, key) == value for key, value in entry["settings"].items()), name
        assert entry["measured"]  # every preset says what was measured for it
    with pytest.raises(ValueError, match=r"unknown preset; choose from w8g8, w4g4, w4g4-nearest-grad-hadamard, w3g3-nearest, w3g2-nearest, w2g2-nearest"):
        QSDPConfig.preset("w1g1")
