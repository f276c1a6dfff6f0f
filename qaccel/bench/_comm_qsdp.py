"""``qaccel bench comm`` section QSDP: bytes on the wire per training step, FSDP2 vs QSDP.

Runs real training steps of a GPT-2 (GPT-2 small, 124M parameters, by default) on ``P`` CPU
processes over gloo, sharded like Accelerate's transformer-based wrap (one FSDP2 unit per block,
then the root), once per method. Every collective is issued by the QSDP comms installed on the
units: with both paths off they forward FSDP2's own collectives unchanged and only count them,
so the FSDP rows are stock FSDP2 traffic measured through the same meter as the QSDP rows.
Bytes depend on the unit layout, not on the batch, so a short sequence keeps the CPU run cheap.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from ._ranks import run_on_cpu_ranks

__all__ = ["add_arguments", "measure", "METHODS"]

logger = logging.getLogger(__name__)

# method -> (QSDPConfig kwargs, FSDP2 param/reduce dtype)
METHODS: dict[str, tuple[dict, torch.dtype | None]] = {
    "FSDP fp32": ({"weight_bits": None, "grad_bits": None}, None),
    "FSDP bf16": ({"weight_bits": None, "grad_bits": None}, torch.bfloat16),
    "QSDP W8G8": ({"weight_bits": 8, "grad_bits": 8}, None),
    "QSDP W4G4": ({"weight_bits": 4, "grad_bits": 4}, None),
    # the low-bit settings (rotation and error feedback do not change the bytes)
    "QSDP W4G2": ({"weight_bits": 4, "grad_bits": 2}, None),
    "QSDP W3G3": ({"weight_bits": 3, "grad_bits": 3}, None),
    "QSDP W3G2": ({"weight_bits": 3, "grad_bits": 2}, None),
    "QSDP W2G2": ({"weight_bits": 2, "grad_bits": 2}, None),
}
MODELS = {
    "gpt2-124m": {},  # GPT2Config() defaults: 12 layers, 768 wide, 50257 vocab, 1024 positions
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 32},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--qsdp_model", choices=sorted(MODELS), default="gpt2-124m", help="model shape (default gpt2-124m)")
    parser.add_argument("--qsdp_world_size", type=int, default=2, help="CPU processes (default 2)")
    parser.add_argument("--qsdp_steps", type=int, default=1, help="training steps per method; bytes are per step (default 1)")
    parser.add_argument("--qsdp_seq_len", type=int, default=8, help="tokens per sequence (bytes do not depend on it)")


def _one_method(rank: int, world_size: int, model_name: str, method: str, steps: int, seq_len: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from ..comm import WireMeter
    from ..fsdp import QSDPConfig, install_qsdp

    qsdp_kwargs, mp_dtype = METHODS[method]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODELS[model_name]))
    num_params = sum(p.numel() for p in model.parameters())
    policy = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=mp_dtype) if mp_dtype else MixedPrecisionPolicy()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    meter = WireMeter()
    config = QSDPConfig(**qsdp_kwargs)
    handle = install_qsdp(model, config, optimizers=[optimizer], meter=meter)
    vocab = model.config.vocab_size
    started = time.perf_counter()
    per_step = []
    for step in range(steps):
        tokens = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(step * world_size + rank))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        per_step.append({kind: vars(t) for kind, t in meter.end_step().items()})
    return {
        "method": method,
        "per_step": per_step,
        "num_params": num_params,
        "units": handle.describe(),
        "weight_codec": _codec_dict(config.weight_codec()),
        "grad_codec": _codec_dict(config.grad_codec()),
        "param_dtype": str(mp_dtype or torch.float32),
        "seconds": time.perf_counter() - started,
    }


def _codec_dict(codec) -> dict | None:
    if codec is None:
        return None
    return {"bits": codec.bits, "bucket_size": codec.bucket_size, "meta_dtype": str(codec.meta_dtype), "rounding": codec.rounding}


def measure(args: argparse.Namespace) -> dict:
    """Run every method on ``--qsdp_world_size`` CPU ranks; bytes per step of rank 0, ratio vs FSDP fp32."""
    world_size = args.qsdp_world_size
    if world_size < 2:
        raise ValueError(f"--qsdp_world_size={world_size}: must be >= 2 (nothing is communicated on 1 rank)")
    jobs = [(args.qsdp_model, method, args.qsdp_steps, args.qsdp_seq_len) for method in METHODS]
    logger.info("bench comm qsdp: %s on %d CPU ranks, %d step(s) per method", args.qsdp_model, world_size, args.qsdp_steps)
    per_rank = run_on_cpu_ranks(_one_method, world_size, jobs, "bench comm qsdp", pg_timeout_s=600)
    rows = []
    for outputs in zip(*per_rank, strict=True):
        rank0 = outputs[0]
        last = rank0["per_step"][-1]  # steady state: the last step (all steps are equal here)
        rows.append(
            {
                "method": rank0["method"],
                "sent_bytes_per_step": sum(t["sent_bytes"] for t in last.values()),
                "recv_bytes_per_step": sum(t["recv_bytes"] for t in last.values()),
                "per_kind": last,
                "per_rank_sent_bytes": [sum(t["sent_bytes"] for t in o["per_step"][-1].values()) for o in outputs],
                "weight_codec": rank0["weight_codec"],
                "grad_codec": rank0["grad_codec"],
                "param_dtype": rank0["param_dtype"],
                "seconds": round(rank0["seconds"], 1),
            }
        )
    baseline = rows[0]["sent_bytes_per_step"]
    for row in rows:
        row["ratio_vs_baseline"] = round(row["sent_bytes_per_step"] / baseline, 4)
    return {
        "title": f"QSDP vs FSDP2: bytes per step per rank ({args.qsdp_model}, {world_size} ranks)",
        "baseline": "FSDP fp32",
        "model": args.qsdp_model,
        "num_params": per_rank[0][0]["num_params"],
        "world_size": world_size,
        "units": per_rank[0][2]["units"],
        "rows": rows,
        "how": "real training steps over gloo; bytes recorded by the installed comms from their buffer sizes",
    }
