"""``qaccel bench project``: a cost model of a training step, calibrated on the simulated cluster, projected to GPU clusters.

Three parts (``BENCHMARKS.md``, "Beyond two nodes: projected"):

1. The model (:mod:`._project_bytes` for the bytes on every link, :mod:`._project_model` for the time):
   compute plus the exposed part of every collective, from exact byte formulas, link rates and the codec
   throughput ``qaccel bench quant`` measured.
2. Calibration: the model's prediction next to every measured configuration of ``qaccel bench e2e`` (one
   node, and two nodes when ``docs/bench/e2e_2node.json`` exists), with the relative error; the goal is
   15 %. Three constants are fitted there, on the simulated cluster only: the host's transport cost per
   byte ``h`` and the overlap efficiency ``alpha`` with and without prefetch. Leave-one-out errors show
   how much the fit flatters itself.
3. Projection: step time and speedup over stock FSDP2 and stock HSDP for the GPU recipes on 2..64 nodes of
   8 GPUs at 10, 25 and 100 Gbit/s between nodes. Every GPU figure is an assumption, named in the output
   with its value (``--mfu``, ``--gpu_tflops``, ...); a ``quant`` report written on a GPU replaces the
   assumed codec throughput by the measured one.
"""

from __future__ import annotations

import argparse
import datetime
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import _project_report as report_mod
from ._e2e_methods import format_rate, parse_rate
from ._figures import png_path
from ._project_bytes import METHODS, Collective, ModelShapes, policy_dtypes, step_collectives
from ._project_inputs import (
    COMPUTE_DTYPES,
    Measured,
    ProjectInputError,
    bench_model_shapes,
    codec_rates,
    load_gpu_recipe,
    measured_configs,
    read_json,
    recipe_model,
)
from ._project_model import CalibrationCase, CodecRates, Fit, Link, Platform, fit_calibration, step_time

__all__ = [
    "add_arguments",
    "run",
    "ProjectInputError",
    "Assumptions",
    "PROJECTED_METHODS",
    "DEFAULT_RECIPES",
    "GOAL_RELATIVE_ERROR",
]

DEFAULT_RECIPES = ("gpt2-124m", "gpt2-350m", "gpt2-1.3b", "bert-base", "bert-large")
PROJECTED_METHODS = ("fsdp2", "hsdp", "qsdp-w8g8", "hqsdp-w8g8-r8", "hqsdp-w8g8-r4", "hqsdp-off-r4")
DEFAULT_NODES = (2, 4, 8, 16, 32, 64)
DEFAULT_RATES = ("10gbit", "25gbit", "100gbit")
GOAL_RELATIVE_ERROR = 0.15
H_GRID = tuple(i * 0.25e-9 for i in range(0, 81))  # 0 .. 20 ns per byte, for each of the two host costs
ALPHA_GRID = tuple(i / 100 for i in range(0, 101))


