"""``qaccel train --recipe NAME [flags]``: launch ``scripts/train.py`` with the recipe's launch config.

Equivalent to ``accelerate launch --config_file <recipe launch config> scripts/train.py --recipe NAME
[flags]``; every flag it does not know itself goes to ``scripts/train.py``. The script and the
launch configs live in the source checkout (``pip install -e .``), next to the package.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = REPO_ROOT / "scripts" / "train.py"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="launch scripts/train.py for a recipe (unknown flags go to the script)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--recipe", required=True, help="a recipe name (`qaccel recipes`) or a recipe file")
    parser.add_argument("--launch_config", help="an Accelerate config file (default: the recipe's launch config)")
    parser.add_argument("--num_processes", type=int, help="override the launch config's process count")
    parser.add_argument("--dry_run", action="store_true", help="print the command instead of running it")
    parser.set_defaults(func=run, accepts_extra_args=True)


def build_command(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The ``accelerate launch`` command line for ``args`` plus the script's own flags ``extra``."""
    from ..zoo import load_recipe

    recipe = load_recipe(args.recipe)
    config = Path(args.launch_config) if args.launch_config else REPO_ROOT / recipe.launch.config
    if not config.is_file():
        raise FileNotFoundError(f"launch config {config} (recipe {recipe.name}): no such file")
    if not TRAIN_SCRIPT.is_file():
        raise FileNotFoundError(f"{TRAIN_SCRIPT}: not found; `qaccel train` runs from a source checkout (pip install -e .)")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    if args.num_processes is not None:
        command += ["--num_processes", str(args.num_processes)]
    return command + [str(TRAIN_SCRIPT), "--recipe", args.recipe, *extra]


def run(args: argparse.Namespace) -> int:
    try:
        command = build_command(args, list(getattr(args, "extra_args", [])))
    except (FileNotFoundError, ValueError) as err:
        print(f"qaccel train: {err}", file=sys.stderr)
        return 2
    print(shlex.join(command), file=sys.stderr)
    if args.dry_run:
        return 0
    env = dict(os.environ)
    # Workers import qaccel from this checkout even when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.call(command, env=env)
