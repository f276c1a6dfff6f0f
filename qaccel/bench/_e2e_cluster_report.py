"""Figures of ``qaccel bench e2e --nodes N``: the simulated cluster's goals, its Markdown section and its plot.

The rows come from ``_e2e_report.summarize`` like the one-node ones, with the bytes per level added
(``inter_node_bytes_per_step`` from the veth counters, ``intra_node_bytes_per_step`` from the loopbacks,
``meter_bytes_by_level_per_rank_step`` from the meter). Pure functions; nothing here runs a process.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from ._e2e_compare import find_row, goal_row
from ._e2e_methods import PAPER_SCHEDULES
from ._e2e_render import failed_line, fraction_cell, mb_cell, seconds_cell, speedup_cells, step_cell
from ._e2e_render import write_markdown as _write_block

__all__ = [
    "evaluate_goals",
    "render_markdown",
    "write_markdown",
    "plot",
    "progress_line",
    "GOAL_BANDWIDTH",
    "HQSDP",
    "HSDP_ZERO_ONE",
    "rate_for_step_goal",
]

MARK_BEGIN = "<!-- qaccel bench e2e --nodes: begin (generated; edit the generator, not this block) -->"
MARK_END = "<!-- qaccel bench e2e --nodes: end -->"
GOAL_BANDWIDTH = "100mbit"
HQSDP = "hqsdp-w8g8-r4"  # the hierarchical QSDP: W8G8 inside a node, 4-bit gradients between nodes
HSDP_ZERO_ONE = "hsdp-zero-one-adam"  # the 0/1 Adam on HSDP shards, weighted by the paper's schedule
# (method, bytes goals: its inter-node bytes / the baseline's <= target, step goals: baseline step time / its >= target)
_GOALS = (
    (HQSDP, (("fsdp2-fp32", 1 / 16), ("hsdp-fp32", 1 / 7)), (("fsdp2-fp32", 4.0), ("hsdp-fp32", 2.0))),
    (HSDP_ZERO_ONE, (("hsdp-fp32", 1 / 100),), (("hsdp-fp32", 3.0),)),
)
IDEAL_FRACTION = 0.85

write_markdown = partial(_write_block, begin=MARK_BEGIN, end=MARK_END)


def _meter_total(row: dict, level: str) -> float:
    """The meter's bytes of ``level`` for the whole job (per rank x ranks), comparable with the counters."""
    return row["meter_bytes_by_level_per_rank_step"][level] * row["world_size"]


def _bound(row: dict) -> str:
    compute, comm = row["t_compute_s"], row["t_comm_s"]
    which = "compute" if compute >= comm else "the link"
    return f"{row['label']}'s ideal is bound by {which} ({compute:.2f} s compute, {comm:.2f} s link)"


def _by_kind(row: dict, value: Callable[[dict], float], unit: str) -> str:
    """What a schedule-weighted figure is made of: ``value`` of each step kind of ``row`` with the kind's weight."""
    kinds = sorted(
        ((kind, k) for kind, k in row["per_kind"].items() if kind != "init"), key=lambda item: -item[1]["weight"]
    )
    return "; per step kind (weight x median): " + ", ".join(
        f"{kind} {k['weight']:.1%} x {value(k):.3g} {unit}" for kind, k in kinds
    )