@dataclass(frozen=True)
class Assumptions:
    """The GPU figures the projection assumes (every one is printed with the results)."""

    gpus_per_node: int = 8
    gpu: str = "H100/H200 SXM"
    tflops_16bit: float = 989.0  # dense bf16/fp16 tensor-core peak, TFLOP/s (datasheet)
    mfu: float = 0.40
    nvlink_gbytes_per_s: float = 360.0
    inter_node_efficiency: float = 0.90
    latency_us: float = 20.0
    overlap: float = 1.0
    codec_quantize_gelems_per_s: float = 200.0
    codec_dequantize_gelems_per_s: float = 300.0

    def flops(self, compute: str) -> float:
        """Peak FLOP/s at ``compute`` precision: the 16-bit figure, halved for fp32 (TF32 tensor cores)."""
        return self.tflops_16bit * 1e12 * (0.5 if compute == "fp32" else 1.0)

    def describe(self, codec_measured: str | None) -> list[dict]:
        codec_note = (f"measured: {codec_measured}" if codec_measured else
                      "assumed: memory-bound kernels at roughly a third of H100 HBM3 bandwidth (3.35 TB/s) for ~5 B "
                      "moved per element; no GPU measurement in the --quant report")  # fmt: skip
        return [
            {
                "name": "gpus_per_node",
                "flag": "--gpus_per_node",
                "value": self.gpus_per_node,
                "unit": "GPUs",
                "note": "one NIC per node carries all of its inter-node traffic",
            },
            {
                "name": "gpu",
                "flag": None,
                "value": self.gpu,
                "unit": "",
                "note": "the GPU the compute figures describe",
            },
            {
                "name": "tflops_16bit",
                "flag": "--gpu_tflops",
                "value": self.tflops_16bit,
                "unit": "TFLOP/s",
                "note": "dense bf16/fp16 tensor-core peak per GPU (datasheet); fp32 recipes get half (TF32)",
            },
            {
                "name": "mfu",
                "flag": "--mfu",
                "value": self.mfu,
                "unit": "",
                "note": "model FLOPs utilisation: T_compute = 6 * params * tokens / (peak * mfu); attention FLOPs are folded in",
            },
            {
                "name": "nvlink_gbytes_per_s",
                "flag": "--nvlink_gbytes_per_s",
                "value": self.nvlink_gbytes_per_s,
                "unit": "GB/s",
                "note": "NCCL bus bandwidth per GPU and direction inside a node (NVLink 4: 450 GB/s raw)",
            },
            {
                "name": "inter_node_efficiency",
                "flag": "--inter_node_efficiency",
                "value": self.inter_node_efficiency,
                "unit": "",
                "note": "fraction of the NIC's line rate NCCL achieves, full duplex",
            },
            {
                "name": "latency_us",
                "flag": "--latency_us",
                "value": self.latency_us,
                "unit": "us",
                "note": "per message step of a collective that crosses nodes (ring: P-1 steps per pass)",
            },
            {
                "name": "overlap",
                "flag": "--gpu_overlap",
                "value": self.overlap,
                "unit": "",
                "note": "alpha on GPUs: NCCL on its own streams hides every collective but the edges behind compute",
            },
            {
                "name": "codec_quantize_gelems_per_s",
                "flag": "--quant",
                "value": self.codec_quantize_gelems_per_s,
                "unit": "G elements/s",
                "note": codec_note,
            },
            {
                "name": "codec_dequantize_gelems_per_s",
                "flag": "--quant",
                "value": self.codec_dequantize_gelems_per_s,
                "unit": "G elements/s",
                "note": codec_note,
            },
        ]


# -- command line ---------------------------------------------------------------------------------
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


# -- calibration ------------------------------------------------------------------------------------
def sim_platform(m: Measured, codec: CodecRates, cores: int, fit: Fit | None = None) -> Platform:
    """The simulated cluster as ``qaccel bench e2e`` shapes it (``_e2e_netns``), with the fitted constants.

    One node: every rank's traffic crosses the namespace's one loopback, shaped to the rate in both
    directions together (a shared bus). Two nodes: each node's loopback is unshaped (its cost is the host's
    transport time) and the veth pair between them is shaped at each end, so each direction has the rate.
    """
    shaped = fit.h_shaped if fit else 0.0
    unshaped = (fit.h_unshaped or 0.0) if fit else 0.0
    rate = None if m.rate_bits is None else m.rate_bits / 8
    h_rate = shaped if rate is not None else unshaped
    if m.nodes == 1:
        intra, inter = Link("bus", rate, host_s_per_byte=h_rate), None
    else:
        intra, inter = Link("bus", None, host_s_per_byte=unshaped), Link("nic", rate, host_s_per_byte=h_rate)
    share = max(1.0, m.nodes * m.per_node / max(1, cores))
    return Platform(intra, inter, codec, codec_share=share, overlap=fit.alpha if fit else {True: 0.0, False: 0.0})


