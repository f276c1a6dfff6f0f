"""Figures of ``qaccel bench e2e`` that compare its rows: compute-only times, speedups over the baselines, the goals.

Pure functions of the rows ``_e2e_report.summarize`` made; nothing here runs a process.
"""

from __future__ import annotations

import statistics

from ._e2e_methods import METHODS, config_label

__all__ = [
    "BASELINES",
    "GOAL_BANDWIDTH",
    "ONEBIT_GOAL_BANDWIDTH",
    "QSDP_OVERLAP_GOAL",
    "compute_summary",
    "find_row",
    "add_speedups",
    "evaluate_goals",
    "goal_row",
]

# fsdp2-fp32-a2a is the fair fp32 baseline: stock FSDP2's reduce-scatter on gloo is an all-reduce (2x the bytes)
BASELINES = ("fsdp2-fp32", "fsdp2-fp32-a2a", "fsdp2-bf16", "ddp-adamw", "onebit-adam", "hsdp-fp32")


def compute_summary(rows: list[dict]) -> dict:
    """Per precision: the median over configurations of the compute-only step time each job measured."""
    out = {}
    for precision in dict.fromkeys(r["compute"] for r in rows if "t_compute_s" in r):
        values = [r["t_compute_s"] for r in rows if r.get("compute") == precision and "t_compute_s" in r]
        out[precision] = {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values), "jobs": len(values)}
    return out


def find_row(rows: list[dict], bandwidth: str, method: str, prefetch: bool | None) -> dict | None:
    """The finished row of ``method`` at ``bandwidth`` with ``prefetch``, else its row without prefetch (None if neither)."""
    for label in dict.fromkeys((config_label(method, prefetch), config_label(method, False))):
        for row in rows:
            if row["bandwidth"] == bandwidth and row["label"] == label and "step_s" in row:
                return row
    return None


def add_speedups(rows: list[dict]) -> None:
    """``row["speedup"][baseline] = baseline step time / row step time`` at the same bandwidth.

    An FSDP row is compared with the baseline run at the same prefetch setting when there is one.
    """
    for row in rows:
        if "step_s" not in row:
            continue
        row["speedup"] = {}
        for base in BASELINES:
            other = find_row(rows, row["bandwidth"], base, row["prefetch"])
            if other is not None:
                row["speedup"][base] = other["step_s"] / row["step_s"]


GOAL_BANDWIDTH = "300mbit"
ONEBIT_GOAL_BANDWIDTH = "50mbit"  # where a 1-bit step's transfer is as long as its compute
_RATIO_GOALS = (  # (numerator, denominator, target, bandwidth): numerator step time / denominator >= target
    ("fsdp2-fp32", "qsdp-w8g8", 5.0, GOAL_BANDWIDTH),
    ("fsdp2-fp32", "qsdp-w4g4", 7.0, GOAL_BANDWIDTH),
    ("fsdp2-fp32-a2a", "qsdp-w8g8", 4.0, GOAL_BANDWIDTH),  # over the fair baseline, a true reduce-scatter
    ("fsdp2-fp32-a2a", "qsdp-w4g4", 7.0, GOAL_BANDWIDTH),
    ("fsdp2-bf16", "qsdp-w8g8-bf16", 2.8, GOAL_BANDWIDTH),
    ("ddp-adamw", "zero-one-adam", 4.0, GOAL_BANDWIDTH),
    ("onebit-adam", "zero-one-adam", 1.5, GOAL_BANDWIDTH),
    ("onebit-adam", "zero-one-adam", 1.5, ONEBIT_GOAL_BANDWIDTH),
)
QSDP_OVERLAP_GOAL = 0.90  # QSDP rows: at least this fraction of max(T_compute, T_comm)
# (method, step kind, target, against): the kind's median step time over "ideal" = max(T_compute, that kind's
# T_comm), or over "compute" = T_compute alone (the same model's AdamW step without communication)
_KIND_GOALS = (
    ("onebit-adam", "onebit_momentum", 1.15, "ideal"),
    ("zero-one-adam", "onebit_gradient", 1.15, "ideal"),
    ("zero-one-adam", "local", 1.05, "compute"),
)


def evaluate_goals(rows: list[dict]) -> list[dict]:
    """The issue's goals, each with its measured value, target and by how much it is met or missed."""
    goals = []
    done = [r for r in rows if "step_s" in r]
    at = [r for r in done if r["bandwidth"] == GOAL_BANDWIDTH]
    prefetches = sorted({r["prefetch"] for r in at if r["prefetch"] is not None}) or [False]
    for slow, fast, target, bandwidth in _RATIO_GOALS:
        for prefetch in prefetches if METHODS[fast].parallel == "fsdp" else [None]:
            a, b = find_row(done, bandwidth, slow, prefetch), find_row(done, bandwidth, fast, prefetch)
            if a is None or b is None or not bool(a["prefetch"]) == bool(b["prefetch"]) == bool(prefetch):
                continue
            value = a["step_s"] / b["step_s"]
            goals.append(goal_row(f"{a['label']} / {b['label']} step time", bandwidth, value, ">=", target))
    for row in at:
        if row["method"].startswith("qsdp-w") and row["fraction_of_ideal_full_overlap"] is not None:
            goals.append(goal_row(f"{row['label']} at the full-overlap ideal", GOAL_BANDWIDTH,
                               row["fraction_of_ideal_full_overlap"], ">=", QSDP_OVERLAP_GOAL))  # fmt: skip
    for method, kind, target, against in _KIND_GOALS:
        # the row as users get it, and with the smaller DDP buckets that let more of the transfer overlap
        for row in [r for r in done if r["method"] in (method, f"{method}-4mb") and r["bandwidth"] == ONEBIT_GOAL_BANDWIDTH]:
            figures = row.get("per_kind", {}).get(kind)
            if figures is None or "ideal_full_overlap_s" not in figures:
                continue
            if against == "ideal":
                name, value = f"{row['label']} {kind} step / max(T_compute, T_comm)", figures["over_ideal_full_overlap"]
            else:
                name, value = f"{row['label']} {kind} step / T_compute", figures["seconds"]["median"] / row["t_compute_s"]
            goals.append(goal_row(name, ONEBIT_GOAL_BANDWIDTH, value, "<=", target))
    for off in [r for r in done if r["method"] == "qsdp-off"]:
        stock = find_row(done, off["bandwidth"], "fsdp2-fp32", off["prefetch"])
        if stock is not None and bool(stock["prefetch"]) == bool(off["prefetch"]):
            goals.append(goal_row(f"{off['label']} overhead vs {stock['label']}", off["bandwidth"],
                               off["step_s"] / stock["step_s"] - 1, "<=", 0.03))  # fmt: skip
    return goals


def goal_row(name: str, bandwidth: str, value: float, op: str, target: float) -> dict:
    """One goal: its measured ``value`` against ``target`` under ``op`` (``>=`` or ``<=``), and by how much it is missed."""
    met = value >= target if op == ">=" else value <= target
    missed_by = None if met else (target - value if op == ">=" else value - target)
    return {"goal": name, "bandwidth": bandwidth, "value": value, "op": op, "target": target, "met": met, "missed_by": missed_by}
