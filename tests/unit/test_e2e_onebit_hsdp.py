"""``qaccel bench e2e --nodes N``'s 1-bit rows on HSDP shards: their method table entries, their schedule
weighting and the issue's two goals, on synthetic per-step records with hand-computed figures.

Reference for the weights: the closed forms in ``docs/zero_one_adam.md`` ("Step counts"): over the paper's
BERT-Large schedule (T = 152,000, var_freeze_step 12,500, kappa 16, local_step_scaler 1000, clipper 16) 0/1
Adam makes 153 variance steps plus the init step, 12,347 1-bit gradient steps, 10,344 sync steps and 129,155
local steps; 1-bit Adam (freeze_step 23,000) makes the init step, 22,999 full steps and 129,000 momentum steps.
"""

from __future__ import annotations

import pytest

from qaccel.bench import _e2e_cluster_report as cluster_report
from qaccel.bench._e2e_methods import (
    METHODS,
    NODES_DEFAULT_METHODS,
    NODES_ONEBIT_METHODS,
    Method,
    check_methods_for_nodes,
    default_methods,
    make_schedule,
    onebit_probe,
)
from qaccel.bench._e2e_report import add_speedups, paper_weights, summarize

T = 152_000
ZERO_ONE_COUNTS = {"init": 1, "full": 153, "onebit_gradient": 12_347, "sync": 10_344, "local": 129_155}
ONEBIT_COUNTS = {"init": 1, "full": 22_999, "onebit_momentum": 129_000}
NEW = ("hsdp-zero-one-adam", "hsdp-onebit-adam", "hqsdp-w8g8-zero-one-adam")


# -- the method table ------------------------------------------------------------------------------------
def test_the_hsdp_onebit_rows_shard_in_a_node_and_need_several_nodes():
    for name in NEW:
        method = METHODS[name]
        assert method.parallel == "fsdp" and method.mesh == "hqsdp" and method.schedule_weighted
        assert method.needs_nodes and name not in default_methods(1) and name in default_methods(2, everything=True)
    # every byte is metered by qaccel: the intra-node collectives go through its comms (compression off or W8G8)
    assert METHODS["hsdp-zero-one-adam"].qsdp == (None, None) and METHODS["hqsdp-w8g8-zero-one-adam"].qsdp == (8, 8)
    assert METHODS["hsdp-zero-one-adam"].optimizer == METHODS["zero-one-adam"].optimizer == "zero_one"
    assert METHODS["hsdp-onebit-adam"].optimizer == METHODS["onebit-adam"].optimizer == "onebit"
    # the documented --methods line: the new rows and their baseline, outside the (long enough) default run
    assert set(NODES_ONEBIT_METHODS) == {"hsdp-fp32", *NEW} and not set(NEW) & set(NODES_DEFAULT_METHODS)
    with pytest.raises(ValueError, match="hsdp-zero-one-adam: shards within a node"):
        check_methods_for_nodes(["ddp-adamw", "hsdp-zero-one-adam"], 1)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"parallel": "fsdp", "optimizer": "sgd"}, "optimizer='sgd', expected one of adamw, onebit, zero_one"),
        ({"parallel": "fsdp", "optimizer": "zero_one"}, "needs mesh='hqsdp'"),
        ({"parallel": "ddp", "ddp": "adamw", "optimizer": "zero_one"}, "needs ddp='onebit'"),
        ({"parallel": "ddp", "ddp": "onebit"}, "needs ddp='onebit' and only it"),
    ],
)
def test_an_impossible_method_row_is_refused_naming_it(kwargs, says):
    with pytest.raises(ValueError, match=f"Method bad: .*{says}"):
        Method("bad", "bad", **kwargs)