def _case(m: Measured, collectives: list[Collective], platform: Platform) -> CalibrationCase:
    """The fit's view of one configuration: its bytes split by whether their link is shaped."""
    terms = step_time(collectives, platform, compute_s=m.compute_s, prefetch=m.prefetch)
    inter = terms.bytes_per_step["machine_inter"]
    by_link = [(platform.intra, terms.bytes_per_step["machine"] - inter), (platform.inter, inter)]
    shaped = sum(n for link, n in by_link if link is not None and link.rate_bytes_per_s is not None)
    unshaped = sum(n for link, n in by_link if link is not None and link.rate_bytes_per_s is None)
    return CalibrationCase(
        terms.compute_s + terms.codec_s, shaped, unshaped, terms.comm_s, terms.edge_s, m.prefetch, m.step_s
    )


def _predicted_bytes(m: Measured, collectives: list[Collective]) -> dict[str, float]:
    """Bytes per step the model puts where the bench counts them (the whole job, all directions)."""
    total = {"link": 0.0, "inter_node": 0.0, "intra_node": 0.0}
    for c in collectives:
        total["link"] += c.count * c.traffic.machine
        total["inter_node"] += c.count * c.traffic.inter_nic * m.nodes
        total["intra_node"] += c.count * c.traffic.intra_bus * m.nodes
    return total if m.nodes > 1 else {"link": total["link"]}


def calibrate(measured: list[Measured], shapes: dict[str, ModelShapes], codec: CodecRates, cores: int) -> dict:
    """Fit ``h`` and ``alpha`` on every measured configuration; predictions, errors and leave-one-out errors."""
    collectives = []
    for m in measured:
        dtype = COMPUTE_DTYPES[m.compute]
        param, reduce = policy_dtypes(METHODS[m.method], dtype, accelerate=False)
        collectives.append(step_collectives(shapes[m.source], METHODS[m.method], nodes=m.nodes, per_node=m.per_node,
                                            param_dtype=param, reduce_dtype=reduce, backend="gloo"))  # fmt: skip
    cases = [_case(m, cs, sim_platform(m, codec, cores)) for m, cs in zip(measured, collectives, strict=True)]
    fit = fit_calibration(cases, h_grid=H_GRID, alpha_grid=ALPHA_GRID)
    rows = []
    for i, (m, cs, case) in enumerate(zip(measured, collectives, cases, strict=True)):
        terms = step_time(cs, sim_platform(m, codec, cores, fit), compute_s=m.compute_s, prefetch=m.prefetch)
        rest = cases[:i] + cases[i + 1 :]
        loo = None
        if rest and any(c.prefetch == m.prefetch for c in rest):
            loo = fit_calibration(rest, h_grid=H_GRID, alpha_grid=ALPHA_GRID).predict(case)
        predicted_bytes = _predicted_bytes(m, cs)
        low, high = m.step_min_s, m.step_max_s
        rows.append({
            "source": m.source, "label": m.label, "method": m.method, "compute": m.compute, "prefetch": m.prefetch,
            "bandwidth": format_rate(m.rate_bits), "rate_bits_per_s": m.rate_bits, "nodes": m.nodes, "per_node": m.per_node,
            "measured_s": m.step_s, "measured_min_s": low, "measured_max_s": high, "compute_only_s": m.compute_s,
            "predicted_s": terms.total_s, "relative_error": terms.total_s / m.step_s - 1,
            "within_goal": abs(terms.total_s / m.step_s - 1) <= GOAL_RELATIVE_ERROR,
            "within_measured_range": (low is not None and high is not None and low <= terms.total_s <= high),
            "loo_predicted_s": loo, "loo_relative_error": None if loo is None else loo / m.step_s - 1,
            "terms": {"codec_s": terms.codec_s, "host_s": terms.host_s, "comm_s": terms.comm_s, "edge_s": terms.edge_s,
                      "link_busy_s": terms.link_busy_s},
            "predicted_bytes_per_step": predicted_bytes,
            "measured_bytes_per_step": m.link_bytes,
        })  # fmt: skip
    errors = [abs(r["relative_error"]) for r in rows]
    loo_errors = [abs(r["loo_relative_error"]) for r in rows if r["loo_relative_error"] is not None]
    return {
        "fitted": {"host_ns_per_byte_shaped": fit.h_shaped * 1e9,
                   "host_ns_per_byte_unshaped": None if fit.h_unshaped is None else fit.h_unshaped * 1e9,
                   "alpha_prefetch_off": fit.alpha[False], "alpha_prefetch_on": fit.alpha[True], "rms_log_error": fit.rms_log_error},
        "rows": rows,
        "summary": {"configurations": len(rows), "within_goal": sum(r["within_goal"] for r in rows),
                    "goal_relative_error": GOAL_RELATIVE_ERROR,
                    "within_measured_range": sum(r["within_measured_range"] for r in rows),
                    "max_abs_relative_error": max(errors) if errors else None,
                    "median_abs_relative_error": float(np.median(errors)) if errors else None,
                    "loo_within_goal": sum(e <= GOAL_RELATIVE_ERROR for e in loo_errors),
                    "loo_max_abs_relative_error": max(loo_errors) if loo_errors else None,
                    "loo_median_abs_relative_error": float(np.median(loo_errors)) if loo_errors else None},
    }  # fmt: skip


