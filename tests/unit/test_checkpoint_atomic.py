"""The one atomic writer (qaccel.checkpoint): whole files and folders or nothing, and no other writer in qaccel/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from qaccel.checkpoint import (
    atomic_open,
    atomic_torch_save,
    atomic_write_json,
    install_dir,
    load_torch_file,
    read_json,
    remove_dir,
    staging_dir,
)

PACKAGE = Path(__file__).resolve().parents[2] / "qaccel"


class Bomb:
    """Pickling it raises, after it records which files its folder held at that moment."""

    def __init__(self, folder: Path, seen: dict) -> None:
        self.folder, self.seen = folder, seen

    def __reduce__(self):
        self.seen.update({p.name: p.stat().st_size for p in self.folder.iterdir()})
        raise RuntimeError("disk full (simulated)")


def test_a_write_that_raises_midway_leaves_the_old_file_and_no_partial(tmp_path):
    target = tmp_path / "state.bin"
    with atomic_open(target, "wb") as handle:
        handle.write(b"old" * 10)
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_open(target, "wb") as handle:
            handle.write(b"\x00" * (1 << 20))
            handle.flush()  # half the bytes reach the disk...
            on_disk = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
            raise RuntimeError("disk full (simulated)")  # ...then the write fails
    partial = [name for name in on_disk if name != "state.bin"]
    assert len(partial) == 1 and partial[0].startswith(".state.bin.") and on_disk[partial[0]] == 1 << 20
    assert [p.name for p in tmp_path.iterdir()] == ["state.bin"]  # the partial file is gone
    assert target.read_bytes() == b"old" * 10  # the old content, whole


def test_a_torch_save_that_raises_midway_leaves_the_old_file_and_no_partial(tmp_path):
    target = tmp_path / "state.pt"
    atomic_torch_save({"w": torch.arange(4.0)}, target)
    seen: dict[str, int] = {}
    with pytest.raises(RuntimeError, match="disk full"):
        atomic_torch_save({"big": torch.zeros(50_000), "bomb": Bomb(tmp_path, seen)}, target)
    assert [name for name in seen if name != "state.pt"][0].startswith(".state.pt.")  # it was being written
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]
    assert torch.equal(load_torch_file(target)["w"], torch.arange(4.0))


def test_a_text_write_that_raises_midway_leaves_nothing(tmp_path):
    target = tmp_path / "sub" / "state.json"
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_open(target) as handle:
            handle.write('{"half": ')
            raise RuntimeError("crash mid-write")
    assert not target.exists() and list(target.parent.iterdir()) == []
    atomic_write_json(target, {"step": 3, "betas": (0.9, 0.99)})
    assert read_json(target) == {"step": 3, "betas": [0.9, 0.99]}
    assert [p.name for p in target.parent.iterdir()] == ["state.json"]


def test_two_writers_of_one_path_never_share_a_temporary_file(tmp_path):
    target = tmp_path / "cache.txt"
    with atomic_open(target) as first:
        first.write("first")
        with atomic_open(target) as second:  # another writer (rank, thread) of the same path, interleaved
            second.write("second")
        assert target.read_text() == "second"
    assert target.read_text() == "first"  # the last rename wins, each file whole
    assert [p.name for p in tmp_path.iterdir()] == ["cache.txt"]


def test_bad_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"atomic_open mode='a': must be one of \['w', 'wb'\]"):
        with atomic_open(tmp_path / "x", "a"):
            pass


def _folder(root: Path, name: str, content: str) -> Path:
    staged = staging_dir(root / name, "test")
    (staged / "sub").mkdir()
    (staged / "sub" / "file.txt").write_text(content)
    return staged


def test_install_dir_replaces_a_folder_whole(tmp_path):
    assert install_dir(_folder(tmp_path, "out", "old"), tmp_path / "out")
    (tmp_path / "out" / "only_in_old.txt").write_text("x")
    assert install_dir(_folder(tmp_path, "out", "new"), tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["sub"]  # nothing of the old folder survives
    assert (tmp_path / "out" / "sub" / "file.txt").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or set-aside folder left


def test_install_dir_without_replace_keeps_the_first_writer(tmp_path):
    assert install_dir(_folder(tmp_path, "cache", "winner"), tmp_path / "cache", replace=False)
    assert not install_dir(_folder(tmp_path, "cache", "loser"), tmp_path / "cache", replace=False)
    assert (tmp_path / "cache" / "sub" / "file.txt").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_remove_dir_leaves_nothing(tmp_path):
    install_dir(_folder(tmp_path, "gone", "x"), tmp_path / "gone")
    remove_dir(tmp_path / "gone")
    assert list(tmp_path.iterdir()) == []


def test_every_rename_in_qaccel_is_the_atomic_writer():
    """Issue 17: one atomic writer. Any other rename-into-place in the package is a second one."""
    renames = re.compile(r"\bos\.(replace|rename)\(|\.rename\(")
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "checkpoint" / "_atomic.py"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if renames.search(line)
    ]
    assert offenders == []
