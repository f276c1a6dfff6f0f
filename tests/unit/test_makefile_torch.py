"""The torch step of the Makefile, run by ``make`` with a stand-in ``python`` that records every call.

The stand-in answers ``pip install`` by "installing" a CUDA or a CPU build (chosen by the test), fails
``--index-url <CPU index>`` when the test says the index is unreachable, and answers the Makefile's
``torch.version.cuda`` probe from what it installed. Nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  case "$*" in
    *"--index-url $FAKE_CPU_INDEX "*) [ "$FAKE_CPU_INDEX_UP" = 1 ] || exit 1; echo cpu > "$FAKE_STATE" ;;
    *freeze*) printf 'filelock==3.0\nnvidia-cublas-cu12==12.1\ntriton==3.0\n' ;;
    *"torch=="*) echo "$FAKE_PIP_GIVES" > "$FAKE_STATE" ;;
  esac
  exit 0
fi
if [ "$1" = "-c" ]; then
  build=$(cat "$FAKE_STATE" 2>/dev/null)
  case "$2" in
    *"sys.exit(torch.version.cuda is None)"*) [ "$build" = cuda ] ;;
    *) echo "make: torch 2.13.0 ($build build)" ;;
  esac
  exit $?
fi
"""

def said(out: str, text: str) -> bool:
    """Whether the recipe printed ``text`` (make also echoes the commands, which contain the messages)."""
    return any(line.startswith("make: ") and text in line for line in out.splitlines())


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make(tmp_path: Path, pip_gives: str, cpu_index_up: bool = True, nvidia_smi: bool = False, *extra: str):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir()
    if nvidia_smi:
        (tools / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (tools / "nvidia-smi").chmod(0o755)
    log = tmp_path / "calls.log"
    path = [str(tools)] + [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()]
    env = {**os.environ, "PATH": os.pathsep.join(path), "FAKE_LOG": str(log), "FAKE_STATE": str(tmp_path / "state"),
           "FAKE_PIP_GIVES": pip_gives, "FAKE_CPU_INDEX": CPU_INDEX, "FAKE_CPU_INDEX_UP": "1" if cpu_index_up else "0"}  # fmt: skip
    env.pop("MAKEFLAGS", None)
    proc = subprocess.run(
        ["make", "--no-print-directory", "-f", str(REPO / "Makefile"), "venv", f"VENV={venv}", *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    return proc.stdout, [c for c in calls if c.startswith("-m pip")]


@needs_make
def test_a_cuda_build_from_the_configured_index_is_replaced_by_the_cpu_build(tmp_path):
    out, pip = _make(tmp_path, "cuda")
    torch_calls = [c for c in pip if "torch==" in c]
    assert torch_calls == ["-m pip install -q torch==2.13.0",
                           f"-m pip install -q --force-reinstall --no-deps --index-url {CPU_INDEX} torch==2.13.0"]  # fmt: skip
    assert "-m pip uninstall -q -y nvidia-cublas-cu12 triton" in pip  # the CUDA-only wheels go; filelock stays
    assert said(out, "installed a CUDA build of torch; replacing it") and said(out, "torch 2.13.0 (cpu build)")
    assert pip[-1] == "-m pip install -q -e .[dev]"


@needs_make
def test_a_cpu_build_from_the_configured_index_is_kept(tmp_path):
    out, pip = _make(tmp_path, "cpu")
    assert [c for c in pip if "torch" in c] == ["-m pip install -q torch==2.13.0"]
    assert not said(out, "replacing") and said(out, "(cpu build)")


@needs_make
def test_an_unreachable_cpu_index_keeps_the_cuda_build_and_says_so(tmp_path):
    out, pip = _make(tmp_path, "cuda", cpu_index_up=False)
    assert not any("uninstall" in c for c in pip)
    assert said(out, f"{CPU_INDEX} is not reachable; keeping the CUDA build") and said(out, "(cuda build)")


@needs_make
def test_torch_index_url_and_nvidia_smi(tmp_path):
    _, pip = _make(tmp_path / "a", "cpu", True, False, "TORCH_INDEX_URL=https://mirror.example/cpu")
    assert [c for c in pip if "torch" in c] == ["-m pip install -q --index-url https://mirror.example/cpu torch==2.13.0"]
    _, pip = _make(tmp_path / "b", "cuda", True, True)
    assert [c for c in pip if "torch" in c] == ["-m pip install -q torch>=2.9,<2.14"]  # a GPU machine: no probe, no swap
