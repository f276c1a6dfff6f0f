"""``qaccel bench e2e``: training step time of every method on a shaped link, with the link's own byte count.

For each ``--bandwidth`` in turn the loopback of a private network namespace is shaped with ``tc`` (token
bucket, ``_e2e_netns``) and every configuration (method x prefetch setting, ``_e2e_methods``) runs as its own
``torchrun`` job inside the namespace (``_e2e_worker``). The kernel's interface counter gives the bytes on
the link, qaccel's wire meter the bytes the method meant to send; a compute-only run of the same per-rank
work gives ``T_compute``, and ``_e2e_report`` turns all of it into step times, ideals, speedups and the
issue's goals. Details and the reading of the results: ``BENCHMARKS.md``.

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
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import _e2e_cluster_report as cluster_report
from . import _e2e_report as report_mod
from ._e2e_methods import (
    METHODS,
    MODELS,
    NODES_DEFAULT_METHODS,
    NODES_ONEBIT_METHODS,
    PREFETCH_DEFAULT,
    check_methods_for_nodes,
    config_label,
    default_methods,
    format_rate,
    onebit_probe,
    parse_methods,
    parse_rate,
)
from ._e2e_netns import (
    MAX_NODES,
    TX_BYTES,
    NamespaceError,
    NodeCluster,
    ShapedNamespace,
    check_prerequisites,
    tbf_parameters,
)

__all__ = ["add_arguments", "run", "E2EError", "plan_configs", "rate_arg"]

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


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


def _child_env(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QACCEL_", "TORCHELASTIC_", "MASTER_", "LOCAL_RANK", "WORLD_SIZE", "RANK"))}
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        GLOO_SOCKET_IFNAME="lo",  # the namespace's loopback: no other interface exists there anyway
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p),
    )
    return env


def _approx_params(model: str) -> float:
    c = MODELS[model]["config"]
    return c["n_layer"] * 12 * c["n_embd"] ** 2 + (c["vocab_size"] + c["n_positions"]) * c["n_embd"]


def _timeout(args: argparse.Namespace, rate_bits: float | None, total_steps: int) -> float:
    if args.config_timeout:
        return float(args.config_timeout)
    # generous: 16 fp32 copies of the model per rank per step on the link, plus 60 s of compute per step
    comm = 16 * 4 * _approx_params(args.model) * args.world_size * 8 / rate_bits if rate_bits else 0.0
    return 300.0 + total_steps * (60.0 + comm)


def _run_logged(jobs: list[tuple[list[str], dict, Path]], timeout: float, what: str) -> None:
    """Run every ``(argv, env, log)`` at once (one per node) until all exit 0; on a failure, a timeout or an
    exception (Ctrl-C) kill the rest and raise, naming the job and its log's tail."""
    procs: list[subprocess.Popen] = []
    deadline = time.monotonic() + timeout
    try:
        for argv, env, log in jobs:
            with open(log, "w") as out:
                procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(PACKAGE_ROOT)))
        while True:
            codes = [proc.poll() for proc in procs]
            failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is not None:
                where = f" node {failed}" if len(jobs) > 1 else ""
                raise E2EError(f"{what}:{where} exit {codes[failed]}; log tail:\n{_tail(jobs[failed][2])}")
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                raise E2EError(f"{what}: no result within {timeout:.0f} s (killed); log tail:\n{_tail(jobs[0][2])}")
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def _jobs(args, ns: ShapedNamespace | NodeCluster, spec_path: Path, label: str, tmp: Path, env: dict) -> list[tuple[list[str], dict, Path]]:
    """The torchrun command(s) of one configuration: one job in the namespace, or one per node of the cluster."""
    worker = ["-m", "qaccel.bench._e2e_worker", str(spec_path)]
    if isinstance(ns, ShapedNamespace):
        argv = ns.command([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world_size),
                           "--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", "29500", *worker])  # fmt: skip
        return [(argv, env, tmp / f"{label}.log")]
    jobs = []
    for node in range(ns.nodes):  # static rendezvous: node 0's agent hosts the store on its veth address
        argv = ns.command(node, [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(ns.nodes), "--node_rank", str(node),
                                 "--nproc_per_node", str(args.nproc_per_node), "--master_addr", ns.address(0),
                                 "--master_port", "29500", *worker])  # fmt: skip
        # gloo binds the node's veth address: peers on other nodes reach it over the link, its own node's
        # ranks over lo (a local address is delivered through the loopback)
        jobs.append((argv, {**env, "GLOO_SOCKET_IFNAME": ns.interface(node)}, tmp / f"{label}.node{node}.log"))
    return jobs


