"""``qaccel bench comm`` QSDP section on a tiny GPT-2: rows come from real steps through the meter."""

import argparse

from qaccel.bench import _comm_qsdp


def test_bench_rows_relate_as_the_wire_formats_say():
    parser = argparse.ArgumentParser()
    _comm_qsdp.add_arguments(parser)
    report = _comm_qsdp.measure(parser.parse_args(["--qsdp_model", "tiny", "--qsdp_steps", "2"]))
    rows = {row["method"]: row for row in report["rows"]}
    assert list(rows) == ["FSDP fp32", "FSDP bf16", "QSDP W8G8", "QSDP W4G4", "QSDP W4G2", "QSDP W3G3", "QSDP W3G2", "QSDP W2G2"]
    fp32, bf16 = rows["FSDP fp32"], rows["FSDP bf16"]
    # Same collectives, half the element size: exactly half the bytes, both directions.
    assert bf16["sent_bytes_per_step"] * 2 == fp32["sent_bytes_per_step"] > 0
    assert fp32["recv_bytes_per_step"] == fp32["sent_bytes_per_step"]
    for name in ("QSDP W8G8", "QSDP W4G4", "QSDP W4G2", "QSDP W3G3", "QSDP W3G2", "QSDP W2G2"):
        row = rows[name]
        # QSDP issues as many collectives as stock FSDP2 (one per gather / reduce-scatter), fewer bytes.
        calls = sum(t["calls"] for t in row["per_kind"].values())
        assert calls == sum(t["calls"] for t in fp32["per_kind"].values())
        assert row["per_kind"]["qsdp.all_gather"]["sent_bytes"] > 0
        # independent bounds: a k-bit code cannot take less than k/32 of fp32's bytes, and must beat bf16's 1/2
        weight_bits, grad_bits = int(name[6]), int(name[8])
        assert (weight_bits + grad_bits) / 64 < row["ratio_vs_baseline"] < 0.5
        assert len(set(row["per_rank_sent_bytes"])) == 1  # equal payloads on every rank
    assert rows["QSDP W4G4"]["sent_bytes_per_step"] < rows["QSDP W8G8"]["sent_bytes_per_step"] < bf16["sent_bytes_per_step"]
    # fewer code bits, fewer bytes
    assert rows["QSDP W2G2"]["sent_bytes_per_step"] < rows["QSDP W3G2"]["sent_bytes_per_step"] < rows["QSDP W4G2"]["sent_bytes_per_step"]
    assert rows["QSDP W4G2"]["sent_bytes_per_step"] < rows["QSDP W4G4"]["sent_bytes_per_step"]
