"""Seed statistics of the convergence study: mean ± std, difference to the baseline, verdict.

A single run can mislead (one QSDP seed matched the baseline, the next was ten times worse), so
every number here is over seeds: the final eval loss as mean ± sample standard deviation, the
difference of the means in % of the baseline and in units of the baseline's seed std, and the
paired difference (same seed, hence same data order, for both methods), whose spread shows
whether a gap is larger than what the seeds alone produce.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["mean_std", "curve_band", "summarize_method", "verdict"]


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std (0 for one value); NaN if any value is not finite."""
    if not values or not all(math.isfinite(v) for v in values):
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def curve_band(runs: list[dict], key: str = "eval_loss") -> dict[str, list[float]]:
    """Per eval step: mean, std, min and max of ``key`` over the runs (all runs share the steps)."""
    steps = [point["step"] for point in runs[0]["eval"]]
    out: dict[str, list[float]] = {"step": steps, "mean": [], "std": [], "min": [], "max": []}
    for i in range(len(steps)):
        values = [run["eval"][i][key] for run in runs]
        mean, std = mean_std(values)
        out["mean"].append(mean)
        out["std"].append(std)
        out["min"].append(min(values))
        out["max"].append(max(values))
    return out


def _final(runs: list[dict], key: str) -> list[float]:
    return [run["eval"][-1][key] for run in runs]


def summarize_method(runs: list[dict], baseline_runs: list[dict], goal_pct: float | None, *, is_baseline: bool) -> dict:
    """Final-value statistics of one method against the baseline (runs in the same seed order)."""
    finals = _final(runs, "eval_loss")
    base = _final(baseline_runs, "eval_loss")
    mean, std = mean_std(finals)
    base_mean, base_std = mean_std(base)
    paired = [a - b for a, b in zip(finals, base, strict=True)]
    paired_mean, paired_std = mean_std(paired)
    diff_pct = 100.0 * (mean - base_mean) / base_mean
    summary = {
        "final_eval_loss": finals,
        "final_eval_loss_mean": mean,
        "final_eval_loss_std": std,
        "diff_vs_baseline_pct": 0.0 if is_baseline else diff_pct,
        "diff_vs_baseline_in_baseline_std": None if is_baseline or base_std == 0 else (mean - base_mean) / base_std,
        "paired_diff_mean": 0.0 if is_baseline else paired_mean,
        "paired_diff_std": 0.0 if is_baseline else paired_std,
        "goal_pct": goal_pct,
        "wire_bytes_per_step_per_rank": statistics.fmean(run["sent_bytes"] / len(run["train_loss"]) for run in runs),
    }
    if "eval_accuracy" in runs[0]["eval"][-1]:
        acc_mean, acc_std = mean_std(_final(runs, "eval_accuracy"))
        summary.update(final_eval_accuracy=_final(runs, "eval_accuracy"), final_eval_accuracy_mean=acc_mean, final_eval_accuracy_std=acc_std)
    summary["verdict"] = "baseline" if is_baseline else verdict(mean, base_mean, base_std, goal_pct)
    return summary


def verdict(mean: float, base_mean: float, base_std: float, goal_pct: float | None) -> str:
    """``met`` / ``missed by X%`` against the goal; ``no goal`` where the issue sets none.

    Met means both: the mean is at most ``goal_pct`` % above the baseline's mean, and it is not
    outside the baseline's seed spread (at most one baseline std above its mean). Lower is never
    penalised.
    """
    if not math.isfinite(mean):
        return "diverged (non-finite loss)"
    excess_pct = 100.0 * (mean - base_mean) / base_mean
    within_spread = mean <= base_mean + base_std
    if goal_pct is None:
        return f"no goal ({excess_pct:+.2f}%, {'within' if within_spread else 'outside'} the baseline's seed spread)"
    problems = []
    if excess_pct > goal_pct:
        problems.append(f"missed by {excess_pct - goal_pct:.2f} points ({excess_pct:+.2f}% vs +{goal_pct:g}%)")
    if not within_spread:
        problems.append("outside the baseline's seed spread (mean > baseline mean + 1 std)")
    return "met" if not problems else "; ".join(problems)
