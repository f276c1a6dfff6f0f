"""The results of ``qaccel bench e2e`` as rows: a configuration's raw result (rank 0's file) summarized, a failed one
as an error row, and the whole run rebuilt from the files a run left in its raw folder (``--from_raw``)."""

from __future__ import annotations

import json
from pathlib import Path

from . import _e2e_report as report_mod
from ._e2e_methods import config_label, format_rate
from ._e2e_netns import NodeCluster, tbf_parameters
from ._e2e_plan import E2EError

__all__ = ["result_row", "error_row", "load_raw", "cluster_info", "log_tail"]


def result_row(raw: dict, method: str, prefetch: bool | None, rate: float | None) -> dict:
    """One configuration's row from its raw result, with the run's wall time, qdisc counters and load average."""
    # the slowest rank sets the pace of a synchronous step
    row = report_mod.summarize(raw, method, prefetch, rate, max(raw["compute_median_s_per_rank"]))
    row.update(wall_s=raw.get("wall_s"), qdisc=raw.get("qdisc", {}))
    if "load_average" in raw:
        row["load_average"] = raw["load_average"]
    return row


def error_row(method: str, prefetch: bool | None, rate: float | None, error: str) -> dict:
    """The row of a configuration that has no result: its label, where it ran, and why it failed."""
    return {"label": config_label(method, prefetch), "method": method, "prefetch": prefetch,
            "bandwidth": format_rate(rate), "rate_bits_per_s": rate, "error": error}  # fmt: skip


def cluster_info(cluster: NodeCluster) -> dict:
    """What the report says about the simulated cluster (addresses, which counter measures what); needs no live cluster."""
    return {
        "topology": cluster.topology,
        "nodes": [{"interface": cluster.interface(k), "address": cluster.address(k)} for k in range(cluster.nodes)],
        "counters": {"intra_node": "lo tx_bytes of every node, summed", "inter_node": "veth tx_bytes of every node, summed",
                     "link_time": "the busiest direction: max over nodes of the veth's tx_bytes and rx_bytes"},  # fmt: skip
        "shaping": "tc tbf on the egress of every veth end: each node's link carries the rate each way (full duplex); "
                   "every node's loopback is unshaped",  # fmt: skip
    }


def load_raw(folder: Path, rates: list[float | None], configs: list, nodes: int = 1) -> tuple[list[dict], dict, dict]:
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
                why = "did not finish: " + log_tail(log, 600) if log.exists() else "not run (no result in the folder)"
                results.append(error_row(method, prefetch, rate, why))
                continue
            results.append(result_row(json.loads(path.read_text()), method, prefetch, rate))
    if nodes > 1:
        return results, shaping, {"names": None, **cluster_info(NodeCluster(nodes)), "removed": True, "rebuilt_from": str(folder)}
    return results, shaping, {"name": None, "removed": True, "rebuilt_from": str(folder)}


def log_tail(path: Path, n: int = 3000) -> str:
    """The last ``n`` characters of a job's log, for an error message."""
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"
