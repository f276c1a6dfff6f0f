"""Running ``qaccel bench e2e``: every configuration as its own ``torchrun`` job (one per node on a simulated cluster)
inside the shaped network namespace, with its time limit, its log and its raw result.

Each job is the users' training entry, ``qaccel.train``, under :mod:`qaccel.bench._e2e_probe` (the link counters
at its step boundaries), with the flags of :func:`qaccel.bench._e2e_entry.entry_flags`; a method that shards
within a node and replicates across nodes gets the mesh the way ``accelerate launch`` hands it to a script
(``parallelism_config`` as ``PARALLELISM_CONFIG_*`` variables, ``dp_replicate_size`` = the node count). The
compute-only times come from one-process runs of the same entry (:func:`qaccel.bench._e2e_entry.compute_jobs`),
once per precision, after the jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import _e2e_cluster_report as cluster_report
from . import _e2e_entry as entry
from ._convergence_run import mesh_env
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


def _jobs(args, ns: ShapedNamespace | NodeCluster, worker: list[str], label: str, tmp: Path, env: dict) -> list[tuple[list[str], dict, Path]]:
    """The torchrun command(s) of one configuration (``worker``: what torchrun runs on every rank): one job in the
    namespace, or one per node of the cluster."""
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


def _run_entry(args, ns: ShapedNamespace | NodeCluster, method: str, prefetch: bool | None, rate_bits: float | None, tmp: Path, env: dict) -> dict:
    """One configuration: the entry's run in the namespace (or one per node), read back (``_e2e_entry.read_run``);
    its compute-only figures are added later (``_with_compute``)."""
    probe, total = None, args.warmup + args.steps
    if METHODS[method].schedule_weighted:
        probe, total = onebit_probe(method, args.steps)
    label = f"{config_label(method, prefetch)}@{format_rate(rate_bits)}"
    out = tmp / label
    shutil.rmtree(out, ignore_errors=True)  # a kept --raw_dir: the entry appends to an old metrics.jsonl
    cluster = isinstance(ns, NodeCluster)
    counters = [ns.counters(k) for k in range(ns.nodes)] if cluster else [{"lo": TX_BYTES}]
    probe_path = tmp / f"{label}.probe.json"
    probe_path.write_text(json.dumps({"nproc_per_node": args.nproc_per_node, "node_counters": counters, "output_dir": str(out)}))
    flags, fsdp = entry.entry_flags(method, prefetch, args.model, probe)
    recipe = entry.write_recipe(args.model, tmp, steps=total, lr=args.lr)
    train = entry.train_argv(recipe, flags, out, steps=total, timeout_s=_timeout(args, rate_bits, 1))
    run_env = entry.child_env(env, fsdp=fsdp)
    if METHODS[method].needs_nodes:
        run_env.update(mesh_env(ns.nodes, args.world_size))
    before, load = ns.qdisc_stats(), os.getloadavg()
    started = time.perf_counter()
    _run_logged(_jobs(args, ns, ["-m", "qaccel.bench._e2e_probe", str(probe_path), "--", *train], label, tmp, run_env), _timeout(args, rate_bits, total), label)
    after = ns.qdisc_stats()
    raw = entry.read_run(out, method, args.world_size, args.warmup, probe, args.nproc_per_node if cluster else 0)
    raw["info"].update(train_flags=flags, fsdp_launch=fsdp)
    raw.update(torch_threads=args.threads, wall_s=time.perf_counter() - started)
    raw["qdisc"] = {k: (after[k] - before.get(k, 0)) for k in ("drops", "overlimits", "requeues") if isinstance(after.get(k), int)}
    if cluster:  # other jobs share the CPUs: the 1/5/15-minute load when the configuration started
        raw["load_average"] = list(load)
    return raw


def _run_compute(args, configs: list, tmp: Path, env: dict) -> dict[str, dict]:
    """The compute-only figures of every precision ``configs`` use: ``world_size`` one-process runs each, at once."""
    recipe = entry.write_recipe(args.model, tmp, steps=args.warmup + args.steps, lr=args.lr)
    out = {}
    for precision in dict.fromkeys(METHODS[method].compute for method, _ in configs):
        jobs = entry.compute_jobs(recipe, precision, args.world_size, args.warmup + args.steps, tmp)
        for _, output_dir, _ in jobs:
            shutil.rmtree(output_dir, ignore_errors=True)
        _progress(f"compute-only {precision} ({args.world_size} one-process runs) ...")
        _run_logged([(argv, entry.child_env(env, fsdp=False), log) for argv, _, log in jobs], _timeout(args, None, args.warmup + args.steps), f"compute-only {precision}")
        out[precision] = entry.read_compute(jobs, args.warmup)
    return out


def measure_all(args: argparse.Namespace, rates: list[float | None], configs: list, tmp: Path) -> tuple[list[dict], dict, dict]:
    """Run every configuration at every rate in one namespace (or cluster) shaped in turn, a failed one an error row;
    then the compute-only runs (after the jobs: an interrupted bench stops in a job). Returns the rows, the shaping
    per rate and what the report says about the namespace."""
    env = _child_env(args.threads)
    results: list = []
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
                    raw = _run_entry(args, ns, method, prefetch, rate, tmp, env)
                except E2EError as exc:
                    _progress(f"{label} failed: {exc}")
                    results.append(error_row(method, prefetch, rate, str(exc)))
                    continue
                results.append((raw, method, prefetch, rate))
                _progress(f"{label}: {len(raw['steps'])} steps ({raw['wall_s']:.0f} s)")
    where = {"names": ns.names, **cluster_info(ns)} if cluster else {"name": ns.name}
    return _with_compute(args, results, configs, tmp, env), shaping, {**where, "removed": not ns.exists()}


def _with_compute(args: argparse.Namespace, results: list, configs: list, tmp: Path, env: dict) -> list[dict]:
    """The rows: every finished job's raw result with its precision's compute-only figures (kept for --from_raw)."""
    compute = _run_compute(args, configs, tmp, env)
    rows = []
    for item in results:
        if isinstance(item, dict):  # an error row
            rows.append(item)
            continue
        raw, method, prefetch, rate = item
        raw.update(compute[METHODS[method].compute])
        label = f"{config_label(method, prefetch)} @ {format_rate(rate)}"
        (tmp / f"{config_label(method, prefetch)}@{format_rate(rate)}.json").write_text(json.dumps(raw))
        rows.append(result_row(raw, method, prefetch, rate))
        if args.nodes > 1:
            _progress(cluster_report.progress_line(label, rows[-1], raw["wall_s"]))
        else:
            _progress(f"{label}: {rows[-1]['step_s']:.3f} s/step, link {rows[-1]['link_bytes_per_rank_step'] / 1e6:.2f} MB/rank, "
                      f"meter {rows[-1]['meter_bytes_per_rank_step'] / 1e6:.2f} MB/rank ({raw['wall_s']:.0f} s)")  # fmt: skip
    return rows


def _progress(message: str) -> None:
    print(f"qaccel bench e2e: {message}", file=sys.stderr, flush=True)
