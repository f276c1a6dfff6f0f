"""How bad input is reported: one line naming the problem, no traceback, exit status 2.

A typo in a flag, a recipe key or a path is not a crash: the CLI and the training entry point print
``<program>: <message>`` and exit 2. Tracebacks stay for real bugs; ``QACCEL_DEBUG=1`` shows them for
bad input too.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = [
    "DEBUG_ENV", "USAGE_EXIT_CODE", "ArgumentParser", "FlagParser", "UsageError", "debug_enabled", "prefixed",
    "report_bad_input",
]  # fmt: skip

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
    """Print ``<program>: <error>`` on stderr (with the traceback under ``QACCEL_DEBUG``) and return ``exit_code``.

    The program is named once: an error that already names it (``push: ...``, ``export out_dir=...``,
    as the library's errors name their owner) is not prefixed with it again (:func:`prefixed`).
    """
    if debug_enabled():
        traceback.print_exception(error, file=sys.stderr)
    print(prefixed(program, str(error)), file=sys.stderr)
    return exit_code


def prefixed(program: str, message: str) -> str:
    """``<program>: <message>``, naming the program once.

    Library errors name their owner (``qaccel.hub.push_folder`` raises ``push: ... offline``,
    ``export_checkpoint`` raises ``export out_dir=...: exists``), so the CLI command of that name
    would say it twice (``qaccel push: push: ...``). A message that starts with the program
    (``qaccel bench quant (its PNG) needs ...``) or with the command's last word followed by a
    space or a colon keeps that word, now led by the program: ``qaccel push: ... offline``,
    ``qaccel export out_dir=...: exists``.

    Example::

        prefixed("qaccel push", "push: no token")  # 'qaccel push: no token'
    """
    if message.startswith((f"{program} ", f"{program}:")):
        return message
    command = program.rsplit(" ", 1)[-1]
    if command != program and message.startswith((f"{command} ", f"{command}:")):
        return program + message[len(command) :]
    return f"{program}: {message}"


class UsageError(ValueError):
    """A command line that cannot be parsed (an unknown flag, a bad choice, a missing argument)."""


class FlagParser(argparse.ArgumentParser):
    """The ``argparse`` parser of every qaccel command line: flags spelled in full, with ``_`` or ``-``.

    - No prefix matching (``allow_abbrev=False`` by default): ``--learning 0.1`` is an unknown flag,
      not ``--learning_rate 0.1``, so a typo or a shortened flag is an error instead of a different setting.
    - ``--repo-id X`` and ``--repo-id=X`` read as ``--repo_id`` when that is one of this parser's own
      options (and ``--repo-id`` is not), as transformers' ``HfArgumentParser`` accepts both spellings;
      ``--help`` lists the underscore form only. Tokens after ``--`` are left alone, and so is a
      token no option of this parser would take: ``qaccel train`` forwards it unchanged to the
      training entry point, whose parser reads it the same way.

    ``add_subparsers`` makes its parsers of the parser's own class, so every subcommand, nested ones
    (``qaccel bench comm``) included, behaves alike.
    """

    def __init__(self, *args: Any, allow_abbrev: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # parse_args and a subcommand's dispatch both come through here (argparse's own entry point)
        tokens = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self.underscore_flags(tokens), namespace)

    def underscore_flags(self, tokens: list[str]) -> list[str]:
        """``tokens`` with each of this parser's options spelled with dashes (``--repo-id``) as it knows it (``--repo_id``)."""
        known = self._option_string_actions  # argparse's map of option strings; argument groups share it
        spelled = []
        for index, token in enumerate(tokens):
            if token == "--":  # end of options: the rest are values, whatever they look like
                return spelled + tokens[index:]
            flag, equals, value = token.partition("=")
            if flag.startswith("--") and "-" in flag[2:] and flag not in known:
                underscored = "--" + flag[2:].replace("-", "_")
                if underscored in known:
                    token = underscored + equals + value
            spelled.append(token)
        return spelled


class ArgumentParser(FlagParser):
    """A :class:`FlagParser` that raises :class:`UsageError` instead of printing and exiting.

    Under ``torchrun`` every rank parses the same command line; raising lets the caller decide who
    reports it (the main process, once) and how (one line, exit status 2).
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)
