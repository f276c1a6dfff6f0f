#!/usr/bin/env python3
"""GPU check of qaccel on one CUDA device; ``scripts/gpu_check.sh`` runs it in one call.

Sections (``--sections`` picks a subset; ``docs/gpu_runbook.md`` explains each and the JSON):

- ``bit_identical``: the CUDA codec kernels (JIT-built for the device) against the pure-torch reference
  on the same GPU, bit for bit, over many sizes, bit widths, bucket sizes, dtypes, roundings, metadata
  dtypes, seeds, special values and misaligned inputs, plus the sign codec and a few CPU-reference cases;
- ``bandwidth``: quantize/dequantize bandwidth (bytes each op must move, CUDA events, median) as a
  fraction of the device's peak memory bandwidth (datasheet table by device name, else the measured
  device-to-device copy) and of a measured copy;
- ``fp64``: what the kernels' per-element fp64 arithmetic costs: rates on an HBM-sized and an
  L2-resident tensor against the fp64 instruction ceiling of the device (fp64:fp32 table by name);
- ``bitsandbytes``: ``quantize_blockwise`` / ``dequantize_blockwise`` on the same tensor as ours;
- ``payloads``: the fused payload kernels (``qaccel.quant.encode_payloads`` & co.) against the
  reference, bit for bit, and their speed, when ``qaccel.quant`` has them;
- ``fsdp_smoke``: FSDP2 + QSDP W8G8 training on one GPU over NCCL against stock FSDP2 (fp32 and bf16
  mixed precision), and the QSDP collectives called directly over the 1-rank NCCL group;
- ``zero_one_adam``: 0/1 Adam on the GPU under DDP over NCCL: moments against ``torch.optim.Adam``,
  the update against the documented formula, and a run through every step kind against a plain loop;
- ``cross_backend``: the C++ kernels agree with the CUDA kernels bit for bit;
- ``payloads_rotated``: the fused payload kernels with ``PayloadSpec(rotation="hadamard")`` against the
  reference (bytes; decoded and summed values, NaN in the same places), and rotated against plain
  encode/decode/sum time.

Every section is guarded: a failure is recorded in the JSON (``--json``, rewritten after each section,
so a timeout keeps what finished) and the others still run; a section's ``summary`` is printed too.
Exit status 0 when every section that ran passed; 1 otherwise, or when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import math
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from qaccel._errors import FlagParser  # noqa: E402
from qaccel.quant import _native, reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
SPECIALS = [math.nan, math.inf, -math.inf, 3e38, -3e38, 0.0, -0.0, 1e-40]

# payloads_rotated runs last: its kernels are the newest, and a fault in one leaves the
# CUDA context unusable for every section after it.
SECTIONS = ("bit_identical", "bandwidth", "fp64", "bitsandbytes", "payloads", "fsdp_smoke", "zero_one_adam", "cross_backend",
            "payloads_rotated")  # fmt: skip
# Sections that call the CUDA codec kernels directly; they are skipped when the JIT build fails.
KERNEL_SECTIONS = frozenset({"bit_identical", "bandwidth", "fp64", "bitsandbytes", "payloads", "cross_backend", "payloads_rotated"})
LOSS_RTOL = 0.02  # QSDP vs stock FSDP2: final losses within 2 %

# Datasheet figures by device name, matched on whole words of the name (so "GH200" is not "H200" and
# "L40S" is not "L4"); first match wins, so specific rows come first. Columns: words that must all occur,
# peak memory bandwidth in GB/s, fp64 and fp32 vector (non-tensor-core) TFLOP/s (None: not listed).
# These are vendor datasheet leads, not measurements.
DEVICE_TABLE: tuple[tuple[tuple[str, ...], float, float | None, float | None], ...] = (
    (("GH200",), 4000.0, 34.0, 67.0),
    (("H200", "NVL"), 4800.0, 30.0, 60.0),
    (("H200",), 4800.0, 34.0, 67.0),
    (("H100", "NVL"), 3900.0, 30.0, 60.0),
    (("H100", "PCIE"), 2000.0, 26.0, 51.0),
    (("H100",), 3350.0, 34.0, 67.0),
    (("B200",), 8000.0, None, None),
    (("A100", "80GB", "PCIE"), 1935.0, 9.7, 19.5),
    (("A100", "80GB"), 2039.0, 9.7, 19.5),
    (("A100",), 1555.0, 9.7, 19.5),
    (("L40S",), 864.0, 1.43, 91.6),
    (("L40",), 864.0, 1.41, 90.5),
    (("L4",), 300.0, 0.47, 30.3),
    (("A10",), 600.0, 0.49, 31.2),
    (("V100",), 900.0, 7.8, 15.7),
    (("T4",), 320.0, 0.25, 8.1),
    (("4090",), 1008.0, 1.29, 82.6),
    (("3090",), 936.0, 0.56, 35.6),
)
# fp64 instructions per element on the kernels' hot path (conversions, subtract, multiply, add, floor
# for an encode; conversion, multiply, add, conversion for a decode): an estimate for the ceiling below.
FP64_OPS_PER_ELEMENT = {"quantize": 6, "dequantize": 4}


# --------------------------------------------------------------------------------------------------
# Pure logic (unit-tested in tests/unit/test_gpu_check_script.py)
# --------------------------------------------------------------------------------------------------
def _name_words(name: str) -> set[str]:
    return {word for word in "".join(c if c.isalnum() else " " for c in name.upper()).split() if word}


def device_specs(name: str) -> dict | None:
    """Datasheet row for a device name (``torch.cuda.get_device_properties(0).name``), or None."""
    words = _name_words(name)
    for required, gbps, fp64, fp32 in DEVICE_TABLE:
        if all(word in words for word in required):
            ratio = fp64 / fp32 if fp64 is not None and fp32 is not None else None
            return {"match": " ".join(required), "peak_gbps": gbps, "fp64_tflops": fp64, "fp32_tflops": fp32, "fp64_fp32_ratio": ratio}
    return None


def peak_bandwidth(name: str, copy_gbps: float | None) -> tuple[float | None, str]:
    """The memory bandwidth figures are compared with: datasheet by name, else the measured copy."""
    specs = device_specs(name)
    if specs is not None:
        return specs["peak_gbps"], f"datasheet ({specs['match']})"
    if copy_gbps:
        return copy_gbps, "measured device-to-device copy (device not in the table)"
    return None, "unknown"


def fp64_verdict(elements_per_s: float | None, fp64_ops_per_element: int, fp64_tflops: float | None) -> dict:
    """Share of the device's fp64 instruction rate that a kernel running at ``elements_per_s`` needs.

    The fp64 rate counts a fused multiply-add as 2 FLOPs, so instructions/s = TFLOP/s / 2. A share near
    or above 1 means the fp64 arithmetic, not memory, bounds the kernel on this device.
    """
    if not elements_per_s or not fp64_tflops:
        return {"fp64_share": None, "fp64_bound": None, "reading": "fp64 rate of this device unknown: no estimate"}
    ceiling = fp64_tflops * 1e12 / 2 / fp64_ops_per_element
    share = elements_per_s / ceiling
    if share >= 0.8:
        reading = "fp64 arithmetic bounds the kernel here"
    elif share >= 0.4:
        reading = "fp64 arithmetic takes a large part of the kernel's issue capacity"
    else:
        reading = "fp64 arithmetic is not what limits the kernel here"
    return {"fp64_ceiling_elements_per_s": ceiling, "fp64_share": share, "fp64_bound": share >= 0.8, "reading": reading}


def loss_verdict(qsdp: Sequence[float], stock: Sequence[float], rtol: float = LOSS_RTOL) -> dict:
    """QSDP's loss curve against stock FSDP2's: finite, same length, final losses within ``rtol``."""
    finite = all(math.isfinite(x) for x in list(qsdp) + list(stock))
    same_length = len(qsdp) == len(stock) and len(stock) > 0
    if not same_length:
        return {"finite": finite, "same_length": False, "final_relative_difference": None,
                "max_relative_difference": None, "identical": False, "ok": False}  # fmt: skip
    relative = [abs(q - s) / abs(s) if s != 0 else (0.0 if q == s else math.inf) for q, s in zip(qsdp, stock, strict=True)]
    final = relative[-1]
    return {
        "finite": finite,
        "same_length": True,
        "final_relative_difference": final,
        "max_relative_difference": max(relative),
        "identical": list(qsdp) == list(stock),
        "stock_loss_fell": stock[-1] < stock[0],
        "ok": finite and math.isfinite(final) and final <= rtol,
    }


def parse_sections(text: str | None) -> list[str]:
    """``--sections a,b`` -> validated names in the script's order; None or ``all`` -> every section."""
    if text is None or text.strip().lower() == "all":
        return list(SECTIONS)
    asked = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in asked if name not in SECTIONS]
    if unknown or not asked:
        raise ValueError(f"--sections={text!r}: unknown {unknown or 'empty list'}; allowed: all, {', '.join(SECTIONS)}")
    return [name for name in SECTIONS if name in asked]