def evaluate_goals(rows: list[dict]) -> list[dict]:
    """The issue's several-node goals at ``GOAL_BANDWIDTH``, each with the figure at the ideals and, when missed, why.

    ``value`` is measured; ``ideal`` is the same figure if every row ran at its full-overlap ideal (step-time
    goals) or by the meter's formulas (bytes goals); ``reason`` says what limits a missed goal. A 1-bit row's
    figures are weighted by the paper's schedule (``_e2e_report.summarize``); its goals say so in their name
    and, when missed, break the figure down by step kind.
    """
    goals = []
    at = [r for r in rows if "step_s" in r and r["bandwidth"] == GOAL_BANDWIDTH and "inter_node_bytes_per_step" in r]
    prefetches = sorted({r["prefetch"] for r in at if r["prefetch"] is not None}) or [False]
    for prefetch in prefetches:
        for method, bytes_goals, step_goals in _GOALS:
            fast = find_row(at, GOAL_BANDWIDTH, method, prefetch)
            if fast is None or bool(fast["prefetch"]) != bool(prefetch):
                continue
            for base, target in bytes_goals:
                slow = find_row(at, GOAL_BANDWIDTH, base, prefetch)
                if slow is not None and bool(slow["prefetch"]) == bool(prefetch):
                    goals.append(_bytes_goal(fast, slow, target))
            for base, target in step_goals:
                slow = find_row(at, GOAL_BANDWIDTH, base, prefetch)
                if (
                    slow is not None
                    and bool(slow["prefetch"]) == bool(prefetch)
                    and fast["ideal_full_overlap_s"] is not None
                ):
                    goals.append(_step_goal(fast, slow, target))
    for row in at:  # hierarchical QSDP's own goal (its AdamW rows: a 1-bit row's step kinds have different ideals)
        if (
            row["method"].startswith("hqsdp-")
            and not row["schedule_weighted"]
            and row["fraction_of_ideal_full_overlap"] is not None
        ):
            goal = goal_row(
                f"{row['label']} at the full-overlap ideal",
                GOAL_BANDWIDTH,
                row["fraction_of_ideal_full_overlap"],
                ">=",
                IDEAL_FRACTION,
            )
            goal["ideal"] = 1.0
            goal["reason"] = None if goal["met"] else (
                f"step {row['step_s']:.2f} s against max(T_compute {row['t_compute_s']:.2f} s, T_comm {row['t_comm_s']:.2f} s) = "
                f"{row['ideal_full_overlap_s']:.2f} s (no overlap: {row['ideal_no_overlap_s']:.2f} s); the rest is time spent "
                "neither computing nor hidden behind the link: codec work, collectives on the critical path, CPU contention"
            )  # fmt: skip
            goals.append(goal)
    return goals


def _weighted_suffix(row: dict) -> str:
    return ", weighted by the paper's schedule" if row["schedule_weighted"] else ""


def _bytes_goal(fast: dict, slow: dict, target: float) -> dict:
    """``fast``'s inter-node bytes (veth) over ``slow``'s <= ``target``; ideal: the same ratio of the meters."""
    value = fast["inter_node_bytes_per_step"] / slow["inter_node_bytes_per_step"]
    meter = _meter_total(fast, "inter_node") / _meter_total(slow, "inter_node")
    name = f"{fast['label']} / {slow['label']} inter-node bytes (veth){_weighted_suffix(fast)}"
    goal = goal_row(name, GOAL_BANDWIDTH, value, "<=", target)
    goal["ideal"] = meter
    if goal["met"]:
        goal["reason"] = None
        return goal
    goal["reason"] = (
        f"the meter's formulas give {meter:.3g}; on the link {fast['label']} sends {fast['inter_node_link_over_meter']:.2f}x "
        f"its meter's inter-node bytes and {slow['label']} {slow['inter_node_link_over_meter']:.2f}x (TCP/IP headers, "
        "acknowledgements, barriers, gloo's algorithm)"
    )  # fmt: skip
    if fast["schedule_weighted"]:
        goal["reason"] += _by_kind(fast, lambda kind: kind["inter_node_bytes"] / 1e6, "MB")
    return goal


def _step_goal(fast: dict, slow: dict, target: float) -> dict:
    """``slow``'s step time over ``fast``'s >= ``target``; ideal: the same ratio of the full-overlap ideals."""
    value = slow["step_s"] / fast["step_s"]
    ideal = slow["ideal_full_overlap_s"] / fast["ideal_full_overlap_s"]
    goal = goal_row(
        f"{slow['label']} / {fast['label']} step time{_weighted_suffix(fast)}", GOAL_BANDWIDTH, value, ">=", target
    )
    goal["ideal"] = ideal
    if goal["met"]:
        goal["reason"] = None
        return goal
    if ideal < target:
        goal["reason"] = f"even at both full-overlap ideals the ratio is {ideal:.2f}x: {_bound(fast)}"
        rate = rate_for_step_goal(fast, slow, target)
        if rate is not None:
            goal["reason"] += (
                f"; at {rate / 1e6:.3g} Mbit/s or slower {slow['label']}'s link time alone is {target:g}x "
                f"{fast['label']}'s compute, and the ideals reach the target"
            )
    else:
        goal["reason"] = (f"at the ideals it would be {ideal:.2f}x, but {fast['label']} ran at "
                          f"{fast['fraction_of_ideal_full_overlap']:.0%} of its ideal and {slow['label']} at "
                          f"{slow['fraction_of_ideal_full_overlap']:.0%}")  # fmt: skip
    if fast["schedule_weighted"]:
        goal["reason"] += _by_kind(fast, lambda kind: kind["seconds"]["median"], "s")
    return goal


