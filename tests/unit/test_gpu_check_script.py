"""``scripts/gpu_check.py`` without a GPU: its pure logic, its CLI, and its training sections on the CPU.

The script's GPU sections run only on a CUDA machine (``docs/gpu_runbook.md``). Here: the datasheet
lookups against the vendors' figures typed in below, the verdicts against hand-computed cases, the
refusal on a machine without CUDA, and the FSDP2 + QSDP and 0/1 Adam sections run over gloo on the CPU
(the same code up to the device), so the GPU day is not their first run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = _load()


@pytest.mark.parametrize(
    ("name", "gbps", "ratio"),
    [
        ("NVIDIA H200", 4800.0, 34 / 67),
        ("NVIDIA H200 NVL", 4800.0, 30 / 60),
        ("NVIDIA GH200 480GB", 4000.0, 34 / 67),  # not the H200 row: whole words only
        ("NVIDIA H100 80GB HBM3", 3350.0, 34 / 67),
        ("NVIDIA H100 PCIe", 2000.0, 26 / 51),
        ("NVIDIA H100 NVL", 3900.0, 30 / 60),
        ("NVIDIA A100-SXM4-80GB", 2039.0, 9.7 / 19.5),
        ("NVIDIA A100 80GB PCIe", 1935.0, 9.7 / 19.5),
        ("NVIDIA A100-SXM4-40GB", 1555.0, 9.7 / 19.5),
        ("NVIDIA L40S", 864.0, 1.43 / 91.6),
        ("NVIDIA L4", 300.0, 0.47 / 30.3),  # not L40 / L40S
        ("NVIDIA A10", 600.0, 0.49 / 31.2),  # not A100
        ("NVIDIA GeForce RTX 4090", 1008.0, 1.29 / 82.6),
        ("Tesla V100-SXM2-32GB", 900.0, 7.8 / 15.7),
    ],
)
def test_device_specs_match_the_datasheet(name, gbps, ratio):
    specs = gc.device_specs(name)
    assert specs["peak_gbps"] == gbps
    assert specs["fp64_fp32_ratio"] == pytest.approx(ratio)


def test_unknown_device_falls_back_to_the_measured_copy():
    assert gc.device_specs("Some Future GPU 9000") is None
    assert gc.device_specs("NVIDIA B200")["fp64_fp32_ratio"] is None  # in the table without fp64 figures
    assert gc.peak_bandwidth("Some Future GPU 9000", 1234.5) == (1234.5, "measured device-to-device copy (device not in the table)")
    assert gc.peak_bandwidth("Some Future GPU 9000", None) == (None, "unknown")
    gbps, source = gc.peak_bandwidth("NVIDIA H200", 4300.0)
    assert gbps == 4800.0 and source.startswith("datasheet")


def test_fp64_verdict_against_hand_computed_shares():
    # H200: 34 TFLOP/s fp64 = 17e12 instructions/s; 6 per element -> 2.833e12 elements/s. A quantize at
    # 4.8 TB/s moving 5 B/element runs 0.96e12 elements/s: a third of the fp64 issue rate.
    h200 = gc.fp64_verdict(0.96e12, 6, 34.0)
    assert h200["fp64_share"] == pytest.approx(0.96e12 / (17e12 / 6))
    assert h200["fp64_bound"] is False
    # L40S: 1.43 TFLOP/s fp64 -> 0.715e12 / 6 = 1.19e11 elements/s; 864 GB/s / 5 B = 1.73e11: fp64-bound.
    l40s = gc.fp64_verdict(864e9 / 5, 6, 1.43)
    assert l40s["fp64_share"] == pytest.approx((864e9 / 5) / (0.715e12 / 6))
    assert l40s["fp64_bound"] is True and "bounds" in l40s["reading"]
    unknown = gc.fp64_verdict(1e12, 6, None)
    assert unknown["fp64_share"] is None and unknown["fp64_bound"] is None


def test_loss_verdict():
    stock = [8.3, 7.9, 7.1, 6.0]
    close = [8.31, 7.95, 7.15, 6.0 * 1.019]
    verdict = gc.loss_verdict(close, stock)
    assert verdict["ok"] and not verdict["identical"] and verdict["stock_loss_fell"]
    assert verdict["final_relative_difference"] == pytest.approx(0.019)
    assert verdict["max_relative_difference"] == pytest.approx(0.019)
    assert not gc.loss_verdict(stock[:-1] + [6.0 * 1.021], stock)["ok"]  # 2.1 % off
    assert not gc.loss_verdict(stock[:-1] + [6.0 * 0.979], stock)["ok"]
    assert gc.loss_verdict(list(stock), stock)["identical"]
    nan = gc.loss_verdict([8.3, math.nan, 7.1, 6.0], stock)
    assert not nan["ok"] and not nan["finite"]  # a NaN mid-run fails even if the end agrees
    assert not gc.loss_verdict(stock[:3], stock)["ok"]
    assert not gc.loss_verdict([], [])["ok"]


def test_parse_sections():
    assert gc.parse_sections(None) == list(gc.SECTIONS)
    assert gc.parse_sections("all") == list(gc.SECTIONS)
    assert gc.parse_sections("zero_one_adam, bandwidth") == ["bandwidth", "zero_one_adam"]  # run order
    with pytest.raises(ValueError, match=r"unknown \['fp65'\].*allowed: all, bit_identical"):
        gc.parse_sections("fp64,fp65")
    with pytest.raises(ValueError, match="empty"):
        gc.parse_sections(" , ")


def test_overall_ok():
    built = {"build": {"ok": True}}
    assert gc.overall_ok({**built, "bit_identical": {"ok": True}, "bandwidth": {"rows": []}}, ["bit_identical", "bandwidth"])
    assert not gc.overall_ok({**built, "bit_identical": {"ok": False}}, ["bit_identical"])
    assert not gc.overall_ok({**built, "fp64": {"error": "Traceback ..."}}, ["fp64"])
    assert not gc.overall_ok(built, ["fp64"])  # a requested section that never reported
    assert gc.overall_ok({**built, "payloads": {"skipped": "not available"}}, ["payloads"])
    # a failed build fails a run with kernel sections, not one with only the training sections
    assert not gc.overall_ok({"build": {"ok": False}, "fp64": {"skipped": "no build"}}, ["fp64"])
    assert gc.overall_ok({"fsdp_smoke": {"ok": True}}, ["fsdp_smoke"])


def test_uint64_as_int64_matches_numpy_bit_patterns():
    values = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15]
    expected = np.array(values, dtype=np.uint64).view(np.int64).tolist()
    assert [gc.uint64_as_int64(v) for v in values] == expected


def test_gpt2_block_segments_tile_the_block():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    expected: list[tuple[int, bool]] = []  # FSDP2's parameter order; adjacent 1-D (raw) parameters merged
    for param in GPT2Block(GPT2Config()).parameters():
        quantized = param.dim() >= 2
        if expected and not quantized and not expected[-1][1]:
            expected[-1] = (expected[-1][0] + param.numel(), False)
        else:
            expected.append((param.numel(), quantized))
    assert list(gc._gpt2_block_segments(1)) == expected
    assert [n for n, _ in gc._gpt2_block_segments(4)] == [math.ceil(n / 4) for n, _ in expected]


def _cpu_env() -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def test_help_and_refusal_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal cannot be observed")
    shown = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120, env=_cpu_env())
    assert shown.returncode == 0 and "--sections" in shown.stdout and "fsdp_smoke" in shown.stdout
    assert "payloads_rotated" in shown.stdout
    report = tmp_path / "out" / "report.json"
    ran = subprocess.run([sys.executable, str(SCRIPT), "--json", str(report), "--sections", "fp64"],
                         capture_output=True, text=True, timeout=120, env=_cpu_env())  # fmt: skip
    assert ran.returncode == 1
    assert "no CUDA device" in ran.stderr
    data = json.loads(report.read_text())
    assert data["ok"] is False and "no CUDA device" in data["error"] and data["sections"] == ["fp64"]


def test_shell_wrapper_exits_nonzero_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal cannot be observed")
    dest = tmp_path / "check.json"
    env = {**_cpu_env(), "PYTHON": sys.executable, "QACCEL_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("OUT", None)
    ran = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(dest), "--sections", "bandwidth"],
                         capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
    assert ran.returncode == 1, ran.stderr
    assert "no CUDA device" in ran.stdout + ran.stderr
    assert json.loads(dest.read_text())["ok"] is False
    assert (tmp_path / "check.log").is_file()


# The training sections on the CPU over gloo, in a fresh process (they create a process group).
_DRY_RUN = """
import json, sys, types, importlib.util
spec = importlib.util.spec_from_file_location("gpu_check_script", sys.argv[1])
gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)
gc.TRAIN_DEVICE = "cpu"
gc.FSDP_MODEL = {**gc.FSDP_MODEL, "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 32}
ctx = types.SimpleNamespace(args=types.SimpleNamespace(steps=3))
report = {"fsdp_smoke": gc.section_fsdp_smoke(ctx), "zero_one_adam": gc.section_zero_one_adam(ctx)}
import torch.distributed as dist
dist.destroy_process_group()
print("REPORT" + json.dumps(report, default=str))
"""


@pytest.mark.slow
def test_training_sections_pass_on_cpu_over_gloo():
    ran = subprocess.run([sys.executable, "-c", _DRY_RUN, str(SCRIPT)], capture_output=True, text=True, timeout=600,
                         env=_cpu_env(), cwd=ROOT)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-4000:]
    report = json.loads(ran.stdout.split("REPORT", 1)[1])
    smoke = report["fsdp_smoke"]
    assert smoke["process_group"]["backend"] == "gloo"
    assert smoke["comms_over_nccl"]["ok"], smoke["comms_over_nccl"]
    for variant in ("fp32", "bf16"):
        entry = smoke[variant]
        assert entry["ok"] and entry["finite"], entry
        assert len(entry["qsdp"]["losses"]) == 3 and entry["qsdp"]["quantized_units"] >= 1
        # Where FSDP2 issued no collective, QSDP could not change a bit of the run.
        if not entry["exercises_qsdp_comms"]:
            assert entry["identical"], entry
    assert smoke["ok"]
    zoadam = report["zero_one_adam"]
    warmup = zoadam["warmup_vs_torch_adam"]
    assert warmup["ok"], warmup
    assert [row["kind"] for row in warmup["steps"]] == ["init", "full", "full", "full", "full"]
    kinds = zoadam["all_step_kinds"]
    assert kinds["ok"] and kinds["all_kinds_seen"] and kinds["weights_vs_plain_loop"] <= 1e-4, kinds
    assert zoadam["ok"]


# --------------------------------------------------------------------------------------------------
# The payload sections' code on the CPU: the C++ kernels stand in for the CUDA build. They match the
# reference bit for bit by their own tests (test_quant_rotation.py), so the checks must pass with them,
# and must fail when a deliberate fault is put between them and the check.
# --------------------------------------------------------------------------------------------------
def _wall_clock_ms(fn) -> float:
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def test_rotation_summary_reads_hand_written_rows():
    cases = [{"layout": 0, "encode": True, "decode": True}, {"layout": 1, "encode": True, "decode": False}]
    timings = [{"label": "numel", "bits": 4, "bucket_size": 128, "slots": 37, "encode_ratio": 1.3, "decode_ratio": 2.044,
                "sum_ratio": 1.999}]  # fmt: skip
    assert gc.rotation_summary(cases, 3, timings) == (
        "1/3 rotated layouts identical to the reference; "
        "4-bit b128 x37 numel: rotated/plain encode 1.30x, decode 2.04x, sum 2.00x"
    )
    assert gc.rotation_summary([], 5, []) == "0/5 rotated layouts identical to the reference"


def test_rotated_section_is_a_kernel_section_run_last():
    assert gc.SECTIONS[-1] == "payloads_rotated" and "payloads_rotated" in gc.KERNEL_SECTIONS
    assert gc.parse_sections("payloads_rotated,payloads") == ["payloads", "payloads_rotated"]
    assert gc.SECTION_FUNCTIONS["payloads_rotated"] is gc.section_payloads_rotated
    assert not gc.overall_ok({"build": {"ok": False}, "payloads_rotated": {"skipped": "no build"}}, ["payloads_rotated"])


def test_rotated_payloads_pass_with_the_cpp_kernels_standing_in(cpu_kernels, monkeypatch):
    small = gc._gpt2_block_segments(64)
    chunk = sum(n for n, _ in small)
    monkeypatch.setattr(gc, "ROTATION_TIMINGS", (("fill", small, 4, 128, torch.bfloat16, None),
                                                 ("fixed", small, 8, 1024, torch.float32, 2)))  # fmt: skip
    report = gc.payload_rotation_report(cpu_kernels, "cpu", _wall_clock_ms, 3 * chunk + 5)
    assert report["ok"] and report["failures"] == [], report["failures"]
    layouts = gc.ROTATED_PAYLOAD_LAYOUTS
    # the layouts asked for: 4-bit b128 bf16 metadata, 3-bit, 2-bit, 8-bit b1024 fp32, ragged with raw segments
    assert (4, 128, torch.bfloat16) in {(bits, bucket, meta) for _, bits, bucket, meta, *_ in layouts}
    assert (8, 1024, torch.float32) in {(bits, bucket, meta) for _, bits, bucket, meta, *_ in layouts}
    assert {3, 2} <= {bits for _, bits, *_ in layouts}
    assert any(sum(not q for _, q in segments) >= 2 and any(n == 0 for n, _ in segments) for segments, *_ in layouts)
    assert [case["layout"] for case in report["cases"]] == list(range(len(layouts)))
    for case, (_, bits, bucket, *_, elem, slots) in zip(report["cases"], layouts, strict=True):
        flags = {"encode", "encode_cpu_reference", "decode", "sum_float32", f"sum_{str(elem).removeprefix('torch.')}"}
        assert {key for key, value in case.items() if isinstance(value, bool)} == flags, case
        assert all(case[key] for key in flags) and (case["bits"], case["bucket_size"], case["slots"]) == (bits, bucket, slots)
    fill, fixed = report["timings"]
    assert (fill["slots"], fill["chunk_numel"], fixed["slots"]) == (3, chunk, 2)  # --numel holds 3 chunks
    for row in report["timings"]:
        for op in ("encode", "decode", "sum"):
            assert row["plain"][f"{op}_ms"] > 0 and row["rotated"][f"{op}_ms"] > 0
            assert row[f"{op}_ratio"] == pytest.approx(row["rotated"][f"{op}_ms"] / row["plain"][f"{op}_ms"])
    assert report["summary"].startswith(f"{len(layouts)}/{len(layouts)} rotated layouts identical to the reference; ")
    assert "4-bit b128 x3 fill: rotated/plain encode" in report["summary"]
    json.dumps(report)  # the JSON report takes it as it is


def test_unrotated_payload_checks_pass_with_the_cpp_kernels_standing_in(cpu_kernels):
    """section_payloads' comparisons, shared with the rotated section, on its first four layouts."""
    cases, failures = gc._check_payload_layouts(cpu_kernels, gc.PAYLOAD_LAYOUTS[:4], "none", "cpu", 0, 4)
    assert failures == [] and len(cases) == 4
    assert all(case["encode"] and case["encode_cpu_reference"] and case["decode"] and case["sum_float32"] for case in cases)


class _FaultyKernels:
    """The C++ kernels with one deliberate fault between them and the check, as a CUDA build might have it."""

    def __init__(self, kernels, fault: str) -> None:
        self.kernels, self.fault, self.nan_bits_flipped = kernels, fault, 0

    def encode_payloads(self, src, spec, offsets, seeds, out):
        if self.fault == "encode_forgets_rotation":
            spec = dataclasses.replace(spec, rotation="none")
        return self.kernels.encode_payloads(src, spec, offsets, seeds, out)

    def decode_payloads(self, blob, spec, out, offsets, seeds=None):
        if self.fault == "decode_forgets_inverse_rotation":
            self.kernels.decode_payloads(blob, dataclasses.replace(spec, rotation="none"), out, offsets)
        else:
            self.kernels.decode_payloads(blob, spec, out, offsets, seeds)
        nan = out.isnan()
        if self.fault == "decode_other_nan_bits":  # still NaN, another payload: must pass
            out.view(gc.INT_VIEW[out.dtype])[nan] ^= 1
            self.nan_bits_flipped += int(nan.sum())
        if self.fault == "decode_nan_elsewhere":
            out[int((~nan).nonzero()[0])] = math.nan
        return out

    def sum_payloads(self, blob, spec, base, out, seeds=None):
        if self.fault == "sum_raises":
            raise RuntimeError("deliberate fault in sum_payloads")
        if self.fault == "sum_with_other_slots_seeds":
            seeds = seeds.flip(0)
        return self.kernels.sum_payloads(blob, spec, base, out, seeds)


@pytest.mark.parametrize(
    ("fault", "wrong"),
    [
        ("encode_forgets_rotation", {"encode", "encode_cpu_reference"}),
        ("decode_forgets_inverse_rotation", {"decode"}),
        ("decode_nan_elsewhere", {"decode"}),
        ("decode_other_nan_bits", set()),  # NaN positions are compared, not NaN bit patterns
        ("sum_with_other_slots_seeds", {"sum_float32", "sum_bfloat16"}),
    ],
)
def test_rotated_check_reports_a_faulty_kernel(cpu_kernels, monkeypatch, fault, wrong):
    monkeypatch.setattr(gc, "ROTATED_PAYLOAD_LAYOUTS", gc.ROTATED_PAYLOAD_LAYOUTS[:1])  # 4-bit b128, 2 slots, NaN/Inf
    monkeypatch.setattr(gc, "ROTATION_TIMINGS", ())
    faulty = _FaultyKernels(cpu_kernels, fault)
    report = gc.payload_rotation_report(faulty, "cpu", _wall_clock_ms, 0)
    (case,) = report["cases"]
    assert {key for key, value in case.items() if value is False} == wrong, case
    assert report["ok"] is not bool(wrong) and report["failures"] == ([case] if wrong else [])
    assert report["summary"] == f"{0 if wrong else 1}/1 rotated layouts identical to the reference"
    if fault == "decode_other_nan_bits":
        assert faulty.nan_bits_flipped > 0  # the inputs' NaN reached the decoded output


def test_rotated_check_records_each_exception_and_carries_on(cpu_kernels, monkeypatch):
    monkeypatch.setattr(gc, "ROTATED_PAYLOAD_LAYOUTS", gc.ROTATED_PAYLOAD_LAYOUTS[:2])
    monkeypatch.setattr(gc, "ROTATION_TIMINGS", (("fixed", gc._gpt2_block_segments(256), 4, 128, torch.bfloat16, 1),))
    report = gc.payload_rotation_report(_FaultyKernels(cpu_kernels, "sum_raises"), "cpu", _wall_clock_ms, 0)
    assert report["ok"] is False and report["cases"] == [] and report["timings"] == []
    assert [f.get("layout", f.get("timing")) for f in report["failures"]] == [0, 1, "fixed"]
    assert all("deliberate fault in sum_payloads" in f["error"] for f in report["failures"])
