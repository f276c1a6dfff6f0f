"""metrics.jsonl: one row per step, truncated to the checkpoint's step on resume."""

import json

from qaccel.training import MetricsLog, read_metrics


def test_rows_are_written_and_read_back(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step, "wire_bytes": 10 * step})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert read_metrics(tmp_path / "metrics.jsonl")[1] == {"step": 2, "loss": 0.5, "wire_bytes": 20}


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    for step in range(1, 8):
        log.write({"step": step})
    resumed = MetricsLog(tmp_path / "metrics.jsonl", enabled=True, resume_step=4)
    resumed.write({"step": 5, "again": True})
    assert [(r["step"], r.get("again", False)) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, False), (2, False), (3, False), (4, False), (5, True),
    ]  # fmt: skip


def test_non_main_process_writes_nothing_and_non_finite_values_survive(tmp_path):
    MetricsLog(tmp_path / "other.jsonl", enabled=False).write({"step": 1})
    assert not (tmp_path / "other.jsonl").exists()
    log = MetricsLog(tmp_path / "m.jsonl", enabled=True)
    log.write({"step": 1, "loss": float("nan")})
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 1, "loss": "nan"}]
