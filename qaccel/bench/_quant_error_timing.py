"""The timing of ``qaccel bench quant --study error``: encode/decode with rotation over the same call without, on one thread.

The goal (issue 20) is at most :data:`GOAL_ROTATION_SLOWDOWN` for the encode, judged on the thread's CPU
time so that other jobs on a shared machine do not decide it; wall-clock ratios are reported too. Only a
native backend's ratio says anything about the kernel: on the pure-torch reference fewer values are timed
and the goal is left unjudged.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from ..quant import PayloadSpec, _backend, decode_payloads, encode_payloads, reference
from ._quant_error_measure import ROTATIONS, segment_seeds

logger = logging.getLogger(__name__)

__all__ = ["GOAL_ROTATION_SLOWDOWN", "backend_name", "time_rotation"]

# Encode with rotation over encode without, on one thread (issue 20's goal).
GOAL_ROTATION_SLOWDOWN = 1.5
# The reference codec holds int64/fp64 temporaries per value: time it on fewer values.
_REFERENCE_TIMING_NUMEL = 1 << 20
# Payloads timed against each other: (bits, bucket_size, meta_dtype).
_TIMED_CODECS = ((4, 128, torch.bfloat16), (8, 1024, torch.float32))


def backend_name(kernels) -> str:
    """``reference`` or the native backend's name (``cpu``)."""
    return "reference" if kernels is reference else kernels.__name__.rsplit(".", 1)[-1]


def _interleaved_medians(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, dict[str, float]]:
    """Median wall-clock and thread-CPU seconds of each call, timed in turns after one warm-up round.

    Taking turns spreads a neighbour's load over every call alike; the calling thread's CPU time
    (one torch thread runs the kernel inline) leaves out the time it waited for a core.
    """
    for call in calls.values():
        call()
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            wall_start, cpu_start = time.perf_counter(), time.thread_time()
            call()
            cpu[name].append(time.thread_time() - cpu_start)
            wall[name].append(time.perf_counter() - wall_start)
    return {name: {"wall_s": statistics.median(wall[name]), "cpu_s": statistics.median(cpu[name])} for name in calls}


def _codec_calls(numel: int, bits: int, bucket_size: int, meta_dtype: torch.dtype, values: torch.Tensor,
                 decoded: torch.Tensor, seeds: torch.Tensor) -> dict[str, Callable[[], object]]:  # fmt: skip
    """``<op>/<rotation>`` -> one encode or decode of ``values`` as a one-segment payload."""
    calls = {}
    for rotation in ROTATIONS:
        spec = PayloadSpec(((numel, True),), bits, bucket_size, meta_dtype, "stochastic", torch.float32, rotation)
        blob = torch.empty(spec.nbytes, dtype=torch.uint8)
        calls[f"encode/{rotation}"] = partial(encode_payloads, values, spec, [0], seeds, blob)
        calls[f"decode/{rotation}"] = partial(decode_payloads, blob, spec, decoded, [0], seeds)
    return calls


def time_rotation(numel: int, repeats: int) -> dict:
    """Encode/decode seconds with and without rotation on one thread, their ratios, and the goal's verdict.

    The goal is judged on thread CPU time, which other processes on a shared machine do not inflate;
    wall-clock medians and their ratios are reported beside it.
    """
    backend = backend_name(_backend.kernels_for("cpu"))
    if backend == "reference":
        numel = min(numel, _REFERENCE_TIMING_NUMEL)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    decoded = torch.empty_like(values)
    seeds = segment_seeds(0, 1)
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for bits, bucket_size, meta_dtype in _TIMED_CODECS:
            logger.info("bench quant error: timing %s b%d", backend, bits)
            calls = _codec_calls(numel, bits, bucket_size, meta_dtype, values, decoded, seeds)
            times = _interleaved_medians(calls, repeats)
            row: dict = {"bits": bits, "bucket_size": bucket_size, "meta_dtype": str(meta_dtype).replace("torch.", ""),
                         "numel": numel}  # fmt: skip
            for op in ("encode", "decode"):
                for clock, suffix in (("wall_s", "s"), ("cpu_s", "cpu_s")):
                    row[f"{op}_{suffix}"] = {rotation: times[f"{op}/{rotation}"][clock] for rotation in ROTATIONS}
                row[f"{op}_ratio"] = row[f"{op}_s"]["hadamard"] / row[f"{op}_s"]["none"]
                row[f"{op}_cpu_ratio"] = row[f"{op}_cpu_s"]["hadamard"] / row[f"{op}_cpu_s"]["none"]
            rows.append(row)
    finally:
        torch.set_num_threads(threads)
    worst = max(row["encode_cpu_ratio"] for row in rows)
    judged = backend != "reference"
    return {
        "backend": backend,
        "threads": 1,
        "repeats": repeats,
        "rows": rows,
        "goal": {"max_encode_ratio": GOAL_ROTATION_SLOWDOWN, "judged_on": "thread CPU time", "worst_encode_ratio": worst,
                 "met": (worst <= GOAL_ROTATION_SLOWDOWN) if judged else None,
                 "note": None if judged else "timed on the pure-torch reference: not the kernel's cost; goal not judged"},
    }  # fmt: skip
