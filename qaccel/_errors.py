"""How bad input is reported: one line naming the problem, no traceback, exit status 2.

A typo in a flag, a recipe key or a path is not a crash: the CLI and the training entry point print
``<program>: <message>`` and exit 2. Tracebacks stay for real bugs; ``QACCEL_DEBUG=1`` shows them for
bad input too.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import NoReturn

__all__ = ["DEBUG_ENV", "USAGE_EXIT_CODE", "ArgumentParser", "UsageError", "debug_enabled", "report_bad_input"]

DEBUG_ENV = "QACCEL_DEBUG"
USAGE_EXIT_CODE = 2


def debug_enabled() -> bool:
    """Whether ``QACCEL_DEBUG`` asks for tracebacks (a truth value as Accelerate reads one; unset: no)."""
    from ._settings import env_flag

    try:
        return env_flag(DEBUG_ENV)
    except ValueError:  # a typo in the debug switch itself should not hide the real message
        return True


def report_bad_input(program: str, error: BaseException, *, exit_code: int = USAGE_EXIT_CODE) -> int:
    """Print ``<program>: <error>`` on stderr (with the traceback under ``QACCEL_DEBUG``) and return ``exit_code``."""
    if debug_enabled():
        traceback.print_exception(error, file=sys.stderr)
    print(f"{program}: {error}", file=sys.stderr)
    return exit_code


class UsageError(ValueError):
    """A command line that cannot be parsed (an unknown flag, a bad choice, a missing argument)."""


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser that raises :class:`UsageError` instead of printing and exiting.

    Under ``torchrun`` every rank parses the same command line; raising lets the caller decide who
    reports it (the main process, once) and how (one line, exit status 2).
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)
