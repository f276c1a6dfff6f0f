"""The command line and the plan of ``qaccel bench e2e``: its flags, the topology they describe, the configurations
to run, and the command line that reproduces a report."""

from __future__ import annotations

import argparse
import shlex

from ._e2e_methods import (
    METHODS,
    MODELS,
    NODES_DEFAULT_METHODS,
    NODES_ONEBIT_METHODS,
    PREFETCH_DEFAULT,
    check_methods_for_nodes,
    default_methods,
    parse_methods,
    parse_rate,
)
from ._e2e_netns import MAX_NODES

__all__ = ["E2EError", "add_arguments", "rate_arg", "plan_configs", "resolve_topology", "command_line"]


class E2EError(RuntimeError):
    """The benchmark cannot run here (not root, no iproute2, a missing API) or a run failed."""


def rate_arg(text: str) -> str:
    """An argparse ``type`` for a tc rate (``300mbit``, ``1gbit``, ``none``); a bad one is a usage error naming it."""
    try:
        parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _methods_arg(text: str) -> list[str]:
    try:
        return parse_methods(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(minimum: int, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value} must be <= {maximum}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``qaccel bench e2e``: what to run, on which link and cluster, and where the results go."""
    parser.add_argument("--bandwidth", action="append", type=rate_arg, default=None, metavar="RATE",
                        help="link rate in tc syntax (300mbit, 1gbit, ...) or 'none' for unshaped; repeat for several "
                             "(default: 300mbit)")  # fmt: skip
    parser.add_argument("--methods", type=_methods_arg, default=None,
                        help=f"comma-separated methods, or all (default: all on one node; with --nodes > 1 "
                             f"{','.join(NODES_DEFAULT_METHODS)}; the 1-bit optimizers on HSDP shards: "
                             f"{','.join(NODES_ONEBIT_METHODS)}): {', '.join(METHODS)}")  # fmt: skip
    parser.add_argument("--prefetch", choices=("default", "on", "off", "both"), default="default",
                        help="FSDP2 forward/backward prefetch between units for the FSDP methods: on, off, both; default: "
                             "both for fsdp2-fp32 and qsdp-w8g8, off for the others (with --nodes > 1: on for all)")  # fmt: skip
    parser.add_argument("--steps", type=_positive(1), default=5, help="measured steps per configuration (default 5)")
    parser.add_argument("--warmup", type=_positive(2), default=2, help="warm-up steps before them, >= 2 (default 2)")
    parser.add_argument("--world_size", type=_positive(2), default=None, help="ranks of the one-node run (default 2)")
    parser.add_argument("--nodes", type=_positive(1, MAX_NODES), default=1,
                        help=f"simulated nodes, 1 to {MAX_NODES}: one network namespace each, joined by veth links shaped to "
                             "--bandwidth, each node's ranks on its own unshaped loopback (default 1: one shaped loopback)")  # fmt: skip
    parser.add_argument("--nproc_per_node", type=_positive(1), default=None,
                        help="ranks per node (default: --world_size, i.e. 2); with --nodes N the job has N x this many ranks")  # fmt: skip
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2-17m", help="model shape (default gpt2-17m; tiny for smoke)")
    parser.add_argument("--threads", type=_positive(1), default=1, help="torch/OpenMP threads per rank (default 1)")
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate of every optimizer (default 1e-4)")
    parser.add_argument("--plot", default=None, help="write the PNG here (default: next to --json)")
    parser.add_argument("--markdown", default=None, help="write/replace the e2e section of this Markdown file (BENCHMARKS.md; with --nodes > 1 the two-node section)")
    parser.add_argument("--raw_dir", default=None,
                        help="keep every configuration's raw result (JSON) and log in this folder (default: a temporary one)")
    parser.add_argument("--from_raw", default=None, metavar="DIR",
                        help="run nothing: build the report from the raw results a run left in DIR (--raw_dir), e.g. after an "
                             "interrupted run; needs no root")  # fmt: skip
    parser.add_argument("--config_timeout", type=_positive(10), default=None,
                        help="seconds one configuration may take before it is killed (default: from the model and rate)")  # fmt: skip


def plan_configs(methods: list[str], prefetch: str, nodes: int = 1) -> list[tuple[str, bool | None]]:
    """``(method, prefetch)`` pairs in run order; DDP methods have no prefetch setting (None).

    ``--prefetch default`` on several nodes is on for every FSDP method: one like-for-like configuration each.
    """
    configs = []
    for name in methods:
        if METHODS[name].parallel != "fsdp":
            configs.append((name, None))
            continue
        if prefetch == "default" and nodes > 1:
            settings = (True,)
        elif prefetch == "default":
            settings = PREFETCH_DEFAULT.get(name, (False,))
        else:
            settings = {"on": (True,), "off": (False,), "both": (False, True)}[prefetch]
        configs.extend((name, setting) for setting in settings)
    return configs


def resolve_topology(args: argparse.Namespace) -> None:
    """Fill in ``world_size``, ``nproc_per_node`` and ``methods`` from the flags; refuse contradictions (E2EError).

    One node: ``--nproc_per_node`` and ``--world_size`` name the same number (default 2). Several nodes:
    the job has ``nodes x nproc_per_node`` ranks; ``--world_size``, if given, must agree.
    """
    args.nodes = getattr(args, "nodes", 1) or 1
    nproc, world = getattr(args, "nproc_per_node", None), args.world_size
    if args.nodes == 1:
        if nproc is not None and world is not None and nproc != world:
            raise E2EError(f"--nproc_per_node {nproc} and --world_size {world} disagree: on one node both are the number of ranks")
        args.world_size = args.nproc_per_node = nproc or world or 2
        if args.world_size < 2:
            raise E2EError(f"--nproc_per_node {args.world_size}: one node needs at least 2 ranks (the link joins them)")
    else:
        args.nproc_per_node = nproc or 2
        if world is not None and world != args.nodes * args.nproc_per_node:
            raise E2EError(f"--world_size {world} != --nodes {args.nodes} x --nproc_per_node {args.nproc_per_node}; "
                           "leave --world_size out with --nodes")  # fmt: skip
        args.world_size = args.nodes * args.nproc_per_node
    if args.methods is None or list(args.methods) == ["all"]:
        args.methods = default_methods(args.nodes, everything=args.methods is not None)
    try:
        check_methods_for_nodes(args.methods, args.nodes)
    except ValueError as exc:
        raise E2EError(str(exc)) from None


def command_line(args: argparse.Namespace) -> str:
    """The ``qaccel bench e2e`` command that reproduces the report: the flags that differ from their defaults."""
    parts = ["qaccel", "bench", "e2e"]
    for bandwidth in args.bandwidth:
        parts += ["--bandwidth", bandwidth]
    if args.nodes > 1:
        parts += ["--nodes", str(args.nodes), "--nproc_per_node", str(args.nproc_per_node)]
    if list(args.methods) != default_methods(args.nodes):
        parts += ["--methods", ",".join(args.methods)]
    ranks = ("--world_size", args.world_size, 2) if args.nodes == 1 else ("--world_size", None, None)
    for flag, value, default in (("--prefetch", args.prefetch, "default"), ("--steps", args.steps, 5), ("--warmup", args.warmup, 2),
                                 ranks, ("--model", args.model, "gpt2-17m"),
                                 ("--threads", args.threads, 1), ("--lr", args.lr, 1e-4)):  # fmt: skip
        if value != default:
            parts += [flag, str(value)]
    for flag, value in (("--json", getattr(args, "json_path", None)), ("--plot", args.plot), ("--markdown", args.markdown),
                        ("--raw_dir", getattr(args, "raw_dir", None)), ("--from_raw", getattr(args, "from_raw", None))):
        if value:
            parts += [flag, value]
    return shlex.join(parts)
