"""``qaccel bench e2e``: training step time of every method on a shaped link, with the link's own byte count.

For each ``--bandwidth`` in turn the loopback of a private network namespace is shaped with ``tc`` (token
bucket, ``_e2e_netns``) and every configuration (method x prefetch setting, ``_e2e_methods``) runs as its own
``torchrun`` job inside the namespace: the users' training entry, ``qaccel.train``, with the method's flags
(``_e2e_entry``), its link counters read at the loop's step boundaries (``_e2e_probe``). The kernel's interface
counter gives the bytes on the link; the run's ``metrics.jsonl`` the step times, the bytes the method meant to
send (the entry's wire meter) and the 1-bit optimizers' step kinds; one-process runs of the same entry, as many
as the job has ranks and all at once, give ``T_compute``; ``_e2e_report`` turns all of it into step times,
ideals, speedups and the issue's goals. Details and the reading of the results: ``BENCHMARKS.md``.

``--nodes N`` (2 to 8) simulates a cluster instead: one namespace per node, its ranks on its own unshaped
loopback, the nodes joined by shaped veth links (``_e2e_netns.NodeCluster``), and per configuration one
``torchrun`` per node (static rendezvous on node 0's veth address, gloo bound to the node's veth). The rows
then also carry the bytes per level, from the interface counters and from the meter; the goals and the
Markdown section are the several-node ones (``_e2e_cluster_report``). The 1-bit optimizers on HSDP shards
(``NODES_ONEBIT_METHODS``: 0/1 Adam and 1-bit Adam across nodes, exact or QSDP inside one) are weighted by
the paper's schedule like the DDP 1-bit rows, and are run with ``--methods``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
from pathlib import Path

from . import _e2e_cluster_report as cluster_report
from . import _e2e_report as report_mod
from ._e2e_jobs import PACKAGE_ROOT, measure_all
from ._e2e_methods import MODELS, format_rate, parse_rate
from ._e2e_netns import TX_BYTES, NamespaceError, check_prerequisites
from ._e2e_plan import E2EError, add_arguments, command_line, plan_configs, rate_arg, resolve_topology
from ._e2e_raw import load_raw

# the flags and the plan (_e2e_plan), the jobs (_e2e_jobs) and the raw results (_e2e_raw) live in their own modules
__all__ = ["add_arguments", "run", "E2EError", "plan_configs", "rate_arg", "PACKAGE_ROOT"]


def run(args: argparse.Namespace) -> dict:
    """Run every configuration at every bandwidth; return the report (also drawn/written when asked)."""
    args.bandwidth = args.bandwidth or ["300mbit"]
    resolve_topology(args)
    rates = [parse_rate(b) for b in args.bandwidth]
    configs = plan_configs(args.methods, args.prefetch, args.nodes)
    if getattr(args, "from_raw", None):
        results, shaping, namespace = load_raw(Path(args.from_raw), rates, configs, args.nodes)
    else:
        try:
            check_prerequisites()
        except NamespaceError as exc:
            raise E2EError(str(exc)) from None
        with tempfile.TemporaryDirectory(prefix="qaccel-e2e-") as tmpdir:
            tmp = Path(getattr(args, "raw_dir", None) or tmpdir)
            tmp.mkdir(parents=True, exist_ok=True)
            results, shaping, namespace = measure_all(args, rates, configs, tmp)
    report_mod.add_speedups(results)
    num_params = next((r["num_params"] for r in results if "num_params" in r), None)
    report = {
        "benchmark": "e2e",
        "command": command_line(args),
        "finished": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "settings": {"model": args.model, **{k: v for k, v in MODELS[args.model].items() if k != "config"},
                     "model_config": MODELS[args.model]["config"], "world_size": args.world_size, "steps": args.steps,
                     "warmup": args.warmup, "threads": args.threads, "lr": args.lr, "prefetch": args.prefetch,
                     "methods": list(args.methods), "bandwidths": [format_rate(r) for r in rates]},  # fmt: skip
        "namespace": {**namespace, "device": "lo", "counter": TX_BYTES,
                      "shaping": "tc tbf on the namespace loopback, shared by both directions and all ranks"},  # fmt: skip
        "shaping": shaping,
        "num_params": num_params,
        "compute_only": report_mod.compute_summary(results),
        "results": results,
        "goals": report_mod.evaluate_goals(results),
        "errors": [r["label"] + " @ " + r["bandwidth"] for r in results if "error" in r],
    }
    drawing = report_mod
    if args.nodes > 1:  # the cluster's own figures: per-level bytes, its goals, its Markdown section
        drawing = cluster_report
        report["settings"].update(nodes=args.nodes, nproc_per_node=args.nproc_per_node)
        report["namespace"] = namespace
        report["goals"] = cluster_report.evaluate_goals(results)
    png = args.plot or (str(Path(args.json_path).with_suffix(".png")) if getattr(args, "json_path", None) else None)
    if png and any("step_s" in r for r in results):
        drawing.plot(report, png)
        report["png"] = png
    if args.markdown:
        image = os.path.relpath(png, Path(args.markdown).resolve().parent) if png else None
        drawing.write_markdown(args.markdown, drawing.render_markdown(report, image))
        report["markdown"] = args.markdown
    return report


def _machine() -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kib = next(int(x.split()[1]) for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem_kib = 0
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_gib": mem_kib / 2**20, "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
