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
from pathlib import Path

from . import _project_report as report_mod
from ._figures import png_path
from ._project_args import DEFAULT_NODES, DEFAULT_RATES, DEFAULT_RECIPES, PROJECTED_METHODS, add_arguments
from ._project_bytes import METHODS
from ._project_calibration import ALPHA_GRID, GOAL_RELATIVE_ERROR, H_GRID, calibrate, sim_platform
from ._project_gpu import Assumptions, gpu_codec, gpu_platform, project, recipe_summary
from ._project_inputs import (
    Measured,
    ProjectInputError,
    bench_model_shapes,
    codec_rates,
    load_gpu_recipe,
    measured_configs,
    read_json,
    recipe_model,
)

# the names this module held before the command line, the calibration and the projection moved out
__all__ = [
    "add_arguments",
    "run",
    "ProjectInputError",
    "Assumptions",
    "PROJECTED_METHODS",
    "DEFAULT_RECIPES",
    "DEFAULT_NODES",
    "DEFAULT_RATES",
    "GOAL_RELATIVE_ERROR",
    "H_GRID",
    "ALPHA_GRID",
    "calibrate",
    "sim_platform",
    "gpu_platform",
    "project",
]


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
    measured, skipped, reports, inputs = _measured(args, e2e)
    inputs = {"e2e": args.e2e, "quant": args.quant, "cpu_codec": cpu_codec.source, **inputs}
    recipes = [load_gpu_recipe(name) for name in args.recipes]

    shapes = {
        source: bench_model_shapes(str((report.get("settings") or {}).get("model")), where)
        for source, (report, where) in reports.items()
    }
    calibration = calibrate(measured, shapes, cpu_codec, cores)
    calibration["skipped"] = skipped
    assumptions = Assumptions(gpus_per_node=args.gpus_per_node, tflops_16bit=args.gpu_tflops, mfu=args.mfu, nvlink_gbytes_per_s=args.nvlink_gbytes_per_s,
                              inter_node_efficiency=args.inter_node_efficiency, latency_us=args.latency_us, overlap=args.gpu_overlap)  # fmt: skip
    measured_gpu_codec = codec_rates(quant, args.quant, cuda=True)
    assumptions, codec = gpu_codec(assumptions, measured_gpu_codec)
    methods = list(dict.fromkeys(["fsdp2", "hsdp", *args.methods]))
    models = [recipe_model(r) for r in recipes]
    rows = project(models, methods, args.nodes, args.rates, assumptions, codec)
    report: dict = {
        "benchmark": "project",
        "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": report_mod.command_line(args),
        "inputs": inputs,
        "equations": report_mod.EQUATIONS,
        "calibration": calibration,
        "assumptions": assumptions.describe(measured_gpu_codec.source if measured_gpu_codec is not None else None),
        "projection": {"recipes": [recipe_summary(m) for m in models], "methods": {m: METHODS[m].title for m in methods},
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


def _measured(args: argparse.Namespace, e2e: dict) -> tuple[list[Measured], list[dict], dict, dict]:
    """The configurations to calibrate on (1 node, and 2 nodes when ``--e2e_2node`` exists), the skipped rows,
    the reports by source with their paths, and what ``inputs`` says about the 2-node report."""
    measured, skipped = measured_configs(e2e, "1-node", args.e2e)
    reports = {"1-node": (e2e, args.e2e)}
    inputs: dict = {}
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
    return measured, skipped, reports, inputs
