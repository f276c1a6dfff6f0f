"""The CI switch of ``tests/conftest.py`` (``tests/_native_required.py``): a required native backend that does not load stops the session.

The real switch is exercised by running pytest in a subprocess with a compiler that always fails
(``CXX=false``, a fresh build cache): with ``QACCEL_REQUIRE_NATIVE=cpu`` (or ``CI=true``) the session must
stop with exit 1 and say why; with ``none`` the same session passes on the reference codec.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._native_required import REQUIRE_ENV, required_native_backends

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "environ, required",
    [
        ({}, ()),
        ({"CI": "true"}, ("cpu",)),
        ({"CI": "false"}, ()),
        ({"CI": "true", REQUIRE_ENV: "none"}, ()),
        ({REQUIRE_ENV: "cpu"}, ("cpu",)),
        ({REQUIRE_ENV: " CPU, cuda ,cpu"}, ("cpu", "cuda")),
        ({REQUIRE_ENV: ""}, ()),
    ],
)
def test_which_backends_are_required(environ, required):
    assert required_native_backends(environ) == required


def test_unknown_backend_names_are_errors():
    with pytest.raises(ValueError, match=r"QACCEL_REQUIRE_NATIVE='cpp': \['cpp'\] unknown; use .*cpu, cuda, or none"):
        required_native_backends({REQUIRE_ENV: "cpp"})


def test_target_for_the_subprocess_sessions():
    """Runs inside the sessions started below; trivially passes once the session got this far."""


def _session(tmp_path: Path, **env_overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", REQUIRE_ENV, "QACCEL_KERNELS")}
    env.update(CXX=shutil.which("false") or "/bin/false", QACCEL_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    env.update(env_overrides)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"{Path(__file__).relative_to(REPO)}::test_target_for_the_subprocess_sessions"]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("switch", [{REQUIRE_ENV: "cpu"}, {"CI": "true"}], ids=["QACCEL_REQUIRE_NATIVE=cpu", "CI=true"])
def test_a_failed_cpp_build_stops_a_session_that_requires_it(tmp_path, switch):
    proc = _session(tmp_path, **switch)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "native codec kernels required" in out and "cpu: build failed" in out, out[-3000:]
    assert "1 passed" not in out


def test_without_the_requirement_the_session_runs_on_the_reference(tmp_path):
    proc = _session(tmp_path, **{REQUIRE_ENV: "none", "CI": "true"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "1 passed" in proc.stdout