def rate_for_step_goal(fast: dict, slow: dict, target: float) -> float | None:
    """The link rate (bits/s) at or below which ``slow``'s full-overlap ideal is ``target`` x ``fast``'s, from the
    rows' busiest-direction bytes and compute times; None when no rate does (``fast`` sends too much for it).

    Below it ``slow`` is link-bound with ``B_slow x 8 / rate >= target x T_compute(fast)``, and since
    ``B_slow >= target x B_fast`` also ``>= target x`` ``fast``'s link time: so ``>= target x`` its ideal.
    """
    slow_bytes = slow["inter_node_busiest_direction_bytes_per_step"]
    fast_bytes = fast["inter_node_busiest_direction_bytes_per_step"]
    if not fast.get("t_compute_s") or slow_bytes < target * fast_bytes:
        return None
    return slow_bytes * 8 / (target * fast["t_compute_s"])


def progress_line(label: str, row: dict, wall_s: float) -> str:
    """One line per configuration on stderr while the run goes on."""
    ideal = row["ideal_full_overlap_s"]
    return (
        f"{label}: {row['step_s']:.3f} s/step (full-overlap ideal {'-' if ideal is None else f'{ideal:.3f}'} s), "
        f"inter-node {row['inter_node_bytes_per_step'] / 1e6:.2f} MB/step on the veths (meter {_meter_total(row, 'inter_node') / 1e6:.2f}), "
        f"intra-node {row['intra_node_bytes_per_step'] / 1e6:.2f} MB/step on lo ({wall_s:.0f} s)"
    )


# -- Markdown -----------------------------------------------------------------------------------------
def _load(report: dict) -> str:
    loads = [r["load_average"][0] for r in report["results"] if r.get("load_average")]
    return f"{min(loads):.2f} to {max(loads):.2f}" if loads else "not recorded"


def render_markdown(report: dict, image: str | None = None) -> str:
    """The BENCHMARKS.md section of a several-node run: settings, the cluster, one table per bandwidth, goals."""
    lines = [MARK_BEGIN, *_header_lines(report)]
    for bandwidth in dict.fromkeys(r["bandwidth"] for r in report["results"]):
        lines += _bandwidth_table(report, bandwidth)
    lines += _per_kind_table(report["results"])
    lines += _goal_lines(report["goals"])
    if image:
        lines += [f"![qaccel bench e2e --nodes]({image})", ""]
    lines += [
        "Columns: *inter-node veth* is the sum over nodes of the veth's `tx_bytes` over the step (every byte between nodes "
        "counted once, where it leaves its node); *intra-node lo* the sum of every node's loopback `tx_bytes`. *meter* is the "
        "whole job's bytes by level (per rank x ranks): qaccel's wire meter, or for stock FSDP2 and HSDP (*ring*) the ring "
        "formula applied to every collective torch issued; a collective counts as inter-node when its group spans nodes, so "
        "every collective of a flat method (FSDP2 or QSDP over all ranks) is inter-node, and for HSDP and hierarchical QSDP "
        "only the replica traffic (the 1-bit rows on HSDP shards: the exact all-reduce of full steps and the 1-bit "
        "optimizer's compressed all-reduce, meter kinds `hsdp.*`). `T_comm` = the busiest direction's veth bytes x 8 / rate (each direction of each link "
        "has the full rate; the loopbacks are unshaped and counted as free). Ideal: `max(T_compute, T_comm)`, with "
        "`T_compute` measured in the same job. *at the ideals*: the goal's figure if every row ran at its full-overlap ideal "
        "(step-time goals) or as the meter's formulas say (bytes goals).",
        MARK_END,
    ]
    return "\n".join(lines) + "\n"


