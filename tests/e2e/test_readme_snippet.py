"""The README's opening snippet runs as the README says, `torchrun --nproc_per_node 2 train.py`, without a GPU,
and the one-line switch really swaps FSDP2's collectives for QSDP's quantized ones."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.test_qsdp_launch import free_port, launcher_env
from tests.unit.test_readme import snippet

# appended after the snippet: what each rank's wire meter saw, one line per rank
PROBE = 'import json\nprint("QACCEL_COMM " + json.dumps(accelerator.comm_stats()["total"]), flush=True)\n'


@pytest.mark.slow
def test_readme_snippet_trains_on_two_cpu_processes_with_quantized_collectives(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(snippet("after") + PROBE)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), str(script)]
    proc = subprocess.run(command, env=launcher_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    totals = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("QACCEL_COMM ")]
    assert len(totals) == 2, proc.stdout[-3000:]
    for total in totals:
        # qsdp.* kinds are recorded by the comms that QSDPPlugin installs; stock FSDP2 records none
        assert total["qsdp.all_gather"]["calls"] > 0 and total["qsdp.all_gather"]["sent_bytes"] > 0, total
        assert total["qsdp.reduce_scatter"]["calls"] > 0 and total["qsdp.reduce_scatter"]["sent_bytes"] > 0, total
