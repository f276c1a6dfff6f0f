"""DeepSpeed JSON configs: ``ZeroOneAdamConfig.from_deepspeed`` / ``OneBitAdamConfig.from_deepspeed`` and
``--deepspeed_config`` of the training entry.

The references are written by hand from DeepSpeed's tutorials (``tests/data/deepspeed/``: the 0/1 Adam
and 1-bit Adam tutorials' JSON as printed) and DeepSpeed's documented rules: the optimizer type is
matched in any case, ``train_batch_size == micro * accumulation * world size``, WarmupLR / WarmupDecayLR
warm up from ``warmup_min_lr`` to ``warmup_max_lr``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from qaccel._errors import UsageError
from qaccel.optim import OneBitAdamConfig, ZeroOneAdamConfig
from qaccel.optim.deepspeed_json import read_deepspeed_config
from qaccel.training.deepspeed_config import apply_deepspeed_config, with_deepspeed_method

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
ZERO_ONE_TUTORIAL = DATA / "zero_one_adam_tutorial.json"
ONEBIT_TUTORIAL = DATA / "onebit_adam_tutorial.json"
MINILM = DATA / "minilm_zero_one_adam.json"


def _zero_one(**engine) -> dict:
    return {"optimizer": {"type": "ZeroOneAdam", "params": {"lr": 1e-3}}, **engine}


def _from_deepspeed(cls, ds):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = cls.from_deepspeed(ds)
    return config, [str(w.message) for w in caught]


def test_zero_one_adam_tutorial_maps_every_param_and_the_clipping():
    config, messages = _from_deepspeed(ZeroOneAdamConfig, ZERO_ONE_TUTORIAL)
    # section 1.4 of the tutorial, by hand; gradient_clipping is the engine key
    assert config == ZeroOneAdamConfig(
        lr=1e-3, weight_decay=0.01, var_freeze_step=1000, var_update_scaler=16, local_step_scaler=1000,
        local_step_clipper=16, gradient_clipping=1.0,
    )  # fmt: skip
    assert len(messages) == 1  # the engine settings a script applies itself, said once
    assert "train_batch_size=4096" in messages[0] and "train_micro_batch_size_per_gpu=16" in messages[0]
    assert "mixed_precision=fp16" in messages[0]


def test_onebit_adam_tutorial_loads_with_its_trailing_comma():
    config, _ = _from_deepspeed(OneBitAdamConfig, ONEBIT_TUTORIAL)
    assert config == OneBitAdamConfig(lr=4e-4, freeze_step=23000)
    ds = read_deepspeed_config(ONEBIT_TUTORIAL)
    assert ds.method == "onebit_adam" and ds.mixed_precision == "fp16"
    assert ds.batch(world_size=32) == (16, 8)  # 4096 / (16 x 32)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    return path


def test_a_string_keeps_its_comma_before_a_brace(tmp_path):
    # the trailing commas go; the one inside the string stays, so the value is refused as written
    text = '{"optimizer": {"type": "ZeroOneAdam", "params": {"granularity": "tensor,}",},},}'
    with pytest.raises(ValueError, match=r"granularity=.tensor,\}."):
        ZeroOneAdamConfig.from_deepspeed(_write(tmp_path, text))


def test_a_file_that_is_not_json_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"ds_config.json': not valid JSON"):
        read_deepspeed_config(_write(tmp_path, '{"optimizer": '))


@pytest.mark.parametrize("spelling", ["ZeroOneAdam", "zerooneadam", "ZEROONEADAM"])
def test_the_type_is_matched_in_any_case(spelling):
    ds = read_deepspeed_config({"optimizer": {"type": spelling, "params": {"var_freeze_step": 7}}})
    assert ds.method == "zero_one_adam" and ds.optimizer_config(ZeroOneAdamConfig).var_freeze_step == 7


def test_another_classs_type_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"optimizer.type='ZeroOneAdam' is not OneBitAdamConfig's; allowed: OneBitAdam \(any case\)"):
        OneBitAdamConfig.from_deepspeed(ZERO_ONE_TUTORIAL)
    with pytest.raises(ValueError, match=r"optimizer.type='OneBitAdam' is not ZeroOneAdamConfig's; allowed: ZeroOneAdam \(any case\)"):
        ZeroOneAdamConfig.from_deepspeed(ONEBIT_TUTORIAL)


@pytest.mark.parametrize("kind", ["Adam", "Lamb", "OneBitLamb", None])
def test_an_unsupported_type_is_refused_listing_the_allowed(kind):
    with pytest.raises(ValueError, match=r"optimizer.type=.*allowed: ZeroOneAdam, OneBitAdam"):
        read_deepspeed_config({"optimizer": {"type": kind, "params": {}}})


@pytest.mark.parametrize(
    ("total", "micro", "steps", "world", "expected"),
    [
        (4096, 16, None, 2, (16, 128)),
        (64, None, 4, 2, (8, 4)),
        (64, 8, 4, 2, (8, 4)),
        (16, None, None, 4, (4, 1)),
        (None, 4, 2, 3, (4, 2)),
        (None, 4, None, 3, (4, 1)),
        (None, None, 2, 3, (None, 2)),
        (None, None, None, 3, (None, None)),
    ],
    ids=["total+micro", "total+acc", "all-three", "total-only", "micro+acc", "micro-only", "acc-only", "none"],
)
def test_batch_keys_follow_deepspeeds_rules(total, micro, steps, world, expected):
    engine = {"train_batch_size": total, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": steps}
    ds = read_deepspeed_config(_zero_one(**{k: v for k, v in engine.items() if v is not None}))
    assert ds.batch(world) == expected


@pytest.mark.parametrize(("total", "micro", "steps", "world"), [(64, 8, 4, 4), (100, 16, None, 2), (10, None, None, 4)])
def test_inconsistent_batch_keys_are_refused_naming_them(total, micro, steps, world):
    engine = {"train_batch_size": total, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": steps}
    ds = read_deepspeed_config(_zero_one(**{k: v for k, v in engine.items() if v is not None}))
    with pytest.raises(ValueError, match=rf"train_batch_size={total} must equal train_micro_batch_size_per_gpu .* world size \({world}\)"):
        ds.batch(world)


def test_logging_keys_are_ignored_and_reported():
    ds = read_deepspeed_config(_zero_one(
        steps_per_print=10, wall_clock_breakdown=False, tensorboard={"enabled": True}, flops_profiler={"enabled": False},
        zero_optimization={"stage": 0, "reduce_bucket_size": 5e8},
    ))  # fmt: skip
    assert ds.ignored == ("steps_per_print", "wall_clock_breakdown", "tensorboard", "flops_profiler", "zero_optimization.reduce_bucket_size")
    _, messages = _from_deepspeed(ZeroOneAdamConfig, _zero_one(steps_per_print=10, wall_clock_breakdown=True))
    assert messages == ["DeepSpeed config dict: ignored (they do not change training): steps_per_print, wall_clock_breakdown"]


def test_a_config_with_nothing_to_report_warns_nothing():
    config, messages = _from_deepspeed(ZeroOneAdamConfig, _zero_one(gradient_clipping=0.5, prescale_gradients=False))
    assert messages == [] and config.gradient_clipping == 0.5


@pytest.mark.parametrize(
    ("engine", "named"),
    [
        ({"zero_optimization": {"stage": 2}}, r"zero_optimization.stage=2 is not supported; allowed: 0"),
        ({"prescale_gradients": True}, r"prescale_gradients=True is not supported; allowed: false"),
        ({"activation_checkpointing": {"partition_activations": True}}, r"activation_checkpointing is not supported by qaccel"),
        ({"fp16": {"enabled": True, "loss_scale_window": 1000}}, r"fp16.loss_scale_window=1000 is not supported; allowed: 2000"),
        ({"fp16": {"enabled": True, "loss_scale": 128}}, r"fp16.loss_scale=128 is not supported; allowed: 0"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"fp16.enabled and bf16.enabled are both true"),
        ({"bf16": {"enabled": True, "immediate_grad_update": True}}, r"bf16.immediate_grad_update is not supported"),
        ({"amp": {"enabled": True}}, r"amp.enabled=true"),
        ({"scheduler": {"type": "OneCycle", "params": {}}}, r"scheduler.type='OneCycle' is not supported; allowed: WarmupLR, WarmupDecayLR"),
        ({"scheduler": {"type": "WarmupLR", "params": {}}}, r"scheduler.params.warmup_type='log' is not supported; allowed: linear"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear", "warmup_min_lr": 1e-5}}}, r"warmup_min_lr=1e-05 is not supported; allowed: 0"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear", "total_num_steps": 9}}}, r"scheduler.params.total_num_steps is not a WarmupLR key"),
        ({"train_batch_size": 0}, r"train_batch_size=0 must be an int >= 1"),
    ],
    ids=["zero-stage-2", "prescale", "unknown-key", "loss-scale-window", "static-loss-scale", "fp16+bf16", "bf16-subkey",
         "apex-amp", "one-cycle", "log-warmup", "warmup-min-lr", "total-steps-in-warmuplr", "zero-batch"],
)  # fmt: skip
def test_keys_qaccel_cannot_honour_are_refused_naming_them(engine, named):
    with pytest.raises(ValueError, match=named):
        read_deepspeed_config(_zero_one(**engine))


@pytest.mark.parametrize(
    ("params", "named"),
    [({"gradient_clipping": 1.0}, r"optimizer.params.gradient_clipping: an engine key"),
     ({"eps_inside_sqrt": True}, r"eps_inside_sqrt"), ({"var_freeze_step": -1}, r"var_freeze_step"), ({"no_such_key": 1}, r"no_such_key")],
    ids=["clipping-in-params", "eps-inside-sqrt", "negative-freeze", "unknown-param"],
)  # fmt: skip
def test_bad_params_are_refused_naming_the_key(params, named):
    with pytest.raises(ValueError, match=named):
        ZeroOneAdamConfig.from_deepspeed({"optimizer": {"type": "ZeroOneAdam", "params": params}})


def test_a_duplicate_key_is_refused_as_deepspeed_does(tmp_path):
    with pytest.raises(ValueError, match=r"duplicate keys \['gradient_clipping'\]"):
        read_deepspeed_config(_write(tmp_path, '{"optimizer": {"type": "OneBitAdam"}, "gradient_clipping": 1, "gradient_clipping": 2}'))


def test_a_missing_optimizer_is_refused():
    with pytest.raises(ValueError, match=r"optimizer is missing; qaccel runs optimizer.type ZeroOneAdam, OneBitAdam"):
        read_deepspeed_config({"train_batch_size": 8})


def test_warmup_lr_sets_the_peak_lr_and_says_it_replaced_the_optimizers():
    ds = read_deepspeed_config(_zero_one(scheduler={"type": "WarmupLR", "params": {"warmup_type": "linear", "warmup_max_lr": 3e-4, "warmup_num_steps": 50}}))
    assert (ds.schedule.name, ds.schedule.warmup_steps, ds.schedule.total_steps) == ("constant_with_warmup", 50, None)
    assert ds.optimizer_config(ZeroOneAdamConfig).lr == 3e-4  # DeepSpeed's scheduler writes each group's lr
    assert ds.notes == ("optimizer.params.lr=0.001 is replaced by scheduler.params.warmup_max_lr=0.0003, as in DeepSpeed",)


# --deepspeed_config of the training entry


def _args(*flags: str, config: Path = MINILM):
    from qaccel.train import parse_args

    base = ["--model_name_or_path", "m", "--task", "sequence-classification", "--train_file", "t.csv", "--output_dir", "o"]
    return parse_args([*base, "--deepspeed_config", str(config), *flags])


def test_the_json_becomes_the_runs_settings():
    args = apply_deepspeed_config(_args(), world_size=2)
    # minilm_zero_one_adam.json, by hand: 8 = 4 x 1 x 2; WarmupDecayLR -> linear over total_num_steps
    assert (args.method, args.per_device_batch_size, args.gradient_accumulation_steps) == ("zero_one_adam", 4, 1)
    assert (args.learning_rate, args.weight_decay, args.lr_scheduler, args.warmup_steps, args.max_steps) == (1e-4, 0.01, "linear", 1, 4)
    assert (args.zoadam_lr, args.zoadam_var_freeze_step, args.zoadam_local_step_scaler, args.zoadam_gradient_clipping) == (1e-4, 1000, 1000, 1.0)
    assert args.mixed_precision is None  # no fp16/bf16 block: the run's own setting


def test_the_tutorial_derives_its_accumulation_from_the_world_size():
    args = apply_deepspeed_config(_args(config=ZERO_ONE_TUTORIAL), world_size=2)
    assert (args.per_device_batch_size, args.gradient_accumulation_steps, args.mixed_precision) == (16, 128, "fp16")
    assert not hasattr(args, "zoadam_freeze_step")  # only the keys the JSON sets become flags


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--per_device_batch_size", "8"], r"--per_device_batch_size 8 conflicts with train_micro_batch_size_per_gpu=4"),
     (["--max_steps", "3"], r"--max_steps 3 conflicts with scheduler.params.total_num_steps=4"),
     (["--zoadam_var_freeze_step", "5"], r"--zoadam_var_freeze_step 5 conflicts with optimizer.params.var_freeze_step=1000"),
     (["--zoadam_gradient_clipping", "2"], r"--zoadam_gradient_clipping 2.0 conflicts with gradient_clipping=1.0"),
     (["--method", "onebit_adam"], r"--method onebit_adam conflicts with --deepspeed_config .*runs --method zero_one_adam")],
    ids=["batch", "steps", "freeze", "clipping", "method"],
)  # fmt: skip
def test_a_flag_that_contradicts_the_json_is_refused_naming_both(flags, named):
    with pytest.raises(UsageError, match=named):
        apply_deepspeed_config(_args(*flags), world_size=2)


def test_flags_that_agree_or_that_the_json_leaves_out_are_kept():
    args = apply_deepspeed_config(_args("--per_device_batch_size", "4", "--zoadam_granularity", "group", "--method", "zero_one_adam"), world_size=2)
    assert (args.per_device_batch_size, args.zoadam_granularity) == (4, "group")


def test_the_launcher_takes_the_method_from_the_json():
    assert with_deepspeed_method(_args()).method == "zero_one_adam"


def test_the_tutorial_files_are_the_tutorials_json():
    # the 0/1 Adam file is plain JSON; the 1-bit Adam one differs from JSON only by the tutorial's trailing comma
    assert json.loads(ZERO_ONE_TUTORIAL.read_text())["optimizer"]["params"]["local_step_scaler"] == 1000
    assert '"enabled": true,\n  }' in ONEBIT_TUTORIAL.read_text()


def test_a_bad_engine_clipping_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"gradient_clipping=-1: must be a number >= 0.*engine keys"):
        ZeroOneAdamConfig.from_deepspeed(_zero_one(gradient_clipping=-1))


def test_qaccel_train_refuses_a_json_before_launching(tmp_path, capsys):
    from qaccel.cli import main

    path = _write(tmp_path, json.dumps(_zero_one(zero_optimization={"stage": 3})))
    flags = ["--model_name_or_path", "m", "--task", "sequence-classification", "--train_file", "t.csv", "--output_dir", str(tmp_path / "o")]
    assert main(["train", *flags, "--deepspeed_config", str(path), "--dry_run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "zero_optimization.stage=3 is not supported; allowed: 0" in err[0], err
    assert not (tmp_path / "o").exists()


def test_with_a_recipe_the_json_replaces_its_optimizer_section():
    from qaccel.train import check_inputs, parse_args

    pytest.importorskip("transformers")
    args = parse_args(["--recipe", "minilm-finetune", "--output_dir", "o", "--deepspeed_config", str(ZERO_ONE_TUTORIAL)])
    inputs = check_inputs(args, launch_parallelism=None, world_size=2)
    # the tutorial's block over DeepSpeed's defaults (betas 0.9, 0.999), not the recipe's betas 0.9, 0.95
    assert inputs.plan.onebit == ZeroOneAdamConfig(
        lr=1e-3, weight_decay=0.01, var_freeze_step=1000, var_update_scaler=16, local_step_scaler=1000,
        local_step_clipper=16, gradient_clipping=1.0,
    )  # fmt: skip
    settings = inputs.settings
    assert (settings.per_device_batch_size, settings.gradient_accumulation_steps, settings.mixed_precision) == (16, 128, "fp16")
    assert (settings.learning_rate, settings.weight_decay) == (1e-3, 0.01)
