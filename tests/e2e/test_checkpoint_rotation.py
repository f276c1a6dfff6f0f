"""``--save_total_limit`` in a real 2-process run of the training loop (QSDP, gpt2-tiny, accelerate launch)."""

from __future__ import annotations

import json

from tests._launch import QSDP_CONFIG, launch, metrics


def test_save_total_limit_leaves_exactly_the_two_newest_checkpoints(tmp_path):
    from qaccel.checkpoint import verify_checkpoint

    out = tmp_path / "run"
    proc = launch(QSDP_CONFIG, "--recipe", "gpt2-tiny", "--max_steps", "4", "--eval_steps", "0", "--save_steps", "1",
                  "--save_total_limit", "2", "--output_dir", str(out))  # fmt: skip
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # every step was saved (once, by the main process)...
        assert proc.stdout.count(f"saved {out / f'checkpoint-{step}'}\n") == 1, proc.stdout[-3000:]
    # ...and only the two newest remain, complete; no partial or set-aside folder is left.
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-3", "checkpoint-4"]
    for step in (3, 4):
        ckpt = out / f"checkpoint-{step}"
        assert verify_checkpoint(ckpt) > 0
        state = json.loads((ckpt / "qaccel_state.json").read_text())
        assert state["step"] == step and state["world_size"] == 2
        assert sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
