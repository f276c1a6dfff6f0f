"""Method planning for the training entry point: parallelism, launch mismatches, setting precedence."""

import pytest

from qaccel.training import plan_method

BASE = dict(recipe_qsdp={}, flag_qsdp={}, recipe_onebit={}, flag_onebit={}, learning_rate=1e-3, weight_decay=0.0)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("QACCEL_", "ACCELERATE_USE_")):
            monkeypatch.delenv(name)


def test_qsdp_runs_on_fsdp2_and_the_one_bit_optimizers_on_ddp():
    assert plan_method("qsdp", recipe_method="qsdp", **BASE).parallelism == "fsdp2"
    assert plan_method("zero_one_adam", recipe_method="qsdp", **BASE).parallelism == "ddp"
    assert plan_method("onebit_adam", recipe_method="zero_one_adam", **BASE).parallelism == "ddp"


def test_none_keeps_the_recipe_parallelism_with_every_path_off():
    stock_fsdp = plan_method("none", recipe_method="qsdp", **BASE)
    assert stock_fsdp.parallelism == "fsdp2"
    # replica_grad_bits too: `none` under an HSDP launch is stock HSDP (an exact replica all-reduce)
    assert stock_fsdp.qsdp.weight_bits is None and stock_fsdp.qsdp.grad_bits is None and stock_fsdp.qsdp.replica_grad_bits is None
    assert plan_method("none", recipe_method="zero_one_adam", **BASE).parallelism == "ddp"


def test_one_bit_optimizer_under_a_1d_fsdp_launch_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"zero_one_adam with an FSDP launch config: runs on HSDP shards.*dp_replicate_size >= 2.*--launch_config cpu_2x2_hqsdp.*cpu_2proc_ddp"):
        plan_method("zero_one_adam", recipe_method="zero_one_adam", **BASE)
    # `none` under an FSDP launch is stock FSDP2, whatever the recipe's method
    assert plan_method("none", recipe_method="zero_one_adam", **BASE).parallelism == "fsdp2"


def test_one_bit_optimizer_under_an_hsdp_launch_runs_on_shards_exact_inside_the_node(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    # the recipe's qsdp section belongs to the qsdp method: codecs stay off unless flags or variables ask
    plan = plan_method("zero_one_adam", recipe_method="qsdp", **{**BASE, "recipe_qsdp": {"weight_bits": 4, "grad_bits": 4}})
    assert plan.parallelism == "fsdp2" and plan.onebit is not None
    assert (plan.qsdp.weight_bits, plan.qsdp.grad_bits, plan.qsdp.replica_grad_bits) == (None, None, None)
    flagged = plan_method("onebit_adam", recipe_method="qsdp", **{**BASE, "flag_qsdp": {"weight_bits": 8, "grad_bits": 8}})
    assert (flagged.qsdp.weight_bits, flagged.qsdp.grad_bits) == (8, 8)
    with pytest.raises(ValueError, match=r"--qsdp_replica_grad_bits=4: with --method zero_one_adam the optimizer compresses"):
        plan_method("zero_one_adam", recipe_method="qsdp", **{**BASE, "flag_qsdp": {"replica_grad_bits": 4}})


def test_deepspeed_launch_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="DeepSpeed"):
        plan_method("qsdp", recipe_method="qsdp", **BASE)


def test_unknown_method_and_unknown_settings_are_named():
    with pytest.raises(ValueError, match=r"--method 'sgd'.*qsdp, zero_one_adam, onebit_adam, diloco, none"):
        plan_method("sgd", recipe_method="qsdp", **BASE)
    with pytest.raises(ValueError, match=r"qsdp settings: unknown keys \['wieght_bits'\]"):
        plan_method("qsdp", recipe_method="qsdp", **{**BASE, "flag_qsdp": {"wieght_bits": 4}})
    with pytest.raises(ValueError, match=r"zero_one_adam settings: unknown keys \['freeze_stepp'\]"):
        plan_method("zero_one_adam", recipe_method="qsdp", **{**BASE, "recipe_onebit": {"freeze_stepp": 3}})


def test_precedence_flag_then_environment_then_recipe(monkeypatch):
    recipe_only = plan_method("qsdp", recipe_method="qsdp", **{**BASE, "recipe_qsdp": {"weight_bits": 6, "grad_bits": 6}})
    assert (recipe_only.qsdp.weight_bits, recipe_only.qsdp.grad_bits) == (6, 6)
    monkeypatch.setenv("QACCEL_QSDP_WEIGHT_BITS", "4")
    env_over_recipe = plan_method("qsdp", recipe_method="qsdp", **{**BASE, "recipe_qsdp": {"weight_bits": 6, "grad_bits": 6}})
    assert (env_over_recipe.qsdp.weight_bits, env_over_recipe.qsdp.grad_bits) == (4, 6)
    flag_over_env = plan_method("qsdp", recipe_method="qsdp", **{**BASE, "recipe_qsdp": {"weight_bits": 6}, "flag_qsdp": {"weight_bits": 5}})
    assert flag_over_env.qsdp.weight_bits == 5


