"""``qaccel train [--recipe NAME] [flags]``: check the inputs, then launch ``qaccel.train`` with the recipe's launch config.

Equivalent to ``accelerate launch --config_file <recipe launch config> -m qaccel.train --recipe NAME
[flags]``; every flag it does not know itself goes to the training entry point (``python -m
qaccel.train --help`` lists them). The recipe, the flags, the environment, the launch config and
a checkpoint to resume are checked here first, in this process: bad input is one line and exit
status 2, before any training process starts.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .._errors import UsageError
from ._output import report_usage_error

if TYPE_CHECKING:
    from ..optim.config import OneBitConfigBase


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
    parser.add_argument(
        "--allow_uncorrected_variance",
        action="store_true",
        help="launch a 1-bit optimizer whose frozen variance, without variance_bias_correction, makes later steps more "
        "than 4x Adam's (DeepSpeed's numerics as they are); refused otherwise",
    )
    parser.set_defaults(func=run, accepts_extra_args=True)


def launcher_args(**given: object) -> argparse.Namespace:
    """This command's own options (``--recipe``, ``--launch_config``, ...) at their defaults, with ``given`` set.

    For commands that check a job as ``qaccel train`` would (``qaccel demo``): an option added here
    reaches them with its default instead of an AttributeError in their hand-built namespace.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["train"])
    unknown = sorted(set(given) - set(vars(args)))
    if unknown:
        raise TypeError(f"qaccel train has no option {', '.join(unknown)}")
    vars(args).update(given)
    return args


def _launch_config(args: argparse.Namespace, recipe, method: str | None) -> Path:
    from .._resources import launch_config_path
    from ..training.methods import launch_config_for_method

    if args.launch_config is None:
        if method is not None and method != recipe.method.name:  # the recipe's config may not run it
            return launch_config_for_method(method, recipe.launch_config_path())
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
    from ..training.deepspeed_config import with_deepspeed_method
    from ..training.methods import launch_config_parallelism

    if args.num_processes is not None and args.num_processes < 1:
        raise UsageError(f"--num_processes {args.num_processes}: must be >= 1")
    train_argv = [*(["--recipe", args.recipe] if args.recipe is not None else []), *extra]
    train_args = with_deepspeed_method(entry.parse_args(train_argv))  # a DeepSpeed JSON's optimizer picks the method
    recipe, _ = entry.resolve_recipe(train_args)  # without --recipe: the defaults, launch config by method
    config = _launch_config(args, recipe, train_args.method)
    num_processes = args.num_processes or _config_processes(config)
    inputs = entry.check_inputs(train_args, launch_parallelism=launch_config_parallelism(config), world_size=num_processes)
    _check_frozen_variance(inputs.plan.onebit, inputs.settings.max_steps, allowed=args.allow_uncorrected_variance)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    if args.num_processes is not None:
        command += ["--num_processes", str(args.num_processes)]
    return command + ["-m", "qaccel.train", *train_argv]


def _check_frozen_variance(config: OneBitConfigBase | None, max_steps: int, *, allowed: bool) -> None:
    """Refuse a 1-bit optimizer whose post-freeze steps would be more than 4x Adam's (:mod:`qaccel.optim._variance_bias`).

    Refused, not warned: such a run diverges within a few steps of the freeze, after the launch and the
    first steps have been paid for, and a warning scrolls past in the ranks' output. Checked here, in
    the launcher, so a direct ``accelerate launch -m qaccel.train`` (benchmarks, reproductions of a
    DeepSpeed run) keeps DeepSpeed's behaviour; the optimizer logs the same message there.
    """
    from ..optim import frozen_variance_problem

    problem = None if config is None or allowed else frozen_variance_problem(config, max_steps=max_steps)
    if problem is not None:
        raise UsageError(f"{problem}; or --allow_uncorrected_variance to launch DeepSpeed's numerics as they are")


def _config_processes(config: Path) -> int:
    from accelerate.commands.config.config_args import load_config_from_file

    return int(load_config_from_file(str(config)).num_processes or 1)


