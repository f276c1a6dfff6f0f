"""End to end: ``scripts/qsdp_example.py`` on 2 CPU processes via ``accelerate launch`` and ``torchrun``.

The Accelerate YAML in ``launch_configs/`` holds only standard keys; QSDP settings reach the
workers through ``QACCEL_QSDP_*`` variables (accelerate launch passes the environment on) or a
recipe file (``--qaccel_config``).
"""

import json
import sys
from pathlib import Path

import yaml

from tests._launch import REPO, free_port, run_job

SCRIPT = REPO / "scripts" / "qsdp_example.py"
CONFIG = REPO / "launch_configs" / "cpu_2proc_qsdp.yaml"


def run(cmd: list[str], out: Path, **extra_env: str) -> dict:
    run_job(cmd, timeout=300, **extra_env)
    return json.loads(out.read_text())


def check_trained(result: dict) -> None:
    """Smoke: the launch ran QSDP on 2 processes and moved quantized bytes; a falling loss over 4
    steps shows only that training did not break (accuracy is checked in tests/dist/)."""
    assert result["world_size"] == 2
    assert result["distributed_type"] == "DistributedType.FSDP"
    losses = result["losses"]
    assert losses[-1] < losses[0]
    for step in result["wire_per_step"]:
        assert step["comm/qsdp.all_gather/sent_bytes"] > 0 and step["comm/qsdp.reduce_scatter/sent_bytes"] > 0


def test_launch_config_has_only_standard_accelerate_keys():
    from accelerate.commands.config.config_args import ClusterConfig

    config = yaml.safe_load(CONFIG.read_text())
    assert set(config) <= set(ClusterConfig.__dataclass_fields__)
    assert not any("qsdp" in str(key).lower() or "qaccel" in str(key).lower() for key in config)
    ClusterConfig.from_yaml_file(str(CONFIG))  # Accelerate's own strict loader accepts it


def test_smoke_accelerate_launch_two_cpu_processes_with_env_settings(tmp_path):
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG), "--main_process_port", str(free_port()),
        str(SCRIPT), "--steps", "4", "--out", str(out),
    ]
    result = run(cmd, out, QACCEL_QSDP_WEIGHT_BITS="4", QACCEL_QSDP_SEED="7")
    check_trained(result)
    assert result["qsdp"]["weight_bits"] == 4 and result["qsdp"]["grad_bits"] == 8 and result["qsdp"]["seed"] == 7


def test_smoke_torchrun_two_cpu_processes_with_recipe_file(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("qsdp:\n  weight_bits: 8\n  grad_bits: 4\n  master_weights: quantized\n")
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        str(SCRIPT), "--steps", "4", "--qaccel_config", str(recipe), "--out", str(out),
    ]
    result = run(cmd, out)
    check_trained(result)
    assert result["qsdp"]["grad_bits"] == 4 and result["qsdp"]["master_weights"] == "quantized"
