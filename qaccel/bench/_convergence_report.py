"""The convergence study's PNG (eval loss vs step with seed bands) and Markdown section."""

from __future__ import annotations

import math

from ._figures import headless_pyplot, save_figure

__all__ = ["plot", "markdown"]


def plot(report: dict, png: str) -> None:
    """Per task (and the long run), two panels: eval loss per method (mean, min..max band over seeds) and
    each method's per-seed difference to the baseline in % (mean, min..max band), with the baseline's
    own seed spread (± 1 std) shaded grey."""
    plt = headless_pyplot()
    panels = [(name + _mesh(report["tasks"][name]), report["tasks"][name]) for name in report["task_order"]]
    if report.get("long_run"):
        panels.append(("gpt2-tiny, long run", report["long_run"]))
    # Many methods (the low-bit study has 21): distinct tab20 colours and the legend beside the panels.
    many = max(len(task["methods"]) for _, task in panels) > 10
    width = 5.5 * len(panels) + (3.5 if many else 0.0)
    fig, axes = plt.subplots(2, len(panels), figsize=(width, 8 + (2 if many else 0)), squeeze=False, sharex="col")
    legend = {"fontsize": 6, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0)} if many else {"fontsize": 7}
    for col, (title, task) in enumerate(panels):
        top, bottom = axes[0][col], axes[1][col]
        methods = _ordered(task)
        base = next(m for m in methods if m["is_baseline"])
        steps = base["eval_curve"]["step"]
        base_mean = base["eval_curve"]["mean"]
        for index, method in enumerate(methods):
            band = method["eval_curve"]
            style = "--" if method["is_baseline"] else "-"
            colour = {"color": plt.cm.tab20(index % 20)} if many else {}
            line = top.plot(band["step"], band["mean"], style, label=method["label"], linewidth=1.2, **colour)
            color = line[0].get_color()
            if len(method["runs"]) > 1:
                top.fill_between(band["step"], band["min"], band["max"], alpha=0.15, color=color)
            if method["is_baseline"]:
                spread = [100.0 * sd / m for sd, m in zip(band["std"], base_mean, strict=True)]
                bottom.fill_between(steps, [-x for x in spread], spread, color="grey", alpha=0.25, label="baseline ± 1 std (seeds)")
                continue
            diffs = [  # per seed, per eval step: (method - baseline) / baseline mean, in %
                [100.0 * (p["eval_loss"] - q["eval_loss"]) / m for p, q, m in zip(run["eval"], base_run["eval"], base_mean, strict=True)]
                for run, base_run in zip(method["runs"], base["runs"], strict=True)
            ]
            per_step = list(zip(*diffs, strict=True))
            bottom.plot(steps, [sum(v) / len(v) for v in per_step], label=method["label"], color=color, linewidth=1.2)
            if len(diffs) > 1:
                bottom.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], color=color, alpha=0.15)
        seeds = len(base["runs"])
        top.set_title(f"{title} ({seeds} seed{'s' if seeds > 1 else ''}; band: min..max over seeds)", fontsize=9)
        top.set_ylabel("eval loss")
        top.legend(**legend)
        top.grid(alpha=0.3)
        bottom.axhline(0.0, color="black", linewidth=0.6)
        bottom.set_title("difference to the baseline, same seed", fontsize=9)
        bottom.set_ylabel("eval loss vs baseline (%)")
        bottom.set_xlabel("optimizer step")
        bottom.legend(**legend)
        bottom.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, png)


def _ordered(task: dict) -> list[dict]:
    """The task's methods in run order (the JSON itself is written with sorted keys)."""
    return [task["methods"][key] for key in task["method_order"]]


def _mesh(task: dict) -> str:
    """`` on R replicas x S ranks`` for a hierarchical task, else nothing."""
    return f" on {task['replicas']} replicas x {task['ranks_per_replica']} ranks" if "replicas" in task else ""


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    """Tables per task (final eval loss mean ± std, differences, verdicts) and the long run."""
    lines: list[str] = []
    for name in report["task_order"]:
        task = report["tasks"][name]
        # reports made before the study ran qaccel.train evaluated a fixed prefix of the eval split
        held_out = f"{task['eval_examples']} held-out examples" if "eval_examples" in task else "the recipe's eval split"
        lines += [
            f"#### {name}: {task['steps']} steps, {task['seeds']} seed{'s' if task['seeds'] != 1 else ''}, {task['world_size']} ranks{_mesh(task)}, "
            f"{task['per_device_batch_size']} examples per rank per step, eval on {held_out}",
            "",
        ]
        has_acc = any("final_eval_accuracy_mean" in m["summary"] for m in task["methods"].values())
        head = "| method | final eval loss (mean ± std) | vs baseline | in baseline stds | paired diff (mean ± std) |"
        rule = "|---|---|---|---|---|"
        if has_acc:
            head += " eval accuracy |"
            rule += "---|"
        inter = any("wire_bytes_inter_node_per_step_per_rank" in m["summary"] for m in task["methods"].values())
        head += " MB sent / step / rank |" + (" of which across replicas |" if inter else "") + " goal | verdict |"
        rule += "---|" + ("---|" if inter else "") + "---|---|"
        lines += [head, rule]
        for method in _ordered(task):
            s = method["summary"]
            z = s["diff_vs_baseline_in_baseline_std"]
            row = (
                f"| {method['label']} | {_fmt(s['final_eval_loss_mean'])} ± {_fmt(s['final_eval_loss_std'])} | "
                f"{s['diff_vs_baseline_pct']:+.2f}% | {'—' if z is None else f'{z:+.2f}'} | "
                f"{s['paired_diff_mean']:+.4f} ± {s['paired_diff_std']:.4f} |"
            )
            if has_acc:
                row += f" {_fmt(s['final_eval_accuracy_mean'], 3)} ± {_fmt(s['final_eval_accuracy_std'], 3)} |"
            goal = "—" if s["goal_pct"] is None else f"≤ +{s['goal_pct']:g}%"
            row += f" {s['wire_bytes_per_step_per_rank'] / 1e6:.3f} |"
            if inter:
                row += f" {s['wire_bytes_inter_node_per_step_per_rank'] / 1e6:.3f} |"
            row += f" {goal} | {s['verdict']} |"
            lines.append(row)
        lines.append("")
    if report.get("long_run"):
        long = report["long_run"]
        lines += [f"#### gpt2-tiny long run: {long['steps']} steps, 1 seed", "", "| method | eval loss at the end | vs baseline | min eval loss |", "|---|---|---|---|"]
        for method in _ordered(long):
            s = method["summary"]
            curve = method["eval_curve"]["mean"]
            lines.append(f"| {method['label']} | {_fmt(s['final_eval_loss_mean'])} | {s['diff_vs_baseline_pct']:+.2f}% | {_fmt(min(curve))} |")
        lines.append("")
    return "\n".join(lines)
