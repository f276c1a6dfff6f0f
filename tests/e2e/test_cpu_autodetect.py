"""``qaccel.Accelerator()`` under ``torchrun --nproc_per_node 2`` on a machine without a GPU.

Stock ``accelerate.Accelerator()`` reports ``DistributedType.NO`` and one process there, so both processes
believe they are the main process (the first test pins that upstream behaviour). qaccel's ``Accelerator()``
detects the launch and runs it as ``cpu=True`` does: two processes over gloo, one main process. An explicit
``cpu=False`` on such a launch is an error. Oracles: torch.distributed's own group size and a sum over it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests._launch import run_job, torchrun_cmd

PROBE = Path(__file__).with_name("_launch_probe.py")
DETECTED = "multi-process CPU launch detected"


def _launch(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / mode
    out.mkdir()
    proc = run_job(torchrun_cmd(str(PROBE), str(out), mode), check=False, timeout=240)
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return proc, records


def _check_ok(proc: subprocess.CompletedProcess, records: list[dict]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert len(records) == 2


def test_stock_accelerator_sees_one_process_per_rank(tmp_path):
    """The upstream behaviour this module exists for (if it changes, the detection may be dropped)."""
    proc, records = _launch(tmp_path, "stock")
    _check_ok(proc, records)
    assert [r["distributed_type"] for r in records] == ["NO", "NO"]
    assert [r["is_main_process"] for r in records] == [True, True]
    assert [r["num_processes"] for r in records] == [1, 1]


@pytest.mark.parametrize("mode, distributed_type", [("default", "MULTI_CPU"), ("qsdp", "FSDP")])
def test_qaccel_accelerator_runs_the_launch_as_multi_cpu(tmp_path, mode, distributed_type):
    proc, records = _launch(tmp_path, mode)
    _check_ok(proc, records)
    assert [r["num_processes"] for r in records] == [2, 2]
    assert [r["distributed_type"] for r in records] == [distributed_type] * 2
    assert sorted(r["process_index"] for r in records) == [0, 1]
    assert [r["process_index"] == r["rank_env"] for r in records] == [True, True]
    assert sum(r["is_main_process"] for r in records) == 1  # exactly one main process
    assert [r["group_size"] for r in records] == [2, 2] and [r["group_sum"] for r in records] == [2.0, 2.0]
    assert all(r["device"].startswith("cpu") for r in records)
    log = proc.stdout + proc.stderr
    assert log.count(DETECTED) == 1, log[-4000:]  # once per launch, at INFO, from rank 0


def test_explicit_cpu_false_is_an_error(tmp_path):
    proc, records = _launch(tmp_path, "cpu_false")
    assert proc.returncode != 0 and records == []
    log = proc.stdout + proc.stderr
    assert "Accelerator(cpu=False)" in log and "WORLD_SIZE=2" in log and "cpu=True" in log, log[-4000:]
