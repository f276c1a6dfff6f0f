"""``qaccel bench quant``: codec throughput per kernel backend against a memory copy (the bound).

Two studies share the command: ``--study throughput`` (the default, described here) and
``--study error`` (round-trip error of 2-8 bit codecs with and without Hadamard rotation, and the
rotation's cost on one thread: :mod:`qaccel.bench._quant_error`). A flag of one study given to the
other is an input error.

For every backend usable on the device (``reference`` always; ``cpu``/``cuda`` when they build) and
for ``bits`` 8 and 4, it times quantize, dequantize and the round trip on one large fp32 tensor,
on one thread and on all threads (CPU), and a plain copy of the same tensor. Throughput is
reported two ways: ``gbps`` counts the bytes each operation must move (quantize reads ``4n`` and
writes ``bits*n/8`` plus metadata; dequantize the reverse; a copy reads and writes ``4n``), and
``gvalues_per_s`` counts input values. Ratios compare a backend's round trip with the reference and
with the copy at the same thread count. The reference is slow and memory hungry (int64/fp64
temporaries), so it runs on ``--reference_numel`` values; its throughput barely depends on size.
The 1-bit codec's own time (``onebit`` per setting: worker and server side, fused ops against the unfused
sequence, ns per value) is measured on the same tensors (:mod:`qaccel.bench._quant_onebit`).
Timings are the median of ``--repeats`` runs after one warm-up. Quantize returns new tensors, so
its figure includes first-touch page faults of the code buffer; ``copy.clone_gbps`` shows what
allocation costs a plain copy on the same machine (``THP_MEM_ALLOC_ENABLE=1`` lets torch back large
CPU allocations with huge pages, which cuts that cost).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time

import torch

from ..quant import _backend, reference
from . import _quant_onebit
from ._figures import headless_pyplot, png_path, save_figure
from ._quant_inputs import QuantInputError, parse_bits, parse_int_list

logger = logging.getLogger(__name__)

_GOAL_VS_REFERENCE = 5.0
_GOAL_VS_COPY = 0.30
STUDIES = ("throughput", "error")
# Defaults of the throughput study's flags (None on the command line means "not given"); --bits and --bucket_size are
# shared with the error study, which has its own defaults (_quant_error.ERROR_DEFAULTS).
THROUGHPUT_DEFAULTS = {"bits": "8,4", "bucket_size": 1024, "numel": 1 << 26, "reference_numel": 1 << 23, "threads": "1,all"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from . import _quant_error

    parser.add_argument("--study", choices=STUDIES, default="throughput",
                        help="throughput: codec GB/s per backend vs a copy (default); error: round-trip error with and "
                             "without Hadamard rotation at 2-8 bits, and the rotation's cost")  # fmt: skip
    parser.add_argument("--numel", type=int, default=None, help="throughput: fp32 values in the test tensor (default 64M)")
    parser.add_argument(
        "--reference_numel", type=int, default=None, help="throughput: values for the slow reference backend (default 8M)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    parser.add_argument("--bits", default=None,
                        help=f"comma-separated code widths (default {THROUGHPUT_DEFAULTS['bits']}; error study: "
                             f"{_quant_error.ERROR_DEFAULTS['bits']})")  # fmt: skip
    parser.add_argument("--bucket_size", type=int, default=None,
                        help="elements per bucket (default 1024; error study: the per-bit default, 1024 at 8 bits, 128 below)")  # fmt: skip
    parser.add_argument(
        "--threads", default=None, help="throughput: comma-separated CPU thread counts, 'all' = torch's default (default 1,all)"
    )
    parser.add_argument("--png", default=None, help="write the figure here (default: next to --json)")
    _quant_error.add_arguments(parser)


def _timer(device: torch.device):
    if device.type == "cuda":

        def synchronized() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return synchronized
    return time.perf_counter


def _median_seconds(fn, device: torch.device, repeats: int) -> float:
    clock = _timer(device)
    fn()  # warm-up: first-touch page faults, lazy initialisation
    samples = []
    for _ in range(repeats):
        start = clock()
        fn()
        samples.append(clock() - start)
    return statistics.median(samples)


def _codec_bytes(numel: int, bits: int, bucket: int) -> tuple[int, int]:
    """(bytes moved by quantize, by dequantize) of ``numel`` fp32 values."""
    packed = bits * math.ceil(numel / 8) + 8 * math.ceil(numel / bucket)
    return 4 * numel + packed, packed + 4 * numel


def _measure_backend(kernels, x: torch.Tensor, bits: int, bucket: int, repeats: int) -> dict:
    numel = x.numel()
    out = torch.empty_like(x)
    encoded = kernels.quantize_buckets(x, bits, bucket, False, 7, torch.float32)
    quantize_s = _median_seconds(lambda: kernels.quantize_buckets(x, bits, bucket, False, 7, torch.float32), x.device, repeats)
    dequantize_s = _median_seconds(lambda: kernels.dequantize_into(*encoded, bits, bucket, out, False), x.device, repeats)
    q_bytes, dq_bytes = _codec_bytes(numel, bits, bucket)
    roundtrip_s = quantize_s + dequantize_s
    return {
        "bits": bits,
        "numel": numel,
        "quantize_s": quantize_s,
        "dequantize_s": dequantize_s,
        "quantize_gbps": q_bytes / quantize_s / 1e9,
        "dequantize_gbps": dq_bytes / dequantize_s / 1e9,
        "roundtrip_gbps": (q_bytes + dq_bytes) / roundtrip_s / 1e9,
        "roundtrip_gvalues_per_s": numel / roundtrip_s / 1e9,
    }


def _measure_copy(x: torch.Tensor, repeats: int) -> dict:
    """Copy into a reused buffer (the bound) and ``clone`` (which, like quantize, allocates its output)."""
    destination = torch.empty_like(x)
    seconds = _median_seconds(lambda: destination.copy_(x), x.device, repeats)
    clone_seconds = _median_seconds(x.clone, x.device, repeats)
    moved = 2 * x.numel() * x.element_size()
    return {"numel": x.numel(), "seconds": seconds, "gbps": moved / seconds / 1e9, "clone_gbps": moved / clone_seconds / 1e9}


def _measure_setting(device: torch.device, args: argparse.Namespace, bits_list: list[int]) -> dict:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=generator).to(device)
    x_reference = x[: min(args.numel, args.reference_numel)].clone()
    setting: dict = {"copy": _measure_copy(x, args.repeats), "backends": {}}
    for name, kernels in _backend.available_kernels(device).items():
        sample = x_reference if kernels is reference else x
        repeats = min(args.repeats, 3) if kernels is reference else args.repeats
        rows = []
        for bits in bits_list:
            logger.info("bench quant: %s %s bits=%d numel=%d", device, name, bits, sample.numel())
            rows.append(_measure_backend(kernels, sample, bits, args.bucket_size, repeats))
        setting["backends"][name] = rows
        setting.setdefault("onebit", {})[name] = _quant_onebit.measure(kernels, sample, repeats, _median_seconds)
    _add_ratios(setting)
    return setting


def _add_ratios(setting: dict) -> None:
    copy_gbps = setting["copy"]["gbps"]
    reference_rows = {row["bits"]: row for row in setting["backends"].get("reference", [])}
    for rows in setting["backends"].values():
        for row in rows:
            row["roundtrip_vs_copy"] = row["roundtrip_gbps"] / copy_gbps
            base = reference_rows.get(row["bits"])
            if base is not None:
                row["roundtrip_vs_reference"] = row["roundtrip_gbps"] / base["roundtrip_gbps"]


def _goals(settings: dict) -> dict:
    """Per thread setting: does the C++ kernel reach 5x the reference and 30% of copy bandwidth?"""
    goals = {}
    for label, setting in settings.items():
        rows = setting["backends"].get("cpu")
        if not rows:
            continue
        goals[label] = {
            "min_roundtrip_vs_reference": min(row.get("roundtrip_vs_reference", math.nan) for row in rows),
            "min_roundtrip_vs_copy": min(row["roundtrip_vs_copy"] for row in rows),
        }
        goals[label]["met"] = (
            goals[label]["min_roundtrip_vs_reference"] >= _GOAL_VS_REFERENCE
            and goals[label]["min_roundtrip_vs_copy"] >= _GOAL_VS_COPY
        )
    return goals


def _with_defaults(args: argparse.Namespace, study: str) -> argparse.Namespace:
    """``args`` with the study's defaults filled in; a flag that belongs only to the other study is an error."""
    from ._quant_error import ERROR_DEFAULTS

    own, other = (THROUGHPUT_DEFAULTS, ERROR_DEFAULTS) if study == "throughput" else (ERROR_DEFAULTS, THROUGHPUT_DEFAULTS)
    shared = {"bits", "bucket_size"}
    stray = [f"--{name}" for name in other if name not in shared and getattr(args, name, None) is not None]
    if stray:
        raise QuantInputError(f"{', '.join(stray)}: not a flag of --study {study} (it belongs to the other study)")
    filled = argparse.Namespace(**vars(args))
    for name, default in own.items():
        if getattr(filled, name, None) is None:
            setattr(filled, name, default)
    return filled


