"""``qaccel bench comm``: exact bytes (and rounds) on the wire per training step, per rank.

Three sections measured in one run: QSDP against stock FSDP2 (``_comm_qsdp``), 0/1 Adam /
1-bit Adam against DDP AdamW (``_comm_onebit``), and the time of one QSDP collective split into
encode, transport and decode (``_comm_phases``). The first two count bytes with the same wire
meter; the 1-bit section also reports the wall-clock of ``optimizer.step()`` per step kind.
"""

from __future__ import annotations

import argparse
import textwrap

from . import _comm_onebit, _comm_phases, _comm_qsdp
from ._figures import headless_pyplot, png_path, save_figure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", choices=("qsdp", "onebit", "phases"), default=None, help="run one section only")
    parser.add_argument("--png", default=None, help="write a bar chart here (default: next to --json)")
    _comm_qsdp.add_arguments(parser)
    _comm_onebit.add_arguments(parser)
    _comm_phases.add_arguments(parser)


def run(args: argparse.Namespace) -> dict:
    report: dict = {"benchmark": "comm"}
    if args.only in (None, "qsdp"):
        report["qsdp"] = _comm_qsdp.measure(args)
    if args.only in (None, "onebit"):
        report["onebit"] = _comm_onebit.measure(args)
    if args.only in (None, "phases"):
        report["phases"] = _comm_phases.measure(args)
    png = png_path(args)
    if png:
        _plot(report, png)
        report["png"] = png
    return report


def _plot(report: dict, png: str) -> None:
    plt = headless_pyplot()

    sections = [name for name in ("qsdp", "onebit", "phases") if name in report]
    fig, axes = plt.subplots(1, len(sections), figsize=(6 * len(sections), 4), squeeze=False)
    for ax, name in zip(axes[0], sections, strict=True):
        rows = report[name]["rows"]
        if name == "phases":
            _plot_phases(ax, report[name])
            continue
        bars = ax.bar([r["method"] for r in rows], [r["ratio_vs_baseline"] for r in rows])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_ylabel("bytes sent vs baseline")
        ax.set_title("\n".join(textwrap.wrap(report[name]["title"], 60)), fontsize=9)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    save_figure(fig, png)


def _plot_phases(ax, section: dict) -> None:
    """Stacked encode/transport/decode per collective, next to the stock fp32 collective."""
    rows = section["rows"]
    labels = [f"{'AG' if r['direction'] == 'all_gather' else 'RS'} {r['bits']}b P{r['world_size']}" for r in rows]
    bottom = [0.0] * len(rows)
    for phase in ("encode", "transport", "decode"):
        values = [r[f"{phase}_ms"] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.scatter(labels, [r["stock_ms"] for r in rows], color="black", marker="_", s=400, label="stock fp32", zorder=3)
    ax.set_ylabel("ms per collective")
    ax.legend(fontsize=7)
    ax.set_title("\n".join(textwrap.wrap(section["title"], 60)), fontsize=9)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
