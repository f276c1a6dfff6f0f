"""Figures of ``qaccel bench e2e``: one configuration's row (step time, bytes, ideals) from its raw per-step records.

Pure functions of the raw per-step records the rank processes wrote; nothing here runs a process. The
figures that compare rows (speedups, goals) are in ``_e2e_compare``, the Markdown section and the plot in
``_e2e_render``; this module re-exports them under the names it has always had.
"""

from __future__ import annotations

import statistics

from ._e2e_compare import (
    BASELINES,
    GOAL_BANDWIDTH,
    ONEBIT_GOAL_BANDWIDTH,
    QSDP_OVERLAP_GOAL,
    add_speedups,
    compute_summary,
    evaluate_goals,
    find_row,
    goal_row,
)
from ._e2e_methods import METHODS, PAPER_SCHEDULES, config_label, format_rate, paper_counts
from ._e2e_render import (
    MARK_BEGIN,
    MARK_END,
    failed_line,
    fraction_cell,
    mb_cell,
    plot,
    render_markdown,
    seconds_cell,
    speedup_cells,
    step_cell,
    write_markdown,
)

__all__ = [
    "summarize",
    "add_speedups",
    "evaluate_goals",
    "render_markdown",
    "plot",
    "paper_weights",
    "BASELINES",
    "compute_summary",
    "find_row",
    "goal_row",
    "GOAL_BANDWIDTH",
    "ONEBIT_GOAL_BANDWIDTH",
    "QSDP_OVERLAP_GOAL",
    "write_markdown",
    "MARK_BEGIN",
    "MARK_END",
    "mb_cell",
    "seconds_cell",
    "failed_line",
    "step_cell",
    "fraction_cell",
    "speedup_cells",
]


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1], "p25": q1, "p75": q3, "n": len(ordered)}


def paper_weights(method: str) -> dict[str, float]:
    """Fraction of the steps of each kind over the paper's whole schedule (``PAPER_SCHEDULES``) for ``method``'s
    1-bit optimizer: the DDP and the HSDP rows of one optimizer are weighted alike."""
    counts = paper_counts(METHODS[method].optimizer)
    return {kind: n / PAPER_SCHEDULES["total_steps"] for kind, n in counts.items()}


def _kind_samples(steps: list[dict], kind: str) -> list[dict]:
    """The steady steps of ``kind``, or every step of it when none is steady (the init step, measured once)."""
    return [s for s in steps if s["kind"] == kind and s["steady"]] or [s for s in steps if s["kind"] == kind]


def _figure(steps: list[dict], value, weights: dict[str, float] | None) -> float:  # noqa: ANN001
    """``value(step)``'s median over the steady steps; schedule-weighted methods: the weighted sum of per-kind medians."""
    if weights is None:
        return statistics.median(value(s) for s in steps if s["steady"])
    return sum(
        weight * statistics.median(value(s) for s in _kind_samples(steps, kind)) for kind, weight in weights.items()
    )


def _meter_level(level: str):  # noqa: ANN202
    """A step's meter bytes of ``level`` (``intra_node`` or ``inter_node``), averaged over the ranks."""
    return lambda s: statistics.fmean(r[level] for r in s["meter_by_level_per_rank"])


def _level_figures(steps: list[dict], weights: dict[str, float] | None, world: int) -> dict:
    """A several-node row's bytes per level: interface counters (whole job) and meter (per rank)."""
    inter = _figure(steps, lambda s: s["inter_node_bytes"], weights)
    meter = {level: _figure(steps, _meter_level(level), weights) for level in ("intra_node", "inter_node")}
    return {
        "inter_node_bytes_per_step": inter,
        "intra_node_bytes_per_step": _figure(steps, lambda s: s["intra_node_bytes"], weights),
        "inter_node_busiest_direction_bytes_per_step": _figure(steps, lambda s: s["inter_node_busiest_direction_bytes"], weights),
        "meter_bytes_by_level_per_rank_step": meter,
        "inter_node_link_over_meter": inter / (meter["inter_node"] * world) if meter["inter_node"] else None,
    }


