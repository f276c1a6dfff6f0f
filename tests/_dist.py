"""Run a function on N real processes over gloo, rendezvousing through a FileStore (no ports).

Usage in a test::

    def _worker(rank, world_size, n):          # top level, so spawn can import it
        ...
        return some_picklable_result

    def test_x(tmp_path):
        results = run_ranks(_worker, 2, tmp_path, 123)   # list indexed by rank

A rank that raises fails the test with its rank and traceback; a hung collective fails it after
``timeout_s`` instead of hanging CI.
"""

from __future__ import annotations

import datetime
import gc
import os
import queue
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["launch_env", "run_ranks"]

REPO = Path(__file__).resolve().parents[1]


def launch_env() -> dict[str, str]:
    """The environment for a launched job (``qaccel train``, ``torchrun``): this one without qaccel's, Accelerate's
    and FSDP's variables, one thread per rank, no GPU, the Hub offline, and this checkout importable."""
    prefixes = ("QACCEL_", "FSDP_", "ACCELERATE_")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    clean.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return clean


def _entry(rank, world_size, store_path, fn, args, kwargs, results, pg_timeout_s):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args, **kwargs)
        results.put(("ok", rank, value))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        results.put(("error", rank, traceback.format_exc()))
    finally:
        # Free cyclic garbage (FSDP state, comm buffers) while gloo is still up: collected only at
        # interpreter exit it can abort the process (see qaccel.Accelerator.end_training).
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    timeout_s: float = 240.0,
    pg_timeout_s: float = 60.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned processes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_path = str(Path(tmp_path) / f"store_{time.monotonic_ns()}")
    procs = [
        ctx.Process(
            target=_entry,
            args=(rank, world_size, store_path, fn, args, kwargs, results, pg_timeout_s),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                status, rank, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        break
                continue
            outcome[rank] = (status, value)
            if status == "error":
                break
    finally:
        for proc in procs:
            proc.join(timeout=30 if len(outcome) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = [f"rank {r}/{world_size}:\n{v}" for r, (s, v) in sorted(outcome.items()) if s == "error"]
    if errors:
        raise AssertionError("distributed worker failed\n" + "\n".join(errors))
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise AssertionError(f"ranks {missing} of {world_size} gave no result within {timeout_s}s (exit codes {codes})")
    # A rank that returned its result but then crashed on the way out is a failure too.
    bad_exits = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if bad_exits:
        raise AssertionError(f"ranks exited abnormally after returning results: {bad_exits} (of {world_size})")
    return [outcome[r][1] for r in range(world_size)]
