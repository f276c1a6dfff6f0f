"""Minimal reproduction: torch's ``powerSGD_hook`` deadlocks on gloo when several DDP buckets are in flight.

Plain torch only (no qaccel, no Accelerate): 2 ranks on this machine over gloo, a small MLP in DDP with
``powerSGD_hook`` (rank 1, PowerSGD from step 2, torch's defaults otherwise). Every rank prints each step;
a step that does not finish within ``--timeout`` seconds fails with gloo's receive timeout, and shortly
before that every rank dumps the Python stacks of all its threads (``faulthandler``), which shows where
gloo's worker threads are blocked. ``docs/powersgd_gloo.md`` explains the reading.

Usage (each run takes a few seconds to finish, or about ``--timeout`` seconds to fail)::

    python scripts/repro_powersgd_gloo.py --layers 1                     # 1 DDP bucket: finishes
    python scripts/repro_powersgd_gloo.py --layers 6                     # 6 buckets: hangs at step 2 (gloo timeout)
    python scripts/repro_powersgd_gloo.py --layers 6 --one_bucket        # the same layers in one bucket: finishes
    python scripts/repro_powersgd_gloo.py --layers 6 --gloo_threads 8    # 6 buckets, 8 gloo worker threads: finishes

Exit status 0 when every step finished on both ranks, 1 when a rank failed (the hang ends in gloo's timeout).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

WIDTH = 256  # one Linear(256, 256) holds 0.25 MiB of fp32 gradients: with bucket_cap_mb=0.25 each layer is a DDP bucket


def _hook_group(args: argparse.Namespace, rank: int) -> dist.ProcessGroup | None:
    """None (the default group: gloo's default of 2 worker threads) or a gloo group with ``--gloo_threads`` worker threads."""
    if args.gloo_threads is None:
        return None
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options._threads = args.gloo_threads
    options._timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.PrefixStore("powersgd_hook_group", dist.distributed_c10d._get_default_store())
    return dist.ProcessGroupGloo(store, rank, 2, options)


def worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=args.timeout))
    # every thread's Python stack, a little before gloo's timeout ends the hang
    faulthandler.dump_traceback_later(max(1.0, args.timeout - 5), exit=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(args.layers)])
    cap_mb = args.layers * 0.3 if args.one_bucket else 0.25  # an explicit cap also sizes DDP's first bucket
    ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
    state = psgd.PowerSGDState(process_group=_hook_group(args, rank), matrix_approximation_rank=1, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(args.steps):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(2 * step + rank))
        start = time.perf_counter()
        ddp(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        kind = "all-reduce" if step < 2 else "PowerSGD"
        print(f"rank {rank}: step {step} ({kind}) done in {time.perf_counter() - start:.3f} s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    # PowerSGD keeps one error-feedback tensor per bucket it compressed
    print(f"rank {rank}: all {args.steps} steps done; DDP buckets compressed by PowerSGD: {len(state.error_dict)}", flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)  # typos are errors
    parser.add_argument("--layers", type=int, default=6, help="Linear(256, 256) layers, one DDP bucket each (default 6)")
    parser.add_argument("--one_bucket", action="store_true", help="a bucket cap that holds every layer: one DDP bucket")
    parser.add_argument("--steps", type=int, default=4, help="training steps; PowerSGD compresses from step 2 (default 4)")
    parser.add_argument("--gloo_threads", type=int, default=None,
                        help="run the hook on its own gloo group with this many worker threads (default: the default group, 2 threads)")
    parser.add_argument("--timeout", type=float, default=30.0, help="gloo timeout in seconds (default 30)")
    args = parser.parse_args()
    args.port = _free_port()
    buckets = 1 if args.one_bucket else args.layers
    print(f"torch {torch.__version__}: 2 ranks over gloo, {buckets} DDP bucket(s), "
          f"gloo worker threads for the hook: {args.gloo_threads or '2 (the default)'}", flush=True)  # fmt: skip
    try:
        mp.spawn(worker, args=(args,), nprocs=2)
    except mp.ProcessRaisedException as exc:
        lines = str(exc).strip().splitlines()
        errors = [line for line in lines if "Timed out" in line] or [line for line in lines if "Error" in line] or lines
        print(f"FAILED: {errors[-1].strip()}", flush=True)
        return 1
    print("OK: every step finished on both ranks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
