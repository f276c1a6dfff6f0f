"""``qaccel bench comm`` section 1-bit: bytes and rounds over a whole schedule, DDP AdamW vs 1-bit / 0/1 Adam.

Two parts:

1. **Per step kind, measured.** On ``N`` CPU processes over gloo, a GPT-2 (124M parameters by default) is
   wrapped in DDP and trained a few real steps with each optimizer, the 1-bit ones through the qaccel DDP
   hook, until every step kind has occurred (0/1 Adam: init, variance, 1-bit gradient, sync, local; 1-bit
   Adam: init, warm-up, compressed; AdamW: one step after DDP's bucket rebuild). The wire meter records
   the bytes of every collective from its buffer sizes; the report also checks that the recorded 1-bit
   bytes equal :func:`qaccel.comm.onebit_wire_bytes` for the model's tensors.
2. **Over the schedule, counted.** The real schedules (:func:`qaccel.optim.count_step_kinds`) are run for
   the whole job (default: T = 152,000 steps, F = 12,500, kappa = 16, alpha = 1000, H = 16; 1-bit Adam
   freezes at 23,000: the BERT-Large seq128 run of the 0/1 Adam paper with the tutorial's alpha;
   ``docs/zero_one_adam.md``, "Schedules") and multiplied by the measured bytes of each kind.
3. **Optimizer step time, measured.** The wall-clock of ``optimizer.step()`` per step kind on the same real
   steps (rank 0), and its mean over the schedule; the compressed kinds include their collectives.

A *communication round* is an optimizer step that puts anything on the wire (the paper's count); the
number of collective calls is reported too (DDP issues one all-reduce per 25 MB bucket, a 1-bit step one
all-to-all and one all-gather for all tensors).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import torch.distributed as dist

from ._ranks import run_on_cpu_ranks

__all__ = ["add_arguments", "measure"]

logger = logging.getLogger(__name__)

MODELS = {
    "gpt2-124m": {},  # GPT2Config() defaults: 12 layers, 768 wide, 50257 vocab, 1024 positions
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 32},
}
# Schedules that make every step kind occur within a few real steps (measurement only), most kinds several
# times, so that the step timings can leave out each kind's first occurrence (state allocation) and the
# step that changes the phase (it allocates the next phase's state). 0/1 Adam: full x5, 1-bit gradient x5,
# sync x7, local x3; 1-bit Adam: full x4, compressed x5; AdamW x4.
_PROBE = {
    "0/1 Adam": ("ZeroOneAdam", dict(var_freeze_step=10, var_update_scaler=2, local_step_scaler=4, local_step_clipper=2), 21),
    "1-bit Adam": ("OneBitAdam", dict(freeze_step=5), 10),
    "DDP AdamW fp32": ("AdamW", {}, 4),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--onebit_model", choices=sorted(MODELS), default="gpt2-124m", help="model shape (default gpt2-124m)")
    parser.add_argument("--onebit_world_size", type=int, default=2, help="CPU processes (default 2)")
    parser.add_argument("--onebit_total_steps", type=int, default=152_000, help="optimizer steps of the job (default 152000)")
    parser.add_argument("--onebit_var_freeze_step", type=int, default=12_500, help="0/1 Adam F (default 12500)")
    parser.add_argument("--onebit_var_update_scaler", type=int, default=16, help="0/1 Adam kappa (default 16)")
    parser.add_argument("--onebit_local_step_scaler", type=int, default=1000, help="0/1 Adam alpha (default 1000)")
    parser.add_argument("--onebit_local_step_clipper", type=int, default=16, help="0/1 Adam H (default 16)")
    parser.add_argument("--onebit_freeze_step", type=int, default=23_000, help="1-bit Adam freeze step (default 23000)")
    parser.add_argument("--onebit_granularity", choices=("tensor", "group"), default="tensor", help="1-bit unit (default tensor)")


def _param_groups(model: torch.nn.Module) -> list[dict]:
    # nanoGPT's rule: matrices decay, biases and norms do not
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def _counting_allreduce_hook(meter):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from ..comm import ring_all_reduce_bytes

    # unannotated on purpose: DDP rejects the string annotations ``from __future__ import annotations`` makes
    def hook(state, bucket):  # noqa: ANN001, ANN202
        buffer = bucket.buffer()
        nbytes = ring_all_reduce_bytes(buffer.numel() * buffer.element_size(), dist.get_world_size())
        meter.record("ddp.all_reduce", sent_bytes=nbytes, recv_bytes=nbytes)
        return allreduce_hook(None, bucket)

    return hook


def _probe(rank: int, world_size: int, model_name: str, method: str, granularity: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel
    from transformers import GPT2Config, GPT2LMHeadModel

    from ..comm import WireMeter, onebit_layout, onebit_wire_bytes
    from ..optim import OneBitAdam, ZeroOneAdam, register_ddp_comm_hook

    optimizer_name, schedule, steps = _PROBE[method]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODELS[model_name]))
    ddp = DistributedDataParallel(model)
    meter = WireMeter()
    groups = _param_groups(model)
    if optimizer_name == "AdamW":
        optimizer = torch.optim.AdamW(groups, lr=1e-4)
        ddp.register_comm_hook(None, _counting_allreduce_hook(meter))
    else:
        cls = ZeroOneAdam if optimizer_name == "ZeroOneAdam" else OneBitAdam
        optimizer = cls(groups, lr=1e-4, granularity=granularity, wire_meter=meter, **schedule)
        register_ddp_comm_hook(ddp, optimizer)
    by_kind: dict[str, dict] = {}
    seconds: dict[str, list[float]] = {}  # optimizer.step() wall-clock per kind, steady-state steps only
    one_time: dict[str, list[float]] = {}
    vocab = model.config.vocab_size
    schedule = getattr(optimizer, "schedule", None)
    for step in range(steps):
        kind = schedule.next_kind().value if schedule is not None else "step"
        phase = schedule.phase if schedule is not None else None
        tokens = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(step * world_size + rank))
        ddp(input_ids=tokens, labels=tokens).loss.backward()
        start = time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - start
        steady = kind in seconds or kind in one_time
        if schedule is not None and schedule.phase != phase:
            steady = False
        (seconds if steady else one_time).setdefault(kind, []).append(elapsed)
        optimizer.zero_grad()
        tallies = meter.end_step()
        by_kind[kind] = {  # the last occurrence: after DDP's bucket rebuild
            "sent_bytes": sum(t.sent_bytes for t in tallies.values()),
            "recv_bytes": sum(t.recv_bytes for t in tallies.values()),
            "collective_calls": sum(t.calls for t in tallies.values()),
        }
    units = [list(g["params"]) for g in groups] if granularity == "group" else [[p] for g in groups for p in g["params"]]
    expected = onebit_wire_bytes([onebit_layout(sum(p.numel() for p in unit), world_size) for unit in units])
    step_seconds = {
        kind: {"seconds": statistics.median(seconds.get(kind) or one_time[kind]), "samples": len(seconds.get(kind, [])),
               "one_time_only": kind not in seconds}
        for kind in by_kind
    }  # fmt: skip
    return {
        "method": method,
        "num_params": sum(p.numel() for p in model.parameters()),
        "by_kind": by_kind,
        "step_seconds": step_seconds,
        "onebit_call_bytes_formula": expected.sent_bytes,
    }


def _schedule_counts(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    from ..optim import OneBitAdamSchedule, ZeroOneAdamSchedule, count_step_kinds

    total = args.onebit_total_steps

    def zoadam(alpha: int):
        def make():
            return ZeroOneAdamSchedule(
                args.onebit_var_freeze_step, args.onebit_var_update_scaler, alpha, args.onebit_local_step_clipper
            )

        return make

    counts = {
        "0/1 Adam": count_step_kinds(zoadam(args.onebit_local_step_scaler), total),
        "1-bit Adam": count_step_kinds(lambda: OneBitAdamSchedule(args.onebit_freeze_step), total),
    }
    if args.onebit_local_step_scaler != 32678:
        counts["0/1 Adam (alpha=32678)"] = count_step_kinds(zoadam(32678), total)
    return {name: {kind.value: n for kind, n in c.items() if n} for name, c in counts.items()}


def measure(args: argparse.Namespace) -> dict:
    """Measure bytes per step kind on real ranks, then total them over the stated schedule."""
    world_size = args.onebit_world_size
    if world_size < 2:
        raise ValueError(f"--onebit_world_size={world_size}: must be >= 2 (nothing is communicated on 1 rank)")
    if args.onebit_total_steps < 1:
        raise ValueError(f"--onebit_total_steps={args.onebit_total_steps}: must be >= 1")
    logger.info("bench comm onebit: %s on %d CPU ranks", args.onebit_model, world_size)
    jobs = [(args.onebit_model, method, args.onebit_granularity) for method in ("DDP AdamW fp32", "1-bit Adam", "0/1 Adam")]
    probes = {out["method"]: out for out in run_on_cpu_ranks(_probe, world_size, jobs, "bench comm onebit", pg_timeout_s=900)[0]}
    total = args.onebit_total_steps
    rows = _schedule_rows(probes, _schedule_counts(args), total)
    verified = _onebit_bytes_match_formula(probes)
    zero_one = next(row for row in rows if row["method"] == "0/1 Adam")
    return {
        "title": f"1-bit / 0/1 Adam vs DDP AdamW: bytes and rounds over a {total}-step schedule "
        f"({args.onebit_model}, {world_size} ranks)",
        "baseline": "DDP AdamW fp32",
        "model": args.onebit_model,
        "num_params": probes["0/1 Adam"]["num_params"],
        "world_size": world_size,
        "granularity": args.onebit_granularity,
        "schedule": {
            "total_steps": total,
            "var_freeze_step": args.onebit_var_freeze_step,
            "var_update_scaler": args.onebit_var_update_scaler,
            "local_step_scaler": args.onebit_local_step_scaler,
            "local_step_clipper": args.onebit_local_step_clipper,
            "onebit_freeze_step": args.onebit_freeze_step,
        },
        "onebit_bytes_match_formula": verified,
        "goal": {
            "bytes_ratio_max": 1 / 40,
            "rounds_ratio_max": 0.5,
            "met": zero_one["ratio_vs_baseline"] <= 1 / 40 and zero_one["rounds_ratio_vs_baseline"] <= 0.5,
        },
        "rows": rows,
        "how": "bytes per step kind recorded by the wire meter on real DDP steps over gloo; step kinds counted "
        "by running the optimizers' schedules for the whole job; a round is a step that communicates",
        "optimizer_step_how": "wall-clock seconds of optimizer.step() on rank 0 (one thread per rank), median over "
        "the probe's steps of each kind without the kind's first step and without a step that changes the phase "
        "(both allocate state; a kind with no other step reports those, one_time_only); steps of the compressed "
        "kinds include their 1-bit collectives; optimizer_step_seconds_mean weights the kinds by the schedule",
    }


def _schedule_rows(probes: dict[str, dict], counts: dict[str, dict[str, int]], total: int) -> list[dict]:
    """One row per method: the measured bytes of each step kind times its count over the ``total``-step schedule;
    the first row is the DDP AdamW baseline, which every ratio divides by."""
    baseline = probes["DDP AdamW fp32"]["by_kind"]["step"]
    rows = [
        {
            "method": "DDP AdamW fp32",
            "steps_by_kind": {"step": total},
            "bytes_by_kind": {"step": baseline},
            "total_sent_bytes": baseline["sent_bytes"] * total,
            "total_recv_bytes": baseline["recv_bytes"] * total,
            "rounds": total,
            "collective_calls": baseline["collective_calls"] * total,
            **_step_time_fields(probes["DDP AdamW fp32"]["step_seconds"], {"step": total}),
        }
    ]
    for name, steps_by_kind in counts.items():
        probe = probes["0/1 Adam" if name.startswith("0/1") else name]
        measured = probe["by_kind"]
        rows.append(
            {
                "method": name,
                "steps_by_kind": steps_by_kind,
                "bytes_by_kind": {kind: measured[kind] for kind in steps_by_kind},
                "total_sent_bytes": sum(n * measured[kind]["sent_bytes"] for kind, n in steps_by_kind.items()),
                "total_recv_bytes": sum(n * measured[kind]["recv_bytes"] for kind, n in steps_by_kind.items()),
                "rounds": sum(n for kind, n in steps_by_kind.items() if measured[kind]["collective_calls"] > 0),
                "collective_calls": sum(n * measured[kind]["collective_calls"] for kind, n in steps_by_kind.items()),
                **_step_time_fields(probe["step_seconds"], steps_by_kind),
            }
        )
    for row in rows:
        row["sent_bytes_per_step"] = row["total_sent_bytes"] // total
        row["recv_bytes_per_step"] = row["total_recv_bytes"] // total
        row["ratio_vs_baseline"] = round(row["total_sent_bytes"] / rows[0]["total_sent_bytes"], 5)
        row["rounds_ratio_vs_baseline"] = round(row["rounds"] / rows[0]["rounds"], 4)
    return rows


def _onebit_bytes_match_formula(probes: dict[str, dict]) -> bool:
    """Whether every recorded 1-bit step sent exactly the bytes :func:`qaccel.comm.onebit_wire_bytes` gives."""
    onebit_kinds = {"onebit_gradient", "sync", "onebit_momentum"}
    return all(
        probe["by_kind"][kind]["sent_bytes"] == probe["onebit_call_bytes_formula"]
        for probe in probes.values()
        for kind in probe["by_kind"]
        if kind in onebit_kinds
    )


def _step_time_fields(step_seconds: dict[str, dict], steps_by_kind: dict[str, int]) -> dict:
    """Per-kind step seconds of one method and their mean over the job's schedule."""
    total = sum(steps_by_kind.values())
    return {
        "optimizer_step_seconds_by_kind": {kind: step_seconds[kind] for kind in steps_by_kind},
        "optimizer_step_seconds_mean": sum(n * step_seconds[kind]["seconds"] for kind, n in steps_by_kind.items()) / total,
    }
