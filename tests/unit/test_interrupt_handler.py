"""Ctrl-C on a training process (``InterruptHandler``), in a real process that gets a real SIGINT.

The oracle is the file system and the process's own exit: status 130, one line naming the newest
complete checkpoint, the partial checkpoint folder and the pid files gone, complete checkpoints kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qaccel.checkpoint import remove_partial_checkpoints
from qaccel.training.faults import RESUME_COMMAND_ENV, resume_argv

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")

_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from qaccel.training.faults import FaultReporter, InterruptHandler

    out, is_main, step = sys.argv[1], sys.argv[2] == "main", int(sys.argv[3])
    with InterruptHandler(is_main=is_main, argv=["--output_dir", out, "--resume_from_checkpoint", "old"]) as handler:
        handler.output_dir = out
        if step:
            handler.reporter = FaultReporter(out, 0 if is_main else 1, 2, install=False)
            handler.reporter.step = step
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)  # never reached: the handler exits
    """
)


def _complete_checkpoint(root: Path, step: int) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"files": {}}))
    return folder


def _interrupt(out: Path, role: str, step: int, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != RESUME_COMMAND_ENV} | (env or {})
    return subprocess.run([sys.executable, "-c", _CHILD, str(out), role, str(step)], capture_output=True, text=True, timeout=120, env=environ)


def test_the_main_process_reports_cleans_up_and_exits_130(tmp_path):
    out = tmp_path / "run"
    kept = _complete_checkpoint(out, 4)
    partial = out / ".checkpoint-6.partial"
    (partial / "pytorch_model_fsdp_0").mkdir(parents=True)
    (out / "pids").mkdir()
    (out / "pids" / "rank1.pid").write_text("1 host 0.0\n")  # a peer still running: the folder stays for it
    proc = _interrupt(out, "main", 6)
    assert proc.returncode == 130, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line]  # a blank line ends a progress bar's
    assert lines == [
        f"qaccel: interrupted at step 6; the last complete checkpoint is {kept}; resume with: your launcher "
        f"(torchrun, accelerate launch) with -m qaccel.train --output_dir {out} --resume_from_checkpoint latest"
    ]
    assert not partial.exists() and kept.is_dir()
    assert sorted(p.name for p in (out / "pids").iterdir()) == ["rank1.pid"]  # its own file only


def test_a_launcher_resume_command_and_no_checkpoint_yet(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    proc = _interrupt(out, "main", 0, {RESUME_COMMAND_ENV: "qaccel train --recipe r --resume_from_checkpoint latest"})
    assert proc.returncode == 130
    assert proc.stderr.lstrip("\n").splitlines() == [
        "qaccel: interrupted before the first training step; no complete checkpoint yet; resume with: "
        "qaccel train --recipe r --resume_from_checkpoint latest"
    ]


def test_another_rank_is_silent_and_removes_the_last_pid_file(tmp_path):
    out = tmp_path / "run"
    partial = out / ".checkpoint-2.partial"
    partial.mkdir(parents=True)
    proc = _interrupt(out, "other", 3)
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "", "")
    assert not (out / "pids").exists()  # it wrote rank1.pid, removed it, and the empty folder
    assert partial.is_dir()  # the main process (or qaccel train) removes partial checkpoints


def test_remove_partial_checkpoints_keeps_complete_ones(tmp_path):
    kept = _complete_checkpoint(tmp_path, 2)
    (tmp_path / ".checkpoint-4.partial" / "sub").mkdir(parents=True)
    (tmp_path / ".checkpoint-1.deleting-12-ab12").mkdir()
    (tmp_path / ".hidden-other").mkdir()
    (tmp_path / "checkpoint-6").mkdir()  # no manifest, not hidden: not ours to judge
    removed = remove_partial_checkpoints(tmp_path)
    assert [p.name for p in removed] == [".checkpoint-1.deleting-12-ab12", ".checkpoint-4.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden-other", kept.name, "checkpoint-6"]


@pytest.mark.parametrize("argv", [
    ["--recipe", "r", "--resume_from_checkpoint", "runs/x/checkpoint-2", "--max_steps", "5"],
    ["--recipe", "r", "--resume_from_checkpoint=latest", "--max_steps", "5"],
    ["--recipe", "r", "--resume-from-checkpoint", "x", "--max_steps", "5"],
    ["--recipe", "r", "--max_steps", "5"],
])  # fmt: skip
def test_resume_argv_resumes_from_the_latest(argv):
    assert resume_argv(argv) == ["--recipe", "r", "--max_steps", "5", "--resume_from_checkpoint", "latest"]


def _leftovers(out: Path, rank0: str) -> None:
    (out / "pids").mkdir(parents=True)
    (out / "pids" / "rank0.pid").write_text(rank0)
    (out / "pids" / "rank1.stopped").write_text("")
    (out / ".checkpoint-4.partial").mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')


def test_the_launcher_reports_for_a_main_rank_that_was_killed(tmp_path, capsys):
    from qaccel.commands.train import _clean_up_interrupted

    out = tmp_path / "run"
    kept = _complete_checkpoint(out, 2)
    _leftovers(out, "4242 host 17.5\n")  # written during this launch: the main rank never got to report
    _clean_up_interrupted(out, "qaccel train --recipe r --resume_from_checkpoint latest", before_launch=None)
    assert capsys.readouterr().err.strip() == (
        f"qaccel: interrupted after step 3 (the last logged); the last complete checkpoint is {kept}; "
        "resume with: qaccel train --recipe r --resume_from_checkpoint latest"
    )
    assert sorted(p.name for p in out.iterdir()) == [kept.name, "metrics.jsonl"]


def test_the_launcher_is_silent_when_the_pid_file_is_an_older_runs(tmp_path, capsys):
    from qaccel.commands.train import _clean_up_interrupted

    out = tmp_path / "run"
    _leftovers(out, "4242 host 17.5\n")
    _clean_up_interrupted(out, "qaccel train", before_launch="4242 host 17.5\n")  # left by a crash before this launch
    assert capsys.readouterr().err == ""
    assert not (out / "pids").exists() and not (out / ".checkpoint-4.partial").exists()
