"""``qaccel bench project``: the byte formulas, the time model, the calibration and the command line.

References are independent of the code under test: bytes a real two-rank gloo run's wire meter recorded
(``docs/bench/e2e.json``), payload sizes counted by hand from the wire format, link placement enumerated
rank by rank, step times worked out by hand.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields

import pytest
import torch

from qaccel.bench._project_bytes import METHODS, Collective, ModelShapes, Traffic, Unit, group_traffic, step_collectives
from qaccel.bench._project_model import (
    CalibrationCase,
    CodecRates,
    Link,
    Platform,
    fit_calibration,
    predict_case,
    step_time,
)
from qaccel.cli import main


# -- where bytes go --------------------------------------------------------------------------------
def _enumerate(group: str, algorithm: str, b: float, nodes: int, g: int) -> Traffic:
    """Every message of every member of every group at once, summed per link for node 0."""
    total = nodes * g
    if group == "flat":
        groups = [list(range(total))]
    elif group == "node":
        groups = [list(range(k * g, (k + 1) * g)) for k in range(nodes)]
    else:
        groups = [[k * g + j for k in range(nodes)] for j in range(g)]
    messages = []  # (src, dst, bytes)
    for members in groups:
        m = len(members)
        for i, src in enumerate(members):
            if algorithm == "all_to_all":
                messages += [(src, dst, b / (m - 1)) for dst in members if dst != src]
            else:
                messages.append((src, members[(i + 1) % m], b))
    node = lambda r: r // g  # noqa: E731
    bus = sum(n for s, d, n in messages if node(s) == node(d) == 0)
    port = max((sum(n for s, d, n in messages if s == r and node(d) == node(r)) for r in range(total)), default=0.0)
    nic = sum(n for s, d, n in messages if node(s) == 0 and node(d) != 0)
    across = sum(n for s, d, n in messages if node(s) != node(d))
    return Traffic(b, bus, port, nic, sum(n for _, _, n in messages), across)


_PLACEMENTS = [
    (group, nodes, g)
    for group in ("flat", "node", "replica")
    for nodes, g in ((1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (3, 2), (4, 8))
    if {"flat": nodes * g, "node": g, "replica": nodes}[group] >= 2  # a group of one rank sends nothing
]


@pytest.mark.parametrize("algorithm", ["ring_all_gather", "ring_all_reduce", "all_to_all"])
@pytest.mark.parametrize("group,nodes,g", _PLACEMENTS)
def test_link_placement_matches_a_rank_by_rank_count(group, algorithm, nodes, g):
    got = group_traffic(group, algorithm, 840.0, nodes, g)
    want = _enumerate(group, algorithm, 840.0, nodes, g)
    for field in fields(Traffic):
        assert getattr(got, field.name) == pytest.approx(getattr(want, field.name)), field.name


def test_group_traffic_refuses_unknown_groups_and_algorithms():
    with pytest.raises(ValueError, match=r"group='ring'.*allowed: flat, node, replica"):
        group_traffic("ring", "all_to_all", 1.0, 2, 2)
    with pytest.raises(ValueError, match=r"algorithm='tree'"):
        group_traffic("flat", "tree", 1.0, 2, 2)


# -- bytes of a step ---------------------------------------------------------------------------------
def _gpt2_17m() -> ModelShapes:
    """``qaccel bench e2e``'s gpt2-17m written out by hand (GPT-2's Conv1D weights are (in, out))."""
    d, vocab, positions = 384, 8192, 128
    block = ((d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,))
    root = Unit("root", ((vocab, d), (positions, d), (d,), (d,)), root=True)
    return ModelShapes("gpt2-17m", (root, *(Unit(f"h.{i}", block) for i in range(8))))


def _sent(collectives, phase: str) -> float:
    return sum(c.count * c.traffic.sent_per_rank for c in collectives if c.phase == phase)


# What the wire meter recorded per rank and step in the real 2-rank gloo run of docs/bench/e2e.json
# (meter_by_kind): (method, compute dtype) -> (all-gather bytes, reduce-scatter bytes).
METER_2_RANKS = {
    ("fsdp2", torch.float32): (63_174_144, 34_782_720),
    ("fsdp2", torch.bfloat16): (31_587_072, 17_391_360),
    ("qsdp-w8g8", torch.float32): (16_037_568, 8_824_512),
    ("qsdp-w4g4", torch.float32): (8_530_176, 4_690_176),
    ("qsdp-w8g8", torch.bfloat16): (15_956_928, 8_783_808),
    ("qsdp-w4g4", torch.bfloat16): (8_449_536, 4_649_472),
}


@pytest.mark.parametrize("method,dtype", list(METER_2_RANKS))
def test_step_bytes_equal_what_the_meter_recorded_in_a_real_run(method, dtype):
    shapes = _gpt2_17m()
    assert shapes.num_params == 17_391_360
    collectives = step_collectives(
        shapes, METHODS[method], nodes=1, per_node=2, param_dtype=dtype, reduce_dtype=dtype, backend="nccl"
    )
    ag, rs = METER_2_RANKS[(method, dtype)]
    assert _sent(collectives, "all_gather") == ag
    assert _sent(collectives, "reduce_scatter") == rs


def test_gloo_reduce_scatter_is_an_all_reduce_on_the_link():
    # docs/bench/e2e.json, fsdp2-fp32 @ 300mbit: 265,874,215 bytes crossed the loopback per step; the model's
    # payload bytes (AG ring + RS as a ring all-reduce, both ranks) must be those minus TCP/IP framing (< 0.5 %)
    collectives = step_collectives(_gpt2_17m(), METHODS["fsdp2"], nodes=1, per_node=2, param_dtype=torch.float32,
                                   reduce_dtype=torch.float32, backend="gloo")  # fmt: skip
    machine = sum(c.count * c.traffic.machine for c in collectives)
    assert machine == 2 * (63_174_144 + 2 * 34_782_720)
    assert 0 < 265_874_215 / machine - 1 < 0.005


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


def _blob(quantized: list[int], raw: int, bits: int, bucket: int, meta: int, elem: int) -> int:
    """Wire format by hand: packed codes | pad 4 | lo and scale per bucket | raw elements | pad 4."""
    codes = sum(math.ceil(n * bits / 8) for n in quantized)
    buckets = sum(math.ceil(n / bucket) for n in quantized)
    return _align4(codes) + 2 * meta * buckets + _align4(raw * elem)


def test_hierarchical_bytes_against_a_hand_count_of_the_wire_format():
    # one unit: a (40, 700) matrix and a (700,) bias, sharded over the 4 ranks of a node, 3 nodes
    unit = Unit("u", ((40, 700), (700,)))
    shapes = ModelShapes("m", (Unit("root", ((64, 64),), root=True), unit))
    cs = step_collectives(shapes, METHODS["hqsdp-w8g8-r4"], nodes=3, per_node=4, param_dtype=torch.float32,
                          reduce_dtype=torch.float32, backend="nccl")  # fmt: skip
    mine = {c.phase: c for c in cs if c.unit == "u"}
    shard_q, shard_raw = 10 * 700, 175  # ceil(40/4) rows of 700; 700/4 bias elements
    w8 = _blob([shard_q], shard_raw, bits=8, bucket=1024, meta=4, elem=4)
    assert mine["all_gather"].traffic.sent_per_rank == 3 * w8  # ring: (S-1) blobs
    assert mine["all_gather"].traffic.inter_nic == 0 and mine["all_gather"].count == 2
    assert mine["reduce_scatter"].traffic.sent_per_rank == 3 * w8  # all-to-all to the 3 others
    # replica chunks: every segment cut in 3 pieces of ceil(n/3); 4 bits, buckets of 128, bf16 lo/scale
    r4 = _blob([math.ceil(shard_q / 3)], math.ceil(shard_raw / 3), bits=4, bucket=128, meta=2, elem=4)
    ar = mine["replica_all_reduce"]
    assert ar.traffic.sent_per_rank == 2 * r4 + 2 * r4  # reduce-scatter (R-1 chunks) + all-gather (R-1 chunks)
    assert ar.traffic.inter_nic == 4 * ar.traffic.sent_per_rank  # the node's 4 ranks all send across
    assert ar.traffic.intra_bus == 0 and ar.steps == 4
    # the root unit's 64x64 shard (1024 elements) is below unit_min_numel: stock collectives, exact all-reduce
    root = {c.phase: c for c in cs if c.root}
    assert root["all_gather"].traffic.sent_per_rank == 3 * 16 * 64 * 4 and not root["all_gather"].encode
    assert root["replica_all_reduce"].traffic.sent_per_rank == 2 * 2 * (16 * 64 * 4) // 3


def test_stock_hsdp_crosses_nodes_with_the_shard_only_and_fsdp_with_everything():
    shapes = _gpt2_17m()
    kw = dict(nodes=2, per_node=2, param_dtype=torch.float32, reduce_dtype=torch.float32, backend="gloo")
    hsdp = step_collectives(shapes, METHODS["hsdp"], **kw)
    fsdp = step_collectives(shapes, METHODS["fsdp2"], **kw)
    inter = lambda cs: sum(c.count * c.traffic.inter_nic for c in cs)  # noqa: E731
    shard_bytes = sum(math.ceil(s[0] / 2) * math.prod(s[1:]) * 4 for u in shapes.units for s in u.shapes)
    assert inter(hsdp) == 2 * shard_bytes  # each node's 2 ranks send their whole shard once (ring over 2 replicas)
    assert all(c.traffic.inter_nic == 0 for c in hsdp if c.phase != "replica_all_reduce")
    # flat ring over 4 ranks on 2 nodes: one rank's bytes leave each node per collective
    assert inter(fsdp) == sum(c.count * c.traffic.sent_per_rank for c in fsdp)
    with pytest.raises(ValueError, match="nodes=1 must be >= 2"):
        step_collectives(shapes, METHODS["hsdp"], **{**kw, "nodes": 1})


# -- the time model -------------------------------------------------------------------------------------
def _bus_collectives() -> list[Collective]:
    bus = lambda n: Traffic(n, n, n, 0.0, n, 0.0)  # noqa: E731
    return [
        Collective("root", True, "all_gather", 1, bus(100.0)),
        Collective("h", False, "all_gather", 2, bus(200.0)),
        Collective("h", False, "reduce_scatter", 1, bus(300.0)),
        Collective("root", True, "reduce_scatter", 1, bus(100.0)),
    ]


def _bus(alpha: float, **kw) -> Platform:
    return Platform(Link("bus", 100.0), None, CodecRates({8: 0.0}, {8: 0.0}), overlap={True: alpha, False: alpha}, **kw)


@pytest.mark.parametrize(
    "compute,alpha,prefetch,want",
    [
        (5.0, 1.0, True, 9.0),  # comm-bound: C = 9 s of link time, compute hidden
        (10.0, 1.0, True, 12.0),  # compute-bound: A + E = 10 + (1 + 1)
        (10.0, 0.0, True, 19.0),  # no overlap: A + C
        (10.0, 0.5, True, 15.5),  # 10 + 9 - 0.5 * min(10, 9 - 2)
        (10.0, 1.0, False, 14.0),  # no prefetch: the forward all-gathers (1 s + 2 s) are edges too: 10 + 4
    ],
)
def test_step_time_by_hand(compute, alpha, prefetch, want):
    t = step_time(_bus_collectives(), _bus(alpha), compute_s=compute, prefetch=prefetch)
    assert t.comm_s == pytest.approx(9.0)
    assert t.total_s == pytest.approx(want)


def test_codec_host_and_latency_terms_by_hand():
    # 8000 bytes sent by all ranks, 6000 of them across nodes: host cost 1e-6 s/B on NVLink-ish ports, 2e-6 on the NIC
    traffic = Traffic(1000.0, 0.0, 0.0, 4000.0, 8000.0, 6000.0)
    c = Collective("root", True, "replica_all_reduce", 1, traffic, steps=3, encode={8: 2e6}, decode={4: 1e6})
    codec = CodecRates({8: 1e-9}, {8: 3e-9}, source="test")  # 4 bits: the nearest measured width, 8
    platform = Platform(Link("port", 1e3, host_s_per_byte=1e-6), Link("nic", 2000.0, latency_s=0.01, host_s_per_byte=2e-6),
                        codec, codec_share=2.0, overlap={True: 1.0, False: 1.0})  # fmt: skip
    t = step_time([c], platform, compute_s=1.0, prefetch=True)
    assert t.codec_s == pytest.approx(2 * (2e6 * 1e-9 + 1e6 * 3e-9))  # two ranks per core
    assert t.host_s == pytest.approx(2000.0 * 1e-6 + 6000.0 * 2e-6)
    assert t.link_busy_s["inter_node"] == pytest.approx(4000.0 / 2000.0 + 3 * 0.01)
    assert t.edge_s == pytest.approx(2.03)
    # A = 1 + 0.01 + 0.014 = 1.024; C = E = 2.03: nothing to hide, so T = A + C
    assert t.total_s == pytest.approx(1.024 + 2.03)


def test_link_refuses_bad_kinds_and_rates():
    with pytest.raises(ValueError, match="Link.kind='wire'"):
        Link("wire", 1.0)
    with pytest.raises(ValueError, match="must be > 0 or None"):
        Link("bus", 0.0)


def test_fit_recovers_the_constants_that_made_the_data():
    h_shaped, h_unshaped, a_off, a_on = 4e-9, 1.5e-9, 0.3, 0.8
    cases = []
    for i, (compute, shaped, unshaped, comm, edge, prefetch) in enumerate(
        [
            (1.0, 5e8, 0.0, 6.0, 0.5, False),
            (2.0, 1e8, 0.0, 1.0, 0.2, False),
            (1.5, 2e8, 0.0, 3.0, 0.3, False),
            (1.0, 5e8, 0.0, 6.0, 0.5, True),
            (3.0, 1e8, 0.0, 1.5, 0.2, True),
            (0.5, 3e8, 0.0, 2.0, 0.1, True),
            (2.0, 1e8, 6e8, 4.0, 0.2, True),
            (2.5, 4e7, 2e8, 1.0, 0.1, True),
        ]  # fmt: skip
    ):
        proto = CalibrationCase(compute, shaped, unshaped, comm, edge, prefetch, 1.0)
        measured = predict_case(proto, h_shaped, h_unshaped, a_on if prefetch else a_off) * (1 + 0.001 * i)
        cases.append(CalibrationCase(compute, shaped, unshaped, comm, edge, prefetch, measured))
    fit = fit_calibration(cases, h_grid=[i * 0.5e-9 for i in range(21)], alpha_grid=[i / 20 for i in range(21)])
    assert fit.h_shaped == pytest.approx(h_shaped) and fit.h_unshaped == pytest.approx(h_unshaped)
    assert fit.alpha == {False: pytest.approx(a_off), True: pytest.approx(a_on)} and fit.rms_log_error < 0.01
    # without a byte over an unshaped link there is nothing to fit h_unshaped on
    assert fit_calibration(cases[:6], h_grid=[0.0, 4e-9], alpha_grid=[0.3, 0.8]).h_unshaped is None


# -- the command ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags,message",
    [
        (["--nodes", "1,4"], "--nodes: 1 must be >= 2"),
        (["--nodes", "two"], "--nodes: 'two' is not an integer"),
        (["--rates", "none"], "a projection needs a finite rate"),
        (["--rates", "10furlong"], "expected a tc rate"),
        (["--mfu", "1.5"], "--mfu: 1.5 must be in (0, 1]"),
        (["--gpu_overlap", "2"], "--gpu_overlap: 2 must be in [0, 1]"),
        (["--methods", "ddp"], "--methods: unknown ddp; allowed: fsdp2, hsdp"),
        (["--latency_us", "-1"], "--latency_us: -1 must be >= 0"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, message, capsys):
    assert main(["bench", "project", *flags]) == 2
    assert message in capsys.readouterr().err


def _quant_report() -> dict:
    rows = [{"bits": b, "numel": 1_000_000, "quantize_s": 1e-3, "dequantize_s": 5e-4} for b in (8, 4)]
    return {"benchmark": "quant", "settings": {"cpu_threads_1": {"backends": {"cpu": rows}}}}


def _row(method: str, rate: float, step: float, compute: float, prefetch: bool | None, **extra) -> dict:
    return {"method": method, "label": method + ("+prefetch" if prefetch else ""), "bandwidth": f"{int(rate / 1e6)}mbit",
            "rate_bits_per_s": rate, "prefetch": prefetch, "compute": "fp32", "step_s": step, "step_s_min": step * 0.9,
            "step_s_max": step * 1.1, "t_compute_s": compute, **extra}  # fmt: skip


def test_missing_inputs_and_unknown_recipes_exit_2_before_any_model_is_built(tmp_path, capsys):
    assert main(["bench", "project", "--e2e", str(tmp_path / "none.json")]) == 2
    assert "--e2e" in (err := capsys.readouterr().err) and "no such file" in err and "qaccel bench e2e" in err
    e2e = {
        "settings": {"world_size": 2, "model": "tiny", "threads": 1},
        "results": [_row("qsdp-w8g8", 3e8, 2.0, 1.0, False)],
    }
    (tmp_path / "e2e.json").write_text(json.dumps(e2e))
    (tmp_path / "quant.json").write_text(json.dumps(_quant_report()))
    base = ["bench", "project", "--e2e", str(tmp_path / "e2e.json"), "--quant", str(tmp_path / "quant.json")]
    assert main([*base, "--recipes", "no-such-recipe"]) == 2
    assert "unknown recipe 'no-such-recipe'" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main([*base, "--e2e_2node", str(tmp_path / "bad.json"), "--recipes", "gpt2-124m"]) == 2
    assert "--e2e_2node" in capsys.readouterr().err


def test_calibration_and_projection_from_small_synthetic_reports(tmp_path, capsys):
    one = {"settings": {"world_size": 2, "model": "tiny", "threads": 1}, "machine": {"cpus": 2},
           "results": [_row("qsdp-w8g8", 3e8, 2.0, 1.0, False, link_bytes_per_step=1e6), _row("qsdp-w8g8", 3e8, 1.6, 1.0, True),
                       _row("fsdp2-fp32", 3e8, 3.0, 1.0, False), _row("ddp-adamw", 3e8, 2.5, 1.0, None),
                       {"method": "qsdp-w4g4", "label": "qsdp-w4g4", "bandwidth": "300mbit", "error": "timed out"}]}  # fmt: skip
    two = {"settings": {"nodes": 2, "nproc_per_node": 2, "world_size": 4, "model": "tiny", "threads": 1},
           "results": [_row("hsdp-fp32", 1e8, 4.0, 2.0, True, inter_node_bytes_per_step=5e5, intra_node_bytes_per_step=7e5),
                       _row("hqsdp-w8g8-r4", 1e8, 2.5, 2.0, True)]}  # fmt: skip
    paths = {name: tmp_path / f"{name}.json" for name in ("e2e", "two", "quant")}
    paths["e2e"].write_text(json.dumps(one))
    paths["two"].write_text(json.dumps(two))
    paths["quant"].write_text(json.dumps(_quant_report()))
    md = tmp_path / "B.md"
    md.write_text("# Benchmarks\n\nkept above\n")
    argv = ["bench", "project", "--e2e", str(paths["e2e"]), "--e2e_2node", str(paths["two"]), "--quant", str(paths["quant"]),
            "--recipes", "gpt2-124m", "--nodes", "2", "--rates", "10gbit", "--markdown", str(md)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    cal = report["calibration"]
    assert [(r["source"], r["label"]) for r in cal["rows"]] == [
        ("1-node", "qsdp-w8g8"), ("1-node", "qsdp-w8g8+prefetch"), ("1-node", "fsdp2-fp32"),
        ("2-node", "hsdp-fp32+prefetch"), ("2-node", "hqsdp-w8g8-r4+prefetch")]  # fmt: skip
    assert {s["label"]: s["reason"] for s in cal["skipped"]} == {
        "ddp-adamw": "not a sharded (FSDP2/HSDP/QSDP) method: outside this model",
        "qsdp-w4g4": "no step time (timed out)",
    }
    for r in cal["rows"]:
        assert r["relative_error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        assert r["predicted_s"] > r["compute_only_s"]
    hsdp = cal["rows"][3]
    assert set(hsdp["predicted_bytes_per_step"]) == {"link", "inter_node", "intra_node"} and hsdp["nodes"] == 2
    # the projection read the recipe: the card says 125,226,240 parameters
    assert report["projection"]["recipes"][0]["params"] == 125_226_240
    rows = {r["method"]: r for r in report["projection"]["rows"]}
    assert rows["fsdp2"]["speedup_vs_fsdp2"] == 1.0 and rows["hsdp"]["speedup_vs_hsdp"] == 1.0
    assert rows["hqsdp-w8g8-r4"]["inter_node_bytes_per_node_step"] < rows["hsdp"]["inter_node_bytes_per_node_step"] / 3
    assert {a["name"] for a in report["assumptions"]} >= {
        "mfu",
        "tflops_16bit",
        "nvlink_gbytes_per_s",
        "codec_quantize_gelems_per_s",
    }
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nkept above\n") and text.count("## Beyond two nodes: projected") == 1
    # without the 2-node file it says so, and a second write replaces the block instead of adding one
    argv[argv.index("--e2e_2node") + 1] = str(tmp_path / "missing.json")
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["inputs"]["e2e_2node"] is None and "no such file" in report["inputs"]["e2e_2node_skipped"]
    assert {r["source"] for r in report["calibration"]["rows"]} == {"1-node"}
    text = md.read_text()
    assert text.count("## Beyond two nodes: projected") == 1 and "Two nodes: skipped" in text