def _run_config(args, ns: ShapedNamespace | NodeCluster, method: str, prefetch: bool | None, rate_bits: float | None, tmp: Path, env: dict) -> dict:
    spec_m = METHODS[method]
    probe, total = None, args.warmup + args.steps
    if spec_m.schedule_weighted:
        probe, total = onebit_probe(method, args.steps)
    label = f"{config_label(method, prefetch)}@{format_rate(rate_bits)}"
    out = tmp / f"{label}.json"
    spec = {"mode": "ranks", "method": method, "prefetch": prefetch, "model": args.model, "lr": args.lr, "threads": args.threads,
            "total_steps": total, "warmup": args.warmup, "compute_steps": args.warmup + args.steps, "probe": probe, "counter_path": TX_BYTES,
            "pg_timeout_s": _timeout(args, rate_bits, 1), "out": str(out)}  # fmt: skip
    if isinstance(ns, NodeCluster):
        spec.update(nodes=ns.nodes, nproc_per_node=args.nproc_per_node, node_counters=[ns.counters(k) for k in range(ns.nodes)])
    spec_path = tmp / f"{label}.spec.json"
    spec_path.write_text(json.dumps(spec))
    before = ns.qdisc_stats()
    load = os.getloadavg()
    started = time.perf_counter()
    _run_logged(_jobs(args, ns, spec_path, label, tmp, env), _timeout(args, rate_bits, total + spec["compute_steps"]), label)
    after = ns.qdisc_stats()
    raw = json.loads(out.read_text())
    raw["wall_s"] = time.perf_counter() - started
    raw["qdisc"] = {k: (after[k] - before.get(k, 0)) for k in ("drops", "overlimits", "requeues") if isinstance(after.get(k), int)}
    if isinstance(ns, NodeCluster):  # other jobs share the CPUs: the 1/5/15-minute load when the configuration started
        raw["load_average"] = list(load)
    out.write_text(json.dumps(raw))  # with the wall time and qdisc counters, for --from_raw
    return raw


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


def _command_line(args: argparse.Namespace) -> str:
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


def _row(raw: dict, method: str, prefetch: bool | None, rate: float | None) -> dict:
    # the slowest rank sets the pace of a synchronous step
    row = report_mod.summarize(raw, method, prefetch, rate, max(raw["compute_median_s_per_rank"]))
    row.update(wall_s=raw.get("wall_s"), qdisc=raw.get("qdisc", {}))
    if "load_average" in raw:
        row["load_average"] = raw["load_average"]
    return row


def _error_row(method: str, prefetch: bool | None, rate: float | None, error: str) -> dict:
    return {"label": config_label(method, prefetch), "method": method, "prefetch": prefetch,
            "bandwidth": format_rate(rate), "rate_bits_per_s": rate, "error": error}  # fmt: skip


def _measure_all(args: argparse.Namespace, rates: list[float | None], configs: list, tmp: Path) -> tuple[list[dict], dict, dict]:
    env = _child_env(args.threads)
    results: list[dict] = []
    shaping: dict[str, dict | None] = {}
    with NodeCluster(args.nodes) if args.nodes > 1 else ShapedNamespace() as ns:
        cluster = isinstance(ns, NodeCluster)
        for rate in rates:
            params = ns.shape(rate)
            shaping[format_rate(rate)] = params
            for method, prefetch in configs:
                label = f"{config_label(method, prefetch)} @ {format_rate(rate)}"
                _progress(f"{label} ...")
                try:
                    raw = _run_config(args, ns, method, prefetch, rate, tmp, env)
                except E2EError as exc:
                    _progress(f"{label} failed: {exc}")
                    results.append(_error_row(method, prefetch, rate, str(exc)))
                    continue
                row = _row(raw, method, prefetch, rate)
                results.append(row)
                if cluster:
                    _progress(cluster_report.progress_line(label, row, raw["wall_s"]))
                else:
                    _progress(f"{label}: {row['step_s']:.3f} s/step, link {row['link_bytes_per_rank_step'] / 1e6:.2f} MB/rank, "
                              f"meter {row['meter_bytes_per_rank_step'] / 1e6:.2f} MB/rank ({raw['wall_s']:.0f} s)")  # fmt: skip
    where = {"names": ns.names, **_cluster_info(ns)} if cluster else {"name": ns.name}
    return results, shaping, {**where, "removed": not ns.exists()}