def _header_lines(report: dict) -> list[str]:
    """The title, the machine, the cluster and settings, the command and the compute-only times."""
    s, m, ns = report["settings"], report["machine"], report["namespace"]
    compute = ", ".join(
        f"{k} {v['median_s']:.3f} s [{v['min_s']:.3f}, {v['max_s']:.3f}]" for k, v in report["compute_only"].items()
    )
    return [
        f"## Two nodes (simulated): `qaccel bench e2e --nodes {s['nodes']}`",
        "",
        f"Measured {report['finished']} on {m['cpu']} ({m['cpus']} CPUs, {m['memory_gib']:.0f} GiB, Linux {m['kernel']}), torch "
        f"{m['torch']}, transformers {m['transformers']}: {s['nodes']} simulated nodes x {s['nproc_per_node']} ranks = "
        f"{s['world_size']} ranks over gloo, {s['threads']} thread(s) per rank; 1-minute load average when each configuration "
        f"started: {_load(report)} (other jobs share the CPUs). Model `{s['model']}`: {report['num_params']:,} parameters, "
        f"per-rank batch {s['batch_size']} x {s['seq_len']} tokens, AdamW (lr {s['lr']}); {s['steps']} measured steps after "
        f"{s['warmup']} warm-up steps per configuration.{_schedule_sentence(report)}",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        f"The cluster: every node is a network namespace whose ranks talk over its own loopback, unshaped; the nodes are "
        f"joined by a {ns.get('topology', 'veth link')} in 10.231.0.0/24, tc tbf on every veth end's egress (each direction "
        "of a node's link has the full rate). Compute only (every job first times the same per-rank steps on all ranks at "
        f"once; median over the jobs [min, max]): {compute}.",
        "",
    ]