# -- the schedule weighting --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "counts"),
    [
        ("hsdp-zero-one-adam", ZERO_ONE_COUNTS),
        ("hqsdp-w8g8-zero-one-adam", ZERO_ONE_COUNTS),
        ("zero-one-adam", ZERO_ONE_COUNTS),
        ("hsdp-onebit-adam", ONEBIT_COUNTS),
        ("onebit-adam", ONEBIT_COUNTS),
    ],
)
def test_weights_are_the_step_kinds_shares_of_the_papers_schedule(method, counts):
    assert sum(counts.values()) == T
    assert paper_weights(method) == pytest.approx({kind: n / T for kind, n in counts.items()}, rel=1e-12)


@pytest.mark.parametrize(
    ("method", "kinds"), [("hsdp-zero-one-adam", ZERO_ONE_COUNTS), ("hsdp-onebit-adam", ONEBIT_COUNTS)]
)
@pytest.mark.parametrize("samples", [1, 3])
def test_the_probe_runs_every_step_kind_more_often_than_asked(method, kinds, samples):
    """The first step of a kind is never steady, so a kind needs samples + 1 steps at least (counted on a fresh
    schedule of the probe's kwargs, stepped by hand)."""
    kwargs, steps = onebit_probe(method, samples)
    schedule = make_schedule(METHODS[method].optimizer, kwargs)
    seen: dict[str, int] = {}
    for _ in range(steps):
        kind = schedule.next_kind()
        schedule.advance(kind)
        seen[kind.value] = seen.get(kind.value, 0) + 1
    assert set(seen) == set(kinds) and seen["init"] == 1
    assert min(n for kind, n in seen.items() if kind != "init") >= samples + 1


# -- synthetic two-node records ----------------------------------------------------------------------------
WORLD = 4
RATE = 100e6


def _step(kind: str, steady: bool, seconds: float, inter: float, meter_inter: float = 0.0) -> dict:
    """One step's record as rank 0 writes it for two nodes of two ranks: ``inter`` bytes on the veths (half
    each way), 1 MB on the loopbacks, ``meter_inter`` inter-node bytes on every rank's meter."""
    return {
        "kind": kind,
        "steady": steady,
        "seconds": seconds,
        "link_bytes": inter + 1e6,
        "meter_sent_bytes_per_rank": [meter_inter + 2e5] * WORLD,
        "inter_node_bytes": inter,
        "intra_node_bytes": 1e6,
        "inter_node_busiest_direction_bytes": inter / 2,
        "meter_by_level_per_rank": [{"intra_node": 2e5, "inter_node": meter_inter}] * WORLD,
    }


def _raw(steps: list[dict]) -> dict:
    return {"world_size": WORLD, "num_params": 1000, "nodes": 2, "nproc_per_node": 2, "steps": steps, "info": {}}


# per kind: (seconds, veth bytes, meter inter-node bytes per rank); init and full steps all-reduce exactly
ZERO_ONE_STEPS = {"init": (12.0, 100e6, 20e6), "full": (10.0, 100e6, 20e6), "onebit_gradient": (5.0, 3e6, 0.6e6),
                  "sync": (5.0, 3e6, 0.6e6), "local": (4.0, 1e4, 0.0)}  # fmt: skip


def _zero_one_raw(local_bytes: float = 1e4) -> dict:
    figures = dict(ZERO_ONE_STEPS, local=(4.0, local_bytes, 0.0))
    steps = [_step("init", False, *figures["init"])]
    for kind in ("full", "onebit_gradient", "sync", "local"):
        seconds, inter, meter = figures[kind]
        steps.append(_step(kind, False, 99.0, 999e6, meter))  # the first of its kind: not steady, left out
        steps += [_step(kind, True, seconds + delta, inter, meter) for delta in (-0.5, 0.0, 0.5)]
    return _raw(steps)


def _hsdp_raw() -> dict:
    # stock HSDP: 140 MB on the veths per step (70 MB each way: 5.6 s at 100 Mbit/s), 10 s per step
    return _raw([_step("step", i >= 2, 10.0, 140e6, 35e6) for i in range(5)])


def _rows(local_bytes: float = 1e4) -> dict[str, dict]:
    rows = [
        summarize(_hsdp_raw(), "hsdp-fp32", True, RATE, 4.0),
        summarize(_zero_one_raw(local_bytes), "hsdp-zero-one-adam", True, RATE, 4.0),
    ]
    add_speedups(rows)
    return {r["method"]: r for r in rows}


