"""Accelerate's own distributed test scripts pass with ``qaccel.Accelerator`` in place of ``accelerate.Accelerator``.

Each script (``test_script.py``: data loaders, RNG sync, training parity with a single-process model,
save/load; ``test_sync.py``: gradient sync, ``no_sync`` and accumulation) runs under ``accelerate launch --cpu --num_processes 2``, as Accelerate's
own CI launches them, with the installed Accelerate's copy of the script. The script's assertions are
the oracle (all three pass with the stock ``Accelerator`` on accelerate 1.15.0 and 1.16.0 here).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import accelerate
import pytest

from tests._launch import run_job

RUNNER = Path(__file__).with_name("_accelerate_script_runner.py")
# test_ops.py is left out: it builds no Accelerator (PartialState only), so it checks nothing of ours
SCRIPTS = ("test_sync", "test_script")

pytestmark = pytest.mark.slow


def _launch(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", str(RUNNER), script,
    ]  # fmt: skip
    return run_job(cmd, check=False, cwd=tmp_path)


@pytest.mark.parametrize("script", SCRIPTS)
def test_upstream_script_passes_with_qaccel_accelerator(script, tmp_path):
    proc = _launch(script, tmp_path)
    assert proc.returncode == 0, (
        f"accelerate {accelerate.__version__} {script}.py with qaccel.Accelerator: exit {proc.returncode}\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
