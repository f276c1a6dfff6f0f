"""``qaccel train --recipe R --method M``: the launch config follows the method when none is given.

gpt2-tiny's recipe runs QSDP under ``cpu_2proc_qsdp.yaml`` (FSDP); 0/1 Adam runs on DDP, so without
``--launch_config`` its twin ``cpu_2proc_ddp.yaml`` is chosen. Nothing is launched: ``build_command``
returns the command line after the same checks every rank makes.
"""

from __future__ import annotations

import pytest

from qaccel._resources import launch_config_path, launch_configs_dir
from qaccel.commands.train import build_command, launcher_args
from qaccel.training.methods import launch_config_for_method


def _config_of(command: list[str]) -> str:
    return command[command.index("--config_file") + 1]


def _command(tmp_path, *extra: str, launch_config: str | None = None) -> list[str]:
    args = launcher_args(recipe="gpt2-tiny", launch_config=launch_config, dry_run=True)
    return build_command(args, ["--output_dir", str(tmp_path / "run"), "--max_steps", "2", *extra])


@pytest.mark.parametrize(("method", "config"), [
    ("zero_one_adam", "cpu_2proc_ddp.yaml"),
    ("onebit_adam", "cpu_2proc_ddp.yaml"),
    ("none", "cpu_2proc_qsdp.yaml"),  # stock FSDP2 runs on the recipe's own config
    ("qsdp", "cpu_2proc_qsdp.yaml"),
])  # fmt: skip
def test_a_changed_method_gets_a_config_it_runs_on(method, config, tmp_path):
    assert _config_of(_command(tmp_path, "--method", method)) == str(launch_configs_dir() / config)


def test_without_method_the_recipe_config_stays(tmp_path):
    assert _config_of(_command(tmp_path)) == str(launch_configs_dir() / "cpu_2proc_qsdp.yaml")


def test_an_explicit_launch_config_wins(tmp_path):
    # HSDP: 0/1 Adam across 2 replicas of 2 shards, not the DDP default
    command = _command(tmp_path, "--method", "zero_one_adam", launch_config="cpu_2x2_hqsdp")
    assert _config_of(command) == str(launch_configs_dir() / "cpu_2x2_hqsdp.yaml")


def test_a_wrong_explicit_launch_config_is_still_refused(tmp_path):
    with pytest.raises(ValueError, match="--method zero_one_adam with an FSDP launch config"):
        _command(tmp_path, "--method", "zero_one_adam", launch_config="cpu_2proc_qsdp")


@pytest.mark.parametrize(("method", "recipe_config", "expected"), [
    ("zero_one_adam", "gpu_1node_8_qsdp", "gpu_1node_8_ddp"),  # same hardware, not a CPU config
    ("qsdp", "gpu_1node_8_ddp", "gpu_1node_8_qsdp"),
    ("qsdp", "cpu_2proc_ddp", "cpu_2proc_qsdp"),
    ("zero_one_adam", "gpu_2node_8_hqsdp", "gpu_2node_8_hqsdp"),  # HSDP runs 0/1 Adam across replicas
    ("zero_one_adam", "gpu_2node_8_qsdp", "gpu_2node_8_qsdp"),  # no twin: kept, and the check names what works
])  # fmt: skip
def test_the_twin_is_on_the_same_hardware(method, recipe_config, expected):
    assert launch_config_for_method(method, launch_config_path(recipe_config)) == launch_config_path(expected)


def test_an_unknown_method_is_named():
    with pytest.raises(ValueError, match="--method 'adam': unknown; choose one of qsdp"):
        launch_config_for_method("adam", launch_config_path("cpu_2proc_qsdp"))
