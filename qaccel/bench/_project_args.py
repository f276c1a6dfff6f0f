"""The command line of ``qaccel bench project``: its flags, their defaults and the parsers that check them."""

from __future__ import annotations

import argparse
import math

from ._e2e_methods import parse_rate
from ._project_gpu import Assumptions

__all__ = ["add_arguments", "DEFAULT_RECIPES", "PROJECTED_METHODS", "DEFAULT_NODES", "DEFAULT_RATES"]

DEFAULT_RECIPES = ("gpt2-124m", "gpt2-350m", "gpt2-1.3b", "bert-base", "bert-large")
PROJECTED_METHODS = ("fsdp2", "hsdp", "qsdp-w8g8", "hqsdp-w8g8-r8", "hqsdp-w8g8-r4", "hqsdp-off-r4")
DEFAULT_NODES = (2, 4, 8, 16, 32, 64)
DEFAULT_RATES = ("10gbit", "25gbit", "100gbit")


def _number(
    name: str, cast: type = float, *, low: float | None = None, high: float | None = None, open_low: bool = False
):
    """A parser of one number: ``cast`` it and refuse what is not finite or outside ``[low, high]`` (``(low, high]``)."""
    if low is not None and high is not None:
        allowed = f"in {'(' if open_low else '['}{low:g}, {high:g}]"
    else:
        allowed = f"{'>' if open_low else '>='} {low:g}" if low is not None else "finite"

    def parse(text: str) -> float:
        word = text.strip()
        try:
            value = cast(word)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name}: {word!r} is not {'an integer' if cast is int else 'a number'}"
            ) from None
        above = low is None or (value > low if open_low else value >= low)
        if not (math.isfinite(value) and above and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"{name}: {word} must be {allowed}")
        return value

    return parse


def _int_list(name: str, minimum: int):
    one = _number(name, int, low=minimum)

    def parse(text: str) -> list[int]:
        return sorted({one(item) for item in text.split(",")})

    return parse


def _rate_list(text: str) -> list[str]:
    rates = []
    for item in text.split(","):
        try:
            bits = parse_rate(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--rates: {exc}") from None
        if bits is None:
            raise argparse.ArgumentTypeError(
                f"--rates: {item.strip()!r}: a projection needs a finite rate (e.g. 25gbit)"
            )
        rates.append(item.strip())
    return rates


def _name_list(name: str, allowed: tuple[str, ...] | None):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"{name}: empty list")
        bad = [n for n in names if allowed is not None and n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{name}: unknown {', '.join(bad)}; allowed: {', '.join(allowed or ())}")
        return list(dict.fromkeys(names))

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``qaccel bench project``: inputs, what to project, the GPU assumptions, outputs."""
    a = Assumptions()
    parser.add_argument(
        "--e2e",
        default="docs/bench/e2e.json",
        metavar="PATH",
        help="the 1-node `qaccel bench e2e` report (default docs/bench/e2e.json)",
    )
    parser.add_argument("--e2e_2node", default="docs/bench/e2e_2node.json", metavar="PATH",
                        help="the 2-node report (`qaccel bench e2e --nodes 2`); skipped, and said so, when missing (default docs/bench/e2e_2node.json)")  # fmt: skip
    parser.add_argument("--quant", default="docs/bench/quant.json", metavar="PATH",
                        help="`qaccel bench quant` report: CPU codec speed for the calibration; its CUDA rows, when present, replace the assumed GPU codec speed")  # fmt: skip
    parser.add_argument("--nodes", type=_int_list("--nodes", 2), default=list(DEFAULT_NODES), metavar="N,N,...",
                        help="node counts to project, each >= 2 (default 2,4,8,16,32,64)")  # fmt: skip
    parser.add_argument("--rates", type=_rate_list, default=list(DEFAULT_RATES), metavar="RATE,RATE,...",
                        help="inter-node rates in tc syntax (default 10gbit,25gbit,100gbit)")  # fmt: skip
    parser.add_argument("--recipes", type=_name_list("--recipes", None), default=list(DEFAULT_RECIPES), metavar="NAME,...",
                        help=f"GPU recipes to project (default {','.join(DEFAULT_RECIPES)})")  # fmt: skip
    parser.add_argument("--methods", type=_name_list("--methods", PROJECTED_METHODS), default=list(PROJECTED_METHODS), metavar="NAME,...",
                        help=f"methods to project; fsdp2 and hsdp are the baselines of the speedups (default {','.join(PROJECTED_METHODS)})")  # fmt: skip
    parser.add_argument(
        "--gpus_per_node",
        type=_number("--gpus_per_node", int, low=2),
        default=a.gpus_per_node,
        metavar="G",
        help=f"assumed GPUs per node, >= 2 (default {a.gpus_per_node})",
    )
    parser.add_argument(
        "--gpu_tflops",
        type=_number("--gpu_tflops", low=0, open_low=True),
        default=a.tflops_16bit,
        help=f"assumed dense bf16/fp16 peak per GPU, TFLOP/s (default {a.tflops_16bit:g})",
    )
    parser.add_argument(
        "--mfu",
        type=_number("--mfu", low=0, high=1, open_low=True),
        default=a.mfu,
        help=f"assumed model FLOPs utilisation, (0, 1] (default {a.mfu:g})",
    )
    parser.add_argument("--nvlink_gbytes_per_s", type=_number("--nvlink_gbytes_per_s", low=0, open_low=True), default=a.nvlink_gbytes_per_s,
                        help=f"assumed intra-node bus bandwidth per GPU and direction, GB/s (default {a.nvlink_gbytes_per_s:g})")  # fmt: skip
    parser.add_argument("--inter_node_efficiency", type=_number("--inter_node_efficiency", low=0, high=1, open_low=True), default=a.inter_node_efficiency,
                        help=f"assumed achieved fraction of the inter-node line rate, (0, 1] (default {a.inter_node_efficiency:g})")  # fmt: skip
    parser.add_argument("--latency_us", type=_number("--latency_us", low=0), default=a.latency_us,
                        help=f"assumed latency per message step across nodes, microseconds, >= 0 (default {a.latency_us:g})")  # fmt: skip
    parser.add_argument(
        "--gpu_overlap",
        type=_number("--gpu_overlap", low=0, high=1),
        default=a.overlap,
        help=f"assumed overlap efficiency alpha on GPUs, [0, 1] (default {a.overlap:g})",
    )
    parser.add_argument("--png", default=None, help="write the figure here (default: next to --json)")
    parser.add_argument(
        "--markdown", default=None, help="write/replace this command's section of a Markdown file (BENCHMARKS.md)"
    )

