"""QSDPConfig: validation messages, precedence (argument > env > recipe > default), round trips."""

import json

import pytest
import torch

from qaccel.fsdp import QSDPConfig


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"weight_bits": 12}, r"QSDPConfig\.weight_bits=12: must be an int in \[2, 8\] or None"),
        ({"grad_bits": 1}, r"QSDPConfig\.grad_bits=1: must be an int in \[2, 8\]"),
        ({"grad_bucket_size": 0}, r"QSDPConfig\.grad_bucket_size=0: must be an int in \[1, "),
        ({"weight_meta_dtype": "float16"}, r"QSDPConfig\.weight_meta_dtype='float16': must be one of float32, bfloat16"),
        ({"rounding": "up"}, r"QSDPConfig\.rounding='up': must be one of stochastic, nearest"),
        ({"seed": -1}, r"QSDPConfig\.seed=-1: must be an int in \[0, "),
        ({"master_weights": "fp32"}, r"QSDPConfig\.master_weights='fp32': must be one of fresh, quantized"),
        ({"master_weights": "quantized", "weight_bits": None}, r"master_weights='quantized': requires weight_bits"),
        ({"unit_min_numel": -5}, r"QSDPConfig\.unit_min_numel=-5: must be an int >= 0"),
    ],
)
def test_bad_values_name_key_value_and_allowed(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        QSDPConfig(**kwargs)


def test_wrong_type_is_type_error():
    with pytest.raises(TypeError, match=r"QSDPConfig\.weight_bits='8'"):
        QSDPConfig(weight_bits="8")


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
        "QACCEL_RECIPE": str(recipe),
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
    with pytest.raises(ValueError, match=r"QACCEL_QSDP_SEED='abc': not a valid value"):
        QSDPConfig.from_env({"QACCEL_QSDP_SEED": "abc"})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"qsdp": {"grad_bits": 9}}))
    with pytest.raises(ValueError, match=r"grad_bits=9: .*\(from recipe .*bad\.json\)"):
        QSDPConfig.from_env({"QACCEL_RECIPE": str(bad)})
    with pytest.raises(ValueError, match="no such file"):
        QSDPConfig.from_file(tmp_path / "missing.yaml")


def test_plugin_refuses_fsdp1_and_mixed_config(monkeypatch):
    from qaccel import QSDPPlugin

    with pytest.raises(NotImplementedError, match=r"QSDPPlugin\.fsdp_version=1 \(from argument\): QSDP runs on FSDP2 only"):
        QSDPPlugin(fsdp_version=1)
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(NotImplementedError, match=r"fsdp_version=1 \(from FSDP_VERSION\)"):
        QSDPPlugin()
    monkeypatch.delenv("FSDP_VERSION")
    with pytest.raises(ValueError, match="either qsdp_config or QSDP keywords"):
        QSDPPlugin(qsdp_config=QSDPConfig(), weight_bits=4)
    plugin = QSDPPlugin(weight_bits=4, grad_bits=None, reshard_after_forward=False)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is False
    assert plugin.qsdp_config == QSDPConfig(weight_bits=4, grad_bits=None)
