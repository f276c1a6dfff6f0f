"""Checkpoint rotation (``save_total_limit``): the N newest complete checkpoints stay, nothing else is touched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qaccel.checkpoint import list_checkpoints, rotate_checkpoints, save_checkpoint, verify_checkpoint


class FakeAccelerator:
    """One process; ``save_state`` writes two small files, as a stand-in for Accelerate's."""

    is_main_process = True

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, output_dir: str) -> None:
        (Path(output_dir) / "model.safetensors").write_bytes(b"\x01" * 100)
        (Path(output_dir) / "optimizer.bin").write_bytes(b"\x02" * 50)


def _state(step: int):
    return lambda folder: (folder / "qaccel_state.json").write_text(json.dumps({"step": step}))


def _save(root: Path, step: int, limit: int | None = None) -> Path:
    return save_checkpoint(FakeAccelerator(), root, step, _state(step), save_total_limit=limit)


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_keeps_the_newest_n_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step, limit=2)
    assert _names(tmp_path) == ["checkpoint-4", "checkpoint-5"]  # nothing hidden left behind either
    for step in (4, 5):
        verify_checkpoint(tmp_path / f"checkpoint-{step}")
        assert json.loads((tmp_path / f"checkpoint-{step}" / "qaccel_state.json").read_text()) == {"step": step}


def test_without_a_limit_every_checkpoint_stays(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [10, 20, 30]


def test_limit_one_keeps_only_the_newest(tmp_path):
    for step in (3, 1, 2):  # written out of step order: step order decides, not the write order
        _save(tmp_path, step)
    assert rotate_checkpoints(tmp_path, 1) == [tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"]
    assert _names(tmp_path) == ["checkpoint-3"]


def test_the_checkpoint_just_written_is_never_deleted(tmp_path):
    # A run resumed from checkpoint-3 saves checkpoint-4 while 6 and 9 of an abandoned longer run exist.
    for step in (3, 6, 9):
        _save(tmp_path, step)
    _save(tmp_path, 4, limit=2)
    assert _names(tmp_path) == ["checkpoint-4", "checkpoint-9"]
    _save(tmp_path, 5, limit=1)
    assert _names(tmp_path) == ["checkpoint-5"]


def test_incomplete_folders_are_neither_counted_nor_deleted(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    # Another rank may still be writing a partial folder; a folder without a manifest is not ours to judge.
    (tmp_path / ".checkpoint-4.partial").mkdir()
    (tmp_path / ".checkpoint-4.partial" / "model.safetensors").write_bytes(b"\x03" * 10)
    (tmp_path / "checkpoint-0").mkdir()
    (tmp_path / "checkpoint-0" / "optimizer.bin").write_bytes(b"x")
    deleted = rotate_checkpoints(tmp_path, 2)
    assert deleted == [tmp_path / "checkpoint-1"]
    assert _names(tmp_path) == [".checkpoint-4.partial", "checkpoint-0", "checkpoint-2", "checkpoint-3"]
    assert (tmp_path / ".checkpoint-4.partial" / "model.safetensors").read_bytes() == b"\x03" * 10
    assert rotate_checkpoints(tmp_path, 2) == []  # nothing more to do
    assert rotate_checkpoints(tmp_path / "no_such_run", 2) == []


@pytest.mark.parametrize(
    ("limit", "error", "message"),
    [
        (0, ValueError, r"save_total_limit=0: must be >= 1"),
        (-3, ValueError, r"save_total_limit=-3: must be >= 1"),
        (True, TypeError, r"save_total_limit=True: expected an int >= 1, or None"),
        (2.0, TypeError, r"save_total_limit=2.0: expected an int >= 1"),
    ],
)
def test_bad_limits_are_refused_before_anything_is_written(tmp_path, limit, error, message):
    with pytest.raises(error, match=message):
        _save(tmp_path, 1, limit=limit)
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []
    _save(tmp_path, 1)
    with pytest.raises(error, match=message.replace("save_total_limit", "rotate_checkpoints limit")):
        rotate_checkpoints(tmp_path, limit)
    assert _names(tmp_path) == ["checkpoint-1"]


@pytest.mark.parametrize("value", ["0", "-1"])
def test_train_refuses_a_bad_save_total_limit_as_bad_input(tmp_path, value, capsys, monkeypatch):
    from qaccel.train import cli

    monkeypatch.delenv("RANK", raising=False)
    code = cli(["--recipe", "gpt2-tiny", "--output_dir", str(tmp_path / "run"), "--save_total_limit", value])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--save_total_limit={value}: must be >= 1" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
