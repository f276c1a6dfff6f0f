"""``qaccel bench quant|comm``: codec throughput and bytes on the wire per training step."""

from __future__ import annotations

import argparse

from ._output import emit


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark and print/write its JSON")
    kinds = parser.add_subparsers(dest="bench_kind", required=True)

    quant_parser = kinds.add_parser("quant", help="quantize+dequantize throughput per backend vs a memory copy")
    quant_parser.add_argument("--json", dest="json_path", default=None, help="also write the report here")
    from ..bench import quant as quant_bench

    quant_bench.add_arguments(quant_parser)
    quant_parser.set_defaults(func=_run(quant_bench))

    comm_parser = kinds.add_parser("comm", help="bytes and rounds on the wire per step: FSDP vs QSDP, AdamW vs 1-bit/0/1 Adam")
    comm_parser.add_argument("--json", dest="json_path", default=None, help="also write the report here")
    from ..bench import comm as comm_bench

    comm_bench.add_arguments(comm_parser)
    comm_parser.set_defaults(func=_run(comm_bench))


def _run(module):
    def run(args: argparse.Namespace) -> int:
        report = module.run(args)
        emit(report, args.json_path)
        return 0

    return run