def summarize(raw: dict, method: str, prefetch: bool | None, rate_bits: float | None, compute_s: float | None) -> dict:
    """One result row from a configuration's raw records (rank 0's file).

    Several nodes (``raw["nodes"]`` > 1): the row also has the bytes per level (``_level_figures``), and the link
    time is the busiest shaped direction's bytes at the rate: every direction of every node's link has the
    full rate, and traffic inside a node crosses its unshaped loopback, counted as free.
    """
    spec = METHODS[method]
    world = raw["world_size"]
    steps = raw["steps"]
    row: dict = {
        "label": config_label(method, prefetch),
        "method": method,
        "title": spec.title,
        "prefetch": prefetch,
        "parallel": spec.parallel,
        "compute": spec.compute,
        "bandwidth": format_rate(rate_bits),
        "rate_bits_per_s": rate_bits,
        "meter_source": spec.meter,
        "schedule_weighted": spec.schedule_weighted,
        "num_params": raw["num_params"],
        "world_size": world,
        "info": raw.get("info", {}),
        "steps": steps,
    }
    if spec.schedule_weighted:
        time_stats, link, meter = _weighted_figures(row, steps, method)
    else:
        steady = [s for s in steps if s["steady"]]
        time_stats = _stats([s["seconds"] for s in steady])
        link = statistics.median(s["link_bytes"] for s in steady)
        meter = statistics.median(statistics.fmean(s["meter_sent_bytes_per_rank"]) for s in steady)
    shaped = link  # one node: every rank's bytes cross the one shaped device
    if raw.get("nodes", 1) > 1:
        shaped = _add_levels(row, raw, steps)
    row.update(
        step_s=time_stats["median"],
        step_s_min=time_stats["min"],
        step_s_max=time_stats["max"],
        step_s_p25=time_stats["p25"],
        step_s_p75=time_stats["p75"],
        measured_steps=time_stats["n"],
        link_bytes_per_step=link,
        link_bytes_per_rank_step=link / world,
        meter_bytes_per_rank_step=meter,
        link_over_meter=(link / world) / meter if meter else None,
        t_compute_s=compute_s,
    )
    _add_ideals(row, raw, rate_bits, compute_s, shaped)
    return row


def _weighted_figures(row: dict, steps: list[dict], method: str) -> tuple[dict, float, float]:
    """A schedule-weighted row: its ``per_kind`` figures and ``schedule`` (set on ``row``), and the weighted step
    time statistics, link bytes and meter bytes per rank."""
    weights = paper_weights(method)
    per_kind = {}
    for kind in weights:
        samples = _kind_samples(steps, kind)
        per_kind[kind] = {
            "weight": weights[kind],
            "steady": samples[0]["steady"],
            "seconds": _stats([s["seconds"] for s in samples]),
            "link_bytes": statistics.median(s["link_bytes"] for s in samples),
            "meter_bytes_per_rank": statistics.median(statistics.fmean(s["meter_sent_bytes_per_rank"]) for s in samples),
        }
    row["per_kind"] = per_kind
    row["schedule"] = dict(PAPER_SCHEDULES, method=method)
    time_stats = {key: sum(k["weight"] * k["seconds"][key] for k in per_kind.values()) for key in ("median", "min", "max", "p25", "p75")}
    # steady samples of the rarest kind (the init step is measured once and never steady)
    time_stats["n"] = min((k["seconds"]["n"] for k in per_kind.values() if k["steady"]), default=0)
    link = sum(k["weight"] * k["link_bytes"] for k in per_kind.values())
    meter = sum(k["weight"] * k["meter_bytes_per_rank"] for k in per_kind.values())
    return time_stats, link, meter


def _add_levels(row: dict, raw: dict, steps: list[dict]) -> float:
    """A several-node row's bytes per level (and per step kind); returns the shaped bytes: the busiest direction's."""
    row.update(nodes=raw["nodes"], nproc_per_node=raw["nproc_per_node"])
    weights = {kind: figures["weight"] for kind, figures in row["per_kind"].items()} if row["schedule_weighted"] else None
    row.update(_level_figures(steps, weights, row["world_size"]))
    for kind, figures in row.get("per_kind", {}).items():  # what each step kind sends between the nodes
        samples = _kind_samples(steps, kind)
        figures["inter_node_bytes"] = statistics.median(s["inter_node_bytes"] for s in samples)
        meter_inter = _meter_level("inter_node")
        figures["meter_inter_node_bytes_per_rank"] = statistics.median(meter_inter(s) for s in samples)
    return row["inter_node_busiest_direction_bytes_per_step"]


def _add_ideals(row: dict, raw: dict, rate_bits: float | None, compute_s: float | None, shaped: float) -> None:
    """``T_comm`` of the ``shaped`` bytes at the rate, the no-overlap and full-overlap ideals, and the row's fractions
    of them (all None on an unshaped link or without a compute-only time)."""
    if rate_bits is not None and compute_s is not None:
        t_comm = shaped * 8 / rate_bits
        row.update(
            t_comm_s=t_comm,
            ideal_no_overlap_s=compute_s + t_comm,
            ideal_full_overlap_s=max(compute_s, t_comm),
            fraction_of_ideal_no_overlap=(compute_s + t_comm) / row["step_s"],
            fraction_of_ideal_full_overlap=max(compute_s, t_comm) / row["step_s"],
            comm_fraction=min(1.0, t_comm / row["step_s"]),
        )
        if raw.get("nodes", 1) == 1:
            for figures in row.get("per_kind", {}).values():  # each step kind against its own ideal
                kind_comm = figures["link_bytes"] * 8 / rate_bits
                figures["t_comm_s"] = kind_comm
                figures["ideal_full_overlap_s"] = max(compute_s, kind_comm)
                figures["over_ideal_full_overlap"] = figures["seconds"]["median"] / max(compute_s, kind_comm)
    else:
        row.update(t_comm_s=None, ideal_no_overlap_s=None, ideal_full_overlap_s=None,
                   fraction_of_ideal_no_overlap=None, fraction_of_ideal_full_overlap=None, comm_fraction=None)  # fmt: skip
