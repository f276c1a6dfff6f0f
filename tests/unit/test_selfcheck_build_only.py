"""``qaccel selfcheck --build_only``: the kernels built ahead of time (an image build step), so the first run does not compile.

References are the file system (the built library in ``QACCEL_CACHE_DIR``) and what a later process
does with it (it loads without building: no "building" warning), not the command's own report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qaccel.cli import main
from qaccel.quant import _native

BUILDING = "building the cpu codec kernels"  # the warning a build in progress logs (qaccel/quant/_native.py)


def _qaccel(args: list[str], cache: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("QACCEL_")}
    environ.update(QACCEL_CACHE_DIR=str(cache), OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-m", "qaccel.cli", *args], env=environ, capture_output=True, text=True, timeout=900)


def test_an_already_built_backend_is_reported_with_its_folder(capsys, monkeypatch):
    monkeypatch.delenv("QACCEL_KERNELS", raising=False)
    kernels, reason = _native.try_load("cpu")
    if kernels is None:
        pytest.skip(f"the C++ kernels do not build here: {reason}")
    assert main(["selfcheck", "--build_only"]) == 0
    report = json.loads(capsys.readouterr().out)["selfcheck"]
    cpu = report["backends"]["cpu"]
    assert report["ok"] is True and report["build_only"] is True and cpu["role"] == "built"
    assert list(Path(cpu["build_dir"]).glob("*.so")), cpu  # the library is on disk where it says
    assert "checks" not in cpu  # nothing compared
    if not torch.cuda.is_available():
        assert report["backends"]["cuda"] == {"role": "not built", "reason": "no CUDA device is available"}


def test_a_build_that_fails_is_exit_1_with_the_reason(tmp_path):
    proc = _qaccel(["selfcheck", "--build_only"], tmp_path / "cache", CXX="/nonexistent/c++")
    assert proc.returncode == 1, proc.stderr
    cpu = json.loads(proc.stdout)["selfcheck"]["backends"]["cpu"]
    assert cpu["role"] == "failed" and "/nonexistent/c++" in cpu["reason"]


def test_kernels_reference_builds_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QACCEL_KERNELS", "reference")
    monkeypatch.setenv("QACCEL_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["selfcheck", "--build_only"]) == 0
    backends = json.loads(capsys.readouterr().out)["selfcheck"]["backends"]
    assert {entry["role"] for entry in backends.values()} == {"not built"}
    assert all(entry["reason"] == "QACCEL_KERNELS=reference" for entry in backends.values())
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_built_ahead_of_time_the_first_run_does_not_compile(tmp_path):
    cache = tmp_path / "cache"
    built = _qaccel(["selfcheck", "--build_only"], cache)  # a cold build: about a minute on 2 cores
    assert built.returncode == 0, built.stdout + built.stderr
    assert BUILDING in built.stderr
    assert len(list(cache.glob("qaccel_quant_cpu_*/*.so"))) == 1
    first_use = _qaccel(["selfcheck", "--numel", "4096"], cache)
    assert first_use.returncode == 0, first_use.stdout + first_use.stderr
    assert BUILDING not in first_use.stderr
    assert json.loads(first_use.stdout)["selfcheck"]["backends"]["cpu"]["role"] == "checked"
