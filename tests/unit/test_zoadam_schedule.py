"""Schedules of 0/1 Adam and 1-bit Adam against the closed forms of ``docs/zero_one_adam.md``, "Schedules".

The closed forms are re-derived here from the formulas, not from qaccel's state machine:
variance updates at t_0 = 2 and t_j = I_j (floor(t_{j-1} / I_j) + 1) with I_j = 2^floor(j / kappa), for
t <= F + 1 (and t = 2 even when F < 1); in phase 2 (k = t - max(F + 1, 2) >= 1) a sync iff
t mod min(H, 2^floor((k - 1) / alpha)) == 0.
"""

from __future__ import annotations

import pytest

from qaccel.optim import CommPlan, OneBitAdamSchedule, Phase, StepKind, ZeroOneAdamSchedule, count_step_kinds
from tests._schedules import closed_form_kinds


def run_kinds(schedule, total: int) -> list[str]:
    kinds = []
    for _ in range(total):
        kind = schedule.next_kind()
        kinds.append(kind.value)
        schedule.advance(kind)
    return kinds


@pytest.mark.parametrize(
    "F, kappa, alpha, H",
    [(12, 2, 2, 4), (10, 1, 1, 2), (100, 16, 3, 16), (0, 16, 1000, 16), (1, 3, 5, 8), (40, 4, 1, 1), (7, 1, 4, 32)],
)
def test_zero_one_adam_steps_follow_closed_form(F, kappa, alpha, H):
    total = F + 300
    assert run_kinds(ZeroOneAdamSchedule(F, kappa, alpha, H), total) == closed_form_kinds(total, F, kappa, alpha, H)


def test_kappa16_variance_steps_table():
    """docs/zero_one_adam.md, "Schedules": kappa = 16 gives variance updates at 2..17, 18..48 step 2, 52..112 step 4, 120..240 step 8."""
    kinds = run_kinds(ZeroOneAdamSchedule(100000, 16, 32678, 16), 500)
    variance = [t for t, kind in enumerate(kinds, start=1) if kind == "full"]
    expected = list(range(2, 18)) + list(range(18, 49, 2)) + list(range(52, 113, 4)) + list(range(120, 241, 8))
    expected += [2**4 * m for m in range(16, 32) if 2**4 * m <= 500]  # row l = 4: 2^4 * 16, 2^4 * 17, ...
    assert variance == expected


def test_f12500_has_153_variance_updates_ending_at_12288():
    kinds = run_kinds(ZeroOneAdamSchedule(12500, 16, 1000, 16), 12501)
    variance = [t for t, kind in enumerate(kinds, start=1) if kind == "full"]
    assert len(variance) == 153 and variance[-1] == 12288


@pytest.mark.parametrize(
    "alpha, syncs, silent",
    [(32678, 61821, 77678), (1000, 10344, 129155)],
    ids=["alpha32678", "alpha1000"],
)
def test_round_count_table_T152000(alpha, syncs, silent):
    """docs/zero_one_adam.md, "Schedules", round-count table: T = 152,000, F = 12,500, kappa = H = 16. The init step's full-precision
    round of DeepSpeed is skipped by qaccel (its gradient is discarded), hence 153 + init instead of 154."""
    counts = count_step_kinds(lambda: ZeroOneAdamSchedule(12500, 16, alpha, 16), 152000)
    assert counts[StepKind.INIT] == 1
    assert counts[StepKind.FULL] == 153
    assert counts[StepKind.ONEBIT_GRADIENT] == 12347
    assert counts[StepKind.SYNC] == syncs
    assert counts[StepKind.LOCAL] == silent
    assert sum(counts.values()) == 152000


@pytest.mark.parametrize("freeze_step", [0, 1, 2, 3, 10])
def test_onebit_adam_warmup_until_freeze_step(freeze_step):
    kinds = run_kinds(OneBitAdamSchedule(freeze_step), 20)
    last_warmup = max(freeze_step, 2)  # DeepSpeed freezes after a step whose counter >= freeze_step, never at init
    assert kinds == ["init"] + ["full"] * (last_warmup - 1) + ["onebit_momentum"] * (20 - last_warmup)


def test_comm_plan_reads_the_schedule_and_state_round_trips():
    schedule = ZeroOneAdamSchedule(5, 1, 1, 4)
    plan = CommPlan(schedule)
    seen = []
    for _ in range(12):
        kind = schedule.next_kind()
        seen.append(plan.full_allreduce_next)
        assert plan.full_allreduce_next == (kind is StepKind.FULL)
        schedule.advance(kind)
    assert seen[:5] == [False, True, False, True, False]  # init, 2 (var), 3 (1-bit), 4 (var), 5 (1-bit)
    copy = ZeroOneAdamSchedule(5, 1, 1, 4)
    copy.load_state_dict(schedule.state_dict())
    assert copy == schedule and copy.phase is Phase.LOCAL_STEPS
    assert run_kinds(copy, 30) == run_kinds(schedule, 30)


def test_advance_rejects_a_kind_the_schedule_did_not_plan():
    schedule = ZeroOneAdamSchedule(5, 1, 1, 4)
    with pytest.raises(RuntimeError, match="must be init"):
        schedule.advance(StepKind.FULL)


@pytest.mark.parametrize("key, value", [("var_update_scaler", 0), ("local_step_scaler", -1), ("var_freeze_step", 1.5)])
def test_schedule_validates(key, value):
    args = dict(var_freeze_step=5, var_update_scaler=1, local_step_scaler=1, local_step_clipper=4)
    args[key] = value
    with pytest.raises(ValueError, match=key):
        ZeroOneAdamSchedule(**args)
