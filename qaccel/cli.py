"""The ``qaccel`` command line: ``train``, ``recipes``, ``configs``, ``export``, ``push``, ``bench`` and more.

Results go to stdout as JSON (stable keys, ``schema_version``), progress and logs to stderr.
Exit codes: 0 success, 1 failure, 2 usage error (one line, no traceback; ``QACCEL_DEBUG=1`` shows it).
Flags use Hugging Face's underscore style (``--output_dir``, ``--dry_run``) in every subcommand.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ._errors import FlagParser, report_bad_input
from ._extras import MissingExtraError
from ._quiet_logs import keep_unused_kernel_notices
from .commands import bench, configs, demo, env, export, push, recipes, selfcheck, train

__all__ = ["main", "build_parser"]

_COMMANDS = (demo, train, recipes, configs, export, push, bench, env, selfcheck)


def build_parser() -> argparse.ArgumentParser:
    # FlagParser: no prefix matching, --a-b for --a_b; its subcommand parsers (nested ones too) are FlagParsers
    parser = FlagParser(
        prog="qaccel",
        description=__doc__.splitlines()[0],
        epilog="Flags use underscores, as in Hugging Face's scripts (--output_dir, --dry_run), spelled in "
        "full; a dash within a flag reads as an underscore. QACCEL_DEBUG=1 shows tracebacks for bad input.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level to stderr")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and not getattr(args, "accepts_extra_args", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # argparse exits 2 on usage errors and 0 on --help
        return int(exc.code or 0)
    args.extra_args = extra
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    if args.verbose:
        keep_unused_kernel_notices()
    try:
        return args.func(args)
    except MissingExtraError as err:  # any subcommand: one line naming the pip install line
        return report_bad_input(f"qaccel {args.command}", err)


if __name__ == "__main__":
    sys.exit(main())
