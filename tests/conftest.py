"""Suite-wide set-up: the native codec kernels are built once, and CI requires them to load.

Without the C++ kernels every codec call falls back to the pure-torch reference (with one warning), so a
broken C++ build would silently turn every distributed test into a test of the reference backend. Where a
native backend is required, a failed build therefore stops the session before any test runs:

- ``QACCEL_REQUIRE_NATIVE``: a comma-separated list of ``cpu`` / ``cuda`` (or ``none``);
- unset: ``cpu`` when ``CI`` is true (as CI services set it), nothing otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

REQUIRE_ENV = "QACCEL_REQUIRE_NATIVE"
_NATIVE = ("cpu", "cuda")


def required_native_backends(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The native backends that must load for this session (see the module docstring)."""
    text = environ.get(REQUIRE_ENV)
    if text is None:
        return ("cpu",) if environ.get("CI", "").strip().lower() in ("1", "true", "yes") else ()
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    if names in ([], ["none"]):
        return ()
    bad = [name for name in names if name not in _NATIVE]
    if bad:
        raise ValueError(f"{REQUIRE_ENV}={text!r}: {bad} unknown; use a comma-separated list of cpu, cuda, or none")
    return tuple(dict.fromkeys(names))


def native_load_failures(required: tuple[str, ...]) -> dict[str, str]:
    """Build (first use; cached on disk) the C++ kernels and every required backend; {backend: reason} of failures."""
    from qaccel.quant import _native

    failures = {}
    for backend in dict.fromkeys(("cpu", *required)):
        kernels, reason = _native.try_load(backend)
        if kernels is None and backend in required:
            failures[backend] = reason
    return failures


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
