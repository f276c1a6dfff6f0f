"""Subcommands of the ``qaccel`` CLI; each exposes ``add_parser(subparsers)`` and ``run(args)``."""
