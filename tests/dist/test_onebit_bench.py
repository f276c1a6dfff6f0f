"""``qaccel bench comm`` 1-bit section on the tiny GPT-2 and a short schedule, against independent counts.

Oracles: the ring all-reduce and 1-bit byte formulas of ``docs/zero_one_adam.md`` ("Wire format")
evaluated here from the model's parameter shapes, and the closed-form step kinds ("Schedules"). Ratios are
recomputed from those oracle totals, never from the report's own fields.
"""

from __future__ import annotations

import argparse
import math

from transformers import GPT2Config, GPT2LMHeadModel

from qaccel.bench import _comm_onebit
from tests._schedules import closed_form_kinds

T, F, KAPPA, ALPHA, H, FREEZE = 400, 40, 2, 20, 4, 60


def test_bench_rows_match_independent_counts():
    parser = argparse.ArgumentParser()
    _comm_onebit.add_arguments(parser)
    args = parser.parse_args(
        ["--onebit_model", "tiny", "--onebit_total_steps", str(T), "--onebit_var_freeze_step", str(F),
         "--onebit_var_update_scaler", str(KAPPA), "--onebit_local_step_scaler", str(ALPHA),
         "--onebit_local_step_clipper", str(H), "--onebit_freeze_step", str(FREEZE)]
    )  # fmt: skip
    report = _comm_onebit.measure(args)
    rows = {row["method"]: row for row in report["rows"]}
    assert report["onebit_bytes_match_formula"] is True

    model = GPT2LMHeadModel(GPT2Config(**_comm_onebit.MODELS["tiny"]))
    sizes = [p.numel() for p in model.parameters()]
    n = 2
    full = 2 * (n - 1) * 4 * sum(sizes) // n  # one DDP bucket: the tiny model is < 25 MB
    multiple = n * (8 * n // math.gcd(n, 8))
    padded = [math.ceil(m / multiple) * multiple for m in sizes]
    onebit = 2 * (n - 1) * (sum(p // (8 * n) for p in padded) + 4 * len(sizes))

    assert rows["DDP AdamW fp32"]["sent_bytes_per_step"] == full
    assert rows["DDP AdamW fp32"]["rounds"] == T

    kinds = closed_form_kinds(T, F, KAPPA, ALPHA, H)
    zo_total = kinds.count("full") * full + (kinds.count("onebit_gradient") + kinds.count("sync")) * onebit
    zo_rounds = T - kinds.count("init") - kinds.count("local")
    zo = rows["0/1 Adam"]
    assert zo["steps_by_kind"] == {k: kinds.count(k) for k in set(kinds)}
    assert zo["total_sent_bytes"] == zo_total
    assert zo["rounds"] == zo_rounds
    # ratios against the oracle's own totals, not the report's fields
    assert zo["ratio_vs_baseline"] == round(zo_total / (T * full), 5)
    assert zo["rounds_ratio_vs_baseline"] == round(zo_rounds / T, 4)

    ob_total = (FREEZE - 1) * full + (T - FREEZE) * onebit
    ob = rows["1-bit Adam"]
    assert ob["total_sent_bytes"] == ob_total and ob["ratio_vs_baseline"] == round(ob_total / (T * full), 5)
    assert ob["rounds"] == T - 1 and ob["rounds_ratio_vs_baseline"] == round((T - 1) / T, 4)
    assert rows["DDP AdamW fp32"]["ratio_vs_baseline"] == 1.0
    assert set(rows) == {"DDP AdamW fp32", "1-bit Adam", "0/1 Adam", "0/1 Adam (alpha=32678)"}

    # optimizer-step timings: every kind of the schedule is timed; the samples are the probe's steps of that
    # kind without the kind's first step and without the step that changes the phase (counted by hand from
    # the probe schedules: 0/1 Adam F=10, kappa=2, alpha=4, H=2, 21 steps; 1-bit Adam freeze 5, 10 steps)
    samples = {
        "0/1 Adam": {"init": 0, "full": 4, "onebit_gradient": 3, "sync": 6, "local": 2},
        "1-bit Adam": {"init": 0, "full": 2, "onebit_momentum": 4},
        "DDP AdamW fp32": {"step": 3},
    }
    for name, expected in samples.items():
        timed = rows[name]["optimizer_step_seconds_by_kind"]
        assert {kind: t["samples"] for kind, t in timed.items()} == expected, name
        assert all(t["seconds"] > 0 and t["one_time_only"] == (t["samples"] == 0) for t in timed.values())
        seconds = [t["seconds"] for t in timed.values()]
        assert min(seconds) <= rows[name]["optimizer_step_seconds_mean"] <= max(seconds)  # a weighted mean
