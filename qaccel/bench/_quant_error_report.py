"""The figure and the Markdown tables of ``qaccel bench quant --study error`` (pure functions of its JSON report)."""

from __future__ import annotations

import math

from ._figures import headless_pyplot, save_figure
from ._quant_error_measure import ROUNDINGS

__all__ = ["plot", "markdown"]


def plot(report: dict, png: str) -> None:
    """One panel per tensor kind (relative MSE against bits, log scale) and one of the timing ratios."""
    plt = headless_pyplot()
    kinds = list(report["kinds"])
    panels = len(kinds) + (report["timing"] is not None)
    columns = min(4, panels)
    rows_count = math.ceil(panels / columns)
    fig, axes = plt.subplots(rows_count, columns, figsize=(4.2 * columns, 3.4 * rows_count), squeeze=False)
    flat_axes = list(axes.flat)
    styles = {("stochastic", "none"): ("C0", "-"), ("stochastic", "hadamard"): ("C0", "--"),
              ("nearest", "none"): ("C1", "-"), ("nearest", "hadamard"): ("C1", "--")}  # fmt: skip
    for ax, kind in zip(flat_axes, kinds, strict=False):
        rows = [row for row in report["errors"] if row["kind"] == kind]
        for (rounding, rotation), (color, line) in styles.items():
            points = sorted((row["bits"], row["rel_mse"][rotation]) for row in rows if row["rounding"] == rounding)
            ax.plot(*zip(*points, strict=True), color=color, linestyle=line, marker="o", label=f"{rounding}, {rotation}")
        ax.set_yscale("log")
        ax.set_xticks(report["bits"])
        ax.set_xlabel("bits")
        ax.set_ylabel("relative MSE")
        ax.set_title(kind, fontsize=9)
        ax.grid(alpha=0.3)
    flat_axes[0].legend(fontsize=7)
    if report["timing"] is not None:
        ax = flat_axes[len(kinds)]
        timing = report["timing"]
        names = [f"{op} {row['bits']}b/B{row['bucket_size']}" for row in timing["rows"] for op in ("encode", "decode")]
        ratios = [row[f"{op}_cpu_ratio"] for row in timing["rows"] for op in ("encode", "decode")]
        ax.bar(range(len(ratios)), ratios, color=["C2" if name.startswith("encode") else "C4" for name in names])
        ax.axhline(timing["goal"]["max_encode_ratio"], color="k", linestyle="--", label="goal (encode)")
        ax.set_xticks(range(len(names)), names, rotation=30, fontsize=7)
        ax.set_ylabel("CPU time with / without rotation")
        ax.set_title(f"1 thread, {timing['backend']} backend, {timing['rows'][0]['numel']:,} values", fontsize=9)
        ax.legend(fontsize=7)
    for ax in flat_axes[panels:]:
        ax.axis("off")
    fig.suptitle(f"Round-trip error with and without Hadamard rotation (mean of {report['seeds']} seeds)")
    fig.tight_layout()
    save_figure(fig, png)


def _sci(value: float | None) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.3g}"


def markdown(report: dict) -> str:
    """The error table (stochastic and nearest side by side), the summary and the timing table."""
    lines = [
        f"Relative MSE `sum((x_hat - x)^2) / sum(x^2)` of one round trip, mean of {report['seeds']} seeds "
        f"({report['backend']} backend); ratio = none / hadamard (above 1: rotation helps).",
        "",
        "| tensors | bits | bucket | stochastic, none | stochastic, hadamard | ratio | nearest, none | nearest, hadamard | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(row["kind"], row["bits"], row["rounding"]): row for row in report["errors"]}
    for kind in report["kinds"]:
        for bits in report["bits"]:
            cells = []
            for rounding in ROUNDINGS:
                row = by_key[(kind, bits, rounding)]
                cells += [_sci(row["rel_mse"]["none"]), _sci(row["rel_mse"]["hadamard"]), _sci(row["ratio_none_over_hadamard"])]
            bucket = f"{row['bucket_size']} {row['meta_dtype']}"
            lines.append(f"| {kind} | {bits} | {bucket} | " + " | ".join(cells) + " |")
    lines += ["", "| bits | rounding | kinds | geometric mean ratio | min | max |", "|---|---|---|---|---|---|"]
    for entry in report["summary"]:
        lines.append(f"| {entry['bits']} | {entry['rounding']} | {entry['kinds']} | {entry['geomean_ratio']:.3g} | "
                     f"{entry['min_ratio']:.3g} | {entry['max_ratio']:.3g} |")  # fmt: skip
    timing = report["timing"]
    if timing is not None:
        goal = timing["goal"]
        verdict = {True: "met", False: "missed", None: goal["note"]}[goal["met"]]
        lines += ["", f"One thread, {timing['backend']} backend, median of {timing['repeats']} interleaved runs, thread CPU "
                      f"time (wall-clock ratio in brackets); goal: encode with rotation <= {goal['max_encode_ratio']:g}x "
                      f"encode without ({verdict}).", "",
                  "| payload | values | encode none (ms) | encode hadamard (ms) | ratio | decode none (ms) | decode hadamard (ms) | ratio |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for row in timing["rows"]:
            cells = []
            for op in ("encode", "decode"):
                cpu = row[f"{op}_cpu_s"]
                cells += [f"{cpu['none'] * 1e3:.1f}", f"{cpu['hadamard'] * 1e3:.1f}",
                          f"{row[f'{op}_cpu_ratio']:.2f} ({row[f'{op}_ratio']:.2f})"]  # fmt: skip
            lines.append(f"| {row['bits']}-bit B{row['bucket_size']} {row['meta_dtype']} | {row['numel']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
