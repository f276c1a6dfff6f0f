"""Suite-wide set-up: the native codec kernels are built once, and CI requires them to load.

Without the C++ kernels every codec call falls back to the pure-torch reference (with one warning), so a
broken C++ build would silently turn every distributed test into a test of the reference backend. Where a
native backend is required, a failed build therefore stops the session before any test runs:

- ``QACCEL_REQUIRE_NATIVE``: a comma-separated list of ``cpu`` / ``cuda`` (or ``none``);
- unset: ``cpu`` when ``CI`` is true (as CI services set it), nothing otherwise.
"""

from __future__ import annotations

import os

import pytest

from tests._native_required import REQUIRE_ENV, native_load_failures, required_native_backends


def pytest_sessionstart(session: pytest.Session) -> None:
    # Build before any test spawns ranks: otherwise every spawned rank would wait on the same ~30 s build
    # lock. A machine without a compiler simply gets the reference unless a native backend is required.
    required = required_native_backends(os.environ)
    failures = native_load_failures(required)
    if failures:
        lines = "; ".join(f"{backend}: {reason}" for backend, reason in failures.items())
        why = f"{REQUIRE_ENV}={os.environ[REQUIRE_ENV]}" if REQUIRE_ENV in os.environ else "CI=true"
        pytest.exit(
            f"native codec kernels required ({why}) but they did not load, so the tests would only exercise the "
            f"pure-torch reference: {lines}. Fix the build, or set {REQUIRE_ENV}=none to run on the reference.",
            returncode=pytest.ExitCode.TESTS_FAILED,
        )
