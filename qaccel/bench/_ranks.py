"""Run benchmark jobs on N spawned CPU ranks over gloo (FileStore rendezvous, no ports)."""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_on_cpu_ranks"]


def _worker(rank: int, world_size: int, store_path: str, job_fn: Callable, jobs: list, pg_timeout_s: float, results) -> None:
    # One thread per rank: the ranks share the machine's cores, and the figures are byte counts.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        results.put((rank, [job_fn(rank, world_size, *job) for job in jobs], None))
    except Exception as exc:  # noqa: BLE001 - reported to the parent with the rank
        results.put((rank, None, f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_cpu_ranks(
    job_fn: Callable[..., Any],
    world_size: int,
    jobs: list[tuple],
    label: str,
    *,
    pg_timeout_s: float = 900.0,
    result_timeout_s: float = 1800.0,
) -> list[list[Any]]:
    """Call ``job_fn(rank, world_size, *job)`` for every job on each of ``world_size`` ranks.

    ``job_fn`` must be a top-level function (spawn pickles it by name). Returns, per rank, the list
    of job results. A failing rank raises RuntimeError naming ``label``, the rank and the error.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, job_fn, jobs, pg_timeout_s, results))
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        collected: dict[int, list[Any]] = {}
        try:
            for _ in range(world_size):
                rank, outputs, error = results.get(timeout=result_timeout_s)
                if error is not None:
                    raise RuntimeError(f"{label}: rank {rank}/{world_size} failed: {error}")
                collected[rank] = outputs
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    return [collected[r] for r in range(world_size)]