def section_failed(result: dict | None) -> bool:
    """A section failed when it is missing, raised, or says ``ok: false``; skipped ones did not fail."""
    if result is None:
        return True
    if "skipped" in result:
        return False
    return "error" in result or result.get("ok", True) is not True


def overall_ok(report: dict, sections: Sequence[str]) -> bool:
    """True when the build worked (if a kernel section was asked for) and no requested section failed."""
    if any(name in KERNEL_SECTIONS for name in sections) and not report.get("build", {}).get("ok"):
        return False
    return not any(section_failed(report.get(name)) for name in sections)


def uint64_as_int64(value: int) -> int:
    """The int64 holding the bit pattern of an unsigned 64-bit value (how seed tensors carry them)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - e| / max|e|`` in fp64 (0 when both are zero)."""
    a, e = actual.detach().double(), expected.detach().double()
    scale = e.abs().max().item() if e.numel() else 0.0
    diff = (a - e).abs().max().item() if e.numel() else 0.0
    return diff / scale if scale else diff


# --------------------------------------------------------------------------------------------------
# Codec kernels against the reference
# --------------------------------------------------------------------------------------------------
def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))
    return torch.equal(a, b)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal numbers with NaN in the same places (NaN payloads and the sign of zero may differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


def _input(numel: int, dtype: torch.dtype, seed: int, specials: bool, misaligned: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(numel + 1, generator=generator) * 10.0 ** (seed % 7 - 3)
    if specials and numel > 8:
        picks = torch.randint(0, numel, (4,), generator=generator).tolist()
        for index, value in zip(picks, SPECIALS[seed % 4 :: 2], strict=False):
            x[index] = value
        x[numel // 2 : numel // 2 + min(numel // 4, 3000)] = 1.5  # a constant run
    x = x.to(dtype).cuda()
    return x[1:] if misaligned else x[:numel]  # x[1:] is contiguous but not 16-byte aligned


def _cases(quick: bool) -> list[dict]:
    numels = [0, 1, 7, 8, 9, 63, 1000, 1023, 1024, 1025, 4097, 100_003, 1_000_000, 4_194_311]
    buckets = [1, 3, 8, 64, 128, 1000, 1024, 2048, 5000, 65_536]
    cases, index = [], 0
    for bits in range(2, 9):
        for bucket in buckets:
            for dtype_name in DTYPES:
                for repeat in range(1 if quick else 2):
                    index += 1
                    cases.append({
                        "numel": numels[(index * 5 + repeat) % len(numels)],
                        "bits": bits,
                        "bucket": bucket,
                        "dtype": dtype_name,
                        "nearest": index % 3 == 0,
                        "meta": "bf16" if index % 2 else "fp32",
                        "seed": (index * 0x9E3779B97F4A7C15) % 2**64,
                        "specials": index % 4 == 1,
                        "misaligned": index % 5 == 2,
                        "out": list(DTYPES)[index % 3],
                        "accumulate": index % 2 == 0,
                    })  # fmt: skip
    return cases


def check_case(kernels, case: dict) -> dict:
    meta = DTYPES[case["meta"]]
    x = _input(case["numel"], DTYPES[case["dtype"]], case["seed"] % 2**31, case["specials"], case["misaligned"])
    args = (case["bits"], case["bucket"], case["nearest"], case["seed"], meta)
    expected = reference.quantize_buckets(x, *args)
    got = kernels.quantize_buckets(x, *args)
    result = {
        "codes": _same_bits(expected[0], got[0]),
        "lo": _same_values(expected[1], got[1]),
        "scale": _same_values(expected[2], got[2]),
    }
    out_dtype = DTYPES[case["out"]]
    base = torch.linspace(-2, 2, case["numel"], device="cuda").to(out_dtype)
    out_ref, out_got = base.clone(), base.clone()
    reference.dequantize_into(*expected, case["bits"], case["bucket"], out_ref, case["accumulate"])
    kernels.dequantize_into(*expected, case["bits"], case["bucket"], out_got, case["accumulate"])
    result["decoded"] = _same_values(out_ref, out_got)
    result["decoded_bits"] = _same_bits(out_ref, out_got)  # NaN payloads too (informational)
    return result


def section_bit_identical(kernels, quick: bool) -> dict:
    cases = _cases(quick)
    mismatches, nan_payload_differences = [], 0
    start = time.perf_counter()
    for case in cases:
        result = check_case(kernels, case)
        if not all(result[key] for key in ("codes", "lo", "scale", "decoded")):
            mismatches.append({**case, **result})
        elif not result["decoded_bits"]:
            nan_payload_differences += 1
    # The GPU reproduces the CPU reference too (codes do not depend on the device).
    cross_device = []
    for numel, bits, bucket, dtype in ((100_003, 4, 1024, "fp32"), (4097, 3, 1000, "bf16"), (1_000_000, 8, 128, "fp16")):
        x = _input(numel, DTYPES[dtype], numel, True, False)
        gpu = kernels.quantize_buckets(x, bits, bucket, False, 2**40 + 1, torch.float32)
        cpu = reference.quantize_buckets(x.cpu(), bits, bucket, False, 2**40 + 1, torch.float32)
        cross_device.append(all(_same_values(a.cpu(), b) if a.is_floating_point() else torch.equal(a.cpu(), b)
                                for a, b in zip(gpu, cpu, strict=True)))  # fmt: skip
    # Sign codec.
    sign_failures = []
    for numel, chunks in ((0, 1), (7, 1), (9, 3), (1000, 4), (1_000_003, 1), (1 << 20, 8)):
        for dtype_name, dtype in DTYPES.items():
            x = _input(numel, dtype, numel + 1, numel > 8, numel % 2 == 1)
            signs = kernels.sign_pack(x, chunks)
            ok = _same_bits(reference.sign_pack(x, chunks), signs)
            scales = kernels.chunk_rms(x, chunks)
            out_ref, out_got = torch.empty(numel, device="cuda"), torch.empty(numel, device="cuda")
            reference.sign_unpack(signs, scales, numel, out_ref)
            kernels.sign_unpack(signs, scales, numel, out_got)
            if not (ok and _same_bits(out_ref, out_got)):
                sign_failures.append({"numel": numel, "chunks": chunks, "dtype": dtype_name})
    torch.cuda.synchronize()
    return {
        "cases": len(cases),
        "mismatches": len(mismatches),
        "mismatch_examples": mismatches[:20],
        "nan_payload_differences": nan_payload_differences,
        "cross_device_identical": cross_device,
        "sign_codec_failures": sign_failures,
        "seconds": time.perf_counter() - start,
        "ok": not mismatches and all(cross_device) and not sign_failures,
    }


# --------------------------------------------------------------------------------------------------
# Bandwidth, fp64 cost, bitsandbytes
# --------------------------------------------------------------------------------------------------
def _median_ms(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """Median over ``repeats`` of the GPU time of ``inner`` back-to-back calls, per call, in ms."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def _props_peak_gbps() -> float | None:
    """Peak from the memory clock and bus width where torch exposes them (double data rate)."""
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


class Context:
    """What the sections share: the kernels, the options, and the device's bandwidth figures (lazily)."""

    def __init__(self, kernels, args: argparse.Namespace) -> None:
        self.kernels = kernels
        self.args = args
        self.name = torch.cuda.get_device_properties(0).name
        self.specs = device_specs(self.name)
        self._copy_gbps: float | None = None

    @property
    def copy_gbps(self) -> float:
        """Device-to-device copy of an fp32 tensor of ``--numel`` values (read + write bytes)."""
        if self._copy_gbps is None:
            x = torch.randn(self.args.numel, device="cuda")
            y = torch.empty_like(x)
            ms = _median_ms(lambda: y.copy_(x), self.args.repeats)
            self._copy_gbps = 8 * x.numel() / ms / 1e6
            del x, y
        return self._copy_gbps

    @property
    def peak(self) -> tuple[float | None, str]:
        return peak_bandwidth(self.name, self.copy_gbps)


def _rate(nbytes: float, ms: float, ctx: Context) -> dict:
    gbps = nbytes / ms / 1e6
    peak, _ = ctx.peak
    return {"gbps": gbps, "vs_peak": gbps / peak if peak else None, "vs_copy": gbps / ctx.copy_gbps}


def section_bandwidth(ctx: Context) -> dict:
    kernels, numel, repeats = ctx.kernels, ctx.args.numel, ctx.args.repeats
    copy_gbps = ctx.copy_gbps  # measured first, before this section's tensors take memory
    x = torch.randn(numel, device="cuda")
    rows = []
    for dtype_name, bits, bucket in (("fp32", 8, 1024), ("fp32", 4, 1024), ("fp32", 2, 1024), ("fp32", 4, 128),
                                     ("fp32", 8, 4096), ("fp32", 4, 1000), ("bf16", 8, 1024), ("bf16", 4, 1024)):  # fmt: skip
        source = x if dtype_name == "fp32" else x.to(DTYPES[dtype_name])
        encoded = kernels.quantize_buckets(source, bits, bucket, False, 1, torch.float32)
        out = torch.empty_like(source)
        q_ms = _median_ms(lambda s=source, b=bits, k=bucket: kernels.quantize_buckets(s, b, k, False, 1, torch.float32), repeats)
        dq_ms = _median_ms(lambda e=encoded, b=bits, k=bucket, o=out: kernels.dequantize_into(*e, b, k, o, False), repeats)
        packed = encoded[0].numel() + 8 * encoded[1].numel()
        q_rate = _rate(source.element_size() * numel + packed, q_ms, ctx)
        dq_rate = _rate(packed + out.element_size() * numel, dq_ms, ctx)
        rows.append({
            "input": dtype_name, "bits": bits, "bucket_size": bucket,
            "quantize_ms": q_ms, "dequantize_ms": dq_ms,
            "quantize_gbps": q_rate["gbps"], "dequantize_gbps": dq_rate["gbps"],
            "quantize_vs_peak": q_rate["vs_peak"], "dequantize_vs_peak": dq_rate["vs_peak"],
            "quantize_vs_copy": q_rate["vs_copy"], "dequantize_vs_copy": dq_rate["vs_copy"],
        })  # fmt: skip
        del encoded, out, source
    signs = kernels.sign_pack(x, 1)
    sign_out = torch.empty_like(x)
    scales = kernels.chunk_rms(x, 1)
    pack_ms = _median_ms(lambda: kernels.sign_pack(x, 1), repeats)
    unpack_ms = _median_ms(lambda: kernels.sign_unpack(signs, scales, numel, sign_out), repeats)
    peak, source_name = ctx.peak
    return {
        "numel": numel,
        "device": ctx.name,
        "peak_gbps": peak,
        "peak_source": source_name,
        "peak_from_memory_clock_gbps": _props_peak_gbps(),
        "copy_gbps": copy_gbps,
        "copy_vs_peak": copy_gbps / peak if peak else None,
        "bytes_moved": "quantize: input + codes + 8 B/bucket; dequantize: codes + 8 B/bucket + output; copy: 2 x 4n",
        "rows": rows,
        "sign_pack": _rate(4 * numel + numel / 8, pack_ms, ctx),
        "sign_unpack": _rate(4 * numel + numel / 8, unpack_ms, ctx),
    }


def section_fp64(ctx: Context) -> dict:
    """Rates on an HBM-sized and an L2-resident tensor against the fp64 instruction ceiling.

    Memory sets the pace on the HBM-sized tensor as long as the arithmetic keeps up; on the L2-resident
    one (10 back-to-back calls per timing) the kernel runs nearer its arithmetic ceiling, so an
    ``l2_speedup`` near 1 says arithmetic, not HBM, bounds it. ``fp64_share``: the part of the device's
    fp64 issue rate that the measured speed needs (FP64_OPS_PER_ELEMENT instructions per element, the
    datasheet fp64 rate); there is no fp64-free build of the kernels to time against.
    """
    kernels, repeats = ctx.kernels, ctx.args.repeats
    specs = ctx.specs or {}
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 0
    small = max(1 << 16, min(1 << 22, l2_bytes // 16)) if l2_bytes else 1 << 20  # fp32 input + codes well inside L2
    rows = []
    for label, numel, inner in (("hbm", ctx.args.numel, 1), ("l2_resident", small, 10)):
        x = torch.randn(numel, device="cuda")
        for bits in (8, 4):
            encoded = kernels.quantize_buckets(x, bits, 1024, False, 1, torch.float32)
            out = torch.empty_like(x)
            q_ms = _median_ms(lambda s=x, b=bits: kernels.quantize_buckets(s, b, 1024, False, 1, torch.float32), repeats, inner)
            dq_ms = _median_ms(lambda e=encoded, b=bits, o=out: kernels.dequantize_into(*e, b, 1024, o, False), repeats, inner)
            nbytes = 4 * numel + encoded[0].numel() + 8 * encoded[1].numel()
            for op, ms in (("quantize", q_ms), ("dequantize", dq_ms)):
                elements_per_s = numel / ms * 1e3
                rows.append({
                    "tensor": label, "numel": numel, "bits": bits, "op": op, "ms": ms,
                    "elements_per_s": elements_per_s, "gbps": nbytes / ms / 1e6,
                    "launch_bound_suspect": ms < 0.015,  # a few microseconds: launch overhead, not the kernel
                    **fp64_verdict(elements_per_s, FP64_OPS_PER_ELEMENT[op], specs.get("fp64_tflops")),
                })  # fmt: skip
            del encoded, out
        del x
    for row in rows:
        if row["tensor"] == "l2_resident":
            hbm = next(r for r in rows if r["tensor"] == "hbm" and r["op"] == row["op"] and r["bits"] == row["bits"])
            row["l2_speedup"] = row["elements_per_s"] / hbm["elements_per_s"]
    hbm_rows = [r for r in rows if r["tensor"] == "hbm" and r["fp64_share"] is not None]
    worst = max(hbm_rows, key=lambda r: r["fp64_share"]) if hbm_rows else None
    return {
        "device": ctx.name,
        "fp64_tflops": specs.get("fp64_tflops"),
        "fp32_tflops": specs.get("fp32_tflops"),
        "fp64_fp32_ratio": specs.get("fp64_fp32_ratio"),
        "fp64_ops_per_element": FP64_OPS_PER_ELEMENT,
        "l2_cache_bytes": l2_bytes,
        "rows": rows,
        "summary": (f"at HBM speed the kernels need up to {worst['fp64_share']:.0%} of the fp64 issue rate "
                    f"({worst['op']}, {worst['bits']} bits): {worst['reading']}") if worst
                   else "device not in the fp64 table: read l2_speedup (near 1: arithmetic-bound)",
    }  # fmt: skip


def section_bitsandbytes(ctx: Context) -> dict:
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnb_functional
    except Exception as error:  # not installed, or its CUDA library failed to load
        return {"skipped": f"bitsandbytes not importable: {type(error).__name__}: {error}"}
    kernels, numel, repeats = ctx.kernels, ctx.args.numel, ctx.args.repeats
    x = torch.randn(numel, device="cuda")
    report: dict = {"version": getattr(bitsandbytes, "__version__", None), "numel": numel, "rows": [],
                    "note": "bitsandbytes: 8-bit dynamic (non-linear) codebook, fp32 absmax per block, nearest "
                            "rounding; qaccel: 8-bit linear grid, fp32 lo+scale per bucket"}  # fmt: skip
    for blocksize in (1024, 256):
        q, state = bnb_functional.quantize_blockwise(x, blocksize=blocksize)
        q_ms = _median_ms(lambda b=blocksize: bnb_functional.quantize_blockwise(x, blocksize=b), repeats)
        dq_ms = _median_ms(lambda q=q, s=state: bnb_functional.dequantize_blockwise(q, s), repeats)
        bnb_error = (bnb_functional.dequantize_blockwise(q, state) - x).abs().mean().item()
        bnb_bytes = 4 * numel + numel + 4 * math.ceil(numel / blocksize)
        ours = kernels.quantize_buckets(x, 8, blocksize, False, 1, torch.float32)
        nearest = kernels.quantize_buckets(x, 8, blocksize, True, 1, torch.float32)
        ours_q_ms = _median_ms(lambda b=blocksize: kernels.quantize_buckets(x, 8, b, False, 1, torch.float32), repeats)
        out = torch.empty_like(x)
        ours_dq_ms = _median_ms(lambda o=ours, b=blocksize, d=out: kernels.dequantize_into(*o, 8, b, d, False), repeats)
        ours_error = (kernels.dequantize_into(*ours, 8, blocksize, out, False) - x).abs().mean().item()
        nearest_error = (kernels.dequantize_into(*nearest, 8, blocksize, out, False) - x).abs().mean().item()
        ours_bytes = 4 * numel + ours[0].numel() + 8 * ours[1].numel()
        report["rows"].append({
            "blocksize": blocksize,
            "bnb_quantize_ms": q_ms, "bnb_dequantize_ms": dq_ms, "bnb_mean_abs_error": bnb_error,
            "bnb_quantize_gbps": _rate(bnb_bytes, q_ms, ctx)["gbps"], "bnb_dequantize_gbps": _rate(bnb_bytes, dq_ms, ctx)["gbps"],
            "bnb_quantize_vs_peak": _rate(bnb_bytes, q_ms, ctx)["vs_peak"], "bnb_dequantize_vs_peak": _rate(bnb_bytes, dq_ms, ctx)["vs_peak"],
            "qaccel_quantize_ms": ours_q_ms, "qaccel_dequantize_ms": ours_dq_ms,
            "qaccel_quantize_gbps": _rate(ours_bytes, ours_q_ms, ctx)["gbps"], "qaccel_dequantize_gbps": _rate(ours_bytes, ours_dq_ms, ctx)["gbps"],
            "qaccel_quantize_vs_peak": _rate(ours_bytes, ours_q_ms, ctx)["vs_peak"],
            "qaccel_dequantize_vs_peak": _rate(ours_bytes, ours_dq_ms, ctx)["vs_peak"],
            "qaccel_mean_abs_error": ours_error, "qaccel_nearest_mean_abs_error": nearest_error,
            "quantize_speedup_vs_bnb": q_ms / ours_q_ms, "dequantize_speedup_vs_bnb": dq_ms / ours_dq_ms,
        })  # fmt: skip
        del q, state, ours, nearest, out
    return report


# --------------------------------------------------------------------------------------------------
# Fused payload kernels
# --------------------------------------------------------------------------------------------------
PAYLOAD_FUNCTIONS = ("PayloadSpec", "encode_payloads", "decode_payloads", "sum_payloads")


def _gpt2_block_segments(world_size: int) -> tuple[tuple[int, bool], ...]:
    """Segment map of one GPT-2 124M block's shard at ``world_size`` (FSDP2 parameter order; raw runs merged)."""
    d = 768
    params = [(2 * d, False), (d * 3 * d, True), (3 * d, False), (d * d, True), (d + 2 * d, False),
              (d * 4 * d, True), (4 * d, False), (4 * d * d, True), (d, False)]  # fmt: skip
    return tuple((math.ceil(numel / world_size), quantized) for numel, quantized in params)


PAYLOAD_LAYOUTS = (
    # segments, bits, bucket, meta dtype, rounding, element dtype, slots
    (((100_003, True), (769, False), (12_293, True)), 8, 1024, torch.float32, "stochastic", torch.float32, 3),
    (((0, True), (1_000, False), (65_537, True), (5, True)), 4, 128, torch.bfloat16, "nearest", torch.bfloat16, 2),
    (((4097, True), (300_001, True), (17, False)), 3, 1000, torch.bfloat16, "stochastic", torch.float16, 4),
    (((1, False), (9, True), (63, True)), 2, 8, torch.float32, "stochastic", torch.float32, 1),
    (_gpt2_block_segments(2), 8, 1024, torch.float32, "stochastic", torch.float32, 1),
    (_gpt2_block_segments(4), 4, 128, torch.bfloat16, "stochastic", torch.float32, 3),
)


def _payload_seeds(slots: int, nseg: int, base: int) -> torch.Tensor:
    from qaccel.comm import mix_seed

    rows = [[uint64_as_int64(mix_seed(base + slot, index)) for index in range(nseg)] for slot in range(slots)]
    return torch.tensor(rows, dtype=torch.int64).reshape(slots, nseg)


def _payload_inputs(numel: int, slots: int, dtype: torch.dtype, seed: int, device: str = "cuda") -> tuple[torch.Tensor, list[int]]:
    """``slots`` chunks of ``numel`` values, with a gap between chunks and NaN/Inf in the first one."""
    generator = torch.Generator().manual_seed(seed)
    gap = 7
    src = torch.randn(slots * (numel + gap) + 3, generator=generator) * 3
    if numel > 64:
        src[5], src[40], src[41] = math.nan, math.inf, -math.inf
    offsets = [3 + slot * (numel + gap) for slot in range(slots)]
    return src.to(dtype).to(device), offsets


def _payload_support(kernels) -> dict | None:
    """Why the payload sections cannot run (a ``skipped`` or failing report), or None when they can."""
    import qaccel.quant as quant

    missing = [name for name in PAYLOAD_FUNCTIONS if not hasattr(quant, name)]
    if missing:
        return {"skipped": f"not available: qaccel.quant has no {', '.join(missing)}"}
    missing = [f"the CUDA build has no {name}" for name in PAYLOAD_FUNCTIONS[1:] if not hasattr(kernels, name)]
    missing += [f"qaccel.quant.reference has no {name}" for name in PAYLOAD_FUNCTIONS[1:] if not hasattr(reference, name)]
    return {"ok": False, "error": "; ".join(missing)} if missing else None


def _compare_payloads(kernels, spec, slots: int, case_seed: int, device: str, cpu_reference: bool) -> dict:
    """``kernels``' fused calls against the reference's on ``device``, for ``slots`` payloads of ``spec``.

    Encode: the bytes. Decode and sum (into fp32 and into the element dtype) read the reference's
    bytes, so a wrong encode does not hide a right decode; their values must be equal with NaN in the
    same places (NaN payload bits may differ). A rotated spec decodes with the encode's seed table.
    """
    numel, nbytes = spec.numel, spec.nbytes
    src, offsets = _payload_inputs(numel, slots, spec.elem_dtype, 1000 + case_seed, device)
    seeds = _payload_seeds(slots, len(spec.segments), 77 * case_seed)
    decode_seeds = seeds if spec.rotated else None
    blob = torch.full((slots * nbytes,), 0xA5, dtype=torch.uint8, device=device)
    blob_ref = torch.full_like(blob, 0x5A)
    kernels.encode_payloads(src, spec, offsets, seeds, blob)
    reference.encode_payloads(src, spec, offsets, seeds, blob_ref)
    result = {"encode": torch.equal(blob, blob_ref)}
    if cpu_reference:  # the reference on the CPU writes the same bytes (codes do not depend on the device)
        blob_cpu = torch.zeros(slots * nbytes, dtype=torch.uint8)
        reference.encode_payloads(src.cpu(), spec, offsets, seeds, blob_cpu)
        result["encode_cpu_reference"] = torch.equal(blob.cpu(), blob_cpu)
    out_offsets = [slot * numel for slot in range(slots)]
    out = torch.full((slots * numel,), 7.0, dtype=spec.elem_dtype, device=device)  # the all-gather decodes into elem dtype
    out_ref = out.clone()
    kernels.decode_payloads(blob_ref, spec, out, out_offsets, decode_seeds)
    reference.decode_payloads(blob_ref, spec, out_ref, out_offsets, decode_seeds)
    result["decode"] = _same_values(out, out_ref)
    base = torch.linspace(-1, 1, numel, device=device).to(spec.elem_dtype)
    for out_dtype in dict.fromkeys((torch.float32, spec.elem_dtype)):  # the reduce-scatter sums into fp32 or elem dtype
        total = torch.empty(numel, dtype=out_dtype, device=device)
        total_ref = torch.empty_like(total)
        kernels.sum_payloads(blob_ref, spec, base, total, decode_seeds)
        reference.sum_payloads(blob_ref, spec, base, total_ref, decode_seeds)
        result[f"sum_{str(out_dtype).removeprefix('torch.')}"] = _same_values(total, total_ref)
    return result


def _case_identical(case: dict) -> bool:
    """Every comparison of a payload case (its boolean entries) came out equal."""
    return all(value for value in case.values() if isinstance(value, bool))


def _check_payload_layouts(kernels, layouts: Sequence[tuple], rotation: str, device: str, seed_base: int,
                           cpu_reference_layouts: int) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """Every layout through :func:`_compare_payloads` (the first ``cpu_reference_layouts`` also against
    the reference on the CPU): ``(cases, failures)``; one layout's exception is recorded, the others run."""
    from qaccel.quant import PayloadSpec

    cases, failures = [], []
    for index, (segments, bits, bucket, meta, rounding, elem, slots) in enumerate(layouts):
        try:
            spec = PayloadSpec(segments=segments, bits=bits, bucket_size=bucket, meta_dtype=meta, rounding=rounding,
                               elem_dtype=elem, rotation=rotation)  # fmt: skip
            result = {"layout": index, "slots": slots, "bits": bits, "bucket_size": bucket,
                      **_compare_payloads(kernels, spec, slots, seed_base + index, device, index < cpu_reference_layouts)}  # fmt: skip
            cases.append(result)
            if not _case_identical(result):
                failures.append(result)
        except Exception:
            failures.append({"layout": index, "error": traceback.format_exc()[-2000:]})
    return cases, failures


def _payload_speed(kernels, spec, src: torch.Tensor, offsets: list[int], seeds: torch.Tensor,
                   timer: Callable[[Callable[[], object]], float]) -> dict:  # fmt: skip
    """``timer``'s time (ms) of one fused encode, decode and sum of ``len(offsets)`` payloads, and GB/s.

    Called as QSDP calls them: seeds and offsets from the CPU; a rotated decode and sum get the seeds.
    """
    slots, numel, nbytes = len(offsets), spec.numel, spec.nbytes
    decode_seeds = seeds if spec.rotated else None
    blob = torch.empty(slots * nbytes, dtype=torch.uint8, device=src.device)
    kernels.encode_payloads(src, spec, offsets, seeds, blob)
    out_offsets = [slot * numel for slot in range(slots)]
    out = torch.empty(slots * numel, dtype=spec.elem_dtype, device=src.device)
    total = torch.empty(numel, dtype=torch.float32, device=src.device)
    base = src[offsets[0] : offsets[0] + numel]
    enc_ms = timer(lambda: kernels.encode_payloads(src, spec, offsets, seeds, blob))
    dec_ms = timer(lambda: kernels.decode_payloads(blob, spec, out, out_offsets, decode_seeds))
    sum_ms = timer(lambda: kernels.sum_payloads(blob, spec, base, total, decode_seeds))
    elem_bytes = slots * numel * src.element_size()
    return {
        "encode_ms": enc_ms, "decode_ms": dec_ms, "sum_ms": sum_ms,
        "encode_gbps": (elem_bytes + slots * nbytes) / enc_ms / 1e6,
        "decode_gbps": (elem_bytes + slots * nbytes) / dec_ms / 1e6,
        "sum_gbps": (slots * nbytes + 2 * 4 * numel) / sum_ms / 1e6,
    }  # fmt: skip


def section_payloads(ctx: Context) -> dict:
    """The CUDA build's fused payload calls against the reference's, bit for bit; then their speed."""
    unsupported = _payload_support(ctx.kernels)
    if unsupported is not None:
        return unsupported
    from qaccel.quant import PayloadSpec

    # The CUDA build's functions, called directly: the public ones would fall back to the reference
    # (and compare it with itself) if QACCEL_KERNELS or a failed build said so.
    cases, failures = _check_payload_layouts(ctx.kernels, PAYLOAD_LAYOUTS, "none", "cuda", 0, 4)
    timings = []
    for index, (segments, bits, bucket, meta, rounding, elem, slots) in enumerate(PAYLOAD_LAYOUTS[4:], start=4):  # GPT-2 blocks
        try:
            spec = PayloadSpec(segments=segments, bits=bits, bucket_size=bucket, meta_dtype=meta, rounding=rounding, elem_dtype=elem)
            src, offsets = _payload_inputs(spec.numel, slots, elem, 1000 + index)
            speed = _payload_speed(ctx.kernels, spec, src, offsets, _payload_seeds(slots, len(segments), 77 * index),
                                   lambda fn: _median_ms(fn, ctx.args.repeats))  # fmt: skip
            timings.append({"layout": index, "slots": slots, "bits": bits, "chunk_numel": spec.numel,
                            "payload_bytes": spec.nbytes, **speed})  # fmt: skip
        except Exception:
            failures.append({"layout": index, "error": traceback.format_exc()[-2000:]})
    return {"cases": cases, "failures": failures, "timings": timings, "ok": not failures}


# --------------------------------------------------------------------------------------------------
# Hadamard-rotated payloads (PayloadSpec(rotation="hadamard"), docs/kernels.md "Hadamard rotation")
# --------------------------------------------------------------------------------------------------
ROTATED_PAYLOAD_LAYOUTS = (
    # segments, bits, bucket, meta dtype, rounding, element dtype, slots (as PAYLOAD_LAYOUTS). Buckets of
    # one block (128), of several power-of-two blocks (1000 = 512+256+128+64+32+8), of two full blocks
    # (2048), ragged segments shorter than a bucket, empty and raw segments; NaN/Inf in the first slot.
    (((65_537, True), (1_000, False), (4_096, True)), 4, 128, torch.bfloat16, "stochastic", torch.bfloat16, 2),
    (((100_003, True), (17, False)), 3, 1000, torch.float32, "nearest", torch.float16, 3),
    (((70_001, True), (63, True)), 2, 2048, torch.bfloat16, "stochastic", torch.float32, 4),
    (((262_147, True), (769, False), (12_293, True)), 8, 1024, torch.float32, "stochastic", torch.float32, 2),
    (((0, True), (1, False), (9, True), (3, False), (2_500, True), (63, True), (7, False), (1_030, True)),
     5, 100, torch.float32, "stochastic", torch.bfloat16, 3),
)  # fmt: skip
# Rotated against plain speed: label, segments, bits, bucket, meta dtype, slots; fp32 elements, stochastic
# rounding. Slots None: as many GPT-2 block chunks as --numel values hold, so that the kernels and not
# the launch and the per-call offset copy set the time; the others are one QSDP reduce-scatter's send.
ROTATION_TIMINGS = (
    ("gpt2_block_ws4", _gpt2_block_segments(4), 4, 128, torch.bfloat16, 3),
    ("gpt2_block_ws4", _gpt2_block_segments(4), 8, 1024, torch.float32, 3),
    ("numel", _gpt2_block_segments(1), 4, 128, torch.bfloat16, None),
    ("numel", _gpt2_block_segments(1), 8, 1024, torch.float32, None),
)


def rotation_summary(cases: Sequence[dict], layouts: int, timings: Sequence[dict]) -> str:
    """One line: how many rotated layouts matched the reference, and rotated / plain time per timed row."""
    identical = sum(1 for case in cases if _case_identical(case))
    parts = [f"{identical}/{layouts} rotated layouts identical to the reference"]
    for row in timings:
        parts.append(f"{row['bits']}-bit b{row['bucket_size']} x{row['slots']} {row['label']}: rotated/plain "
                     f"encode {row['encode_ratio']:.2f}x, decode {row['decode_ratio']:.2f}x, sum {row['sum_ratio']:.2f}x")  # fmt: skip
    return "; ".join(parts)


def _rotation_speed(kernels, row: tuple, device: str, timer: Callable[[Callable[[], object]], float], numel: int) -> dict:
    """One ``ROTATION_TIMINGS`` row timed plain and rotated on the same values, and the ratios."""
    from qaccel.quant import PayloadSpec

    label, segments, bits, bucket, meta, slots = row
    specs = {rotation: PayloadSpec(segments=segments, bits=bits, bucket_size=bucket, meta_dtype=meta, rotation=rotation)
             for rotation in ("none", "hadamard")}  # fmt: skip
    chunk = specs["none"].numel
    slots = slots or max(1, numel // chunk)
    src = torch.randn(slots * chunk, device=device, generator=torch.Generator(device).manual_seed(bits))
    offsets = [slot * chunk for slot in range(slots)]
    seeds = _payload_seeds(slots, len(segments), 5)
    plain = _payload_speed(kernels, specs["none"], src, offsets, seeds, timer)
    rotated = _payload_speed(kernels, specs["hadamard"], src, offsets, seeds, timer)
    return {
        "label": label, "bits": bits, "bucket_size": bucket, "meta_dtype": str(meta).removeprefix("torch."),
        "slots": slots, "chunk_numel": chunk, "payload_bytes": specs["none"].nbytes, "plain": plain, "rotated": rotated,
        **{f"{op}_ratio": rotated[f"{op}_ms"] / plain[f"{op}_ms"] for op in ("encode", "decode", "sum")},
    }  # fmt: skip


def payload_rotation_report(kernels, device: str, timer: Callable[[Callable[[], object]], float], numel: int) -> dict:
    """Rotated payloads of ``kernels`` against the reference on ``device``; then rotated vs plain speed.

    ``timer(fn)`` returns the time of one call in ms; ``numel`` sizes the ``ROTATION_TIMINGS`` rows
    without a slot count. The GPU section passes the CUDA kernels, "cuda" and CUDA-event medians;
    tests/unit/test_gpu_check_script.py passes the C++ kernels, "cpu" and a wall-clock timer.
    """
    unsupported = _payload_support(kernels)
    if unsupported is not None:
        return unsupported
    from qaccel.quant import PayloadSpec

    if not hasattr(PayloadSpec, "rotated"):
        return {"skipped": "not available: qaccel.quant.PayloadSpec has no rotation"}
    cases, failures = _check_payload_layouts(kernels, ROTATED_PAYLOAD_LAYOUTS, "hadamard", device, 100,
                                             len(ROTATED_PAYLOAD_LAYOUTS))  # fmt: skip
    timings = []
    for row in ROTATION_TIMINGS:
        try:
            timings.append(_rotation_speed(kernels, row, device, timer, numel))
        except Exception:
            failures.append({"timing": row[0], "bits": row[2], "error": traceback.format_exc()[-2000:]})
    return {
        "cases": cases,
        "failures": failures,
        "timings": timings,
        "ratio": "rotated time / plain time of the same call on the same values (above 1: rotation costs that much more)",
        "summary": rotation_summary(cases, len(ROTATED_PAYLOAD_LAYOUTS), timings),
        "ok": not failures,
    }


def section_payloads_rotated(ctx: Context) -> dict:
    """The CUDA build's rotated payloads against the reference, bit for bit; then rotated vs plain speed."""
    return payload_rotation_report(ctx.kernels, "cuda", lambda fn: _median_ms(fn, ctx.args.repeats), ctx.args.numel)


# --------------------------------------------------------------------------------------------------
# Training on one GPU over NCCL: FSDP2 + QSDP, and 0/1 Adam
# --------------------------------------------------------------------------------------------------
# The device and backend of the training sections. tests/unit/test_gpu_check_script.py sets "cpu" to run
# them over gloo without a GPU (the same code path up to the device), so the GPU day is not their first run.
TRAIN_DEVICE = "cuda"


def _on_gpu() -> bool:
    return TRAIN_DEVICE == "cuda"


def _synchronize() -> None:
    if _on_gpu():
        torch.cuda.synchronize()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _process_group() -> dict:
    """A 1-rank NCCL process group in this process (created once, destroyed at exit by ``main``)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        if _on_gpu():
            torch.cuda.set_device(0)
            dist.init_process_group("nccl", init_method=init_method, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        else:
            dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
    nccl_version = ".".join(map(str, torch.cuda.nccl.version())) if _on_gpu() else None
    return {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "nccl_version": nccl_version}


FSDP_MODEL = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 4096, "n_positions": 128,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip


def _fsdp_run(qsdp: bool, bf16: bool, steps: int) -> dict:
    """Train the small GPT-2 sharded per block + root; QSDP W8G8 installed or stock FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel.comm import WireMeter
    from qaccel.fsdp import QSDPConfig, install_qsdp

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**FSDP_MODEL)).to(TRAIN_DEVICE)
    # bf16 as qaccel's Accelerate integration sets it: bf16 compute, fp32 gradient reduction.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    mesh = init_device_mesh(TRAIN_DEVICE, (1,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = WireMeter()
    info: dict = {}
    if qsdp:
        extra = {"prefetch": True} if "prefetch" in {f.name for f in dataclasses.fields(QSDPConfig)} else {}
        config = QSDPConfig(weight_bits=8, grad_bits=8, **extra)
        handle = install_qsdp(model, config, optimizers=[optimizer], meter=meter)
        info = {"qsdp_config": config.to_dict(), "quantized_units": sum(1 for u in handle.describe() if u["weights_quantized"])}
    tokens = torch.randint(0, FSDP_MODEL["vocab_size"], (8, FSDP_MODEL["n_positions"]), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(TRAIN_DEVICE)
    losses = []
    _synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    values = torch.stack(losses).cpu().tolist()
    seconds = time.perf_counter() - started
    calls = {kind: tally.calls for kind, tally in meter.totals().items()}
    del model, optimizer
    return {"losses": values, "seconds": seconds, "comm_calls": calls, **info}


def _comms_over_nccl() -> dict:
    """The QSDP collectives called directly over the 1-rank NCCL group, against the reference codec.

    At world size 1 the all-gather still encodes and every rank (here: the owner) decodes the gathered
    bytes, so the output must equal the reference's dequantize(quantize(shard)) bit for bit; the
    reduce-scatter's own chunk never leaves the rank, so its output must equal its input (an all-to-all
    with zero-length splits goes through NCCL). Run on the default stream and on a side stream.
    """
    import torch.distributed as dist

    from qaccel.comm import (
        PayloadLayout,
        WireCodec,
        WireMeter,
        mix_seed,
        quantized_all_gather,
        quantized_reduce_scatter,
    )

    group = dist.group.WORLD
    results = []
    for bits, bucket, meta, dtype, side_stream in ((8, 1024, torch.float32, torch.float32, False),
                                                   (4, 128, torch.bfloat16, torch.float32, True),
                                                   (8, 1024, torch.float32, torch.bfloat16, True)):  # fmt: skip
        segments = ((768 * 2304, True), (3 * 768, False), (768 * 768 + 5, True))
        codec = WireCodec(bits=bits, bucket_size=bucket, meta_dtype=meta, rounding="stochastic")
        layout = PayloadLayout(segments=segments, codec=codec, elem_dtype=dtype)
        numel = layout.numel
        shard = (torch.randn(numel, generator=torch.Generator().manual_seed(bits)) * 0.02).to(dtype).to(TRAIN_DEVICE)
        seed = 12345 + bits
        expected = torch.empty_like(shard)
        start = 0
        for index, (length, quantized) in enumerate(segments):
            piece = shard[start : start + length]
            if quantized:
                codes, lo, scale = reference.quantize_buckets(piece, bits, bucket, False, mix_seed(seed, index), meta)
                reference.dequantize_into(codes, lo, scale, bits, bucket, expected[start : start + length], False)
            else:
                expected[start : start + length].copy_(piece)
            start += length
        gathered = torch.full_like(shard, math.nan)
        reduced = torch.full_like(shard, math.nan)
        stream = torch.cuda.Stream() if side_stream and _on_gpu() else None  # as FSDP2's all-gather stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # asynchronous where the comm offers it (the prefetch path): the work decodes on wait()
            extra = {"async_op": True} if side_stream and "async_op" in inspect.signature(quantized_all_gather).parameters else {}
            work = quantized_all_gather(gathered, shard, group, layout, seed, WireMeter(), "probe.all_gather", **extra)
            if work is not None:
                work.wait()
            quantized_reduce_scatter(reduced, shard, group, layout, [seed], WireMeter(), "probe.reduce_scatter")
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        _synchronize()
        results.append({
            "bits": bits, "bucket_size": bucket, "meta_dtype": str(meta), "dtype": str(dtype), "side_stream": side_stream,
            "async_op": bool(extra),
            "all_gather_matches_reference": _same_bits(gathered, expected),
            "reduce_scatter_returns_own_chunk": _same_bits(reduced, shard),
        })  # fmt: skip
    return {"cases": results, "ok": all(r["all_gather_matches_reference"] and r["reduce_scatter_returns_own_chunk"] for r in results)}


def section_fsdp_smoke(ctx: Context) -> dict:
    report: dict = {"process_group": _process_group(), "model": FSDP_MODEL, "steps": ctx.args.steps}
    try:
        report["comms_over_nccl"] = _comms_over_nccl()
    except Exception:
        report["comms_over_nccl"] = {"error": traceback.format_exc()[-3000:]}
    for variant, bf16 in (("fp32", False), ("bf16", True)):
        try:
            qsdp = _fsdp_run(True, bf16, ctx.args.steps)
            stock = _fsdp_run(False, bf16, ctx.args.steps)
            verdict = loss_verdict(qsdp["losses"], stock["losses"])
            qsdp_calls = {k: v for k, v in qsdp["comm_calls"].items() if k.startswith("qsdp.")}
            entry = {"qsdp": qsdp, "stock": stock, **verdict, "qsdp_comm_calls": qsdp_calls,
                     "exercises_qsdp_comms": bool(qsdp_calls)}  # fmt: skip
            if not qsdp_calls:
                entry["note"] = ("FSDP2 issued no all-gather or reduce-scatter at world size 1 (torch skips them), so the "
                                 "QSDP comms were not called and the losses should equal stock FSDP2's; the comms run "
                                 "over NCCL in comms_over_nccl")  # fmt: skip
            report[variant] = entry
        except Exception:
            report[variant] = {"error": traceback.format_exc()[-3000:]}
    report["ok"] = all(not section_failed(report[k]) for k in ("comms_over_nccl", "fp32", "bf16"))
    return report


def _zoadam_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(TRAIN_DEVICE)


def _zoadam_batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(t)
    return torch.randn(64, 32, generator=generator).to(TRAIN_DEVICE), torch.randn(64, 8, generator=generator).to(TRAIN_DEVICE)


def _zoadam_reference(steps: int, lr: float, betas: tuple[float, float], eps: float, wd: float,
                      F: int, kappa: int, alpha: int, H: int) -> torch.nn.Module:  # fmt: skip
    """0/1 Adam on one worker in plain torch, from the algorithm table of docs/zero_one_adam.md (C = identity)."""
    net = _zoadam_net()
    params = list(net.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    u = [torch.zeros_like(p) for p in params]
    synced: list[torch.Tensor] = []
    var_interval, var_counter, local_interval, local_counter, lrs, frozen = 1, 0, 1, 0, 0.0, False
    for t in range(1, steps + 1):
        net.zero_grad()
        x, y = _zoadam_batch(t)
        torch.nn.functional.mse_loss(net(x), y).backward()
        if t == 1:
            continue  # initialization step: the gradient is discarded
        with torch.no_grad():
            if not frozen:
                variance_step = t % var_interval == 0
                for i, p in enumerate(params):
                    if variance_step:
                        v[i] = betas[1] * v[i] + (1 - betas[1]) * p.grad * p.grad
                    m[i] = betas[0] * m[i] + (1 - betas[0]) * p.grad
                    p -= lr * (m[i] / (v[i].sqrt() + eps) + wd * p)
                if variance_step:
                    var_counter += 1
                    if var_counter == kappa:
                        var_counter, var_interval = 0, 2 * var_interval
                if t > F:
                    frozen = True
                    synced = [p.detach().clone() for p in params]
            else:
                lrs += lr
                for i, p in enumerate(params):
                    m[i] = betas[0] * m[i] + (1 - betas[0]) * p.grad
                    d = m[i] / (v[i].sqrt() + eps) + wd * p
                    p -= lr * d
                    u[i] -= lr * d
                if t % local_interval == 0:
                    for i, p in enumerate(params):
                        m[i] = -u[i] * (v[i].sqrt() + eps) / lrs
                        p.copy_(synced[i] + u[i])
                        synced[i] = p.detach().clone()
                        u[i].zero_()
                    lrs = 0.0
                local_counter += 1
                if local_counter == alpha:
                    local_counter, local_interval = 0, min(H, 2 * local_interval)
    return net


def _zoadam_ddp(**settings):
    from torch.nn.parallel import DistributedDataParallel

    from qaccel.optim import ZeroOneAdam, register_ddp_comm_hook

    net = _zoadam_net()
    ddp = DistributedDataParallel(net, device_ids=[0] if _on_gpu() else None)
    optimizer = ZeroOneAdam(ddp.parameters(), **settings)
    register_ddp_comm_hook(ddp, optimizer)
    return net, ddp, optimizer


def _zoadam_warmup_vs_torch_adam(lr: float, betas: tuple[float, float], eps: float, wd: float) -> dict:
    """Steps 2..5 are full Adam steps: moments against torch.optim.Adam's, update against the formula.

    torch.optim.Adam, fed the same gradients from step 2 on (step 1 only creates 0/1 Adam's state), keeps
    the same exp_avg / exp_avg_sq; its update differs by design (bias correction), so the weights are
    checked against w - lr (m / (sqrt(v) + eps) + wd w) with torch.optim.Adam's moments.
    """
    net, ddp, optimizer = _zoadam_ddp(lr=lr, betas=betas, eps=eps, weight_decay=wd, var_freeze_step=8,
                                      var_update_scaler=16, local_step_scaler=1000, local_step_clipper=16)  # fmt: skip
    params = list(net.parameters())
    shadow = [p.detach().clone().requires_grad_(True) for p in params]
    adam = torch.optim.Adam(shadow, lr=lr, betas=betas, eps=eps, weight_decay=0.0)
    rows = []
    for t in range(1, 6):
        kind = optimizer.schedule.next_kind().value
        optimizer.zero_grad()
        x, y = _zoadam_batch(t)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        grads = [p.grad.detach().clone() for p in params]
        before = [p.detach().clone() for p in params]
        optimizer.step()
        if t == 1:
            rows.append({"step": t, "kind": kind, "weights_unchanged": all(torch.equal(a, b) for a, b in zip(before, params, strict=True))})
            continue
        for s, g in zip(shadow, grads, strict=True):
            s.grad = g
        adam.step()
        moments, update = 0.0, 0.0
        for p, s, w0 in zip(params, shadow, before, strict=True):
            state, ref = optimizer.state[p], adam.state[s]
            moments = max(moments, max_relative_error(state["exp_avg"], ref["exp_avg"]),
                          max_relative_error(state["exp_avg_sq"], ref["exp_avg_sq"]))  # fmt: skip
            expected = w0 - lr * (ref["exp_avg"] / (ref["exp_avg_sq"].sqrt() + eps) + wd * w0)
            update = max(update, max_relative_error(p.detach() - w0, expected - w0))
        rows.append({"step": t, "kind": kind, "moments_vs_torch_adam": moments, "update_vs_formula": update})
    ok = rows[0]["weights_unchanged"] and all(r["kind"] == "full" and r["moments_vs_torch_adam"] <= 1e-5
                                              and r["update_vs_formula"] <= 1e-4 for r in rows[1:])  # fmt: skip
    return {"steps": rows, "ok": ok}


def _zoadam_all_kinds(steps: int = 24) -> dict:
    """Every step kind (full, 1-bit gradient, local, sync) against the plain loop; no step waits for the GPU."""
    # lr 1e-3 keeps this net stable: at 5e-3 the fresh variance makes the run chaotic and rounding grows to %.
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    schedule = {"var_freeze_step": 6, "var_update_scaler": 1, "local_step_scaler": 2, "local_step_clipper": 4}
    net, ddp, optimizer = _zoadam_ddp(**hyper, **schedule)
    kinds, host_syncs, losses = [], [], []
    for t in range(1, steps + 1):
        kinds.append(optimizer.schedule.next_kind().value)
        optimizer.zero_grad()
        x, y = _zoadam_batch(t)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        losses.append(loss.detach())
        # The step must queue its work without waiting for the GPU (docs/zero_one_adam.md, "Cost per step").
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if _on_gpu():
                torch.cuda.set_sync_debug_mode("warn")
            try:
                optimizer.step()
            finally:
                if _on_gpu():
                    torch.cuda.set_sync_debug_mode(0)
        # torch's warning for a synchronizing call; its one-time "debug mode is a prototype" notice is none.
        syncs = [str(w.message)[:300] for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
        if syncs:
            host_syncs.append({"step": t, "kind": kinds[-1], "warnings": syncs[:3]})
    expected = _zoadam_reference(steps, hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"],
                                 schedule["var_freeze_step"], schedule["var_update_scaler"],
                                 schedule["local_step_scaler"], schedule["local_step_clipper"])  # fmt: skip
    error = max(max_relative_error(a, e) for a, e in zip(net.parameters(), expected.parameters(), strict=True))
    values = torch.stack(losses).cpu().tolist()
    seen = set(kinds)
    return {
        "kinds": kinds,
        "losses": values,
        "weights_vs_plain_loop": error,
        "all_kinds_seen": {"full", "onebit_gradient", "local", "sync"} <= seen,
        "host_syncs": host_syncs,
        "finite": all(math.isfinite(v) for v in values),
        # As tests/unit/test_zoadam_optimizer.py: rounding differences stay far below the O(1) of a slip.
        "ok": error <= 1e-4 and {"full", "onebit_gradient", "local", "sync"} <= seen and all(math.isfinite(v) for v in values)
        and not host_syncs,
    }


def section_zero_one_adam(ctx: Context) -> dict:
    group = _process_group()
    report: dict = {"process_group": group, "setup": f"DDP over {group['backend']}, world size 1, qaccel's DDP comm hook"}
    for name, run in (("warmup_vs_torch_adam", lambda: _zoadam_warmup_vs_torch_adam(1e-3, (0.9, 0.999), 1e-8, 0.01)),
                      ("all_step_kinds", _zoadam_all_kinds)):  # fmt: skip
        try:
            report[name] = run()
        except Exception:
            report[name] = {"error": traceback.format_exc()[-3000:]}
    report["ok"] = not section_failed(report["warmup_vs_torch_adam"]) and not section_failed(report["all_step_kinds"])
    return report


# --------------------------------------------------------------------------------------------------
# C++ against CUDA, environment, driver
# --------------------------------------------------------------------------------------------------
def section_cross_backend(ctx: Context) -> dict:
    """CUDA and C++ kernels agree bit for bit, metadata and NaN bits included."""
    cpu_kernels, reason = _native.try_load("cpu")
    if cpu_kernels is None:
        return {"skipped": f"C++ kernels unavailable: {reason}"}
    failures = []
    cases = _cases(quick=True)[::3]
    for case in cases:
        meta = DTYPES[case["meta"]]
        x = _input(case["numel"], DTYPES[case["dtype"]], case["seed"] % 2**31, case["specials"], case["misaligned"])
        args = (case["bits"], case["bucket"], case["nearest"], case["seed"], meta)
        gpu = ctx.kernels.quantize_buckets(x, *args)
        cpu = cpu_kernels.quantize_buckets(x.cpu(), *args)
        if not all(_same_bits(a.cpu(), b) for a, b in zip(gpu, cpu, strict=True)):
            failures.append(case)
    return {"cases": len(cases), "failures": failures[:20], "ok": not failures}


def _environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    nvcc = _native.find_nvcc()
    nvcc_version = None
    if nvcc:
        lines = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()
        nvcc_version = lines[-1] if lines else None
    versions = {}
    for package in ("transformers", "accelerate", "bitsandbytes"):
        try:
            versions[package] = __import__(package).__version__
        except Exception as error:  # absent, or fails to load its native library
            versions[package] = f"unavailable: {type(error).__name__}"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": props.name,
        "capability": list(torch.cuda.get_device_capability(0)),
        "multiprocessors": props.multi_processor_count,
        "memory_gib": props.total_memory / 2**30,
        "datasheet": device_specs(props.name),
        "nvcc": nvcc_version,
        **versions,
    }


SECTION_FUNCTIONS: dict[str, Callable[[Context], dict]] = {
    "bit_identical": lambda ctx: section_bit_identical(ctx.kernels, ctx.args.quick),
    "bandwidth": section_bandwidth,
    "fp64": section_fp64,
    "bitsandbytes": section_bitsandbytes,
    "payloads": section_payloads,
    "fsdp_smoke": section_fsdp_smoke,
    "zero_one_adam": section_zero_one_adam,
    "cross_backend": section_cross_backend,
    "payloads_rotated": section_payloads_rotated,
}


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(  # qaccel's flag rules: no prefix matching, --a-b reads as --a_b
        description=__doc__.splitlines()[0],
        epilog=f"sections, in run order: {', '.join(SECTIONS)}. See docs/gpu_runbook.md.",
    )
    parser.add_argument("--json", default="gpu_check.json", help="write the report here (default ./gpu_check.json)")
    parser.add_argument("--sections", default=None, help="comma-separated subset of the sections (default: all)")
    parser.add_argument("--numel", type=int, default=1 << 28, help="values in the bandwidth tensor (default 256M)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per bandwidth figure (median)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per FSDP2 run (default 20)")
    parser.add_argument("--quick", action="store_true", help="half the bit-identity cases")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sections = parse_sections(args.sections)
    except ValueError as error:
        parser.error(str(error))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"schema_version": 2, "check": "gpu_check", "ok": False, "sections": sections}

    def save() -> None:
        path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")

    if not torch.cuda.is_available():
        report["error"] = f"no CUDA device visible to torch {torch.__version__} (torch.version.cuda={torch.version.cuda})"
        save()
        sys.stderr.write(f"gpu_check: {report['error']}; this check needs an NVIDIA GPU. Report: {path}\n")
        return 1
    report["environment"] = _environment()
    save()
    kernels = None
    if any(name in KERNEL_SECTIONS for name in sections):
        start = time.perf_counter()
        kernels, reason = _native.try_load("cuda")
        report["build"] = {"seconds": time.perf_counter() - start, "ok": kernels is not None, "error": reason,
                           **{k: v for k, v in _native.describe("cuda").items() if k in ("name", "build_dir")}}  # fmt: skip
        save()
    ctx = Context(kernels, args)
    try:
        for name in sections:
            section_start = time.perf_counter()
            if name in KERNEL_SECTIONS and kernels is None:
                report[name] = {"skipped": "the CUDA kernels did not build (see build.error)"}
            else:
                try:
                    report[name] = SECTION_FUNCTIONS[name](ctx)
                except Exception:  # keep the other sections' figures
                    report[name] = {"error": traceback.format_exc()[-4000:]}
            report[name]["section_seconds"] = time.perf_counter() - section_start
            report["ok"] = overall_ok(report, sections)
            save()
            sys.stdout.write(f"gpu_check: {name}: {'FAILED' if section_failed(report[name]) else 'done'} "
                             f"in {report[name]['section_seconds']:.1f} s\n")  # fmt: skip
            if isinstance(report[name].get("summary"), str):
                sys.stdout.write(f"gpu_check: {name}: {report[name]['summary']}\n")
            sys.stdout.flush()
            torch.cuda.empty_cache()
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    report["ok"] = overall_ok(report, sections)
    save()
    sys.stdout.write(json.dumps({"ok": report["ok"], "json": str(path),
                                 "failed": [n for n in sections if section_failed(report.get(n))]}) + "\n")  # fmt: skip
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
