"""``qaccel bench e2e``'s overlap figures: each 1-bit step kind against its own ideal, the issue's goals at
50 and 300 Mbit/s, and the rows that switch an overlap off (synthetic one-node records; the figures are
computed here by hand from the records, not read back from the report)."""

from __future__ import annotations

import pytest

from qaccel.bench._e2e_methods import METHODS
from qaccel.bench._e2e_report import add_speedups, evaluate_goals, render_markdown, summarize

WORLD = 2
MBIT = 1e6


def _step(kind: str, steady: bool, seconds: float, link: float) -> dict:
    return {"kind": kind, "steady": steady, "seconds": seconds, "link_bytes": link, "meter_sent_bytes_per_rank": [link / WORLD] * WORLD}


def _onebit_raw(kinds: dict[str, tuple[float, float]]) -> dict:
    """Every kind once unsteady (left out of the medians), then three steady steps around ``seconds``."""
    steps = [_step("init", False, 1.0, 0.0)]
    for kind, (seconds, link) in kinds.items():
        steps.append(_step(kind, False, 99.0, 9e9))
        steps += [_step(kind, True, seconds + delta, link) for delta in (-0.1, 0.0, 0.1)]
    return {"world_size": WORLD, "num_params": 1000, "steps": steps, "info": {}}


def _flat_raw(seconds: float, link: float) -> dict:
    return {"world_size": WORLD, "num_params": 1000, "info": {}, "steps": [_step("step", i >= 2, seconds, link) for i in range(6)]}


def test_each_one_bit_kind_is_measured_against_its_own_ideal():
    # 4.375 MB on the link per compressed step: 0.7 s at 50 Mbit/s; compute 0.8 s
    row = summarize(_onebit_raw({"full": (23.0, 140e6), "onebit_momentum": (1.2, 4.375e6)}), "onebit-adam", None, 50 * MBIT, 0.8)
    kind = row["per_kind"]["onebit_momentum"]
    assert kind["t_comm_s"] == pytest.approx(0.7)
    assert kind["ideal_full_overlap_s"] == pytest.approx(0.8)  # compute-bound kind
    assert kind["over_ideal_full_overlap"] == pytest.approx(1.2 / 0.8)
    full = row["per_kind"]["full"]
    assert full["ideal_full_overlap_s"] == pytest.approx(140e6 * 8 / 50e6)  # link-bound kind: 22.4 s
    assert full["over_ideal_full_overlap"] == pytest.approx(23.0 / 22.4)


def _goal_rows() -> list[dict]:
    rate50, rate300 = 50 * MBIT, 300 * MBIT
    rows = [
        summarize(_onebit_raw({"full": (23.0, 140e6), "onebit_momentum": (1.0, 4.375e6)}), "onebit-adam", None, rate50, 0.8),
        summarize(
            _onebit_raw({"full": (23.0, 140e6), "onebit_gradient": (1.2, 4.375e6), "local": (0.86, 0.0), "sync": (1.3, 4.375e6)}),
            "zero-one-adam", None, rate50, 0.8,
        ),
        summarize(_onebit_raw({"full": (23.0, 140e6), "onebit_momentum": (1.5, 4.375e6)}), "onebit-adam-serial", None, rate50, 0.8),
        summarize(_onebit_raw({"full": (23.0, 140e6), "onebit_momentum": (0.9, 4.375e6)}), "onebit-adam-4mb", None, rate50, 0.8),
        # QSDP W8G8 at 300 Mbit/s: 33.75 MB per step is 0.9 s of link; 1.0 s per step, compute 0.7 s
        summarize(_flat_raw(1.0, 33.75e6), "qsdp-w8g8", True, rate300, 0.7),
        summarize(_flat_raw(1.2, 33.75e6), "qsdp-w8g8-rs-serial", True, rate300, 0.7),
        summarize(_flat_raw(4.2, 150e6), "fsdp2-fp32-a2a", True, rate300, 0.7),
    ]
    add_speedups(rows)
    return rows


def test_the_issue_goals_with_their_verdicts():
    goals = {g["goal"]: g for g in evaluate_goals(_goal_rows())}
    # 1-bit Adam: 1.0 s against max(0.8, 0.7) = 0.8 s -> 1.25 > 1.15
    momentum = goals["onebit-adam onebit_momentum step / max(T_compute, T_comm)"]
    assert momentum["bandwidth"] == "50mbit" and momentum["value"] == pytest.approx(1.25) and not momentum["met"]
    assert momentum["missed_by"] == pytest.approx(0.10)
    gradient = goals["zero-one-adam onebit_gradient step / max(T_compute, T_comm)"]
    assert gradient["value"] == pytest.approx(1.5) and not gradient["met"]
    local = goals["zero-one-adam local step / T_compute"]
    assert local["value"] == pytest.approx(0.86 / 0.8) and not local["met"]  # 1.075 > 1.05
    # the 4 MB-bucket row is held to the same goal: 0.9 s against 0.8 s -> 1.125, met
    small = goals["onebit-adam-4mb onebit_momentum step / max(T_compute, T_comm)"]
    assert small["value"] == pytest.approx(1.125) and small["met"]
    # the serial row is reported, not held to the goal
    assert not any(name.startswith("onebit-adam-serial") for name in goals)
    # 0.9 s of link and 0.7 s of compute: ideal 0.9 s; 1.0 s -> 90%, met at >= 90%; the serial row 75%
    assert goals["qsdp-w8g8+prefetch at the full-overlap ideal"]["value"] == pytest.approx(0.9)
    assert goals["qsdp-w8g8+prefetch at the full-overlap ideal"]["met"]
    assert not goals["qsdp-w8g8-rs-serial+prefetch at the full-overlap ideal"]["met"]
    fair = goals["fsdp2-fp32-a2a+prefetch / qsdp-w8g8+prefetch step time"]
    assert fair["value"] == pytest.approx(4.2) and fair["met"]


def test_the_markdown_has_the_per_kind_table():
    report = {
        "settings": {"world_size": 2, "threads": 1, "model": "tiny", "batch_size": 1, "seq_len": 8, "lr": 1e-4, "steps": 3, "warmup": 2},
        "machine": {"cpu": "cpu", "cpus": 2, "memory_gib": 24, "kernel": "k", "torch": "t", "transformers": "t"},
        "finished": "now", "num_params": 1000, "command": "qaccel bench e2e", "compute_only": {},
        "shaping": {}, "results": _goal_rows()[:1], "goals": [],
    }  # fmt: skip
    text = render_markdown(report)
    assert "| onebit-adam | 50mbit | onebit_momentum | 84.8684% | 1.00 | 2.19 | 0.70 | 0.80 | 1.25 |" in text


def test_overlap_rows_differ_from_their_twins_only_in_the_switch():
    for twin, serial, field in (
        ("onebit-adam", "onebit-adam-serial", "overlap_comm"),
        ("zero-one-adam", "zero-one-adam-serial", "overlap_comm"),
        ("qsdp-w8g8", "qsdp-w8g8-rs-serial", "overlap_reduce_scatter"),
        ("qsdp-w4g4", "qsdp-w4g4-rs-serial", "overlap_reduce_scatter"),
        ("onebit-adam", "onebit-adam-4mb", "ddp_buckets"),
        ("zero-one-adam", "zero-one-adam-4mb", "ddp_buckets"),
    ):
        a, b = METHODS[twin], METHODS[serial]
        differ = [name for name in a.__dataclass_fields__ if name not in ("name", "title") and getattr(a, name) != getattr(b, name)]
        assert differ == [field], (twin, serial, differ)
