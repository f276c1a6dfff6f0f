"""ZeroOneAdamConfig / OneBitAdamConfig: DeepSpeed names and defaults, validation, env and dict round trips."""

from __future__ import annotations

import dataclasses
import json

import pytest

from qaccel.optim import OneBitAdam, OneBitAdamConfig, ZeroOneAdam, ZeroOneAdamConfig

# DeepSpeed 0.19.6 zoadam.py / adam.py signature defaults, written out independently
DEEPSPEED_ZOADAM_DEFAULTS = dict(
    lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, var_freeze_step=100000, var_update_scaler=16,
    local_step_scaler=32678, local_step_clipper=16,
)  # fmt: skip
DEEPSPEED_ONEBIT_DEFAULTS = dict(lr=1e-3, freeze_step=100000, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def test_defaults_are_deepspeeds():
    zo, onebit = ZeroOneAdamConfig(), OneBitAdamConfig()
    assert {k: getattr(zo, k) for k in DEEPSPEED_ZOADAM_DEFAULTS} == DEEPSPEED_ZOADAM_DEFAULTS
    assert {k: getattr(onebit, k) for k in DEEPSPEED_ONEBIT_DEFAULTS} == DEEPSPEED_ONEBIT_DEFAULTS
    assert zo.granularity == "tensor" and zo.padding == "deepspeed"  # DeepSpeed's fp32 numerics by default


def test_deepspeed_json_params_block_loads_and_round_trips():
    # the DeepSpeed tutorial's block (docs/_tutorials/zero-one-adam.md)
    block = json.loads(
        '{"lr": 1e-3, "weight_decay": 0.01, "bias_correction": false, "var_freeze_step": 1000,'
        ' "var_update_scaler": 16, "local_step_scaler": 1000, "local_step_clipper": 16, "cuda_aware": false,'
        ' "comm_backend_name": "nccl"}'
    )
    cfg = ZeroOneAdamConfig.from_dict(block)
    assert cfg.var_freeze_step == 1000 and cfg.local_step_scaler == 1000 and cfg.weight_decay == 0.01
    assert ZeroOneAdamConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    onebit = OneBitAdamConfig.from_dict({"lr": 4e-4, "freeze_step": 23000, "betas": [0.9, 0.98]})
    assert onebit.betas == (0.9, 0.98) and OneBitAdamConfig.from_dict(onebit.to_dict()) == onebit


@pytest.mark.parametrize(
    "key, value, error, match",
    [
        ("lr", -1.0, ValueError, r"ZeroOneAdamConfig\.lr=-1\.0: must be a number >= 0"),
        ("betas", (0.9, 1.0), ValueError, "betas"),
        ("eps", 0.0, ValueError, "eps=0.0"),
        ("weight_decay", -0.1, ValueError, "weight_decay"),
        ("var_freeze_step", -1, ValueError, "var_freeze_step=-1"),
        ("var_update_scaler", 0, ValueError, "var_update_scaler=0: must be an int >= 1"),
        ("local_step_scaler", 2.0, ValueError, "local_step_scaler"),
        ("local_step_clipper", True, ValueError, "local_step_clipper"),
        ("granularity", "bucket", ValueError, "granularity='bucket': must be one of tensor, group"),
        ("padding", "none", ValueError, "padding"),
        ("gradient_clipping", -1.0, ValueError, "gradient_clipping"),
        ("replica_check_interval", -2, ValueError, "replica_check_interval=-2"),
        # DeepSpeed keys DeepSpeed ignores or rejects: only the value that is true here is accepted
        ("bias_correction", True, ValueError, "no bias correction"),
        ("eps_inside_sqrt", True, ValueError, "outside the sqrt"),
        ("amsgrad", True, NotImplementedError, "AMSGrad"),
        ("max_grad_norm", 1.0, ValueError, "use gradient_clipping"),
        ("cuda_aware", True, ValueError, "MPI"),
        ("comm_backend_name", "mpi", NotImplementedError, "process group"),
    ],
)
def test_bad_values_name_key_value_and_rule(key, value, error, match):
    with pytest.raises(error, match=match):
        ZeroOneAdamConfig(**{key: value})


def test_unknown_keys_are_errors():
    with pytest.raises(ValueError, match=r"unknown keys \['freeze_step'\]"):
        ZeroOneAdamConfig.from_dict({"freeze_step": 10})  # a OneBitAdam key
    with pytest.raises(TypeError, match="unknown arguments"):
        ZeroOneAdam([], var_freez_step=3)


def test_env_precedence_and_errors():
    env = {"QACCEL_ZERO_ONE_ADAM_VAR_FREEZE_STEP": "1000", "QACCEL_ZERO_ONE_ADAM_BETAS": "0.8,0.99",
           "QACCEL_ZERO_ONE_ADAM_GRANULARITY": "group", "OTHER": "x"}  # fmt: skip
    cfg = ZeroOneAdamConfig.from_env(env, lr=5e-4)
    assert (cfg.var_freeze_step, cfg.betas, cfg.granularity, cfg.lr) == (1000, (0.8, 0.99), "group", 5e-4)
    assert ZeroOneAdamConfig.from_env(env, var_freeze_step=7).var_freeze_step == 7  # argument beats env
    with pytest.raises(ValueError, match="QACCEL_ZERO_ONE_ADAM_VAR_FREEZ: not a ZeroOneAdamConfig field"):
        ZeroOneAdamConfig.from_env({"QACCEL_ZERO_ONE_ADAM_VAR_FREEZ": "1"})
    with pytest.raises(ValueError, match=r"var_update_scaler='x' \(from QACCEL_ZERO_ONE_ADAM_VAR_UPDATE_SCALER\)"):
        ZeroOneAdamConfig.from_env({"QACCEL_ZERO_ONE_ADAM_VAR_UPDATE_SCALER": "x"})
    with pytest.raises(ValueError, match="QACCEL_ONEBIT_ADAM_FREEZE_STEP"):
        OneBitAdamConfig.from_env({"QACCEL_ONEBIT_ADAM_FREEZE_STEP": "-3"})
    with pytest.raises(ValueError, match="not a boolean"):
        ZeroOneAdamConfig.from_env({"QACCEL_ZERO_ONE_ADAM_AMSGRAD": "maybe"})


def test_optimizer_accepts_config_or_keywords():
    cfg = ZeroOneAdamConfig(var_freeze_step=3)
    import torch

    p = torch.nn.Parameter(torch.zeros(3))
    assert ZeroOneAdam([p], cfg).config is cfg
    assert ZeroOneAdam([p], cfg, lr=0.5).config == dataclasses.replace(cfg, lr=0.5)
    assert OneBitAdam([p], freeze_step=4).schedule.freeze_step == 4
    with pytest.raises(TypeError, match="config must be a ZeroOneAdamConfig"):
        ZeroOneAdam([p], OneBitAdamConfig())


# -- settings without code changes: argument, then environment, then recipe, then default (as QSDP) ----------


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith(("QACCEL_ZERO_ONE_ADAM_", "QACCEL_ONEBIT_ADAM_", "QACCEL_CONFIG_FILE", "QACCEL_RECIPE")):
            monkeypatch.delenv(name)
    return monkeypatch


def _param():
    import torch

    return torch.nn.Parameter(torch.zeros(3))


def test_optimizer_reads_the_environment_and_arguments_win(clean_env):
    clean_env.setenv("QACCEL_ZERO_ONE_ADAM_VAR_FREEZE_STEP", "7")
    clean_env.setenv("QACCEL_ZERO_ONE_ADAM_PADDING", "minimal")
    opt = ZeroOneAdam([_param()])
    assert (opt.config.var_freeze_step, opt.config.padding) == (7, "minimal")
    assert opt.schedule.var_freeze_step == 7  # the schedule follows the resolved config
    assert ZeroOneAdam([_param()], var_freeze_step=3).config.var_freeze_step == 3
    clean_env.setenv("QACCEL_ONEBIT_ADAM_FREEZE_STEP", "11")
    assert OneBitAdam([_param()]).schedule.freeze_step == 11
    assert OneBitAdam([_param()], freeze_step=4).schedule.freeze_step == 4


def test_optimizer_rejects_unknown_or_bad_environment(clean_env):
    clean_env.setenv("QACCEL_ZERO_ONE_ADAM_VAR_FREEZ", "7")
    with pytest.raises(ValueError, match="QACCEL_ZERO_ONE_ADAM_VAR_FREEZ: not a ZeroOneAdamConfig field"):
        ZeroOneAdam([_param()])
    clean_env.delenv("QACCEL_ZERO_ONE_ADAM_VAR_FREEZ")
    clean_env.setenv("QACCEL_ONEBIT_ADAM_LR", "-1")
    with pytest.raises(ValueError, match=r"lr=-1\.0.*QACCEL_ONEBIT_ADAM_LR"):
        OneBitAdam([_param()])


def test_a_config_object_is_used_as_given(clean_env):
    clean_env.setenv("QACCEL_ZERO_ONE_ADAM_VAR_FREEZE_STEP", "7")
    cfg = ZeroOneAdamConfig(var_freeze_step=3)
    assert ZeroOneAdam([_param()], cfg).config is cfg
    with pytest.raises(TypeError, match="give config or recipe, not both"):
        ZeroOneAdam([_param()], cfg, recipe={"var_freeze_step": 4})


def test_recipe_sits_between_environment_and_defaults(clean_env, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "qsdp: {weight_bits: 4}\n"
        "zero_one_adam: {var_freeze_step: 9, local_step_scaler: 5, betas: [0.8, 0.99]}\n"
        "onebit_adam: {freeze_step: 13}\n"
    )
    clean_env.setenv("QACCEL_CONFIG_FILE", str(recipe))
    cfg = ZeroOneAdam([_param()]).config
    assert (cfg.var_freeze_step, cfg.local_step_scaler, cfg.betas) == (9, 5, (0.8, 0.99))
    assert cfg.local_step_clipper == 16  # not in the recipe: the default
    clean_env.setenv("QACCEL_ZERO_ONE_ADAM_LOCAL_STEP_SCALER", "6")  # environment beats the recipe
    cfg = ZeroOneAdam([_param()]).config
    assert (cfg.var_freeze_step, cfg.local_step_scaler) == (9, 6)
    assert ZeroOneAdam([_param()], local_step_scaler=2).config.local_step_scaler == 2  # argument beats both
    assert OneBitAdam([_param()]).config.freeze_step == 13
    # an explicit recipe (file or mapping) replaces QACCEL_CONFIG_FILE
    assert ZeroOneAdam([_param()], recipe={"var_freeze_step": 4}).config.var_freeze_step == 4
    other = tmp_path / "other.json"
    other.write_text('{"zero_one_adam": {"var_freeze_step": 21}}')
    assert ZeroOneAdamConfig.from_env(recipe=other).var_freeze_step == 21


def test_recipe_errors_name_the_file_and_key(clean_env, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_one_adam: {var_freez_step: 9}\n")
    with pytest.raises(ValueError, match=r"unknown keys \['var_freez_step'\].*bad\.yaml"):
        ZeroOneAdam([_param()], recipe=bad)
    bad.write_text("zero_one_adam: {var_update_scaler: 0}\n")
    with pytest.raises(ValueError, match=r"var_update_scaler=0.*recipe .*bad\.yaml"):
        ZeroOneAdam([_param()], recipe=bad)
    with pytest.raises(ValueError, match="no such file"):
        ZeroOneAdam([_param()], recipe=tmp_path / "missing.yaml")
    bad.write_text("zero_one_adam: [1, 2]\n")
    with pytest.raises(ValueError, match="'zero_one_adam' section must be a mapping"):
        ZeroOneAdam([_param()], recipe=bad)
