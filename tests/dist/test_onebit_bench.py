"""``qaccel bench comm`` 1-bit section on the tiny GPT-2 and a short schedule, against independent counts.

Oracles: the ring all-reduce and 1-bit byte formulas of ``shared/design/zero_one_adam.md`` section 5.2
evaluated here from the model's parameter shapes, and the closed-form step kinds of section 4.
"""

from __future__ import annotations

import argparse
import math

from transformers import GPT2Config, GPT2LMHeadModel

from qaccel.bench import _comm_onebit
from tests.unit.test_zoadam_schedule import closed_form_kinds

T, F, KAPPA, ALPHA, H, FREEZE = 400, 40, 2, 20, 4, 60


def test_bench_rows_match_independent_counts():
    parser = argparse.ArgumentParser()
    _comm_onebit.add_arguments(parser)
    args = parser.parse_args(
        ["--onebit-model", "tiny", "--onebit-total-steps", str(T), "--onebit-var-freeze-step", str(F),
         "--onebit-var-update-scaler", str(KAPPA), "--onebit-local-step-scaler", str(ALPHA),
         "--onebit-local-step-clipper", str(H), "--onebit-freeze-step", str(FREEZE)]
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
    zo = rows["0/1 Adam"]
    assert zo["steps_by_kind"] == {k: kinds.count(k) for k in set(kinds)}
    assert zo["total_sent_bytes"] == kinds.count("full") * full + (kinds.count("onebit_gradient") + kinds.count("sync")) * onebit
    assert zo["rounds"] == T - kinds.count("init") - kinds.count("local")
    assert zo["ratio_vs_baseline"] == round(zo["total_sent_bytes"] / (T * full), 5)

    ob = rows["1-bit Adam"]
    assert ob["total_sent_bytes"] == (FREEZE - 1) * full + (T - FREEZE) * onebit
    assert ob["rounds"] == T - 1 and ob["rounds_ratio_vs_baseline"] == round((T - 1) / T, 4)
    assert set(rows) == {"DDP AdamW fp32", "1-bit Adam", "0/1 Adam", "0/1 Adam (alpha=32678)"}
