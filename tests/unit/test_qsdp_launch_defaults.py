"""What ``qaccel.Accelerator`` does with an ``accelerate launch`` FSDP2 config and no plugin.

`accelerate launch` with ``distributed_type: FSDP`` exports ``ACCELERATE_USE_FSDP=true`` and
``FSDP_VERSION=2`` to the workers; qaccel then builds a QSDPPlugin from ``QACCEL_QSDP_*``, reduces
in fp32 under bf16 mixed precision, and asks for the CPU backend on a machine without a GPU.
"""

import pytest
import torch

from qaccel.integration import QSDPPlugin, _qsdp


@pytest.fixture
def launch_env(monkeypatch):
    for name in ("FSDP_AUTO_WRAP_POLICY", "FSDP_TRANSFORMER_CLS_TO_WRAP", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("QACCEL_QSDP_WEIGHT_BITS", "4")
    return monkeypatch


def test_fsdp2_launch_without_plugin_gets_qsdp_from_env(launch_env):
    kwargs = _qsdp.before_init({"mixed_precision": "bf16"})
    plugin = kwargs["fsdp_plugin"]
    assert isinstance(plugin, QSDPPlugin)
    assert plugin.qsdp_config.weight_bits == 4 and plugin.qsdp_config.grad_bits == 8
    policy = plugin.mixed_precision_policy
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert kwargs["cpu"] is (not torch.cuda.is_available())


def test_both_paths_off_gives_stock_fsdp2_settings(launch_env):
    launch_env.setenv("QACCEL_QSDP_WEIGHT_BITS", "off")
    launch_env.setenv("QACCEL_QSDP_GRAD_BITS", "off")
    plugin = _qsdp.before_init({"mixed_precision": "bf16"})["fsdp_plugin"]
    assert plugin.qsdp_config.weight_bits is None and plugin.qsdp_config.grad_bits is None
    # No quantized gradients: Accelerate's own mixed-precision policy applies unchanged.
    assert plugin.mixed_precision_policy is None


def test_no_fsdp_launch_leaves_arguments_alone(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert _qsdp.before_init({"mixed_precision": "no"}) == {"mixed_precision": "no"}
