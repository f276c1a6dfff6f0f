"""The README's opening snippet runs as the README says, `torchrun --nproc_per_node 2 train.py`, without a GPU,
and the one-line switch really swaps FSDP2's collectives for QSDP's quantized ones."""

from __future__ import annotations

import json

import pytest

from tests._launch import run_job, torchrun_cmd
from tests._readme import snippet

# appended after the snippet: what each rank's wire meter saw, one line per rank. One write per line: ranks
# run under `python -u`, where print() writes the text and the newline apart, and two ranks printing at once
# glued their lines (a CI run failed on it).
PROBE = (
    'import json, sys\n'
    'sys.stdout.write("QACCEL_COMM " + json.dumps(accelerator.comm_stats()["total"]) + "\\n")\n'
    'sys.stdout.flush()\n'
)


@pytest.mark.slow
def test_readme_snippet_trains_on_two_cpu_processes_with_quantized_collectives(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(snippet("after") + PROBE)
    proc = run_job(torchrun_cmd(str(script)), cwd=tmp_path)
    totals = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("QACCEL_COMM ")]
    assert len(totals) == 2, proc.stdout[-3000:]
    for total in totals:
        # qsdp.* kinds are recorded by the comms that QSDPPlugin installs; stock FSDP2 records none
        assert total["qsdp.all_gather"]["calls"] > 0 and total["qsdp.all_gather"]["sent_bytes"] > 0, total
        assert total["qsdp.reduce_scatter"]["calls"] > 0 and total["qsdp.reduce_scatter"]["sent_bytes"] > 0, total
