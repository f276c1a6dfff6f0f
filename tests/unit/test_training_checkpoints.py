"""Atomic, verified training checkpoints (qaccel.checkpoint), with a fake Accelerator.

The fake stands in for the process-group side only (single process); what is tested is the
file protocol: a checkpoint appears only complete, a crash leaves the previous one as latest,
and any missing, truncated, altered or unlisted file is named when verified.
"""

import json
from pathlib import Path

import pytest

from qaccel.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)


class FakeAccelerator:
    is_main_process = True

    def __init__(self, fail_after_first_file: bool = False) -> None:
        self.fail = fail_after_first_file

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, output_dir: str) -> None:
        out = Path(output_dir)
        (out / "model.safetensors").write_bytes(b"\x01" * 1000)
        if self.fail:
            raise RuntimeError("disk full (simulated)")
        (out / "optimizer.bin").write_bytes(b"\x02" * 500)
        (out / "sub").mkdir()
        (out / "sub" / "shard_0.distcp").write_bytes(b"\x03" * 64)


def _extra(folder: Path) -> None:
    (folder / "qaccel_state.json").write_text(json.dumps({"step": 1}))


def test_saved_checkpoint_is_complete_and_verifies(tmp_path):
    path = save_checkpoint(FakeAccelerator(), tmp_path, 10, _extra)
    assert path == tmp_path / "checkpoint-10"
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert set(manifest) == {"model.safetensors", "optimizer.bin", "sub/shard_0.distcp", "qaccel_state.json"}
    assert manifest["model.safetensors"]["size"] == 1000
    assert verify_checkpoint(path) == 1000 + 500 + 64 + len(json.dumps({"step": 1}))
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_crash_mid_write_keeps_previous_checkpoint_latest(tmp_path):
    save_checkpoint(FakeAccelerator(), tmp_path, 10, _extra)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(FakeAccelerator(fail_after_first_file=True), tmp_path, 20, _extra)
    assert not (tmp_path / "checkpoint-20").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert resolve_resume("latest", tmp_path) == tmp_path / "checkpoint-10"
    # The next save clears the leftover partial folder and succeeds.
    save_checkpoint(FakeAccelerator(), tmp_path, 20, _extra)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [10, 20]


def test_saving_the_same_step_again_replaces_it_whole(tmp_path):
    save_checkpoint(FakeAccelerator(), tmp_path, 5, _extra)
    save_checkpoint(FakeAccelerator(), tmp_path, 5, lambda f: (f / "qaccel_state.json").write_text('{"step": 2}'))
    assert json.loads((tmp_path / "checkpoint-5" / "qaccel_state.json").read_text()) == {"step": 2}
    verify_checkpoint(tmp_path / "checkpoint-5")


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: (p / "optimizer.bin").unlink(), "optimizer.bin is listed in the manifest but missing"),
        (lambda p: (p / "model.safetensors").write_bytes(b"\x01" * 999), "model.safetensors has 999 bytes, the manifest says 1000"),
        (lambda p: (p / "sub" / "shard_0.distcp").write_bytes(b"\x04" * 64), "sub/shard_0.distcp does not match its SHA-256"),
        (lambda p: (p / "stray.pt").write_bytes(b"x"), "files not in the manifest: stray.pt"),
        (lambda p: (p / "manifest.json").unlink(), "no manifest.json"),
    ],
)
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage, message):
    path = save_checkpoint(FakeAccelerator(), tmp_path, 3, _extra)
    damage(path)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        verify_checkpoint(path)


def test_resolve_resume(tmp_path):
    assert resolve_resume(None, tmp_path) is None
    assert resolve_resume("latest", tmp_path) is None  # nothing saved yet: start fresh
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_resume(str(tmp_path / "nope"), tmp_path)
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        resolve_resume(str(tmp_path / "half"), tmp_path)


def _dcp_checkpoint(tmp_path):
    """A real single-process DCP save (what FSDP2 sharded checkpoints hold), then a manifest."""
    import torch
    import torch.distributed.checkpoint as dcp

    from qaccel.checkpoint import write_manifest

    root = tmp_path / "checkpoint-1"
    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(root / "pytorch_model_fsdp_0"))
    write_manifest(root)
    return root


def test_genuine_dcp_metadata_passes_the_pickle_check(tmp_path):
    root = _dcp_checkpoint(tmp_path)
    assert verify_checkpoint(root) > 0


def test_dcp_metadata_that_would_run_code_is_refused_before_torch_reads_it(tmp_path):
    import os
    import pickle

    from qaccel.checkpoint import write_manifest

    root = _dcp_checkpoint(tmp_path)

    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (root / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(Exploit()))
    write_manifest(root)  # the attacker also rewrote the manifest: hashes alone cannot help
    with pytest.raises(CheckpointError, match=r"\.metadata: refers to (posix|os)\.system"):
        verify_checkpoint(root)
    assert not (tmp_path / "pwned").exists()