# -- projection ------------------------------------------------------------------------------------
def gpu_platform(rate_bits: float, a: Assumptions, codec: CodecRates) -> Platform:
    """A GPU node: NVLink ports inside, one NIC per node between nodes, NCCL overlapping as assumed."""
    inter = Link("nic", rate_bits / 8 * a.inter_node_efficiency, a.latency_us * 1e-6)
    return Platform(
        Link("port", a.nvlink_gbytes_per_s * 1e9), inter, codec, overlap={True: a.overlap, False: a.overlap}
    )


def project(
    recipes: list, methods: list[str], nodes_list: list[int], rates: list[str], a: Assumptions, codec: CodecRates
) -> list[dict]:
    """Step time of every (recipe, nodes, rate, method), with speedups over stock FSDP2 and HSDP."""
    rows = []
    for r in recipes:
        dtype = COMPUTE_DTYPES[r.compute]
        compute_s = 6 * r.shapes.num_params * r.tokens_per_gpu_step / (a.flops(r.compute) * a.mfu)
        for nodes in nodes_list:
            per_method = {}
            for name in methods:
                param, reduce = policy_dtypes(METHODS[name], dtype, accelerate=True)
                per_method[name] = step_collectives(r.shapes, METHODS[name], nodes=nodes, per_node=a.gpus_per_node, param_dtype=param,
                                                    reduce_dtype=reduce, backend="nccl", micro_batches=r.micro_batches)  # fmt: skip
            for rate in rates:
                platform = gpu_platform(parse_rate(rate), a, codec)
                times = {
                    name: step_time(cs, platform, compute_s=compute_s, prefetch=True, micro_batches=r.micro_batches)
                    for name, cs in per_method.items()
                }
                for name, t in times.items():
                    rows.append({
                        "recipe": r.name, "nodes": nodes, "gpus": nodes * a.gpus_per_node, "bandwidth": rate, "rate_bits_per_s": parse_rate(rate),
                        "method": name, "step_s": t.total_s, "compute_s": t.compute_s, "codec_s": t.codec_s, "comm_s": t.comm_s,
                        "exposed_comm_s": t.total_s - t.compute_s - t.codec_s, "edge_s": t.edge_s, "link_busy_s": t.link_busy_s,
                        "inter_node_bytes_per_node_step": t.bytes_per_step["inter_node"],
                        "intra_node_bytes_per_gpu_step": t.bytes_per_step["intra_node"],
                        "comm_bound": t.total_s > t.compute_s + t.codec_s + t.edge_s + 1e-12,
                        "speedup_vs_fsdp2": times["fsdp2"].total_s / t.total_s if "fsdp2" in times else None,
                        "speedup_vs_hsdp": times["hsdp"].total_s / t.total_s if "hsdp" in times else None,
                    })  # fmt: skip
    return rows


