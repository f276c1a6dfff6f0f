"""``qaccel bench comm`` section phases: where the time of one QSDP collective goes.

For one GPT-2 transformer block (a unit of Accelerate's transformer-based wrap; GPT-2 124M by
default) sharded over ``P`` CPU ranks, each quantized all-gather and reduce-scatter is timed
phase by phase (encode, transport, decode) through the comms' :class:`qaccel.comm.PhaseTimer`,
and set next to, measured in the same run:

- ``kernel_ms``: the fused codec calls alone on the same data (one encode, one decode/sum), with no
  collective around them; ``overhead`` = (encode + decode) / kernel_ms is what the collective adds
  on top of the kernels (seed tables, views, buffer handling);
- ``per_segment_ms``: the codec work done the way it was before the fused calls (one codec call per
  segment and per owner/destination, through ``encode_chunk`` / ``decode_chunk``);
- ``stock_ms``: the stock fp32 collective of the same unit, as FSDP2 issues it, and
  ``same_bytes_ms``: a stock collective moving exactly the quantized payload's bytes.

Every rank runs one thread; at ``P`` above the core count the ranks share cores, so the transport
figures include waiting for the slowest rank.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time

import torch
import torch.distributed as dist

from ._ranks import run_on_cpu_ranks

__all__ = ["add_arguments", "measure"]

logger = logging.getLogger(__name__)

BLOCK_SHAPES = {  # one transformer block's parameters in FSDP2 order: (shape, ...) per model
    "gpt2-124m": ((768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)),
    "tiny": ((64,), (64,), (64, 192), (192,), (64, 64), (64,), (64,), (64,), (64, 256), (256,), (256, 64), (64,)),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--phases_model", choices=sorted(BLOCK_SHAPES), default="gpt2-124m", help="block shape (default gpt2-124m)")
    parser.add_argument("--phases_world_sizes", type=int, nargs="+", default=[2, 4], help="process counts (default 2 4)")
    parser.add_argument("--phases_bits", type=int, nargs="+", default=[8, 4], help="code widths (default 8 4)")
    parser.add_argument("--phases_repeats", type=int, default=7, help="timed calls per collective; the median is reported")


def _median_ms(samples: list[float]) -> float:
    return round(1000 * statistics.median(samples), 3)


def _timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up: first-touch of buffers, kernel load
    samples = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples


def _one_config(rank: int, world: int, model: str, bits: int, repeats: int) -> dict:
    from ..comm import BufferPool, PhaseTimer, WireMeter
    from ..fsdp import QSDPConfig, SeedSchedule, UnitPlan

    shapes = [torch.Size(s) for s in BLOCK_SHAPES[model]]
    shard_numels = [math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes]
    config = QSDPConfig(weight_bits=bits, grad_bits=bits, prefetch=False)
    plan = UnitPlan.build(0, "block", shapes, shard_numels, param_min_numel=config.param_min_numel, unit_min_numel=config.unit_min_numel)
    context = {"plan": plan, "timer": PhaseTimer(), "meter": WireMeter(), "seeds": SeedSchedule(config.seed), "pool": BufferPool()}
    gen = torch.Generator().manual_seed(rank)
    rows = [
        _measure(rank, world, "all_gather", config.weight_codec(), context, gen, repeats),
        _measure(rank, world, "reduce_scatter", config.grad_codec(), context, gen, repeats),
    ]
    return {"rows": rows}


def _all_gather_cases(rank: int, world: int, layout, context: dict, gen: torch.Generator) -> dict:
    from ..comm import decode_chunk, encode_chunk
    from ..fsdp._comms import QuantizedAllGather
    from ..quant import decode_payloads, encode_payloads

    group, spec, shard = dist.group.WORLD, layout.spec, layout.numel
    comm = QuantizedAllGather(context["plan"], layout.codec, context["seeds"], context["meter"], context["pool"])
    output = torch.empty(world * shard)
    own = output[rank * shard : (rank + 1) * shard]
    source = torch.randn(shard, generator=gen) * 0.02
    stock_out = torch.empty(world * shard)
    same_in, same_out = torch.empty(spec.nbytes, dtype=torch.uint8), torch.empty(world * spec.nbytes, dtype=torch.uint8)
    blob, gathered = torch.empty(spec.nbytes, dtype=torch.uint8), torch.empty(world * spec.nbytes, dtype=torch.uint8)
    seed_table = torch.zeros(1, len(spec.segments), dtype=torch.int64)
    offsets = [owner * shard for owner in range(world)]

    def collective():
        own.copy_(source)  # FSDP2's input aliases the output slice of this rank
        comm(output, own, group)

    def per_segment():
        encode_chunk(source, layout, 0, blob)
        for owner in range(world):
            decode_chunk(gathered[owner * spec.nbytes : (owner + 1) * spec.nbytes], layout, output[owner * shard : (owner + 1) * shard])

    return {
        "comm": comm,
        "collective": collective,
        "kernels": lambda: (encode_payloads(source, spec, [0], seed_table, blob), decode_payloads(gathered, spec, output, offsets)),
        "per_segment": per_segment,
        "stock": lambda: dist.all_gather_into_tensor(stock_out, source, group=group),
        "same_bytes": lambda: dist.all_gather_into_tensor(same_out, same_in, group=group),
    }


def _reduce_scatter_cases(rank: int, world: int, layout, context: dict, gen: torch.Generator) -> dict:
    from ..comm import decode_chunk, encode_chunk
    from ..fsdp._comms import QuantizedReduceScatter
    from ..quant import encode_payloads, sum_payloads

    group, spec, shard = dist.group.WORLD, layout.spec, layout.numel
    comm = QuantizedReduceScatter(context["plan"], layout.codec, context["seeds"], context["meter"], context["pool"])
    grads = torch.randn(world * shard, generator=gen) * 1e-3
    own = grads[rank * shard : (rank + 1) * shard]
    output, stock_out = torch.empty(shard), torch.empty(shard)
    dests = [j for j in range(world) if j != rank]
    send = torch.empty(len(dests) * spec.nbytes, dtype=torch.uint8)
    same_out = torch.empty_like(send)
    splits = [0 if j == rank else spec.nbytes for j in range(world)]
    seed_table = torch.zeros(len(dests), len(spec.segments), dtype=torch.int64)

    def per_segment():
        for slot, j in enumerate(dests):
            encode_chunk(grads[j * shard : (j + 1) * shard], layout, j, send[slot * spec.nbytes : (slot + 1) * spec.nbytes])
        total = own.to(torch.float32, copy=True)
        for slot in range(len(dests)):
            decode_chunk(send[slot * spec.nbytes : (slot + 1) * spec.nbytes], layout, total, accumulate=True)
        output.copy_(total)

    return {
        "comm": comm,
        "collective": lambda: comm(output, grads, group, dist.ReduceOp.SUM),
        "kernels": lambda: (
            encode_payloads(grads, spec, [j * shard for j in dests], seed_table, send),
            sum_payloads(send, spec, own, output),
        ),
        "per_segment": per_segment,
        "stock": lambda: dist.reduce_scatter_tensor(stock_out, grads, group=group),
        "same_bytes": lambda: dist.all_to_all_single(same_out, send, output_split_sizes=splits, input_split_sizes=splits, group=group),
    }


def _measure(rank: int, world: int, direction: str, codec, context: dict, gen: torch.Generator, repeats: int) -> dict:
    plan, timer = context["plan"], context["timer"]
    shard = sum(n for n, _ in plan.segments)
    layout = plan.layout(codec, shard, torch.float32)
    build = _all_gather_cases if direction == "all_gather" else _reduce_scatter_cases
    cases = build(rank, world, layout, context, gen)
    comm, kind = cases["comm"], "qsdp." + direction
    comm.timer = timer
    cases["collective"]()  # warm-up, not counted
    timer.reset()
    phase_samples: dict[str, list[float]] = {"encode": [], "transport": [], "decode": []}
    total_samples = []
    for _ in range(repeats):
        before = timer.totals().get(kind)
        dist.barrier()
        started = time.perf_counter()
        cases["collective"]()
        total_samples.append(time.perf_counter() - started)
        after = timer.totals()[kind]
        for phase, samples in phase_samples.items():
            samples.append(getattr(after, phase) - (getattr(before, phase) if before else 0.0))
    comm.timer = None
    row = {
        "direction": direction,
        "bits": codec.bits,
        "bucket_size": codec.bucket_size,
        "world_size": world,
        "shard_numel": shard,
        "segments": len(layout.segments),
        "payload_bytes": layout.nbytes,
        "stock_bytes": shard * 4,
        **{f"{phase}_ms": _median_ms(samples) for phase, samples in phase_samples.items()},
        "collective_ms": _median_ms(total_samples),
        **{f"{name}_ms": _median_ms(_timed(cases[name], repeats)) for name in ("kernels", "per_segment", "stock", "same_bytes")},
    }
    row["kernel_ms"] = row.pop("kernels_ms")
    row["overhead"] = round((row["encode_ms"] + row["decode_ms"]) / row["kernel_ms"], 3) if row["kernel_ms"] else None
    row["fused_speedup"] = round(row["per_segment_ms"] / row["kernel_ms"], 2) if row["kernel_ms"] else None
    return row


def measure(args: argparse.Namespace) -> dict:
    """Per collective: encode / transport / decode next to kernel-only, per-segment and stock times (rank 0)."""
    rows = []
    for world in args.phases_world_sizes:
        if world < 2:
            raise ValueError(f"--phases_world_sizes: {world}: every world size must be >= 2")
        jobs = [(args.phases_model, bits, args.phases_repeats) for bits in args.phases_bits]
        logger.info("bench comm phases: %s block on %d CPU ranks, bits %s", args.phases_model, world, args.phases_bits)
        per_rank = run_on_cpu_ranks(_one_config, world, jobs, "bench comm phases", pg_timeout_s=600)
        for job_result in per_rank[0]:
            rows.extend(job_result["rows"])
    return {
        "title": f"QSDP collective phases ({args.phases_model} block, fp32 shards, medians of {args.phases_repeats})",
        "model": args.phases_model,
        "threads_per_rank": 1,
        "rows": rows,
        "how": (
            "encode/transport/decode from the comms' PhaseTimer; kernel_ms: the fused codec calls alone on the "
            "same data; per_segment_ms: one codec call per segment and owner/destination (the path before "
            "the fused calls); stock_ms: FSDP2's fp32 collective of the unit; same_bytes_ms: a stock "
            "collective of the payload's bytes"
        ),
    }
