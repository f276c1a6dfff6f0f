"""``qaccel bench e2e --nodes N``: the simulated cluster, its clean-up, its flags, and a two-node smoke run.

Where the traffic goes is checked against the kernel's own interface counters, with independent senders
(plain TCP sockets, stock HSDP's all-reduce as torch.distributed issues it): bytes between nodes cross the
veth links, bytes between two ranks of one node (even through the node's veth address) cross its loopback.
Everything that needs root and network namespaces is skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qaccel import cli
from qaccel.bench import e2e
from qaccel.bench._e2e_methods import NODES_DEFAULT_METHODS, default_methods
from qaccel.bench._e2e_netns import NamespaceError, NodeCluster, counter_path
from tests._launch import REPO, env, gone, interrupt_once_ranks_run, namespaces, needs_netns, rebuild_from_raw


# -- flags (no root needed) ----------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "says"), [(["--nodes", "0"], "--nodes: 0 must be >= 1"), (["--nodes", "9"], "--nodes: 9 must be <= 8"),
                                             (["--nproc_per_node", "0"], "--nproc_per_node: 0 must be >= 1"),
                                             (["--nodes", "two"], "'two' is not an integer")])  # fmt: skip
def test_bad_node_counts_are_usage_errors(flags, says, capsys):
    assert cli.main(["bench", "e2e", *flags]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--methods", "fsdp2-fp32,hsdp-fp32,hqsdp-w8g8-r4"],
            "--methods hsdp-fp32,hqsdp-w8g8-r4: shards within a node",
        ),
        (["--nodes", "2", "--world_size", "6"], "--world_size 6 != --nodes 2 x --nproc_per_node 2"),
        (["--nproc_per_node", "3", "--world_size", "2"], "--nproc_per_node 3 and --world_size 2 disagree"),
        (["--nproc_per_node", "1"], "one node needs at least 2 ranks"),
    ],
)
def test_contradicting_flags_are_refused_before_anything_runs(flags, says, capsys):
    before = namespaces() if shutil.which("ip") else []
    assert cli.main(["bench", "e2e", "--model", "tiny", *flags]) == 1
    assert says in capsys.readouterr().err
    if shutil.which("ip"):
        assert namespaces() == before


def test_several_nodes_default_to_the_issue_methods_with_prefetch_on():
    assert default_methods(1) == default_methods(1, everything=True) and "hsdp-fp32" not in default_methods(1)
    assert default_methods(2) == list(NODES_DEFAULT_METHODS)
    assert {"hsdp-fp32", "hqsdp-off-r4", "zero-one-adam"} <= set(default_methods(2, everything=True))
    assert e2e.plan_configs(["fsdp2-fp32", "hqsdp-w8g8-r4", "ddp-adamw"], "default", nodes=2) == [
        ("fsdp2-fp32", True), ("hqsdp-w8g8-r4", True), ("ddp-adamw", None)]  # fmt: skip
    assert e2e.plan_configs(["hsdp-fp32"], "both", nodes=2) == [("hsdp-fp32", False), ("hsdp-fp32", True)]


# -- the cluster itself (root, network namespaces) ----------------------------------------------------------
_SERVER = textwrap.dedent("""
    import socket, sys
    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("ready", flush=True)
    for _ in range(int(sys.argv[3])):
        conn, _ = server.accept()
        received = 0
        while chunk := conn.recv(1 << 16):
            received += len(chunk)
        conn.close()
        print(received, flush=True)
