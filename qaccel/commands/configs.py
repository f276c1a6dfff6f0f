"""``qaccel configs [--path NAME] [--json]``: the Accelerate launch configs that ship with qaccel.

Each is an ``accelerate launch --config_file`` file for one set-up (CPU processes for trying things,
one or two GPU nodes). ``--path NAME`` prints one file's installed path, for use in a shell::

    accelerate launch --config_file "$(qaccel configs --path cpu_2proc_qsdp)" -m qaccel.train --recipe gpt2-tiny --output_dir runs/x
"""

from __future__ import annotations

import argparse
import sys

import yaml

from .._resources import launch_config_names, launch_config_path
from ._output import emit, format_table, report_usage_error


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "configs",
        help="list the shipped Accelerate launch configs with their paths (--path NAME: one path)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--path", metavar="NAME", help="print only this config's path (e.g. cpu_2proc_qsdp)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def _describe(name: str) -> dict[str, str]:
    path = launch_config_path(name)
    settings = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return {
        "name": name,
        "distributed_type": str(settings.get("distributed_type", "")),
        "num_machines": str(settings.get("num_machines", 1)),
        "num_processes": str(settings.get("num_processes", "")),
        "path": str(path),
    }


def run(args: argparse.Namespace) -> int:
    if args.path is not None:
        try:
            print(launch_config_path(args.path))
        except ValueError as err:
            return report_usage_error("configs", err)
        return 0
    rows = [_describe(name) for name in launch_config_names()]
    if args.json:
        emit({"configs": rows})
        return 0
    sys.stdout.write(format_table(rows, ("name", "distributed_type", "num_machines", "num_processes", "path")))
    return 0
