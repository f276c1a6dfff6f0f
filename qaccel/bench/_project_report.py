"""The Markdown section and the figure of ``qaccel bench project`` (``BENCHMARKS.md``, "Beyond two nodes: projected")."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = [
    "EQUATIONS",
    "command_line",
    "render_markdown",
    "write_markdown",
    "plot",
    "MARK_BEGIN",
    "MARK_END",
    "MARKDOWN_NODES",
]

MARK_BEGIN = "<!-- qaccel bench project: begin (generated; edit the generator, not this block) -->"
MARK_END = "<!-- qaccel bench project: end -->"
MARKDOWN_NODES = (2, 8, 64)  # node counts the Markdown tables show; the JSON and the figure have all

EQUATIONS = [
    "t(c) = max over links l of bytes_l(c) / rate_l + steps(c) * latency   (latency only when c crosses nodes)",
    "L_l  = sum over collectives c of count(c) * bytes_l(c) / rate_l       (busy time of link l per step)",
    "C    = max over links of L_l                                          (intra- and inter-node links run in parallel)",
    "E    = sum of t(c) over the edge collectives: the root unit's all-gather of every micro-batch, its reduce-scatter and replica all-reduce;",
    "       without prefetch also every unit's forward all-gather (FSDP2 issues it when the unit is reached)",
    "K    = (elements quantized / quantize rate + elements dequantized / dequantize rate) * max(1, ranks per machine / cores)",
    "H    = sum over links l of h_l * bytes all ranks send over l           (host TCP work on the simulated cluster; 0 on GPUs)",
    "       h_l = h_shaped on a tc-shaped link, h_unshaped on an unshaped loopback (both fitted)",
    "A    = T_compute + K + H",
    "T    = A + C - alpha * min(A, max(0, C - E))                          (alpha = 1: T = max(A + E, C); alpha = 0: T = A + C)",
    "T_compute (GPU) = 6 * params * tokens per GPU per optimizer step / (peak FLOP/s * MFU)",
]


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces the report (flags that differ from nothing are all spelled out)."""
    parts = ["qaccel bench project", f"--e2e {args.e2e}", f"--e2e_2node {args.e2e_2node}", f"--quant {args.quant}",
             f"--nodes {','.join(map(str, args.nodes))}", f"--rates {','.join(args.rates)}", f"--recipes {','.join(args.recipes)}"]  # fmt: skip
    for flag in ("json_path", "png", "markdown"):
        value = getattr(args, flag, None)
        if value:
            parts.append(f"--{'json' if flag == 'json_path' else flag} {value}")
    return " ".join(parts)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _s(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}"


def _mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 1e6:.1f}"