""")
_CLIENT = (
    "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2]))).sendall(bytes(int(sys.argv[3])))"
)


def _read(cluster: NodeCluster, node: int, path: str) -> int:
    return int(subprocess.run(cluster.command(node, ["cat", path]), capture_output=True, text=True, check=True).stdout)


@needs_netns
@pytest.mark.parametrize("nodes", [2, 3])
def test_cluster_sends_inter_node_bytes_over_the_shaped_veths_and_intra_node_bytes_over_lo(nodes):
    payload, rate = 2_000_000, 20e6
    with NodeCluster(nodes, prefix=f"qaccel-test-{nodes}n") as cluster:
        params = cluster.shape(rate)
        last = nodes - 1
        server = subprocess.Popen(cluster.command(0, [sys.executable, "-c", _SERVER, cluster.address(0), "29400", "2"]),
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert server.stdout.readline().strip() == "ready"

            def send(node: int) -> tuple[dict, float]:
                paths = {"lo": counter_path("lo"), "veth": counter_path(cluster.interface(node))}
                before = {k: _read(cluster, node, p) for k, p in paths.items()}
                start = time.perf_counter()
                client = [sys.executable, "-c", _CLIENT, cluster.address(0), "29400", str(payload)]
                subprocess.run(cluster.command(node, client), check=True, timeout=60)
                assert int(server.stdout.readline()) == payload  # all of it arrived: the counters are complete
                seconds = time.perf_counter() - start
                return {k: _read(cluster, node, p) - before[k] for k, p in paths.items()}, seconds

            # to its own node's veth address: delivered through the loopback, the link sees nothing of it
            intra, _ = send(0)
            assert intra["lo"] >= payload and intra["veth"] < 10_000
            # from another node (through the bridge when nodes > 2): the payload leaves on the veth, at the shaped rate
            inter, seconds = send(last)
            assert payload <= inter["veth"] < 1.1 * payload and inter["lo"] < 10_000
            assert seconds >= (payload - params["burst_bytes"]) * 8 / rate
            server.wait(timeout=30)
        finally:
            server.kill()
        assert cluster.qdisc_stats()["drops"] == 0
    assert not set(cluster.names) & set(namespaces())


@needs_netns
def test_cluster_kills_its_processes_and_removes_its_namespaces_when_the_body_fails():
    prefix = "qaccel-test-fail"
    sleepers = []
    with pytest.raises(RuntimeError, match="boom"), NodeCluster(2, prefix=prefix) as cluster:
        sleepers = [subprocess.Popen(cluster.command(k, ["sleep", "300"])) for k in range(2)]
        deadline = time.monotonic() + 10
        while len(cluster.pids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        inside = cluster.pids()
        assert len(inside) == 2
        raise RuntimeError("boom")
    assert not any(name.startswith(prefix) for name in namespaces())
    for sleeper in sleepers:
        assert sleeper.wait(timeout=10) == -signal.SIGTERM
    for pid in inside:
        assert gone(pid)


@needs_netns
def test_cluster_refuses_a_namespace_it_did_not_make_and_removes_the_ones_it_did():
    prefix = "qaccel-test-taken"
    subprocess.run(["ip", "netns", "add", f"{prefix}-node1"], check=True)
    try:
        with pytest.raises(NamespaceError, match=f"{prefix}-node1.*already exists"), NodeCluster(2, prefix=prefix):
            pass
        assert f"{prefix}-node0" not in namespaces() and f"{prefix}-node1" in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", f"{prefix}-node1"], check=True)


# -- the benchmark on two nodes ----------------------------------------------------------------------
@needs_netns
@pytest.mark.slow  # four qaccel.train runs of 4 ranks and 4 compute-only runs on a shared CPU: about 8 minutes
def test_smoke_two_nodes_of_two_ranks(tmp_path):
    out, md = tmp_path / "e2e_2node.json", tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nkept text\n")
    rate = 100e6
    cmd = [sys.executable, "-m", "qaccel.cli", "bench", "e2e", "--nodes", "2", "--nproc_per_node", "2", "--model", "tiny",
           "--methods", "fsdp2-fp32,hsdp-fp32,hqsdp-w8g8-r4,hsdp-zero-one-adam", "--steps", "2", "--bandwidth", "100mbit",
           "--json", str(out), "--markdown", str(md), "--raw_dir", str(tmp_path / "raw")]  # fmt: skip
    proc = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(out.read_text())
    assert report["errors"] == [] and report["settings"]["nodes"] == 2 and report["settings"]["world_size"] == 4
    assert report["namespace"]["removed"] is True and not set(report["namespace"]["names"]) & set(namespaces())
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"fsdp2-fp32", "hsdp-fp32", "hqsdp-w8g8-r4", "hsdp-zero-one-adam"}
    burst = report["shaping"]["100mbit"]["burst_bytes"]
    for row in rows.values():
        # the contract other tools read
        assert {"step_s", "t_compute_s", "ideal_full_overlap_s", "inter_node_bytes_per_step", "intra_node_bytes_per_step",
                "meter_bytes_by_level_per_rank_step", "speedup", "load_average"} <= set(row)  # fmt: skip
        assert set(row["meter_bytes_by_level_per_rank_step"]) == {"intra_node", "inter_node"}
        assert row["prefetch"] is True and row["measured_steps"] == 2  # 1-bit rows: steady steps of the rarest kind
        # one veth pair: what one end sent, the other received (each namespace reads its own counters, at slightly
        # different moments, so a step's acknowledgements may fall on either side of a read: compare whole runs)
        sent = [sum(step["node_bytes"][k]["inter_tx"] for step in row["steps"]) for k in range(2)]
        received = [sum(step["node_bytes"][k]["inter_rx"] for step in row["steps"]) for k in range(2)]
        assert sent == [pytest.approx(received[1], rel=0.05), pytest.approx(received[0], rel=0.05)]
        for step in row["steps"]:
            if step["steady"]:  # shaped: no direction moved its bytes faster than the rate (one token bucket of slack)
                assert step["seconds"] >= (step["inter_node_busiest_direction_bytes"] - burst) * 8 / rate
    # Stock HSDP: only the replica all-reduce crosses nodes. The veths carry what the ring formula says that
    # all-reduce sends (the entry's metered pass-through comms), plus headers and the loop's loss all-reduce...
    hsdp = rows["hsdp-fp32"]
    replica = hsdp["meter_bytes_by_level_per_rank_step"]["inter_node"] * 4
    assert replica > 0 and replica <= hsdp["inter_node_bytes_per_step"] < 1.3 * replica
    # ...and the intra-node all-gathers and reduce-scatters stay on the loopbacks (gloo's reduce-scatter moves
    # up to twice the ring formula's bytes, an all-reduce's)
    intra = hsdp["meter_bytes_by_level_per_rank_step"]["intra_node"] * 4
    assert intra <= hsdp["intra_node_bytes_per_step"] < 2.2 * intra
    # Stock FSDP2 over all four ranks: the ring crosses between the nodes on two of its four hops.
    flat = rows["fsdp2-fp32"]
    assert (
        0.35
        < flat["inter_node_bytes_per_step"] / (flat["inter_node_bytes_per_step"] + flat["intra_node_bytes_per_step"])
        < 0.65
    )
    # Hierarchical QSDP: weights stay inside the nodes, 4-bit gradient shards cross them.
    hq = rows["hqsdp-w8g8-r4"]
    meter = hq["meter_bytes_by_level_per_rank_step"]
    assert (
        meter["intra_node"] > 0
        and 0 < meter["inter_node"] * 4 <= hq["inter_node_bytes_per_step"] < 1.5 * meter["inter_node"] * 4
    )
    assert hq["inter_node_bytes_per_step"] < 0.5 * hsdp["inter_node_bytes_per_step"]
    assert hq["speedup"]["hsdp-fp32"] == pytest.approx(hsdp["step_s"] / hq["step_s"])
    # 0/1 Adam on HSDP shards: inside a node as stock HSDP; between the nodes, by step kind, what its schedule says.
    zero_one = rows["hsdp-zero-one-adam"]
    stock_step = statistics.median(step["inter_node_bytes"] for step in hsdp["steps"])
    replica_per_rank = hsdp["meter_bytes_by_level_per_rank_step"]["inter_node"]  # the replica all-reduce, ring formula
    by_kind: dict[str, list[dict]] = {}
    for step in zero_one["steps"]:
        by_kind.setdefault(step["kind"], []).append(step)
    assert set(by_kind) == {"init", "full", "onebit_gradient", "sync", "local"}
    for step in by_kind["full"]:  # the exact replica all-reduce: stock HSDP's bytes, on the meter and on the veths
        assert step["meter_by_kind"]["hsdp.replica_all_reduce"] == replica_per_rank
        assert step["inter_node_bytes"] == pytest.approx(stock_step, rel=0.02)
    for step in by_kind["onebit_gradient"] + by_kind["sync"]:  # 1 bit per element plus scales: ~1/32 of fp32's
        onebit = step["meter_by_kind"]["hsdp.onebit.all_to_all"] + step["meter_by_kind"]["hsdp.onebit.all_gather"]
        assert replica_per_rank / 32 <= onebit < 1.1 * replica_per_rank / 32
        assert 4 * onebit <= step["inter_node_bytes"] < 2 * 4 * onebit
    for step in by_kind["local"] + by_kind["init"]:  # nothing between the nodes but the loop's loss all-reduce
        assert not any(kind.startswith("hsdp.") for kind in step["meter_by_kind"]) and step["inter_node_bytes"] < 10_000
    assert zero_one["inter_node_bytes_per_step"] < hsdp["inter_node_bytes_per_step"] / 20
    goals = {g["goal"]: g for g in report["goals"]}
    weighted = ", weighted by the paper's schedule"
    assert {"hqsdp-w8g8-r4+prefetch / fsdp2-fp32+prefetch inter-node bytes (veth)", "hsdp-fp32+prefetch / hqsdp-w8g8-r4+prefetch step time",
            "hqsdp-w8g8-r4+prefetch at the full-overlap ideal",
            f"hsdp-zero-one-adam+prefetch / hsdp-fp32+prefetch inter-node bytes (veth){weighted}",
            f"hsdp-fp32+prefetch / hsdp-zero-one-adam+prefetch step time{weighted}"} <= set(goals)  # fmt: skip
    for goal in goals.values():
        assert goal["met"] == (goal["reason"] is None) and "ideal" in goal
    assert Path(report["png"]).stat().st_size > 0
    text = md.read_text()
    assert (
        text.startswith("# Benchmarks\n\nkept text\n")
        and "## Two nodes (simulated)" in text
        and "| hqsdp-w8g8-r4+prefetch |" in text
        and "| hsdp-zero-one-adam+prefetch | 100mbit | local |" in text
    )
    # --from_raw rebuilds the same rows from the per-configuration results, without root or namespaces
    rebuilt = {r["method"]: r for r in rebuild_from_raw(cmd, tmp_path).values()}
    for method, row in rows.items():
        assert rebuilt[method]["inter_node_bytes_per_step"] == row["inter_node_bytes_per_step"]
        assert rebuilt[method]["meter_bytes_by_level_per_rank_step"] == row["meter_bytes_by_level_per_rank_step"]


@needs_netns
def test_sigterm_removes_both_nodes_and_their_processes(tmp_path):
    cmd = [sys.executable, "-m", "qaccel.cli", "bench", "e2e", "--nodes", "2", "--model", "tiny", "--methods", "fsdp2-fp32",
           "--steps", "100000", "--bandwidth", "1mbit", "--json", str(tmp_path / "x.json")]  # fmt: skip
    names = [f"qaccel-e2e-{{pid}}-node{k}" for k in range(2)]
    code, err, inside = interrupt_once_ranks_run(cmd, names, signal.SIGTERM)
    assert code == 130, err[-3000:]
    assert "interrupted (signal SIGTERM)" in err
    assert len(inside) >= 6 and all(gone(pid) for pid in inside)  # torchrun and two ranks on each node