def test_one_bit_settings_precedence_and_training_defaults(monkeypatch):
    plan = plan_method("zero_one_adam", recipe_method="zero_one_adam", **{**BASE, "recipe_onebit": {"var_freeze_step": 50}})
    assert (plan.onebit.var_freeze_step, plan.onebit.lr, plan.onebit.weight_decay) == (50, 1e-3, 0.0)
    monkeypatch.setenv("QACCEL_ZERO_ONE_ADAM_VAR_FREEZE_STEP", "70")
    plan = plan_method("zero_one_adam", recipe_method="zero_one_adam", **{**BASE, "recipe_onebit": {"var_freeze_step": 50}})
    assert plan.onebit.var_freeze_step == 70
    plan = plan_method(
        "zero_one_adam", recipe_method="zero_one_adam", **{**BASE, "recipe_onebit": {"var_freeze_step": 50}, "flag_onebit": {"var_freeze_step": 90}}
    )
    assert plan.onebit.var_freeze_step == 90
    assert plan.config_dict()["var_freeze_step"] == 90


@pytest.mark.parametrize("name, expected", [("cpu_2proc_qsdp", "fsdp2"), ("gpu_2node_8_qsdp", "fsdp2"), ("cpu_2x2_hqsdp", "hsdp"), ("gpu_2node_8_hqsdp", "hsdp"), ("cpu_2proc_ddp", None), ("gpu_1node_8_ddp", None)])
def test_a_launch_config_file_tells_its_parallelism_as_accelerate_launch_exports_it(name, expected):
    import yaml

    from qaccel._resources import launch_config_path
    from qaccel.training.methods import launch_config_parallelism

    path = launch_config_path(name)
    assert launch_config_parallelism(path) == expected
    # the independent reading: the file's own distributed_type
    raw = yaml.safe_load(path.read_text())
    assert (raw["distributed_type"] == "FSDP") == (expected in ("fsdp2", "hsdp"))
    assert (raw.get("parallelism_config", {}).get("parallelism_config_dp_replicate_size", 1) > 1) == (expected == "hsdp")


def test_an_explicit_launch_parallelism_wins_over_the_environment(monkeypatch):
    from qaccel.training.methods import launch_config_parallelism

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # ignored when the caller read the config file itself
    assert plan_method("zero_one_adam", recipe_method="zero_one_adam", launch_parallelism=None, **BASE).parallelism == "ddp"
    with pytest.raises(ValueError, match="DeepSpeed"):
        plan_method("qsdp", recipe_method="qsdp", launch_parallelism="deepspeed", **BASE)
    with pytest.raises(ValueError, match=r"launch config '.*nope.yaml': no such file"):
        launch_config_parallelism("/nope.yaml")


def test_diloco_runs_on_ddp_or_on_hsdp_shards_and_reads_its_section(monkeypatch):
    ddp = plan_method("diloco", recipe_method="qsdp", **BASE, recipe_diloco={"sync_every": 20, "outer_bits": 4}, flag_diloco={"sync_every": 10})
    assert (ddp.parallelism, ddp.qsdp, ddp.onebit) == ("ddp", None, None)
    assert (ddp.diloco.sync_every, ddp.diloco.outer_bits, ddp.diloco.outer_lr) == (10, 4, 0.7)  # flag, recipe, default
    assert ddp.config_dict() == {**ddp.diloco.to_dict(), "parallelism": "ddp", "qsdp": None}
    assert plan_method("qsdp", recipe_method="qsdp", **BASE, recipe_diloco={"sync_every": 20}).diloco is None
    with pytest.raises(ValueError, match=r"diloco settings: unknown keys \['sync_period'\]"):
        plan_method("diloco", recipe_method="qsdp", **BASE, recipe_diloco={"sync_period": 20})
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "2")
    hsdp = plan_method("diloco", recipe_method="qsdp", **{**BASE, "recipe_qsdp": {"weight_bits": 4, "grad_bits": 4}})
    assert hsdp.parallelism == "fsdp2"  # HSDP shards: the recipe's qsdp section is the qsdp method's, codecs off
    assert (hsdp.qsdp.weight_bits, hsdp.qsdp.grad_bits, hsdp.qsdp.replica_grad_bits) == (None, None, None)
