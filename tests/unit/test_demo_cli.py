"""`qaccel demo` as a subcommand: its flags, its usage errors, and jobs that need nothing but the installed package.

Nothing is trained here (the shaped link is `test_demo_link.py`'s; a run is `make demo`). The wheel
layout is rebuilt by hand in a temporary folder (a `qaccel/launch_configs/` inside the package, no
checkout beside it), so the launch config the jobs use is checked against a path the test made.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import qaccel._resources as resources
from qaccel.bench import demo
from qaccel.cli import build_parser, main
from qaccel.commands import demo as demo_command

REPO = Path(__file__).resolve().parents[2]
SCRIPT_FLAGS = ("--output_dir", "--recipe", "--max_steps", "--bandwidth", "--launch_config")  # those of scripts/demo.py


def test_help_parses_through_the_cli_and_lists_the_flags(capsys):
    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: qaccel demo")
    assert all(flag in out for flag in SCRIPT_FLAGS)


def test_defaults_are_those_of_make_demo():
    args = build_parser().parse_args(["demo"])
    assert (args.output_dir, args.recipe, args.max_steps, args.bandwidth) == ("runs/demo", "gpt2-tiny", 200, "100mbit")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bandwidth", "fast"], "argument --bandwidth: bandwidth 'fast': expected a tc rate"),
        (["--max_steps", "0"], "argument --max_steps: 0: must be an integer >= 1"),
        (["--max_steps", "ten"], "argument --max_steps: 'ten': must be an integer >= 1"),
        (["--launch_config", "cpu_8proc"], "argument --launch_config: 'cpu_8proc': neither a file nor a launch config"),
    ],
    ids=["bandwidth", "zero-steps", "steps-not-int", "launch-config"],
)
def test_bad_flags_are_usage_errors(argv, message, capsys, tmp_path):
    assert main(["demo", "--output_dir", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_unknown_recipe_is_one_line_before_any_job_starts(capsys, tmp_path, monkeypatch):
    def no_job(*args, **kwargs):
        raise AssertionError(f"a job was started: {args}")

    monkeypatch.setattr(subprocess, "run", no_job)
    assert main(["demo", "--recipe", "gpt2-tinyy", "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qaccel demo: unknown recipe 'gpt2-tinyy'"), err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def wheel_layout(tmp_path, monkeypatch) -> Path:
    """An installed package's layout: the launch configs inside ``qaccel/``, no checkout next to it."""
    package = tmp_path / "site-packages" / "qaccel"
    shutil.copytree(REPO / "launch_configs", package / "launch_configs")
    monkeypatch.setattr(resources, "_PACKAGE_DIR", package)
    return package


def test_the_jobs_use_the_launch_config_inside_the_installed_package(wheel_layout, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    args = build_parser().parse_args(["demo", "--output_dir", str(tmp_path / "out"), "--max_steps", "3"])
    expected = wheel_layout / "launch_configs" / "cpu_2proc_qsdp.yaml"
    for _, method, extra in demo.RUNS:
        command = demo.train_command(args, method, extra, tmp_path / "out" / method)
        assert command[:5] == [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(expected)]
        assert command[5:7] == ["-m", "qaccel.train"] and "--method" in command and method in command
        assert not Path(command[4]).is_relative_to(REPO)
    # the jobs import qaccel as installed: nothing points them at a checkout
    assert "PYTHONPATH" not in demo.job_env(None)


def test_the_jobs_are_what_qaccel_train_would_launch(tmp_path):
    args = build_parser().parse_args(["demo", "--output_dir", str(tmp_path / "out"), "--max_steps", "3"])
    checked = demo_command.job_commands(args)  # through `qaccel train`'s own checks and command builder
    ours = [demo.train_command(args, method, extra, tmp_path / "out" / method) for _, method, extra in demo.RUNS]
    assert checked == ours
    assert [c[c.index("--method") + 1] for c in ours] == ["qsdp", "none"]
    assert ours[0][-4:] == ["--qsdp_weight_bits", "8", "--qsdp_grad_bits", "8"]


def test_one_thread_per_rank_unless_set(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert demo.job_env(None)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert demo.job_env(None)["OMP_NUM_THREADS"] == "3"
    assert "GLOO_SOCKET_IFNAME" not in demo.job_env(None)  # set only inside the shaped namespace
