"""The multi-process test harness: run a function on N real ranks over gloo, and count what they put on the wire.

Ranks rendezvous through a FileStore (no ports). They come from a pool spawned once per session and world size
(``tests._rank_pool``): each call gets its own process group and a process state as fresh as a new one's.

Usage in a test::

    def _worker(rank, world_size, n):          # top level, so spawn can import it
        ...
        return some_picklable_result

    def test_x(tmp_path):
        results = run_ranks(_worker, 2, tmp_path, 123)   # list indexed by rank

A rank that raises fails the test with its rank and traceback; a hung collective fails it after
``timeout_s`` instead of hanging CI. Bytes on the wire are counted by :class:`CollectiveRecorder`
(``tests._collectives``), which wraps torch.distributed's collectives inside a rank.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tests._collectives import CollectiveCall, CollectiveRecorder, ring_all_reduce
from tests._rank_pool import PoolBroken, pool_for, run_job

__all__ = ["CollectiveCall", "CollectiveRecorder", "RankJobs", "launch_env", "ring_all_reduce", "run_ranks"]

REPO = Path(__file__).resolve().parents[1]


def launch_env() -> dict[str, str]:
    """The environment for a launched job (``qaccel train``, ``torchrun``): this one without qaccel's, Accelerate's
    and FSDP's variables, one thread per rank, no GPU, the Hub offline, and this checkout importable."""
    prefixes = ("QACCEL_", "FSDP_", "ACCELERATE_")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    clean.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return clean


def _entry(rank, world_size, store_path, payload, results, pg_timeout_s):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    torch.set_num_threads(1)
    status, value = run_job(rank, world_size, store_path, payload, pg_timeout_s)
    results.put((status, rank, value))


def _run_fresh(fn, world_size, store_path, args, kwargs, timeout_s, pg_timeout_s) -> dict[int, tuple[str, Any]]:
    """One new process per rank for this call only; {rank: (status, value)} of the ranks that answered."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    payload = pickle.dumps((fn, args, kwargs))
    procs = [
        ctx.Process(target=_entry, args=(rank, world_size, store_path, payload, results, pg_timeout_s), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcome) < world_size and time.monotonic() < deadline:
            try:
                status, rank, value = results.get(timeout=min(deadline - time.monotonic(), 1.0))
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
    # A rank that returned its result but then crashed on the way out is a failure too.
    bad_exits = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if len(outcome) == world_size and bad_exits:
        raise AssertionError(f"ranks exited abnormally after returning results: {bad_exits} (of {world_size})")
    if len(outcome) < world_size and not any(s == "error" for s, _ in outcome.values()):
        raise PoolBroken(outcome, {r: p.exitcode for r, p in enumerate(procs)})
    return outcome


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    timeout_s: float = 240.0,
    pg_timeout_s: float = 60.0,
    fresh: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; the results, indexed by rank.

    Args:
        fn: a top-level function (the ranks import it by name).
        world_size: how many ranks.
        tmp_path: where the job's ``FileStore`` goes.
        timeout_s: the whole job's deadline; past it the ranks are killed and the test fails.
        pg_timeout_s: the process group's timeout, so a collective a rank never joins fails instead of hanging.
        fresh: spawn new processes for this call instead of the session's pool (``tests._rank_pool``), for a
            job that needs an interpreter nothing ran in before.

    Raises:
        AssertionError: a rank raised (its rank and traceback are in the message), died or missed the deadline.
    """
    store_path = str(Path(tmp_path) / f"store_{time.monotonic_ns()}")
    try:
        if fresh:
            outcome = _run_fresh(fn, world_size, store_path, args, kwargs, timeout_s, pg_timeout_s)
        else:
            outcome = pool_for(world_size).run(fn, args, kwargs, store_path, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s)
    except PoolBroken as broken:
        outcome, codes = broken.args
        errors = _errors(outcome, world_size)
        missing = [r for r in range(world_size) if r not in outcome]
        raise AssertionError(
            f"ranks {missing} of {world_size} gave no result within {timeout_s}s (exit codes {codes})" + errors
        ) from None
    errors = _errors(outcome, world_size)
    if errors:
        raise AssertionError(errors.lstrip("\n"))
    return [outcome[r][1] for r in range(world_size)]


def _errors(outcome: dict[int, tuple[str, Any]], world_size: int) -> str:
    failed = [f"rank {r}/{world_size}:\n{v}" for r, (s, v) in sorted(outcome.items()) if s == "error"]
    return "\ndistributed worker failed\n" + "\n".join(failed) if failed else ""


class RankJobs:
    """Per-rank results of named jobs, each run (one ``run_ranks`` call) when a test first reads it.

    A module fixture that ran every check in one spawn made one failing check fail every test of the module; with
    the rank pool a job costs little to start, so each check is its own job and a failure fails only the tests
    that read that check (its error is raised again on every read).

    Args:
        fn: ``fn(rank, world_size, name)``, a top-level function that runs the check ``name``.
        world_size: how many ranks.
        tmp_path_factory: pytest's, for each job's directory.
        **run_kwargs: passed to :func:`run_ranks` (``timeout_s``, ``pg_timeout_s``).

    Example::

        jobs = RankJobs(_check, 2, tmp_path_factory)
        jobs["refusals"]            # [rank 0's result, rank 1's result]
        jobs.by_rank()[1]["refusals"]  # the same, rank first
    """

    def __init__(self, fn: Callable[..., Any], world_size: int, tmp_path_factory: Any, **run_kwargs: Any) -> None:
        self.fn, self.world_size, self.tmp_path_factory, self.run_kwargs = fn, world_size, tmp_path_factory, run_kwargs
        self.done: dict[str, tuple[bool, Any]] = {}

    def __getitem__(self, name: str) -> list[Any]:
        if name not in self.done:
            tmp = self.tmp_path_factory.mktemp(f"{self.fn.__name__.strip('_')}_{self.world_size}_{name}")
            try:
                self.done[name] = (True, run_ranks(self.fn, self.world_size, tmp, name, **self.run_kwargs))
            except AssertionError as failure:
                self.done[name] = (False, failure)
        ok, value = self.done[name]
        if not ok:
            raise value
        return value

    def by_rank(self) -> list[_RankView]:
        """One mapping per rank: ``by_rank()[rank][name] == self[name][rank]``."""
        return [_RankView(self, rank) for rank in range(self.world_size)]


class _RankView:
    def __init__(self, jobs: RankJobs, rank: int) -> None:
        self.jobs, self.rank = jobs, rank

    def __getitem__(self, name: str) -> Any:
        return self.jobs[name][self.rank]