def _bandwidth_table(report: dict, bandwidth: str) -> list[str]:
    """The table of every configuration run at ``bandwidth`` between the nodes, and how the veths were shaped."""
    shaping = report["shaping"].get(bandwidth)
    how = (
        f"tbf rate {bandwidth} each way, burst {shaping['burst_bytes']} B, latency {shaping['latency']}"
        if shaping
        else "unshaped veths"
    )
    lines = [
        f"### {bandwidth} between nodes ({how})",
        "",
        "| configuration | step s (median [min, max]) | T_compute s | inter-node MB/step: veth | meter | intra-node MB/step: lo | "
        "meter | T_comm s | ideal full overlap s | of ideal | vs FSDP2 fp32 | vs HSDP fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in report["results"] if r["bandwidth"] == bandwidth):
        if "step_s" not in r:
            lines.append(failed_line(r))
            continue
        ring = "" if r["meter_source"] == "qaccel" else " (ring)"
        lines.append(
            f"| {r['label']} | {step_cell(r)} | {seconds_cell(r['t_compute_s'])} | "
            f"{mb_cell(r['inter_node_bytes_per_step'])} | {mb_cell(_meter_total(r, 'inter_node'))}{ring} | "
            f"{mb_cell(r['intra_node_bytes_per_step'])} | {mb_cell(_meter_total(r, 'intra_node'))}{ring} | {seconds_cell(r['t_comm_s'])} | "
            f"{seconds_cell(r['ideal_full_overlap_s'])} | {fraction_cell(r)} | {speedup_cells(r, ('fsdp2-fp32', 'hsdp-fp32'))} |"
        )
    lines.append("")
    return lines


def _goal_lines(goals: list[dict]) -> list[str]:
    """The goals table with each goal's figure at the ideals and what limits a missed one (none without goals)."""
    if not goals:
        return []
    lines = [
        "### Goals (two nodes)",
        "",
        "| goal | at | measured | at the ideals | target | met | what limits it |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in goals:
        verdict = "yes" if g["met"] else f"**no** (missed by {g['missed_by']:.3g})"
        reason = (g.get("reason") or "").replace("|", "/")
        lines.append(
            f"| {g['goal']} | {g['bandwidth']} | {g['value']:.3g} | {g['ideal']:.3g} | {g['op']} {g['target']:.3g} | {verdict} | {reason} |"
        )
    lines.append("")
    return lines

def _schedule_sentence(report: dict) -> str:
    """How the 1-bit rows were measured and weighted (empty when the run has none)."""
    weighted = list(dict.fromkeys(r["method"] for r in report["results"] if r.get("schedule_weighted")))
    if not weighted:
        return ""
    zero_one = ", ".join(f"{k} {v:,}" for k, v in PAPER_SCHEDULES["zero_one"].items())
    return (
        f" 1-bit optimizer rows ({', '.join(weighted)}, same lr) run a probe schedule with "
        f"{report['settings']['steps']} steady steps of every step kind; each figure is the per-kind medians weighted "
        f"by the step kinds' shares of the 0/1 Adam paper's BERT-Large schedule (T = {PAPER_SCHEDULES['total_steps']:,} "
        f"steps; 0/1 Adam {zero_one}; 1-bit Adam freeze_step {PAPER_SCHEDULES['onebit']['freeze_step']:,}), as for the "
        "one-node 1-bit rows."
    )


def _per_kind_table(rows: list[dict]) -> list[str]:
    """Markdown lines: every schedule-weighted row's figures per step kind (none when no row is weighted)."""
    weighted = [r for r in rows if r.get("per_kind") and "inter_node_bytes_per_step" in r]
    if not weighted:
        return []
    lines = [
        "### 1-bit optimizers by step kind",
        "",
        "| configuration | at | step kind | weight in the paper's schedule | samples | step s (median) | "
        "inter-node MB/step: veth | meter |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in weighted:
        for kind, k in r["per_kind"].items():
            samples = f"{k['seconds']['n']}" + ("" if k["steady"] else " (not steady)")
            meter = k["meter_inter_node_bytes_per_rank"] * r["world_size"]
            lines.append(
                f"| {r['label']} | {r['bandwidth']} | {kind} | {k['weight']:.4%} | {samples} | {k['seconds']['median']:.2f} | "
                f"{mb_cell(k['inter_node_bytes'])} | {mb_cell(meter)} |"
            )
    lines += [
        "",
        "A row's step time and bytes above are the sum of these medians times their weights. *full* steps (warm-up "
        "and variance updates) all-reduce the gradient shard exactly across the nodes; *onebit_gradient*, *sync* and "
        "*onebit_momentum* steps send it 1-bit compressed; *local* steps send nothing between the nodes.",
        "",
    ]
    return lines


# -- plot ----------------------------------------------------------------------------------------------
def plot(report: dict, png: str) -> None:
    """Three panels at the slowest link: step time with its ideals, bytes per level, speedup over the baselines."""
    from ._figures import headless_pyplot, save_figure

    plt = headless_pyplot()
    rows = [r for r in report["results"] if "step_s" in r]
    rates = {r["bandwidth"]: r.get("rate_bits_per_s") for r in rows}
    first = sorted(rates, key=lambda b: (rates[b] is None, rates[b] or 0.0))[0]
    at = [r for r in rows if r["bandwidth"] == first]
    pos = list(range(len(at)))
    labels = [r["label"] for r in at]
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.5))
    axes[0].bar(pos, [r["step_s"] for r in at], width=0.6, label="step (median)")
    axes[0].scatter(pos, [r["ideal_full_overlap_s"] or 0.0 for r in at], marker="_", s=400, color="black",
                    label="ideal: max(T_compute, T_comm)")  # fmt: skip
    axes[0].scatter(pos, [r["t_compute_s"] or 0.0 for r in at], marker="x", color="tab:red", label="T_compute")
    axes[0].set_ylabel("seconds per step")
    axes[0].set_title("step time")
    series = (
        ("inter-node (veth)", [r["inter_node_bytes_per_step"] for r in at]),
        ("inter-node (meter)", [_meter_total(r, "inter_node") for r in at]),
        ("intra-node (lo)", [r["intra_node_bytes_per_step"] for r in at]),
        ("intra-node (meter)", [_meter_total(r, "intra_node") for r in at]),
    )
    for i, (name, values) in enumerate(series):
        axes[1].bar([p - 0.3 + 0.2 * i for p in pos], [v / 1e6 for v in values], width=0.2, label=name)
    axes[1].set_yscale("log")  # a level without bytes (the meter's intra-node of a flat method) has no bar
    top = max(max(values) for _, values in series) / 1e6
    axes[1].set_ylim(0.1, top * 20)
    axes[1].set_ylabel("MB per step (whole job)")
    axes[1].set_title("bytes per level")
    for offset, base in ((-0.2, "fsdp2-fp32"), (0.2, "hsdp-fp32")):
        axes[2].bar(
            [p + offset for p in pos], [r.get("speedup", {}).get(base, 0.0) for r in at], width=0.4, label=f"vs {base}"
        )
    axes[2].axhline(1.0, color="gray", linewidth=0.8)
    axes[2].set_ylabel("baseline step time / step time")
    axes[2].set_title("speedup")
    for ax in axes:
        ax.set_xticks(pos, labels, rotation=50, ha="right", fontsize=7)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    s = report["settings"]
    fig.suptitle(
        f"qaccel bench e2e --nodes {s['nodes']}: {s['model']}, {s['nodes']} x {s['nproc_per_node']} ranks over gloo, {first} between nodes"
    )
    fig.tight_layout()
    save_figure(fig, png)
