"""``enable_fsdp2_on_cpu`` refusals (the switch itself runs on real processes in
``tests/dist/test_qsdp_accelerate.py``, which also fails if Accelerate stops honouring it)."""

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from qaccel.integration.cpu_fsdp import enable_fsdp2_on_cpu


def fake_accelerator(**state):
    return SimpleNamespace(state=SimpleNamespace(**state))


def test_refuses_a_state_that_is_not_multi_cpu():
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    with pytest.raises(RuntimeError, match="needs a MULTI_CPU state, got DistributedType.NO"):
        enable_fsdp2_on_cpu(fake_accelerator(distributed_type=DistributedType.NO, mixed_precision="no"), plugin)


def test_fails_loudly_when_accelerate_internals_move():
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    with pytest.raises(RuntimeError, match="AcceleratorState has no 'mixed_precision'"):
        enable_fsdp2_on_cpu(fake_accelerator(distributed_type=DistributedType.MULTI_CPU), plugin)


def test_refuses_fsdp1():
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1)
    with pytest.raises(NotImplementedError, match="fsdp_version=1"):
        enable_fsdp2_on_cpu(fake_accelerator(distributed_type=DistributedType.MULTI_CPU, mixed_precision="no"), plugin)
