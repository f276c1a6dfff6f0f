"""The ``qaccel`` command line: ``env``, ``selfcheck``, ``bench {quant,comm}``, ``train`` and more.

Results go to stdout as JSON (stable keys, ``schema_version``), progress and logs to stderr.
Exit codes: 0 success, 1 failure, 2 usage error.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .commands import bench, env, export, push, recipes, selfcheck, train

__all__ = ["main", "build_parser"]

_COMMANDS = (env, selfcheck, bench, train, export, push, recipes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qaccel", description=__doc__.splitlines()[0])
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
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