def run(args: argparse.Namespace) -> dict:
    """Run the chosen study (``args.study``, default throughput); returns the JSON report and writes the PNG when asked."""
    study = getattr(args, "study", "throughput")
    if study not in STUDIES:
        raise QuantInputError(f"--study={study!r}: must be one of {', '.join(STUDIES)}")
    args = _with_defaults(args, study)
    if study == "error":
        from . import _quant_error

        return _quant_error.run(args)
    return _run_throughput(args)


def _run_throughput(args: argparse.Namespace) -> dict:
    bits_list = parse_bits(args.bits)
    for name in ("numel", "reference_numel", "repeats", "bucket_size"):
        if getattr(args, name) < 1:
            raise QuantInputError(f"--{name}={getattr(args, name)}: must be >= 1")
    threads = parse_int_list("threads", args.threads, allow_all=True)
    default_threads = torch.get_num_threads()
    settings: dict = {}
    try:
        for count in threads:
            torch.set_num_threads(default_threads if count == "all" else int(count))
            label = f"cpu_threads_{torch.get_num_threads()}"
            if label not in settings:
                settings[label] = _measure_setting(torch.device("cpu"), args, bits_list)
    finally:
        torch.set_num_threads(default_threads)
    if torch.cuda.is_available():
        settings["cuda"] = _measure_setting(torch.device("cuda"), args, bits_list)
    report: dict = {
        "benchmark": "quant",
        "numel": args.numel,
        "reference_numel": min(args.numel, args.reference_numel),
        "bucket_size": args.bucket_size,
        "bits": bits_list,
        "repeats": args.repeats,
        "default_threads": default_threads,
        "bytes_moved": "quantize: 4n + bits*ceil(n/8) + 8*ceil(n/B); dequantize: the same; copy: 8n",
        "settings": settings,
        "goals": {"cpu_roundtrip_vs_reference": _GOAL_VS_REFERENCE, "cpu_roundtrip_vs_copy": _GOAL_VS_COPY,
                  "by_setting": _goals(settings)},
    }  # fmt: skip
    png = png_path(args)
    if png:
        _plot(report, png)
        report["png"] = png
    return report


def _plot(report: dict, png: str) -> None:
    plt = headless_pyplot()

    settings = report["settings"]
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.5), squeeze=False)
    for ax, (label, setting) in zip(axes[0], settings.items(), strict=True):
        names, values = [], []
        for backend, rows in setting["backends"].items():
            for row in rows:
                for op in ("quantize", "dequantize", "roundtrip"):
                    names.append(f"{backend}\n{op} {row['bits']}b")
                    values.append(row[f"{op}_gbps"])
        ax.bar(range(len(values)), values, color=["C0" if "reference" in n else "C1" for n in names])
        ax.axhline(setting["copy"]["gbps"], color="k", linestyle="--", label=f"copy {setting['copy']['gbps']:.1f} GB/s")
        ax.set_xticks(range(len(values)), names, rotation=90, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("GB/s (bytes moved)")
        ax.set_title(label.replace("_", " "))
        ax.legend(fontsize=8)
    fig.suptitle(f"qaccel codec throughput, {report['numel']:,} fp32 values, bucket {report['bucket_size']}")
    fig.tight_layout()
    save_figure(fig, png)
