"""``QSDPPlugin`` behaves like Accelerate's own plugin dataclasses, and ``before_init`` copies it.

The reference for "like Accelerate's own" is Accelerate's ``FullyShardedDataParallelPlugin``
itself: the same calls (``repr``, ``dataclasses.fields``, ``dataclasses.replace``) on it and on
``QSDPPlugin`` must keep every field, ``qsdp_config`` included.
"""

import dataclasses
import inspect
import os

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin

from qaccel import QSDPPlugin
from qaccel.fsdp import QSDPConfig
from qaccel.integration import _qsdp

FSDP_KWARGS = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["GPT2Block"], "reshard_after_forward": False}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("FSDP_VERSION", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION", "QACCEL_CONFIG_FILE", "QACCEL_RECIPE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith(("QACCEL_QSDP_", "FSDP_"))]:
        monkeypatch.delenv(name)


def test_qsdp_config_is_a_real_dataclass_field():
    plugin = QSDPPlugin(weight_bits=4, grad_bits=None, **FSDP_KWARGS)
    names = [f.name for f in dataclasses.fields(plugin)]
    stock = [f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)]
    assert names == [*stock, "qsdp_config"]  # every Accelerate field, plus ours; no init-only keyword
    assert plugin.qsdp_config == QSDPConfig(weight_bits=4, grad_bits=None)
    assert "qsdp_config=QSDPConfig(weight_bits=4, grad_bits=None" in repr(plugin)
    assert dataclasses.asdict(plugin)["qsdp_config"] == dataclasses.asdict(QSDPConfig(weight_bits=4, grad_bits=None))


def test_replace_keeps_qsdp_config_and_accelerate_fields_as_on_accelerates_own_plugin():
    plugin = QSDPPlugin(qsdp_config=QSDPConfig(weight_bits=6, seed=3), **FSDP_KWARGS)
    replaced = dataclasses.replace(plugin, reshard_after_forward=True)
    assert replaced.qsdp_config == QSDPConfig(weight_bits=6, seed=3)
    assert replaced.reshard_after_forward is True and replaced.fsdp_version == 2
    # Reference: the same replace on Accelerate's own plugin keeps the same FSDP fields.
    stock = dataclasses.replace(FullyShardedDataParallelPlugin(fsdp_version=2, **FSDP_KWARGS), reshard_after_forward=True)
    for f in dataclasses.fields(stock):
        assert getattr(replaced, f.name) == getattr(stock, f.name), f.name
    new_config = dataclasses.replace(plugin, qsdp_config=QSDPConfig(grad_bits=4))
    assert new_config.qsdp_config.grad_bits == 4 and plugin.qsdp_config.grad_bits == 8


def test_keywords_are_exactly_the_config_fields_in_order():
    # Class-body annotations in declaration order; init-only ones read "InitVar[...]".
    init_only = [name for name, hint in QSDPPlugin.__annotations__.items() if str(hint).startswith("InitVar")]
    assert init_only == ["recipe", *[f.name for f in dataclasses.fields(QSDPConfig)]]
    assert list(_qsdp.QSDP_KEYWORDS) == [f.name for f in dataclasses.fields(QSDPConfig)]


# A value other than the default for every QSDPConfig field, written by hand: a new field must be
# added here, and then reaches the plugin without an edit of the plugin.
NON_DEFAULTS = {
    "weight_bits": 4, "grad_bits": 3, "replica_grad_bits": None, "weight_bucket_size": 64, "grad_bucket_size": 512,
    "weight_meta_dtype": "bfloat16", "grad_meta_dtype": "float32", "rounding": "nearest", "seed": 5,
    "master_weights": "quantized", "param_min_numel": 7, "unit_min_numel": 0, "weight_rotation": "hadamard",
    "grad_rotation": "hadamard", "grad_error_feedback": "bfloat16", "prefetch": False, "overlap_reduce_scatter": False,
}  # fmt: skip


def test_every_config_field_is_a_plugin_keyword_that_round_trips():
    names = [f.name for f in dataclasses.fields(QSDPConfig)]
    assert sorted(NON_DEFAULTS) == sorted(names)
    keyword_only = [p.name for p in inspect.signature(QSDPPlugin).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert keyword_only[-len(names) - 1 :] == ["recipe", *names]
    defaults = QSDPConfig()
    for name in names:
        config = QSDPPlugin(**{name: NON_DEFAULTS[name]}).qsdp_config
        assert getattr(config, name) == NON_DEFAULTS[name] != getattr(defaults, name), name
        assert config.differences(defaults).keys() <= {name}, name  # nothing else moved
    # all at once (quantized masters stay on the unrotated grid, so weight_rotation keeps its default)
    together = {**NON_DEFAULTS, "weight_rotation": "none"}
    config = QSDPPlugin(**together).qsdp_config
    assert {name: getattr(config, name) for name in names} == together


def test_keywords_environment_and_recipe_fill_the_config(monkeypatch, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("qsdp: {weight_bits: 6, seed: 5}\n")
    monkeypatch.setenv("QACCEL_QSDP_GRAD_BITS", "off")
    plugin = QSDPPlugin(recipe=str(recipe), seed=9)
    assert plugin.qsdp_config == QSDPConfig(weight_bits=6, grad_bits=None, seed=9)
    assert QSDPPlugin(weight_bits=None).qsdp_config.weight_bits is None  # None given explicitly means off


def test_refusals_name_the_value(monkeypatch):
    with pytest.raises(NotImplementedError, match=r"QSDPPlugin\.fsdp_version=1 \(from argument\): QSDP runs on FSDP2 only"):
        QSDPPlugin(fsdp_version=1)
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(NotImplementedError, match=r"fsdp_version=1 \(from FSDP_VERSION\)"):
        QSDPPlugin()
    monkeypatch.delenv("FSDP_VERSION")
    with pytest.raises(ValueError, match=r"either qsdp_config or QSDP keywords/recipe, not both \(got \['weight_bits'\]"):
        QSDPPlugin(qsdp_config=QSDPConfig(), weight_bits=4)
    with pytest.raises(TypeError, match=r"QSDPPlugin\.qsdp_config: expected a QSDPConfig, got dict"):
        QSDPPlugin(qsdp_config={"weight_bits": 4})
    # Accelerate's FSDP2 plugin refuses reshard_after_forward=<int> itself (install_qsdp does too).
    with pytest.raises(ValueError, match=r"reshard_after_forward set to 2\. This is not supported with FSDP2"):
        QSDPPlugin(reshard_after_forward=2)


def test_before_init_leaves_the_callers_plugin_untouched(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    plugin = QSDPPlugin(weight_bits=8, grad_bits=8, **FSDP_KWARGS)
    before = repr(plugin)
    kwargs = {"fsdp_plugin": plugin, "mixed_precision": "bf16"}
    adjusted = _qsdp.before_init(kwargs)
    assert plugin.mixed_precision_policy is None and repr(plugin) == before
    assert kwargs == {"fsdp_plugin": plugin, "mixed_precision": "bf16"}  # the caller's dict too
    given = adjusted["fsdp_plugin"]
    assert given is not plugin and isinstance(given, QSDPPlugin)
    assert given.qsdp_config == plugin.qsdp_config
    assert (given.mixed_precision_policy.param_dtype, given.mixed_precision_policy.reduce_dtype) == (torch.bfloat16, torch.float32)