def _resume_command(args: argparse.Namespace, extra: list[str]) -> str:
    """This ``qaccel train`` command with ``--resume_from_checkpoint latest``."""
    from ..training.faults import resume_argv

    own = [
        *(["--recipe", args.recipe] if args.recipe is not None else []),
        *(["--launch_config", args.launch_config] if args.launch_config is not None else []),
        *(["--num_processes", str(args.num_processes)] if args.num_processes is not None else []),
        *(["--allow_uncorrected_variance"] if args.allow_uncorrected_variance else []),
    ]
    return shlex.join(["qaccel", "train", *own, *resume_argv(extra)])


def _last_logged_step(output_dir: Path) -> str:
    from ..training.metrics_log import read_metrics

    try:
        rows = read_metrics(output_dir / "metrics.jsonl")
    except (OSError, ValueError):
        rows = []
    steps = [row["step"] for row in rows if isinstance(row.get("step"), int)]
    return f"after step {steps[-1]} (the last logged)" if steps else "before the first logged step"


def _main_pid_record(output_dir: Path) -> str | None:
    """The main rank's pid file (pid, host, start time: unique to one process), if there is one."""
    try:
        return (output_dir / "pids" / "rank0.pid").read_text()
    except OSError:
        return None


def _clean_up_interrupted(output_dir: Path, resume_command: str, before_launch: str | None) -> None:
    """After a Ctrl-C, once every rank has exited: the line if the main rank could not print it, no leftovers.

    The main rank removes its pid file only after its line is out, so a ``pids/rank0.pid`` of this launch
    (not one a crashed earlier run left) means it was killed first (a rank stuck in a collective outlives
    the launcher's grace period): say it here.
    """
    from ..checkpoint import remove_partial_checkpoints
    from ..training.faults import interrupt_line

    pid_dir = output_dir / "pids"
    record = _main_pid_record(output_dir)
    if record is not None and record != before_launch:
        print("\n" + interrupt_line(_last_logged_step(output_dir), output_dir, resume_command), file=sys.stderr, flush=True)
    remove_partial_checkpoints(output_dir)  # no rank writes any more: a partial folder is garbage
    if pid_dir.is_dir():
        for path in [*pid_dir.glob("rank*.pid"), *pid_dir.glob("rank*.stopped")]:
            path.unlink(missing_ok=True)
        try:
            pid_dir.rmdir()
        except OSError:
            pass  # something else lives there: not ours to delete


def _launch(command: list[str], output_dir: Path, resume_command: str) -> int:
    """Run the launch command; on Ctrl-C wait for the ranks to leave, clean up and return 130.

    A Ctrl-C reaches every process of the terminal's foreground group: this one, ``accelerate
    launch`` (which passes SIGINT on to the ranks it started in their own sessions) and, with one
    process, the rank. So the launcher only notes it and keeps waiting: the main rank prints the
    line (it knows the step), and the launcher removes what a killed rank could leave.
    """
    from ..training.faults import EXIT_INTERRUPTED, RESUME_COMMAND_ENV

    interrupted = False

    def on_sigint(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True

    before_launch = _main_pid_record(output_dir)
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        status = EXIT_INTERRUPTED
        if not interrupted:
            child = subprocess.Popen(command, env={**os.environ, RESUME_COMMAND_ENV: resume_command})
            status = child.wait()  # retried after on_sigint returns (PEP 475)
    finally:
        signal.signal(signal.SIGINT, previous)
    if not interrupted or status == 0:  # a run that finished as the key was pressed has finished
        return status
    _clean_up_interrupted(output_dir, resume_command, before_launch)
    return EXIT_INTERRUPTED


def run(args: argparse.Namespace) -> int:
    from ..train import BAD_INPUT_ERRORS
    from ..training.faults import EXIT_INTERRUPTED

    extra = list(getattr(args, "extra_args", []))
    try:
        command = build_command(args, extra)
    except BAD_INPUT_ERRORS as err:
        return report_usage_error("train", err)
    except KeyboardInterrupt:
        print("qaccel train: interrupted while checking the run; nothing was started", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(shlex.join(command), file=sys.stderr)
    if args.dry_run:
        return 0
    from .. import train as entry

    output_dir = Path(entry.parse_args([*(["--recipe", args.recipe] if args.recipe is not None else []), *extra]).output_dir)
    return _launch(command, output_dir, _resume_command(args, extra))
