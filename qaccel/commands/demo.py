"""``qaccel demo [--output_dir DIR] [--max_steps N] [--bandwidth RATE]``: gpt2-tiny on 2 CPU processes, QSDP W8G8 next to stock FSDP2.

The README's first command (``make demo`` runs it). Two ``accelerate launch -m qaccel.train`` jobs
with a launch config that ships in the package, over a loopback shaped to ``--bandwidth`` where
root allows it; prints the table and writes ``demo.json``, ``demo.png`` and one run folder per
method under ``--output_dir``. Both jobs are checked first, as ``qaccel train`` checks one (bad
input: one line, exit 2, before any process starts). The work is done by :mod:`qaccel.bench.demo`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..bench import demo

    parser = subparsers.add_parser(
        "demo",
        help="train gpt2-tiny on 2 CPU processes with QSDP W8G8 and with stock FSDP2, and print the table (make demo)",
        description=__doc__.splitlines()[0],
        epilog="Needs the zoo extra (the plot: the bench extra; docs/install.md). Shaping the link needs root, ip and tc; "
        "without them both jobs run on the plain loopback and one line says so.",
    )
    demo.add_arguments(parser)
    parser.set_defaults(func=run)


def job_commands(args: argparse.Namespace) -> list[list[str]]:
    """Each job's command as ``qaccel train`` would build it, after its checks (recipe, flags, launch config).

    Raises:
        ValueError, RuntimeError, MissingExtraError, ...: bad input, as ``qaccel train`` reports it.
    """
    from ..bench import demo
    from . import train

    checked = []
    for _, method, extra in demo.RUNS:
        job = train.launcher_args(launch_config=args.launch_config)  # --recipe is in the argv
        checked.append(train.build_command(job, demo.train_args(args, method, extra, Path(args.output_dir) / method)))
    return checked


def run(args: argparse.Namespace) -> int:
    from .._extras import ZOO_FOR_TRAINING, require_extra
    from ..bench import demo
    from ..train import BAD_INPUT_ERRORS
    from ._output import report_usage_error

    require_extra("zoo", "qaccel demo", modules=ZOO_FOR_TRAINING)  # the recipe, its data and qaccel.train: one line first
    try:
        job_commands(args)
    except BAD_INPUT_ERRORS as err:
        return report_usage_error("demo", err)
    try:
        demo.run(args)
    except subprocess.CalledProcessError as err:  # the job's own output above says why
        print(f"qaccel demo: a training job exited with status {err.returncode}; its output is above", file=sys.stderr)
        return 1
    return 0