def test_a_zero_one_row_on_hsdp_shards_is_its_step_kinds_medians_weighted_by_the_schedule():
    row = _rows()["hsdp-zero-one-adam"]
    # hand-computed: sum over kinds of count x median / T
    step = (1 * 12 + 153 * 10 + 12_347 * 5 + 10_344 * 5 + 129_155 * 4) / T  # 631,617 / 152,000
    inter = (154 * 100e6 + (12_347 + 10_344) * 3e6 + 129_155 * 1e4) / T
    meter = (154 * 20e6 + (12_347 + 10_344) * 0.6e6) / T
    assert row["step_s"] == pytest.approx(631_617 / T) == pytest.approx(step)
    assert row["inter_node_bytes_per_step"] == pytest.approx(inter)
    assert row["inter_node_busiest_direction_bytes_per_step"] == pytest.approx(inter / 2)
    assert row["meter_bytes_by_level_per_rank_step"] == pytest.approx({"intra_node": 2e5, "inter_node": meter})
    assert row["t_comm_s"] == pytest.approx(inter / 2 * 8 / RATE) and row["ideal_full_overlap_s"] == 4.0
    assert row["measured_steps"] == 3  # steady steps of every kind (the init step is measured once)
    local = row["per_kind"]["local"]
    assert local["weight"] == pytest.approx(129_155 / T) and local["inter_node_bytes"] == 1e4
    assert local["seconds"]["median"] == 4.0 and local["seconds"]["n"] == 3 and local["steady"] is True
    assert row["per_kind"]["full"]["meter_inter_node_bytes_per_rank"] == 20e6
    assert row["per_kind"]["init"]["steady"] is False and row["per_kind"]["init"]["inter_node_bytes"] == 100e6
    assert row["speedup"]["hsdp-fp32"] == pytest.approx(10.0 / step)


def test_goals_of_zero_one_adam_on_hsdp_shards_say_met_or_missed_and_why():
    rows = _rows()
    goals = {g["goal"]: g for g in cluster_report.evaluate_goals(list(rows.values()))}
    zero_one, hsdp = rows["hsdp-zero-one-adam"], rows["hsdp-fp32"]
    weighted = ", weighted by the paper's schedule"
    bytes_goal = goals[f"hsdp-zero-one-adam+prefetch / hsdp-fp32+prefetch inter-node bytes (veth){weighted}"]
    # (a) inter-node bytes at most 1/100 of HSDP + AdamW's: 557,661.5 / 140e6 = 0.00398
    expected = (154 * 100e6 + 22_691 * 3e6 + 129_155 * 1e4) / T / 140e6
    assert bytes_goal["value"] == pytest.approx(expected) and expected == pytest.approx(557_661.5 / 140e6)
    assert (
        bytes_goal["op"] == "<=" and bytes_goal["target"] == 0.01 and bytes_goal["met"] and bytes_goal["reason"] is None
    )
    meter = (154 * 20e6 + 22_691 * 0.6e6) / T / 35e6
    assert bytes_goal["ideal"] == pytest.approx(meter)
    # (b) HSDP + AdamW's step time / 0/1 Adam's >= 3: 10 s / 4.155 s = 2.41, missed; compute bounds it
    step_goal = goals[f"hsdp-fp32+prefetch / hsdp-zero-one-adam+prefetch step time{weighted}"]
    assert step_goal["value"] == pytest.approx(10.0 * T / 631_617) and not step_goal["met"]
    assert step_goal["missed_by"] == pytest.approx(3.0 - 10.0 * T / 631_617)
    assert step_goal["ideal"] == pytest.approx(5.6 / 4.0)  # HSDP's link time (70 MB each way) over 0/1 Adam's compute
    reason = step_goal["reason"]
    assert reason.startswith("even at both full-overlap ideals the ratio is 1.40x") and "bound by compute" in reason
    assert "local 85.0% x 4 s" in reason and "full 0.1% x 10 s" in reason
    # 70 MB each way x 8 / (3 x 4 s): at 46.7 Mbit/s HSDP's link time alone is 3x 0/1 Adam's compute
    assert "at 46.7 Mbit/s or slower hsdp-fp32+prefetch's link time alone is 3x" in reason
    assert zero_one["speedup"]["hsdp-fp32"] == pytest.approx(step_goal["value"])
    # no hierarchical-QSDP goal is made up for the 1-bit row, and HSDP's row gets none of its own
    assert len(goals) == 2 and hsdp["schedule_weighted"] is False


