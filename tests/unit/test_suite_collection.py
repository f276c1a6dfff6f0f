"""A bare ``pytest`` run (``make test``, ``make test-all``, CI) collects every test file under tests/.

pytest's default ``norecursedirs`` lists ``dist``, so until pyproject.toml set its own list, tests/dist (the
multi-process tier) was never collected by a bare run: only a run naming it ran it. The reference here is
the files on disk, not pytest's configuration.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_bare_run_collects_every_test_file_under_tests():
    on_disk = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = {line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line}
    assert on_disk - collected == set(), f"test files a bare `pytest` does not collect: {sorted(on_disk - collected)}"
    assert {"tests/dist", "tests/e2e", "tests/unit"} <= {str(Path(f).parent) for f in collected}
