"""``qaccel bench quant|comm|e2e|convergence|project``: codec throughput, bytes on the wire per step, step time on a shaped link, eval loss over seeds, a calibrated cost model projected to GPU clusters."""

from __future__ import annotations

import argparse

from ._output import emit


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark and print/write its JSON")
    kinds = parser.add_subparsers(dest="bench_kind", required=True)

    quant_parser = kinds.add_parser(
        "quant", help="quantize+dequantize throughput per backend vs a memory copy; --study error: round-trip error with/without rotation"
    )
    quant_parser.add_argument("--json", dest="json_path", default=None, help="also write the report here")
    from ..bench import quant as quant_bench

    quant_bench.add_arguments(quant_parser)
    quant_parser.set_defaults(func=_run(quant_bench, quant_bench.QuantInputError))

    comm_parser = kinds.add_parser("comm", help="bytes and rounds on the wire per step: FSDP vs QSDP, AdamW vs 1-bit/0/1 Adam")
    comm_parser.add_argument("--json", dest="json_path", default=None, help="also write the report here")
    from ..bench import comm as comm_bench

    comm_bench.add_arguments(comm_parser)
    comm_parser.set_defaults(func=_run(comm_bench))

    e2e_parser = kinds.add_parser("e2e", help="step time of every method on a tc-shaped link in a network namespace (root)")
    e2e_parser.add_argument("--json", dest="json_path", default=None, help="also write the report here")
    from ..bench import e2e as e2e_bench

    e2e_bench.add_arguments(e2e_parser)
    e2e_parser.set_defaults(func=_run_e2e)

    convergence_parser = kinds.add_parser("convergence", help="eval loss vs the uncompressed baseline over seeds: QSDP (also hierarchical, --replicas), 0/1 Adam, 1-bit Adam")
    convergence_parser.add_argument("--json", dest="json_path", default=None, help="also write the report here")
    from ..bench import convergence as convergence_bench

    convergence_bench.add_arguments(convergence_parser)
    convergence_parser.set_defaults(func=_run(convergence_bench, convergence_bench.ConvergenceInputError))

    project_parser = kinds.add_parser(
        "project", help="cost model of a step: calibrated on the simulated cluster, projected to 2..64 GPU nodes"
    )
    project_parser.add_argument("--json", "--out", dest="json_path", default=None, help="also write the report here")
    from ..bench import project as project_bench

    project_bench.add_arguments(project_parser)
    project_parser.set_defaults(func=_run(project_bench, project_bench.ProjectInputError))


def _require_plotting(args: argparse.Namespace) -> None:
    """A benchmark that will draw its PNG (``--json`` puts one beside it) needs matplotlib: say so before it runs."""
    from .._extras import require_extra

    if any(getattr(args, name, None) for name in ("json_path", "png", "plot")):
        require_extra("bench", f"qaccel bench {args.bench_kind} (its PNG)", modules=("matplotlib",))


def _run(module, bad_input: type[Exception] | None = None):
    """Run ``module``'s benchmark; ``bad_input`` (its input error) becomes one line on stderr and exit 2."""

    def run(args: argparse.Namespace) -> int:
        from ._output import report_usage_error

        _require_plotting(args)
        try:
            report = module.run(args)
        except Exception as exc:
            if bad_input is not None and isinstance(exc, bad_input):
                return report_usage_error(f"bench {args.bench_kind}", exc)
            raise
        emit(report, args.json_path)
        return 0

    return run


def _run_e2e(args: argparse.Namespace) -> int:
    """Exit 1 with the reason when the benchmark cannot run (not root, no iproute2) or a configuration failed; 130 when interrupted."""
    import sys

    from .._errors import prefixed
    from ..bench import e2e as e2e_bench

    _require_plotting(args)
    try:
        report = e2e_bench.run(args)
    except e2e_bench.E2EError as exc:  # "needs root" names the command itself: prefixed says it once
        print(prefixed("qaccel bench e2e", str(exc)), file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the namespace and its processes are gone by now
        print(f"qaccel bench e2e: interrupted ({exc or 'SIGINT'}); the network namespace was removed", file=sys.stderr)
        return 130
    emit(report, args.json_path)
    if report["errors"]:
        print(f"qaccel bench e2e: failed configurations: {', '.join(report['errors'])}", file=sys.stderr)
        return 1
    return 0
