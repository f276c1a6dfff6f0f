"""End to end: Ctrl-C during ``qaccel train`` (2 CPU ranks of gpt2-tiny under ``accelerate launch``).

The job runs in its own process group, as a terminal's foreground job does, and gets SIGINT once
it has logged 3 steps and written a complete checkpoint. It must exit with status 130 and print
exactly one "interrupted" line (no traceback from any rank) naming a complete checkpoint and a
resume command that ``qaccel train`` accepts; no ``pids/`` folder and no partial checkpoint may be
left in the output folder.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qaccel.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint
from qaccel.training.metrics_log import read_metrics
from tests._launch import env

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 300  # start-up and 3 steps on 2 shared cores
EXIT_TIMEOUT_S = 90  # SIGINT -> launcher exit (Accelerate's agent takes a few seconds itself)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.name != "posix", reason="POSIX process groups")]


def _ready(out: Path) -> bool:
    try:
        steps = len(read_metrics(out / "metrics.jsonl"))
    except ValueError:  # a line being written
        return False
    return steps >= 3 and bool(list_checkpoints(out))


def test_ctrl_c_during_qaccel_train(tmp_path):
    out = tmp_path / "run"
    flags = ["--recipe", "gpt2-tiny", "--max_steps", "1000", "--save_steps", "2", "--eval_steps", "0", "--output_dir", str(out)]
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        job = subprocess.Popen([sys.executable, "-m", "qaccel.cli", "train", *flags], env=env(), cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not _ready(out):
                assert job.poll() is None, stderr_path.read_text()[-4000:]
                assert time.monotonic() < deadline, "no 3 steps and a checkpoint in time"
                time.sleep(0.2)
            os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C sends to the terminal's foreground job
            status = job.wait(timeout=EXIT_TIMEOUT_S)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    text = stderr_path.read_text()
    assert status == 130, text[-4000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    lines = [line for line in re.split(r"[\r\n]", text) if "interrupted" in line]
    assert len(lines) == 1, lines
    match = re.fullmatch(r"qaccel: interrupted at step (\d+); the last complete checkpoint is (\S+); resume with: (.+)", lines[0])
    assert match, lines[0]
    named = out.parent / match.group(2) if not Path(match.group(2)).is_absolute() else Path(match.group(2))
    assert named.resolve() == latest_checkpoint(out).resolve()
    verify_checkpoint(named)  # complete: every file its manifest lists, intact
    assert int(match.group(1)) > int(named.name.split("-")[1])  # the step in progress is past the checkpoint
    assert not (out / "pids").exists()
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no partial checkpoint
    resume = shlex.split(match.group(3))
    assert resume[:2] == ["qaccel", "train"] and resume[-2:] == ["--resume_from_checkpoint", "latest"]
    # The command is one qaccel train accepts: its checks (which open the checkpoint) pass.
    check = subprocess.run([sys.executable, "-m", "qaccel.cli", *resume[1:], "--dry_run"], env=env(), cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert check.returncode == 0, check.stderr[-3000:]
