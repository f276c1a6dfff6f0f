"""End to end: ``scripts/diloco_example.py`` on 2 CPU processes via ``torchrun`` (DDP over gloo, each process an island).

References: the step numbers at which a sync is due (every 10th optimizer step, with 2 micro-batches
per step), plain DDP's bytes per step from the ring formula over the parameter count, and each
island's weights gathered at the end.
"""

import json

import pytest

from tests._launch import REPO, run_job, torchrun_cmd

SCRIPT = REPO / "scripts" / "diloco_example.py"
STEPS, H = 40, 10


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One torchrun launch shared by the tests below (about 20 s on 2 cores)."""
    out = tmp_path_factory.mktemp("diloco_launch") / "result.json"
    cmd = torchrun_cmd(str(SCRIPT), "--cpu", "--steps", str(STEPS), "--sync_every", str(H), "--outer_bits", "4", "--grad_accum", "2", "--out", str(out))
    run_job(cmd, timeout=300)
    return json.loads(out.read_text())


def test_islands_talk_only_at_each_sync_and_end_identical(launched):
    assert launched["world_size"] == 2 and launched["syncs"] == STEPS // H and launched["islands_identical"]
    for step, wire in enumerate(launched["wire_per_step"], start=1):
        synced = wire.get("comm/diloco.outer_reduce_scatter/sent_bytes", 0) > 0 and wire.get("comm/diloco.outer_all_gather/sent_bytes", 0) > 0
        assert synced == (step % H == 0), (step, wire)
        assert (wire["comm/sent_bytes"] > 0) == (step % H == 0), (step, wire)  # no gradient all-reduce in between


def test_bytes_per_step_are_a_small_fraction_of_ddps(launched):
    ddp_per_step = 2 * (2 - 1) * 4 * launched["trainable_values"] // 2  # a ring all-reduce of fp32 gradients, 2 ranks
    mean = sum(w["comm/sent_bytes"] for w in launched["wire_per_step"]) / STEPS
    assert mean < ddp_per_step / 40  # 4 bits (about 1/6 with metadata) once every 10 steps


def test_loss_falls_over_40_steps_smoke(launched):
    assert launched["losses"][-1] < launched["losses"][0]