def _recipe_summary(r) -> dict:
    return {"name": r.name, "params": r.shapes.num_params, "units": len(r.shapes.units), "compute": r.compute,
            "tokens_per_gpu_step": r.tokens_per_gpu_step, "micro_batches": r.micro_batches}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    """Calibrate on the measured configurations, project the GPU recipes; returns the JSON report.

    Every input is read and checked before any model is built, so a bad path or recipe fails at once.
    """
    e2e = read_json(args.e2e, "--e2e", "qaccel bench e2e --json docs/bench/e2e.json")
    quant = read_json(args.quant, "--quant", "qaccel bench quant --json docs/bench/quant.json")
    settings = e2e.get("settings") or {}
    threads = settings.get("threads") if isinstance(settings.get("threads"), int) else 1
    cores = int((e2e.get("machine") or {}).get("cpus") or 1)
    cpu_codec = codec_rates(quant, args.quant, threads=threads)
    measured, skipped = measured_configs(e2e, "1-node", args.e2e)
    reports = {"1-node": (e2e, args.e2e)}
    inputs: dict = {"e2e": args.e2e, "quant": args.quant, "cpu_codec": cpu_codec.source}
    if Path(args.e2e_2node).is_file():
        e2e2 = read_json(args.e2e_2node, "--e2e_2node", "qaccel bench e2e --nodes 2 --nproc_per_node 2")
        more, more_skipped = measured_configs(e2e2, "2-node", args.e2e_2node)
        measured += more
        skipped += more_skipped
        reports["2-node"] = (e2e2, args.e2e_2node)
        inputs["e2e_2node"] = args.e2e_2node
    else:
        inputs["e2e_2node"] = None
        inputs["e2e_2node_skipped"] = f"{args.e2e_2node}: no such file; the 2-node configurations were not calibrated"
    if not measured:
        raise ProjectInputError(f"--e2e {args.e2e!r}: no measured configuration of a sharded method to calibrate on")
    recipes = [load_gpu_recipe(name) for name in args.recipes]

    shapes = {
        source: bench_model_shapes(str((report.get("settings") or {}).get("model")), where)
        for source, (report, where) in reports.items()
    }
    calibration = calibrate(measured, shapes, cpu_codec, cores)
    calibration["skipped"] = skipped
    assumptions = Assumptions(gpus_per_node=args.gpus_per_node, tflops_16bit=args.gpu_tflops, mfu=args.mfu, nvlink_gbytes_per_s=args.nvlink_gbytes_per_s,
                              inter_node_efficiency=args.inter_node_efficiency, latency_us=args.latency_us, overlap=args.gpu_overlap)  # fmt: skip
    gpu_codec = codec_rates(quant, args.quant, cuda=True)
    measured_codec = gpu_codec.source if gpu_codec is not None else None
    if gpu_codec is None:
        gpu_codec = CodecRates(
            {8: 1e-9 / assumptions.codec_quantize_gelems_per_s},
            {8: 1e-9 / assumptions.codec_dequantize_gelems_per_s},
            source="assumed",
        )
    else:
        assumptions = replace(assumptions, codec_quantize_gelems_per_s=1e-9 / _nearest_value(gpu_codec.quantize_s),
                              codec_dequantize_gelems_per_s=1e-9 / _nearest_value(gpu_codec.dequantize_s))  # fmt: skip
    methods = list(dict.fromkeys(["fsdp2", "hsdp", *args.methods]))
    models = [recipe_model(r) for r in recipes]
    rows = project(models, methods, args.nodes, args.rates, assumptions, gpu_codec)
    report: dict = {
        "benchmark": "project",
        "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": report_mod.command_line(args),
        "inputs": inputs,
        "equations": report_mod.EQUATIONS,
        "calibration": calibration,
        "assumptions": assumptions.describe(measured_codec),
        "projection": {"recipes": [_recipe_summary(m) for m in models], "methods": {m: METHODS[m].title for m in methods},
                       "nodes": args.nodes, "rates": args.rates, "rows": rows},
    }  # fmt: skip
    png = png_path(args)
    if png:
        report_mod.plot(report, png)
        report["png"] = png
    if args.markdown:
        report_mod.write_markdown(args.markdown, report_mod.render_markdown(report, image=report.get("png")))
        report["markdown"] = args.markdown
    return report


def _nearest_value(table: dict[int, float]) -> float:
    """The 8-bit figure (the projection's common width), else the widest measured."""
    return table.get(8, table[max(table)])
