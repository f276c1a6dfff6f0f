"""``qaccel train`` refuses 1-bit optimizer settings whose frozen variance would make steps more than 4x Adam's.

The case is the one measured in ``tests/unit/test_onebit_variance_bias.py`` (a GPT-2 recipe, 0/1 Adam,
``var_freeze_step`` 4: 15.8x Adam's steps on the frozen variance). The refusal happens in the launcher
process, before ``accelerate launch`` starts any rank: exit 2, one line, nothing written. Each fix the
message names then passes the same check (``--dry_run``: checked, printed, not launched).
"""

from __future__ import annotations

import shlex
import sys

import pytest

from qaccel.cli import main
from tests._launch import run_job

DIVERGENT = ["train", "--recipe", "gpt2-tiny", "--method", "zero_one_adam", "--zoadam_var_freeze_step", "4"]


def test_the_divergent_settings_are_refused_before_anything_launches(tmp_path):
    out = tmp_path / "out"
    proc = run_job([sys.executable, "-m", "qaccel.cli", *DIVERGENT, "--output_dir", str(out)], check=False, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line: no traceback, no launch command
    line = proc.stderr
    assert line.startswith("qaccel train: ZeroOneAdamConfig.var_freeze_step=4 with betas[1]=0.999: "), line
    for fragment in ("1/sqrt(1 - 0.999^4) = 15.8x Adam's", "no bias correction", "var_freeze_step >= 255",
                     "--zoadam_variance_bias_correction true", "--allow_uncorrected_variance"):  # fmt: skip
        assert fragment in line, (fragment, line)
    assert not out.exists()


def test_onebit_adam_from_the_environment_is_refused_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QACCEL_ONEBIT_ADAM_FREEZE_STEP", "16")
    argv = ["train", "--recipe", "gpt2-tiny", "--method", "onebit_adam", "--output_dir", str(tmp_path / "out"), "--dry_run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "OneBitAdamConfig.freeze_step=16" in err and "after 15 update(s)" in err and "8.2x Adam's" in err, err
    assert "freeze_step >= 66" in err


@pytest.mark.parametrize(
    "fix",
    [
        ["--zoadam_variance_bias_correction", "true"],
        ["--zoadam_var_freeze_step", "255"],  # the smallest freeze the message names
        ["--zoadam_betas", "0.9,0.95"],  # 1/sqrt(1 - 0.95^4) = 2.3x
        ["--max_steps", "5"],  # the run ends on the last variance step
        ["--allow_uncorrected_variance"],
    ],
    ids=["bias-correction", "later-freeze", "smaller-beta2", "ends-before-the-freeze", "explicitly-allowed"],
)
def test_each_named_fix_passes_the_check(fix, tmp_path, capsys):
    assert main([*DIVERGENT, "--output_dir", str(tmp_path / "out"), *fix, "--dry_run"]) == 0
    command = shlex.split(capsys.readouterr().err.strip().splitlines()[-1])
    assert command[command.index("-m", 5) + 1] == "qaccel.train"
    forwarded = command[command.index("qaccel.train") + 1 :]
    if fix != ["--allow_uncorrected_variance"]:  # the training flags reach the ranks unchanged
        assert forwarded[-len(fix) :] == fix
    else:  # the launcher's own flag stays with the launcher
        assert "--allow_uncorrected_variance" not in forwarded
