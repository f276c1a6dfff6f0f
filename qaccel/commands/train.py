"""``qaccel train [--recipe NAME] [flags]``: check the inputs, then launch ``qaccel.train`` with the recipe's launch config.

Equivalent to ``accelerate launch --config_file <recipe launch config> -m qaccel.train --recipe NAME
[flags]``; every flag it does not know itself goes to the training entry point (``python -m
qaccel.train --help`` lists them). The recipe, the flags, the environment, the launch config and
a checkpoint to resume are checked here first, in this process: bad input is one line and exit
status 2, before any training process starts.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from .._errors import UsageError
from ._output import report_usage_error


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="check a recipe's run, then launch python -m qaccel.train with its launch config (unknown flags go to it)",
        description=__doc__.splitlines()[0],
        epilog="Every other flag goes to the training entry point: `python -m qaccel.train --help` lists them "
        "(--output_dir, --max_steps, --qsdp_*, --zoadam_*, ...).",
    )
    parser.add_argument(
        "--recipe", help="a recipe name (`qaccel recipes`) or a recipe file; optional with --model_name_or_path, --task and a dataset"
    )
    parser.add_argument(
        "--launch_config", help="an Accelerate config file, or the name of a shipped one (`qaccel configs`); default: the recipe's"
    )
    parser.add_argument("--num_processes", type=int, help="override the launch config's process count")
    parser.add_argument("--dry_run", action="store_true", help="check everything and print the command instead of running it")
    parser.set_defaults(func=run, accepts_extra_args=True)


def _launch_config(args: argparse.Namespace, recipe) -> Path:
    from .._resources import launch_config_path

    if args.launch_config is None:
        return recipe.launch_config_path()
    given = Path(args.launch_config).expanduser()
    return given if given.is_file() else launch_config_path(args.launch_config)


def build_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """Check the run as each rank will, then return its ``accelerate launch`` command line.

    Raises:
        ValueError, NotImplementedError, CheckpointError, MissingExtraError: bad input, as the
            training entry point would report it.
    """
    from .. import train as entry
    from ..training.methods import launch_config_parallelism

    if args.num_processes is not None and args.num_processes < 1:
        raise UsageError(f"--num_processes {args.num_processes}: must be >= 1")
    train_argv = [*(["--recipe", args.recipe] if args.recipe is not None else []), *extra]
    train_args = entry.parse_args(train_argv)
    recipe, _ = entry.resolve_recipe(train_args)  # without --recipe: the defaults, launch config by method
    config = _launch_config(args, recipe)
    num_processes = args.num_processes or _config_processes(config)
    entry.check_inputs(train_args, launch_parallelism=launch_config_parallelism(config), world_size=num_processes)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    if args.num_processes is not None:
        command += ["--num_processes", str(args.num_processes)]
    return command + ["-m", "qaccel.train", *train_argv]


def _config_processes(config: Path) -> int:
    from accelerate.commands.config.config_args import load_config_from_file

    return int(load_config_from_file(str(config)).num_processes or 1)


def run(args: argparse.Namespace) -> int:
    from ..train import BAD_INPUT_ERRORS

    try:
        command = build_command(args, list(getattr(args, "extra_args", [])))
    except BAD_INPUT_ERRORS as err:
        return report_usage_error("train", err)
    print(shlex.join(command), file=sys.stderr)
    if args.dry_run:
        return 0
    return subprocess.call(command)
