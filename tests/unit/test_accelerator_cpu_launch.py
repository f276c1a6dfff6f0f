"""The launch detection behind ``qaccel.Accelerator()`` on machines without a GPU, with explicit environments.

Real ``torchrun`` launches are in ``tests/e2e/test_cpu_autodetect.py``; here every branch of the rule:
several processes (``WORLD_SIZE`` > 1 or ``LOCAL_RANK`` alone) and no usable accelerator give ``cpu=True``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from qaccel.integration import _cpu_launch
from qaccel.integration.accelerator import _as_keywords

pytestmark = pytest.mark.skipif(_cpu_launch.usable_accelerator() is not None, reason="needs a machine without GPU")


@pytest.mark.parametrize(
    "environ, cpu",
    [
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "0"}, True),
        ({"WORLD_SIZE": "4"}, True),
        ({"LOCAL_RANK": "1"}, True),  # a launcher that exports only LOCAL_RANK
        ({"OMPI_COMM_WORLD_SIZE": "2"}, True),  # mpirun, as Accelerate reads it
        ({"WORLD_SIZE": "1", "LOCAL_RANK": "0"}, None),  # torchrun --nproc_per_node 1: one process is right
        ({}, None),  # a plain python run
        ({"WORLD_SIZE": "2", "ACCELERATE_USE_CPU": "true"}, None),  # accelerate launch --cpu: Accelerate does it
    ],
)
def test_cpu_is_set_exactly_on_multi_process_launches(environ, cpu):
    assert _cpu_launch.before_init({"mixed_precision": "no"}, environ).get("cpu") is cpu


def test_explicit_values(caplog):
    environ = {"WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert _cpu_launch.before_init({"cpu": True}, environ) == {"cpu": True}
    assert _cpu_launch.before_init({"cpu": None}, environ) == {"cpu": True}  # None: not given
    assert _cpu_launch.before_init({"cpu": None}, {}) == {}
    with pytest.raises(ValueError, match=r"Accelerator\(cpu=False\): .*WORLD_SIZE=2.*pass cpu=True"):
        _cpu_launch.before_init({"cpu": False}, environ)
    with pytest.raises(ValueError, match="WORLD_SIZE='two': must be an integer"):
        _cpu_launch.before_init({}, {"WORLD_SIZE": "two"})


def test_logs_once_per_process_and_only_on_rank_0(caplog, monkeypatch):
    monkeypatch.setattr(_cpu_launch, "_logged", False)
    with caplog.at_level(logging.INFO, logger=_cpu_launch.__name__):
        _cpu_launch.before_init({}, {"WORLD_SIZE": "2", "RANK": "1"})
        _cpu_launch.before_init({}, {"WORLD_SIZE": "2", "RANK": "0"})  # same process: already decided once
    assert caplog.records == []
    monkeypatch.setattr(_cpu_launch, "_logged", False)
    with caplog.at_level(logging.INFO, logger=_cpu_launch.__name__):
        for _ in range(3):
            _cpu_launch.before_init({}, {"WORLD_SIZE": "2", "RANK": "0"})
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "multi-process CPU launch detected (WORLD_SIZE=2" in caplog.records[0].getMessage()


def test_a_usable_gpu_leaves_accelerate_alone(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _cpu_launch.usable_accelerator() == "cuda"
    assert _cpu_launch.before_init({"cpu": False}, {"WORLD_SIZE": "2"}) == {"cpu": False}


def test_positional_arguments_are_named():
    # accelerate.Accelerator(device_placement, split_batches, mixed_precision, gradient_accumulation_steps, cpu, ...)
    assert _as_keywords((True, False, "no", 1, True), {})["cpu"] is True
    with pytest.raises(TypeError, match=r"multiple values for \['cpu'\]"):
        _as_keywords((True, False, "no", 1, True), {"cpu": False})