def test_a_missed_bytes_goal_names_the_step_kind_that_sends_too_much():
    rows = _rows(local_bytes=2e6)  # local steps that leak 2 MB each between the nodes
    goal = next(g for g in cluster_report.evaluate_goals(list(rows.values())) if "inter-node bytes" in g["goal"])
    expected = (154 * 100e6 + 22_691 * 3e6 + 129_155 * 2e6) / T / 140e6  # 0.0167
    assert goal["value"] == pytest.approx(expected) and not goal["met"]
    assert goal["missed_by"] == pytest.approx(expected - 0.01)
    assert "local 85.0% x 2 MB" in goal["reason"] and "onebit_gradient 8.1% x 3 MB" in goal["reason"]


def test_the_markdown_shows_every_step_kind_of_the_weighted_rows():
    rows = list(_rows().values())
    report = {
        "settings": {"nodes": 2, "nproc_per_node": 2, "world_size": 4, "threads": 1, "model": "tiny", "batch_size": 2,
                     "seq_len": 32, "lr": 1e-4, "steps": 3, "warmup": 2},
        "machine": {"cpu": "cpu", "cpus": 2, "memory_gib": 8, "kernel": "6", "torch": "2", "transformers": "4"},
        "namespace": {"topology": "veth pair"},
        "compute_only": {"fp32": {"median_s": 4.0, "min_s": 4.0, "max_s": 4.0}},
        "shaping": {"100mbit": None},
        "results": rows,
        "goals": cluster_report.evaluate_goals(rows),
        "command": "qaccel bench e2e --nodes 2",
        "finished": "now",
        "num_params": 1000,
    }  # fmt: skip
    text = cluster_report.render_markdown(report)
    assert "| hsdp-zero-one-adam+prefetch | 100mbit | local | 84.9704% | 3 | 4.00 | 0.01 | 0.00 |" in text
    assert "| hsdp-zero-one-adam+prefetch | 100mbit | full | 0.1007% | 3 | 10.00 | 100.00 | 80.00 |" in text
    assert (
        "| hsdp-zero-one-adam+prefetch | 100mbit | init | 0.0007% | 1 (not steady) | 12.00 | 100.00 | 80.00 |" in text
    )
    assert "1-bit optimizer rows (hsdp-zero-one-adam, same lr) run a probe schedule with 3 steady steps" in text
    assert "| **no** (missed by 0.593) |" in text


def test_no_link_rate_reaches_a_step_goal_when_the_fast_row_sends_more_than_baseline_over_target():
    slow = {"inter_node_busiest_direction_bytes_per_step": 70e6, "t_compute_s": 4.0}
    assert (
        cluster_report.rate_for_step_goal(
            {"inter_node_busiest_direction_bytes_per_step": 30e6, "t_compute_s": 4.0}, slow, 3.0
        )
        is None
    )
    rate = cluster_report.rate_for_step_goal(
        {"inter_node_busiest_direction_bytes_per_step": 10e6, "t_compute_s": 2.0}, slow, 3.0
    )
    assert rate == pytest.approx(560e6 / 6.0)
    # at that rate: HSDP's ideal max(4, 560e6 / rate = 6 s) is 3 x the fast row's max(2, 80e6 / rate = 0.86 s)
    assert max(4.0, 560e6 / rate) == pytest.approx(3 * max(2.0, 80e6 / rate))
