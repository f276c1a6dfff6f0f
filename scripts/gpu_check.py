#!/usr/bin/env python3
"""GPU check of qaccel's CUDA codec kernels; ``scripts/gpu_check.sh`` runs it in one call.

1. builds the CUDA kernels with the JIT loader (``qaccel.quant._native``, sm of the device);
2. checks them bit for bit against the pure-torch reference run on the same GPU (and, for a few
   cases, against the reference on the CPU): codes, ``lo``, ``scale`` and decoded values over many
   sizes, bit widths, bucket sizes, dtypes, roundings, metadata dtypes, seeds, special values,
   misaligned inputs, and the sign codec;
3. measures quantize/dequantize bandwidth (bytes each op must move, CUDA events, median) on a
   large tensor against a device-to-device copy of the same tensor and the device's peak;
4. when ``bitsandbytes`` imports, times ``bitsandbytes.functional.quantize_blockwise`` /
   ``dequantize_blockwise`` on the same tensor and compares their errors with ours;
5. builds the C++ kernels too and checks CUDA and C++ agree bit for bit (metadata included).

Figures go to the JSON file given by ``--json`` (rewritten after every section, so a timeout
keeps what was measured). Exit status 0 when the build works and every case is bit-identical.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from qaccel.quant import _native, reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
SPECIALS = [math.nan, math.inf, -math.inf, 3e38, -3e38, 0.0, -0.0, 1e-40]


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


def _median_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _peak_gbps() -> float | None:
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate


def section_bandwidth(kernels, numel: int, repeats: int) -> dict:
    x = torch.randn(numel, device="cuda")
    copy_ms = _median_ms(lambda: torch.empty_like(x).copy_(x), repeats)
    copy_gbps = 8 * numel / copy_ms / 1e6
    rows = []
    for dtype_name, bits, bucket in (("fp32", 8, 1024), ("fp32", 4, 1024), ("fp32", 2, 1024), ("fp32", 4, 128),
                                     ("fp32", 8, 4096), ("fp32", 4, 1000), ("bf16", 8, 1024), ("bf16", 4, 1024)):  # fmt: skip
        source = x if dtype_name == "fp32" else x.to(DTYPES[dtype_name])
        encoded = kernels.quantize_buckets(source, bits, bucket, False, 1, torch.float32)
        out = torch.empty_like(source)
        q_ms = _median_ms(lambda s=source, b=bits, k=bucket: kernels.quantize_buckets(s, b, k, False, 1, torch.float32), repeats)
        dq_ms = _median_ms(lambda e=encoded, b=bits, k=bucket, o=out: kernels.dequantize_into(*e, b, k, o, False), repeats)
        packed = encoded[0].numel() + 8 * encoded[1].numel()
        q_bytes = source.element_size() * numel + packed
        dq_bytes = packed + out.element_size() * numel
        rows.append({
            "input": dtype_name, "bits": bits, "bucket_size": bucket,
            "quantize_ms": q_ms, "dequantize_ms": dq_ms,
            "quantize_gbps": q_bytes / q_ms / 1e6, "dequantize_gbps": dq_bytes / dq_ms / 1e6,
            "quantize_vs_copy": q_bytes / q_ms / 1e6 / copy_gbps, "dequantize_vs_copy": dq_bytes / dq_ms / 1e6 / copy_gbps,
        })  # fmt: skip
        del encoded, out
    signs = kernels.sign_pack(x, 1)
    sign_out = torch.empty_like(x)
    scales = kernels.chunk_rms(x, 1)
    pack_ms = _median_ms(lambda: kernels.sign_pack(x, 1), repeats)
    unpack_ms = _median_ms(lambda: kernels.sign_unpack(signs, scales, numel, sign_out), repeats)
    return {
        "numel": numel,
        "copy_gbps": copy_gbps,
        "peak_gbps": _peak_gbps(),
        "datasheet_h200_gbps": 4800.0,
        "bytes_moved": "quantize: input + codes + 8 B/bucket; dequantize: codes + 8 B/bucket + output; copy: 2 x 4n",
        "rows": rows,
        "sign_pack_gbps": (4 * numel + numel / 8) / pack_ms / 1e6,
        "sign_unpack_gbps": (4 * numel + numel / 8) / unpack_ms / 1e6,
    }


def section_bitsandbytes(kernels, numel: int, repeats: int) -> dict:
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnb_functional
    except Exception as error:  # not installed, or its CUDA library failed to load
        return {"skipped": f"bitsandbytes not importable: {type(error).__name__}: {error}"}
    x = torch.randn(numel, device="cuda")
    report: dict = {"version": getattr(bitsandbytes, "__version__", None), "numel": numel, "rows": []}
    for blocksize in (1024, 256):
        q, state = bnb_functional.quantize_blockwise(x, blocksize=blocksize)
        q_ms = _median_ms(lambda b=blocksize: bnb_functional.quantize_blockwise(x, blocksize=b), repeats)
        dq_ms = _median_ms(lambda q=q, s=state: bnb_functional.dequantize_blockwise(q, s), repeats)
        bnb_error = (bnb_functional.dequantize_blockwise(q, state) - x).abs().mean().item()
        ours = kernels.quantize_buckets(x, 8, blocksize, False, 1, torch.float32)
        ours_q_ms = _median_ms(lambda b=blocksize: kernels.quantize_buckets(x, 8, b, False, 1, torch.float32), repeats)
        out = torch.empty_like(x)
        ours_dq_ms = _median_ms(lambda o=ours, b=blocksize, d=out: kernels.dequantize_into(*o, 8, b, d, False), repeats)
        ours_error = (kernels.dequantize_into(*ours, 8, blocksize, out, False) - x).abs().mean().item()
        report["rows"].append({
            "blocksize": blocksize,
            "bnb_quantize_ms": q_ms, "bnb_dequantize_ms": dq_ms, "bnb_mean_abs_error": bnb_error,
            "qaccel_quantize_ms": ours_q_ms, "qaccel_dequantize_ms": ours_dq_ms, "qaccel_mean_abs_error": ours_error,
            "quantize_speedup_vs_bnb": q_ms / ours_q_ms, "dequantize_speedup_vs_bnb": dq_ms / ours_dq_ms,
        })  # fmt: skip
    return report


def section_cross_backend(kernels) -> dict:
    """CUDA and C++ kernels agree bit for bit, metadata and NaN bits included."""
    cpu_kernels, reason = _native.try_load("cpu")
    if cpu_kernels is None:
        return {"skipped": f"C++ kernels unavailable: {reason}"}
    failures = []
    for case in _cases(quick=True)[::3]:
        meta = DTYPES[case["meta"]]
        x = _input(case["numel"], DTYPES[case["dtype"]], case["seed"] % 2**31, case["specials"], case["misaligned"])
        args = (case["bits"], case["bucket"], case["nearest"], case["seed"], meta)
        gpu = kernels.quantize_buckets(x, *args)
        cpu = cpu_kernels.quantize_buckets(x.cpu(), *args)
        if not all(_same_bits(a.cpu(), b) for a, b in zip(gpu, cpu, strict=True)):
            failures.append(case)
    return {"cases": len(_cases(quick=True)[::3]), "failures": failures[:20], "ok": not failures}


def _environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    nvcc = _native.find_nvcc()
    nvcc_version = None
    if nvcc:
        lines = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout.splitlines()
        nvcc_version = lines[-1] if lines else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": props.name,
        "capability": list(torch.cuda.get_device_capability(0)),
        "multiprocessors": props.multi_processor_count,
        "memory_gib": props.total_memory / 2**30,
        "nvcc": nvcc_version,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the report here")
    parser.add_argument("--numel", type=int, default=1 << 28, help="values in the bandwidth tensor (default 256M)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per bandwidth figure (median)")
    parser.add_argument("--quick", action="store_true", help="half the bit-identity cases")
    args = parser.parse_args(argv)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"schema_version": 1, "check": "gpu_check", "ok": False}

    def save() -> None:
        path.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")

    if not torch.cuda.is_available():
        report["error"] = f"no CUDA device visible to torch {torch.__version__}"
        save()
        return 1
    report["environment"] = _environment()
    save()
    start = time.perf_counter()
    kernels, reason = _native.try_load("cuda")
    report["build"] = {"seconds": time.perf_counter() - start, "ok": kernels is not None, "error": reason,
                       **{k: v for k, v in _native.describe("cuda").items() if k in ("name", "build_dir")}}  # fmt: skip
    save()
    if kernels is None:
        return 1
    for name, section in (
        ("bit_identical", lambda: section_bit_identical(kernels, args.quick)),
        ("bandwidth", lambda: section_bandwidth(kernels, args.numel, args.repeats)),
        ("bitsandbytes", lambda: section_bitsandbytes(kernels, args.numel, args.repeats)),
        ("cross_backend", lambda: section_cross_backend(kernels)),
    ):
        section_start = time.perf_counter()
        try:
            report[name] = section()
        except Exception:  # keep the other sections' figures
            report[name] = {"error": traceback.format_exc()[-4000:]}
        report[name]["section_seconds"] = time.perf_counter() - section_start
        cross = report.get("cross_backend", {"ok": True})
        report["ok"] = bool(report["build"]["ok"] and report.get("bit_identical", {}).get("ok")
                            and (cross.get("ok") or "skipped" in cross))  # fmt: skip
        save()
    sys.stdout.write(json.dumps({"ok": report["ok"], "json": str(path)}) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
