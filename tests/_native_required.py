"""Which native codec backends a test session requires, and whether they load (``tests/conftest.py`` enforces it).

- ``QACCEL_REQUIRE_NATIVE``: a comma-separated list of ``cpu`` / ``cuda`` (or ``none``);
- unset: ``cpu`` when ``CI`` is true (as CI services set it), nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["REQUIRE_ENV", "native_load_failures", "required_native_backends"]

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