def _cluster_info(cluster: NodeCluster) -> dict:
    """What the report says about the simulated cluster (addresses, which counter measures what); needs no live cluster."""
    return {
        "topology": cluster.topology,
        "nodes": [{"interface": cluster.interface(k), "address": cluster.address(k)} for k in range(cluster.nodes)],
        "counters": {"intra_node": "lo tx_bytes of every node, summed", "inter_node": "veth tx_bytes of every node, summed",
                     "link_time": "the busiest direction: max over nodes of the veth's tx_bytes and rx_bytes"},  # fmt: skip
        "shaping": "tc tbf on the egress of every veth end: each node's link carries the rate each way (full duplex); "
                   "every node's loopback is unshaped",  # fmt: skip
    }


def _load_raw(folder: Path, rates: list[float | None], configs: list, nodes: int = 1) -> tuple[list[dict], dict, dict]:
    """Rows from the per-configuration files a run left in ``folder``; a configuration without a result is an error row."""
    if not folder.is_dir():
        raise E2EError(f"--from_raw {folder}: not a folder")
    results: list[dict] = []
    shaping: dict[str, dict | None] = {}
    for rate in rates:
        shaping[format_rate(rate)] = tbf_parameters(rate) if rate else None
        for method, prefetch in configs:
            label = f"{config_label(method, prefetch)}@{format_rate(rate)}"
            path = folder / f"{label}.json"
            if not path.exists():
                log = folder / f"{label}.log" if nodes == 1 else folder / f"{label}.node0.log"
                why = "did not finish: " + _tail(log, 600) if log.exists() else "not run (no result in the folder)"
                results.append(_error_row(method, prefetch, rate, why))
                continue
            results.append(_row(json.loads(path.read_text()), method, prefetch, rate))
    if nodes > 1:
        return results, shaping, {"names": None, **_cluster_info(NodeCluster(nodes)), "removed": True, "rebuilt_from": str(folder)}
    return results, shaping, {"name": None, "removed": True, "rebuilt_from": str(folder)}


def _resolve_topology(args: argparse.Namespace) -> None:
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


def run(args: argparse.Namespace) -> dict:
    """Run every configuration at every bandwidth; return the report (also drawn/written when asked)."""
    args.bandwidth = args.bandwidth or ["300mbit"]
    _resolve_topology(args)
    rates = [parse_rate(b) for b in args.bandwidth]
    configs = plan_configs(args.methods, args.prefetch, args.nodes)
    if getattr(args, "from_raw", None):
        results, shaping, namespace = _load_raw(Path(args.from_raw), rates, configs, args.nodes)
    else:
        try:
            check_prerequisites()
        except NamespaceError as exc:
            raise E2EError(str(exc)) from None
        with tempfile.TemporaryDirectory(prefix="qaccel-e2e-") as tmpdir:
            tmp = Path(getattr(args, "raw_dir", None) or tmpdir)
            tmp.mkdir(parents=True, exist_ok=True)
            results, shaping, namespace = _measure_all(args, rates, configs, tmp)
    report_mod.add_speedups(results)
    num_params = next((r["num_params"] for r in results if "num_params" in r), None)
    report = {
        "benchmark": "e2e",
        "command": _command_line(args),
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


def _progress(message: str) -> None:
    print(f"qaccel bench e2e: {message}", file=sys.stderr, flush=True)

