"""Figures of ``qaccel bench e2e``: per-configuration summary, ideals, speedups, goals, Markdown and plots.

Pure functions of the raw per-step records the rank processes wrote; nothing here runs a process.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ._e2e_methods import METHODS, PAPER_SCHEDULES, config_label, format_rate, paper_counts

__all__ = ["summarize", "add_speedups", "evaluate_goals", "render_markdown", "plot", "paper_weights", "BASELINES"]

# fsdp2-fp32-a2a is the fair fp32 baseline: stock FSDP2's reduce-scatter on gloo is an all-reduce (2x the bytes)
BASELINES = ("fsdp2-fp32", "fsdp2-fp32-a2a", "fsdp2-bf16", "ddp-adamw", "onebit-adam", "hsdp-fp32")
MARK_BEGIN = "<!-- qaccel bench e2e: begin (generated; edit the generator, not this block) -->"
MARK_END = "<!-- qaccel bench e2e: end -->"


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
    else:
        steady = [s for s in steps if s["steady"]]
        time_stats = _stats([s["seconds"] for s in steady])
        link = statistics.median(s["link_bytes"] for s in steady)
        meter = statistics.median(statistics.fmean(s["meter_sent_bytes_per_rank"]) for s in steady)
    shaped = link  # one node: every rank's bytes cross the one shaped device
    if raw.get("nodes", 1) > 1:
        row.update(nodes=raw["nodes"], nproc_per_node=raw["nproc_per_node"])
        weights = {kind: figures["weight"] for kind, figures in row["per_kind"].items()} if spec.schedule_weighted else None
        row.update(_level_figures(steps, weights, world))
        for kind, figures in row.get("per_kind", {}).items():  # what each step kind sends between the nodes
            samples = _kind_samples(steps, kind)
            figures["inter_node_bytes"] = statistics.median(s["inter_node_bytes"] for s in samples)
            meter_inter = _meter_level("inter_node")
            figures["meter_inter_node_bytes_per_rank"] = statistics.median(meter_inter(s) for s in samples)
        shaped = row["inter_node_busiest_direction_bytes_per_step"]
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
    return row


def compute_summary(rows: list[dict]) -> dict:
    """Per precision: the median over configurations of the compute-only step time each job measured."""
    out = {}
    for precision in dict.fromkeys(r["compute"] for r in rows if "t_compute_s" in r):
        values = [r["t_compute_s"] for r in rows if r.get("compute") == precision and "t_compute_s" in r]
        out[precision] = {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values), "jobs": len(values)}
    return out


def find_row(rows: list[dict], bandwidth: str, method: str, prefetch: bool | None) -> dict | None:
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
    met = value >= target if op == ">=" else value <= target
    missed_by = None if met else (target - value if op == ">=" else value - target)
    return {"goal": name, "bandwidth": bandwidth, "value": value, "op": op, "target": target, "met": met, "missed_by": missed_by}


# -- Markdown -----------------------------------------------------------------------------------------
def mb_cell(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def seconds_cell(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def failed_line(row: dict) -> str:
    """A table line for a configuration that has no result: its label and the first line of the error."""
    reason = (row.get("error") or "?").splitlines()[0][:120].replace("|", "/")
    return f"| {row['label']} | failed: {reason} |||||||||||"


def step_cell(row: dict) -> str:
    return f"{row['step_s']:.2f} [{row['step_s_min']:.2f}, {row['step_s_max']:.2f}]"


def fraction_cell(row: dict) -> str:
    frac = row["fraction_of_ideal_full_overlap"]
    return "-" if frac is None else f"{frac:.0%}"


def speedup_cells(row: dict, baselines: tuple[str, ...]) -> str:
    speedup = row.get("speedup", {})
    return " | ".join(f"{speedup[b]:.2f}x" if b in speedup else "-" for b in baselines)


def render_markdown(report: dict, image: str | None = None) -> str:
    """The BENCHMARKS.md section: settings, compute-only times, one table per bandwidth, goals, reproduction."""
    s = report["settings"]
    m = report["machine"]
    lines = [
        MARK_BEGIN,
        "## End-to-end step time on a shaped link: `qaccel bench e2e`",
        "",
        f"Measured {report['finished']} on {m['cpu']} ({m['cpus']} CPUs, {m['memory_gib']:.0f} GiB, Linux {m['kernel']}), "
        f"torch {m['torch']}, transformers {m['transformers']}; {s['world_size']} ranks over gloo, "
        f"{s['threads']} thread(s) per rank. Model `{s['model']}`: {report['num_params']:,} parameters, per-rank batch "
        f"{s['batch_size']} x {s['seq_len']} tokens, AdamW (lr {s['lr']}). {s['steps']} measured steps after "
        f"{s['warmup']} warm-up steps per configuration (1-bit optimizers: {s['steps']} steady steps of every step kind, "
        "weighted by the paper's schedule, see below).",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        "Compute only (every job first times the same per-rank steps on all ranks at once, without communication; "
        "median over the jobs [min, max]): "
        + ", ".join(f"{k} {v['median_s']:.3f} s [{v['min_s']:.3f}, {v['max_s']:.3f}]" for k, v in report["compute_only"].items())
        + ".",
        "",
    ]
    bandwidths = list(dict.fromkeys(r["bandwidth"] for r in report["results"]))
    for bandwidth in bandwidths:
        rows = [r for r in report["results"] if r["bandwidth"] == bandwidth]
        shaping = report["shaping"].get(bandwidth)
        how = f"tbf rate {bandwidth}, burst {shaping['burst_bytes']} B, latency {shaping['latency']}" if shaping else "unshaped loopback"
        lines += [
            f"### {bandwidth} ({how})",
            "",
            "| configuration | step s (median [min, max]) | link MB/step/rank | meter MB/step/rank | link/meter | T_comm s | "
            "ideal no overlap s | ideal full overlap s | of full-overlap ideal | vs FSDP2 fp32 | vs FSDP2 fp32, true RS | "
            "vs FSDP2 bf16 | vs DDP AdamW |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if "step_s" not in r:
                lines.append(failed_line(r))
                continue
            lines.append(
                f"| {r['label']} | {step_cell(r)} | "
                f"{mb_cell(r['link_bytes_per_rank_step'])} | {mb_cell(r['meter_bytes_per_rank_step'])}"
                f"{'' if r['meter_source'] == 'qaccel' else ' (ring)'} | {seconds_cell(r['link_over_meter'])} | {seconds_cell(r['t_comm_s'])} | "
                f"{seconds_cell(r['ideal_no_overlap_s'])} | {seconds_cell(r['ideal_full_overlap_s'])} | {fraction_cell(r)} | "
                + speedup_cells(r, ("fsdp2-fp32", "fsdp2-fp32-a2a", "fsdp2-bf16", "ddp-adamw"))
                + " |"
            )
        lines.append("")
    kind_rows = [r for r in report["results"] if "step_s" in r and any("over_ideal_full_overlap" in k for k in r.get("per_kind", {}).values())]
    if kind_rows:
        lines += [
            "### 1-bit optimizers by step kind",
            "",
            "Each kind's median step against its own ideal `max(T_compute, T_comm)`, `T_comm` from that kind's link bytes.",
            "",
            "| configuration | at | kind | weight | step s | link MB/step/rank | T_comm s | ideal s | step / ideal |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in kind_rows:
            for kind, k in r["per_kind"].items():
                lines.append(
                    f"| {r['label']} | {r['bandwidth']} | {kind} | {k['weight']:.4%} | {k['seconds']['median']:.2f} | "
                    f"{mb_cell(k['link_bytes'] / r['world_size'])} | {k['t_comm_s']:.2f} | {k['ideal_full_overlap_s']:.2f} | "
                    f"{k['over_ideal_full_overlap']:.2f} |"
                )
        lines.append("")
    if report["goals"]:
        lines += ["### Goals", "", "| goal | at | measured | target | met |", "|---|---|---|---|---|"]
        for g in report["goals"]:
            verdict = "yes" if g["met"] else f"**no** (missed by {g['missed_by']:.3g})"
            lines.append(f"| {g['goal']} | {g['bandwidth']} | {g['value']:.3g} | {g['op']} {g['target']:g} | {verdict} |")
        lines.append("")
    if image:
        lines += [f"![qaccel bench e2e]({image})", ""]
    lines += [
        "Columns: *link* is the namespace loopback's `tx_bytes` over the step divided by the number of ranks (every "
        "rank's traffic crosses the one device); *meter* is what qaccel's wire meter recorded per rank, or for stock "
        "FSDP2, PowerSGD and the bf16 hook (marked *ring*) the ring formula applied to each collective torch issued. "
        "*true RS* is `fsdp2-fp32-a2a`: FSDP2 fp32 whose reduce-scatter is an fp32 all-to-all and a local sum, the fair "
        "baseline, since gloo's own reduce-scatter all-reduces the whole buffer (twice the bytes). "
        "`T_comm` = link bytes of all ranks x 8 / rate, since all ranks share the shaped device. Ideals: "
        "`T_compute + T_comm` (no overlap) and `max(T_compute, T_comm)` (full overlap), with `T_compute` the "
        "compute-only time of the same precision.",
        MARK_END,
    ]
    return "\n".join(lines) + "\n"


def write_markdown(path: str, text: str, begin: str = MARK_BEGIN, end: str = MARK_END) -> None:
    """Replace the generated block between ``begin`` and ``end`` in ``path`` (or append it; create the file if missing)."""
    target = Path(path)
    old = target.read_text() if target.exists() else "# Benchmarks\n\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        new = head + text + ("\n" + tail if tail else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(new)
    tmp.replace(target)


# -- plots ---------------------------------------------------------------------------------------------
def plot(report: dict, png: str) -> None:
    """Three panels: step time vs bandwidth, speedup vs bandwidth, bytes per step (link and meter)."""
    from ._figures import headless_pyplot, save_figure

    plt = headless_pyplot()
    rows = [r for r in report["results"] if "step_s" in r]
    rates = {r["bandwidth"]: r.get("rate_bits_per_s") for r in report["results"]}
    # slowest link first, unshaped last
    bandwidths = sorted(rates, key=lambda b: (rates[b] is None, rates[b] or 0.0))
    xs = {b: i for i, b in enumerate(bandwidths)}
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.5))
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        x = [xs[r["bandwidth"]] for r in mine]
        axes[0].plot(x, [r["step_s"] for r in mine], marker="o", label=label)
        bases = ("ddp-adamw",) if mine[0]["parallel"] == "ddp" else ("fsdp2-fp32", "fsdp2-fp32-a2a")
        for base, style in zip(bases, ("-", "--"), strict=False):
            if all(base in r.get("speedup", {}) for r in mine) and mine[0]["method"] not in bases:
                axes[1].plot(x, [r["speedup"][base] for r in mine], marker="o", linestyle=style, label=f"{label} vs {base}")
    for ax, title, ylabel in ((axes[0], "step time", "seconds per step (median)"), (axes[1], "speedup", "baseline step time / step time")):
        ax.set_xticks(range(len(bandwidths)), bandwidths)
        ax.set_xlabel("link rate (shared loopback)")
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    first = bandwidths[0]  # the slowest shaped link when there is one
    at = [r for r in rows if r["bandwidth"] == first]
    pos = range(len(at))
    axes[2].bar([p - 0.2 for p in pos], [r["link_bytes_per_rank_step"] / 1e6 for r in at], width=0.4, label="link (tx_bytes / ranks)")
    axes[2].bar([p + 0.2 for p in pos], [r["meter_bytes_per_rank_step"] / 1e6 for r in at], width=0.4, label="meter")
    axes[2].set_xticks(list(pos), [r["label"] for r in at], rotation=60, ha="right", fontsize=7)
    axes[2].set_ylabel("MB per step per rank")
    axes[2].set_title(f"bytes per step at {first}")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"qaccel bench e2e: {report['settings']['model']}, {report['settings']['world_size']} ranks over gloo, shaped loopback")
    fig.tight_layout()
    save_figure(fig, png)
