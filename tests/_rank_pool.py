"""A pool of rank processes per world size, spawned once per test session and reused by every ``run_ranks`` call.

Starting a rank costs an interpreter plus the torch import (measured on the loaded 2-core machine: a job that does
nothing took 5.3 s on 2 new ranks and 8.4 s on 4, against 0.25 s and 0.65 s on warm ones), so ranks are kept and sent
one job at a time. What a fresh process gave a job, each job still gets:

- its own default process group: initialised from a fresh ``FileStore`` with the job's timeout and destroyed after
  it, so the subgroups a job creates (``new_group``, ``init_device_mesh``) go with it;
- torch's, Python's and NumPy's RNGs reseeded from the OS (as a new process seeds them), the environment, working
  directory, default dtype, grad mode, warning filters, Accelerate's per-process state and qaccel's default wire
  meter as at the pool's start.

An exception in a job is that job's failure: it is reported with rank and traceback, and the pool keeps serving
once every rank has answered. A rank that dies, or a job that outlives its deadline (a hung collective), fails
that job and ends the pool; the next job starts a new one.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import pickle
import queue
import random
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from itertools import count
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["PoolBroken", "RankPool", "pool_for", "run_job"]

# After one rank raised, how long the others get to answer (they may be blocked in a collective the failed rank
# never joined, until the group's timeout) before the pool is replaced instead of waited on.
ERROR_GRACE_S = 5.0
# After a rank died, how long the others get to report (gloo usually tells them at once that a peer is gone).
DEAD_GRACE_S = 2.0
# A world size's pool is kept while at most this many other world sizes were used since: idle ranks hold memory.
POOLS_KEPT = 3


class PoolBroken(RuntimeError):
    """A rank died or a job outlived its deadline: the pool was shut down and its job failed."""


def run_job(rank: int, world_size: int, store_path: str, payload: bytes, pg_timeout_s: float) -> tuple[str, Any]:
    """Run one pickled ``(fn, args, kwargs)`` job inside a fresh default process group; ("ok" | "error", value)."""
    try:
        fn, args, kwargs = pickle.loads(payload)
        store = dist.FileStore(store_path, world_size)
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        outcome = ("ok", fn(rank, world_size, *args, **kwargs))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
        outcome = ("error", traceback.format_exc())
    finally:
        # Free cyclic garbage (FSDP state, comm buffers) while gloo is still up: collected only later it can abort
        # the process (see qaccel.Accelerator.end_training).
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    return outcome


class _FreshState:
    """What a job may change in its process, captured at the rank's start and put back after every job."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.seed()  # a fresh process seeds torch from the OS too
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)
        if "qaccel.comm" in sys.modules:  # what runs without a meter of its own counts into the process-wide one
            sys.modules["qaccel.comm"].default_meter.reset()
        if "accelerate.state" in sys.modules:  # Accelerate keeps one state per process
            state = sys.modules["accelerate.state"]
            state.AcceleratorState._reset_state(reset_partial_state=True)
            state.GradientState._reset_state()


def _serve(rank: int, world_size: int, jobs: Any, results: Any, parent: int) -> None:
    """A rank's loop: take a job, run it, answer with (job id, status, rank, pickled value); None ends it."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    torch.set_num_threads(1)
    fresh = _FreshState()
    while True:
        try:
            job = jobs.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test session is gone
                return
            continue
        if job is None:
            return
        job_id, store_path, payload, pg_timeout_s = job
        fresh.restore()
        with warnings.catch_warnings():
            status, value = run_job(rank, world_size, store_path, payload, pg_timeout_s)
        try:
            answer = pickle.dumps(value)
        except Exception:  # noqa: BLE001 - an unpicklable result is the job's error, not the pool's
            status, answer = "error", pickle.dumps(f"result of rank {rank} is not picklable:\n{traceback.format_exc()}")
        results.put((job_id, status, rank, answer))


class RankPool:
    """``world_size`` spawned rank processes that run jobs one at a time (see the module docstring)."""

    _ids = count()

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_serve, args=(rank, world_size, self.jobs[rank], self.results, os.getpid()), daemon=True)
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, store_path: str, *, timeout_s: float,
            pg_timeout_s: float) -> dict[int, tuple[str, Any]]:  # fmt: skip
        """Send ``fn`` to every rank; {rank: (status, value)} of the ranks that answered.

        Raises:
            PoolBroken: a rank died or the deadline passed (the pool is closed; ranks that answered are attached).
        """
        job_id = next(self._ids)
        payload = pickle.dumps((fn, args, kwargs))
        for jobs in self.jobs:
            jobs.put((job_id, store_path, payload, pg_timeout_s))
        try:
            outcome = self._answers(job_id, timeout_s)
        except BaseException:  # interrupted (pytest-timeout, Ctrl-C) mid-job: the ranks may still be busy with it
            self.close(graceful=False)
            raise
        if len(outcome) < self.world_size:
            codes = {rank: proc.exitcode for rank, proc in enumerate(self.procs)}
            self.close(graceful=False)
            raise PoolBroken(outcome, codes)
        return outcome

    def _answers(self, job_id: int, timeout_s: float) -> dict[int, tuple[str, Any]]:
        """The ranks' answers to ``job_id`` until all came, the deadline passed, or a rank died and its grace ended."""
        outcome: dict[int, tuple[str, Any]] = {}
        deadline, dead_noticed = time.monotonic() + timeout_s, False
        while len(outcome) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                answer_id, status, rank, answer = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if not dead_noticed and not self.alive():  # the survivors get a moment to report what they saw
                    dead_noticed, deadline = True, min(deadline, time.monotonic() + DEAD_GRACE_S)
                continue
            if answer_id != job_id:
                continue  # a late answer to an earlier, abandoned job
            if status == "error":
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
            outcome[rank] = (status, pickle.loads(answer))
        return outcome

    def close(self, graceful: bool = True) -> None:
        """End the ranks: each finishes its loop when ``graceful``, else (a rank may hang) they are killed."""
        for jobs, proc in zip(self.jobs, self.procs, strict=True):
            if graceful and proc.is_alive():
                jobs.put(None)
        for proc in self.procs:
            proc.join(timeout=5 if graceful else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()


_POOLS: dict[int, RankPool] = {}


def pool_for(world_size: int) -> RankPool:
    """The live pool for ``world_size`` (started on first use); the least recently used ones beyond POOLS_KEPT end."""
    pool = _POOLS.pop(world_size, None)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = RankPool(world_size)
    _POOLS[world_size] = pool  # most recently used last
    while len(_POOLS) > POOLS_KEPT:
        _POOLS.pop(next(iter(_POOLS))).close()
    return pool


@atexit.register
def _close_all() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()
