"""The Markdown section (``BENCHMARKS.md``) and the figure of a one-node ``qaccel bench e2e`` run, and the table
cells the several-node section (``_e2e_cluster_report``) shares. Pure functions of the report."""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "MARK_BEGIN",
    "MARK_END",
    "render_markdown",
    "write_markdown",
    "plot",
    "mb_cell",
    "seconds_cell",
    "failed_line",
    "step_cell",
    "fraction_cell",
    "speedup_cells",
]

MARK_BEGIN = "<!-- qaccel bench e2e: begin (generated; edit the generator, not this block) -->"
MARK_END = "<!-- qaccel bench e2e: end -->"


def mb_cell(x: float | None) -> str:
    """Bytes as MB with two decimals; ``-`` for none."""
    return "-" if x is None else f"{x / 1e6:.2f}"


def seconds_cell(x: float | None, digits: int = 2) -> str:
    """Seconds (or any ratio) with ``digits`` decimals; ``-`` for none."""
    return "-" if x is None else f"{x:.{digits}f}"


def failed_line(row: dict) -> str:
    """A table line for a configuration that has no result: its label and the first line of the error."""
    reason = (row.get("error") or "?").splitlines()[0][:120].replace("|", "/")
    return f"| {row['label']} | failed: {reason} |||||||||||"


def step_cell(row: dict) -> str:
    """The median step time and its [min, max]."""
    return f"{row['step_s']:.2f} [{row['step_s_min']:.2f}, {row['step_s_max']:.2f}]"


def fraction_cell(row: dict) -> str:
    """The full-overlap ideal over the step time, as a percentage; ``-`` without an ideal."""
    frac = row["fraction_of_ideal_full_overlap"]
    return "-" if frac is None else f"{frac:.0%}"


def speedup_cells(row: dict, baselines: tuple[str, ...]) -> str:
    """The row's speedup over each of ``baselines``, one cell each (``-`` where that baseline was not run)."""
    speedup = row.get("speedup", {})
    return " | ".join(f"{speedup[b]:.2f}x" if b in speedup else "-" for b in baselines)


def render_markdown(report: dict, image: str | None = None) -> str:
    """The BENCHMARKS.md section: settings, compute-only times, one table per bandwidth, goals, reproduction."""
    lines = [MARK_BEGIN, *_header_lines(report)]
    for bandwidth in dict.fromkeys(r["bandwidth"] for r in report["results"]):
        lines += _bandwidth_table(report, bandwidth)
    lines += _per_kind_table(report["results"])
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


def _header_lines(report: dict) -> list[str]:
    """The title, the machine and settings, the command and the compute-only times."""
    s = report["settings"]
    m = report["machine"]
    return [
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


def _bandwidth_table(report: dict, bandwidth: str) -> list[str]:
    """The table of every configuration run at ``bandwidth``, and how the link was shaped."""
    rows = [r for r in report["results"] if r["bandwidth"] == bandwidth]
    shaping = report["shaping"].get(bandwidth)
    how = f"tbf rate {bandwidth}, burst {shaping['burst_bytes']} B, latency {shaping['latency']}" if shaping else "unshaped loopback"
    lines = [
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
    return lines


def _per_kind_table(rows: list[dict]) -> list[str]:
    """The 1-bit rows' figures per step kind, each against its own ideal (none when no row has them)."""
    kind_rows = [r for r in rows if "step_s" in r and any("over_ideal_full_overlap" in k for k in r.get("per_kind", {}).values())]
    if not kind_rows:
        return []
    lines = [
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
    return lines

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