def _calibration_lines(cal: dict, inputs: dict) -> list[str]:
    fit, summary = cal["fitted"], cal["summary"]
    unshaped = fit["host_ns_per_byte_unshaped"]
    host = f"h = {fit['host_ns_per_byte_shaped']:.2f} ns per byte sent over a shaped link and " + (
        f"{unshaped:.2f} ns per byte over an unshaped loopback"
        if unshaped is not None
        else "none fitted for unshaped loopbacks (no such bytes measured)"
    )
    lines = [
        "### Calibration on the simulated cluster",
        "",
        f"Fitted on the rows below (log least squares): {host}; alpha = {fit['alpha_prefetch_off']:.2f} without "
        f"prefetch, {fit['alpha_prefetch_on']:.2f} with prefetch; rms log error {fit['rms_log_error']:.3f}. "
        f"**{summary['within_goal']} of {summary['configurations']} predictions are within "
        f"{summary['goal_relative_error']:.0%}** of the measured step (max error {summary['max_abs_relative_error']:.1%}, median "
        f"{summary['median_abs_relative_error']:.1%}), {summary['within_measured_range']} inside the [min, max] of the measured "
        "steps; refitted without the row it predicts (leave-one-out), "
        f"{summary['loo_within_goal']} of {summary['configurations']} (max {_pct(summary['loo_max_abs_relative_error'])}, median "
        f"{_pct(summary['loo_median_abs_relative_error'])}).",
        "",
    ]
    if inputs.get("e2e_2node") is None:
        lines += [f"Two nodes: skipped ({inputs.get('e2e_2node_skipped')}).", ""]
    lines += [
        "| configuration | at | nodes x ranks | measured s [min, max] | compute only s | predicted s | error | leave-one-out | predicted / measured MB per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in cal["rows"]:
        rng = f"[{_s(r['measured_min_s'])}, {_s(r['measured_max_s'])}]" if r["measured_min_s"] is not None else ""
        pb, mb = r["predicted_bytes_per_step"], r["measured_bytes_per_step"]
        bytes_cell = (
            "; ".join(f"{k.replace('_', '-')} {_mb(pb.get(k))} / {_mb(mb.get(k))}" for k in pb if k in mb) or "n/a"
        )
        flag = "" if r["within_goal"] else " **(>15%)**"
        lines.append(f"| {r['label']} | {r['bandwidth']} | {r['nodes']} x {r['per_node']} | {_s(r['measured_s'])} {rng} | {_s(r['compute_only_s'])} | "
                     f"{_s(r['predicted_s'])} | {_pct(r['relative_error'])}{flag} | {_pct(r['loo_relative_error'])} | {bytes_cell} |")  # fmt: skip
    if cal.get("skipped"):
        reasons: dict[str, list[str]] = {}
        for s in cal["skipped"]:
            reasons.setdefault(s["reason"], []).append(f"{s['label']} @ {s['bandwidth']}")
        lines += ["", "Not calibrated: " + "; ".join(f"{', '.join(v)}: {k}" for k, v in reasons.items()) + "."]
    return lines


def _projection_lines(report: dict) -> list[str]:
    proj = report["projection"]
    rows = proj["rows"]
    nodes = [n for n in proj["nodes"] if n in MARKDOWN_NODES] or proj["nodes"]
    methods = list(proj["methods"])
    gpus = next(a["value"] for a in report["assumptions"] if a["name"] == "gpus_per_node")
    lines = [f"### Projection: GPU recipes on {min(proj['nodes'])} to {max(proj['nodes'])} nodes of {gpus} GPUs", "", "Assumed (every GPU figure, and the flag that changes it):", "",
             "| assumption | value | flag | note |", "|---|---|---|---|"]  # fmt: skip
    for a in report["assumptions"]:
        flag = f"`{a['flag']}`" if a["flag"] else "-"
        lines.append(
            f"| {a['name']} | {str(a['value']) + ' ' + a['unit']} | {flag} | {a['note']} |".replace("  |", " |")
        )
    lines += ["", "Methods: " + "; ".join(f"`{m}` {t}" for m, t in proj["methods"].items()) + ".", ""]
    lines += _headlines(rows, proj)
    for recipe in proj["recipes"]:
        lines += ["", f"#### {recipe['name']}: {recipe['params'] / 1e6:,.0f}M parameters, {recipe['compute']}, "
                      f"{recipe['tokens_per_gpu_step']:,} tokens per GPU per optimizer step ({recipe['micro_batches']} micro-batches)", ""]  # fmt: skip
        lines.append("Step time in seconds (speedup over stock FSDP2 / over stock HSDP).")
        lines.append("")
        lines.append("| nodes | Gbit/s | compute s | " + " | ".join(methods) + " |")
        lines.append("|---|---|---|" + "---|" * len(methods))
        for n in nodes:
            for rate in proj["rates"]:
                cell = {
                    r["method"]: r
                    for r in rows
                    if r["recipe"] == recipe["name"] and r["nodes"] == n and r["bandwidth"] == rate
                }
                if not cell:
                    continue
                first = next(iter(cell.values()))
                parts = []
                for m in methods:
                    r = cell[m]
                    parts.append(f"{_s(r['step_s'])} ({r['speedup_vs_fsdp2']:.2f}x / {r['speedup_vs_hsdp']:.2f}x)")
                lines.append(
                    f"| {n} | {first['rate_bits_per_s'] / 1e9:g} | {_s(first['compute_s'])} | "
                    + " | ".join(parts)
                    + " |"
                )
    return lines


def _headlines(rows: list[dict], proj: dict) -> list[str]:
    """Per recipe, the best method's speedups at the largest cluster, slowest and fastest rate."""
    if not rows:
        return []
    big = max(proj["nodes"])
    rates = sorted(proj["rates"], key=lambda b: next(r["rate_bits_per_s"] for r in rows if r["bandwidth"] == b))
    lines = [f"Headlines at {big} nodes ({big * (rows[0]['gpus'] // rows[0]['nodes'])} GPUs):", ""]
    for recipe in proj["recipes"]:
        parts = []
        for rate in (rates[0], rates[-1]) if len(rates) > 1 else rates:
            cands = [
                r
                for r in rows
                if r["recipe"] == recipe["name"]
                and r["nodes"] == big
                and r["bandwidth"] == rate
                and r["method"] not in ("fsdp2", "hsdp")
            ]
            if not cands:
                continue
            best = max(cands, key=lambda r: r["speedup_vs_fsdp2"])
            parts.append(f"at {rate}, {best['method']} {best['speedup_vs_fsdp2']:.2f}x over FSDP2 and {best['speedup_vs_hsdp']:.2f}x over HSDP "
                         f"({_s(best['step_s'])} s, compute {_s(best['compute_s'])} s)")  # fmt: skip
        lines.append(f"- {recipe['name']}: " + "; ".join(parts) + ".")
    return lines


def render_markdown(report: dict, image: str | None = None) -> str:
    """The whole generated section, markers included."""
    lines = [
        MARK_BEGIN,
        "## Beyond two nodes: projected",
        "",
        "A cost model of one optimizer step, calibrated on the simulated cluster of `qaccel bench e2e` and projected to GPU "
        "clusters. Bytes are exact (the wire meter's formulas applied to every FSDP2 unit's parameter shapes, ring "
        "all-gather/all-reduce and all-to-all placed rank by rank, node by node); times follow the equations below. "
        "The projection is a model, not a measurement: every GPU figure it uses is an assumption listed with it.",
        "",
        "```bash",
        report["command"],
        "```",
        "",
        "```text",
        *report["equations"],
        "```",
        "",
        "Links: on the simulated cluster, one node's ranks share its loopback; on one node it is shaped (`tc tbf`), a bus "
        "for both directions and all ranks; on two nodes each loopback is unshaped (its cost is the host's TCP work `H`) and "
        "the veth pair between the namespaces is shaped at each end, one rate per direction. On GPUs: NVLink ports inside "
        "a node, one NIC per node between nodes. gloo's reduce-scatter is an all-reduce (twice the bytes); NCCL's is a ring.",
        "",
        *_calibration_lines(report["calibration"], report["inputs"]),
        "",
        *_projection_lines(report),
    ]
    if image:
        lines += ["", f"![qaccel bench project]({image})"]
    lines += ["", MARK_END]
    return "\n".join(lines) + "\n"


def write_markdown(path: str, text: str) -> None:
    """Replace this command's block in ``path`` between its markers, or append the block."""
    target = Path(path)
    old = target.read_text() if target.exists() else "# Benchmarks\n"
    if MARK_BEGIN in old and MARK_END in old:
        head, rest = old.split(MARK_BEGIN, 1)
        new = head + text.rstrip("\n") + rest.split(MARK_END, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(new)
    tmp.replace(target)


def plot(report: dict, png: str) -> None:
    """Speedup vs nodes, one panel per recipe, a line per method (colour) and rate (style): over FSDP2 (top), HSDP (bottom)."""
    from ._figures import headless_pyplot, save_figure

    plt = headless_pyplot()
    proj = report["projection"]
    rows = proj["rows"]
    recipes = [r["name"] for r in proj["recipes"]]
    methods = list(proj["methods"])
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(2, len(recipes), figsize=(4.3 * len(recipes), 9.0), squeeze=False, sharey="row")
    for row, (key, baseline) in enumerate((("speedup_vs_fsdp2", "stock FSDP2"), ("speedup_vs_hsdp", "stock HSDP"))):
        for ax, recipe in zip(axes[row], recipes, strict=True):
            for i, method in enumerate(methods):
                for j, rate in enumerate(proj["rates"]):
                    pts = sorted(
                        (r["nodes"], r[key])
                        for r in rows
                        if r["recipe"] == recipe and r["method"] == method and r["bandwidth"] == rate
                    )
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[j % len(styles)], color=f"C{i}", marker="o",
                            markersize=3, label=f"{method} @ {rate}")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(proj["nodes"], [str(n) for n in proj["nodes"]])
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{recipe}: over {baseline}", fontsize=10)
            if row == 1:
                ax.set_xlabel(f"nodes ({rows[0]['gpus'] // rows[0]['nodes']} GPUs each)")
        axes[row][0].set_ylabel(f"speedup over {baseline} (projected)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(methods), fontsize=8)
    fig.suptitle(
        "qaccel bench project: projected step time speedup (cost model calibrated on the simulated cluster; GPU figures assumed)"
    )
    fig.tight_layout(rect=(0, 0.08, 1, 0.97))
    save_figure(fig, png)
