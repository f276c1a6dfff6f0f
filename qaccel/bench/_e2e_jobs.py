"""Running ``qaccel bench e2e``: every configuration as its own ``torchrun`` job (one per node on a simulated cluster)
inside the shaped network namespace, with its time limit, its log and its raw result."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import _e2e_cluster_report as cluster_report
from ._e2e_methods import METHODS, MODELS, config_label, format_rate, onebit_probe
from ._e2e_netns import TX_BYTES, NodeCluster, ShapedNamespace
from ._e2e_plan import E2EError
from ._e2e_raw import cluster_info, error_row, log_tail, result_row

__all__ = ["PACKAGE_ROOT", "measure_all"]

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


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
                raise E2EError(f"{what}:{where} exit {codes[failed]}; log tail:\n{log_tail(jobs[failed][2])}")
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                raise E2EError(f"{what}: no result within {timeout:.0f} s (killed); log tail:\n{log_tail(jobs[0][2])}")
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


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


def measure_all(args: argparse.Namespace, rates: list[float | None], configs: list, tmp: Path) -> tuple[list[dict], dict, dict]:
    """Run every configuration at every rate in one namespace (or cluster) shaped in turn; a failed one becomes an
    error row. Returns the rows, the shaping per rate and what the report says about the namespace."""
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
                    results.append(error_row(method, prefetch, rate, str(exc)))
                    continue
                row = result_row(raw, method, prefetch, rate)
                results.append(row)
                if cluster:
                    _progress(cluster_report.progress_line(label, row, raw["wall_s"]))
                else:
                    _progress(f"{label}: {row['step_s']:.3f} s/step, link {row['link_bytes_per_rank_step'] / 1e6:.2f} MB/rank, "
                              f"meter {row['meter_bytes_per_rank_step'] / 1e6:.2f} MB/rank ({raw['wall_s']:.0f} s)")  # fmt: skip
    where = {"names": ns.names, **cluster_info(ns)} if cluster else {"name": ns.name}
    return results, shaping, {**where, "removed": not ns.exists()}


def _progress(message: str) -> None:
    print(f"qaccel bench e2e: {message}", file=sys.stderr, flush=True)
