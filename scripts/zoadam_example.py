"""Train a small GPT-2 with 0/1 Adam (or 1-bit Adam) on DDP through ``qaccel.Accelerator``.

The model is built from a config and the data is a synthetic next-token task (a fixed random bigram
chain), so nothing is downloaded. Optimizer settings come, in this order, from a DeepSpeed JSON config
(``--ds_config``, its ``"optimizer": {"type": "ZeroOneAdam" | "OneBitAdam", "params": {...}}`` block), from
``QACCEL_ZERO_ONE_ADAM_*`` / ``QACCEL_ONEBIT_ADAM_*`` variables, and from the defaults below.

Run it on 2 CPU processes (no GPU needed)::

    torchrun --nproc_per_node 2 scripts/zoadam_example.py --cpu --steps 60
    QACCEL_ZERO_ONE_ADAM_VAR_FREEZE_STEP=20 torchrun --nproc_per_node 2 scripts/zoadam_example.py --cpu
    torchrun --nproc_per_node 2 scripts/zoadam_example.py --cpu --ds_config ds_config.json --grad_accum 2
    torchrun --nproc_per_node 2 scripts/zoadam_example.py --cpu --save_at 30 --ckpt ckpt   # then --resume ckpt

On GPUs drop ``--cpu`` (``torchrun --nproc_per_node 8 ...`` or ``accelerate launch --multi_gpu ...``).

``--out`` writes losses and per-step wire bytes as JSON (main process).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from qaccel import Accelerator
from qaccel.optim import OneBitAdam, OneBitAdamConfig, ZeroOneAdam, ZeroOneAdamConfig
from qaccel.zoo import bigram_sequences

logger = logging.getLogger("zoadam_example")

# Short-run defaults: F and alpha scaled to a 60-step demo. The variance freezes after F steps, so a
# short warm-up leaves it small and calls for a modest lr (with lr 1e-3 and F = 6 this demo diverges).
DEMO_DEFAULTS = {"lr": 5e-4, "var_freeze_step": 20, "var_update_scaler": 4, "local_step_scaler": 10, "local_step_clipper": 8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # typos are errors
    parser.add_argument("--optimizer", choices=("ZeroOneAdam", "OneBitAdam"), default=None, help="default: from --ds_config, else ZeroOneAdam")
    parser.add_argument("--ds_config", default=None, help="DeepSpeed JSON config whose optimizer block to use")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--grad_accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per process per micro-step")
    parser.add_argument("--seq_len", type=int, default=32)
    # Small vocabulary: every embedding row gets a gradient on the first variance steps. A row first seen
    # after the variance froze would have v = 0 and move by lr * m / eps (as in DeepSpeed).
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed")
    parser.add_argument("--mixed_precision", default=None, help="no|bf16|fp16 (default: Accelerate's setting)")
    parser.add_argument("--cpu", action="store_true", help="train on CPU (gloo); needed for multi-process CPU runs")
    parser.add_argument("--save_at", type=int, default=None, help="save_state after this optimizer step")
    parser.add_argument("--ckpt", default="zoadam_ckpt", help="checkpoint directory for --save_at")
    parser.add_argument("--resume", default=None, help="load_state from this directory first")
    parser.add_argument("--out", default=None, help="write losses and wire bytes here (JSON)")
    return parser.parse_args(argv)


def build_optimizer(args: argparse.Namespace, model: torch.nn.Module) -> torch.optim.Optimizer:
    name, params = args.optimizer, {}
    if args.ds_config:
        with open(args.ds_config) as fh:
            block = json.load(fh)["optimizer"]
        name = name or {"zerooneadam": "ZeroOneAdam", "onebitadam": "OneBitAdam"}[block["type"].lower()]
        params = block.get("params", {})
    name = name or "ZeroOneAdam"
    cls, config_cls = (ZeroOneAdam, ZeroOneAdamConfig) if name == "ZeroOneAdam" else (OneBitAdam, OneBitAdamConfig)
    defaults = {k: v for k, v in DEMO_DEFAULTS.items() if k in config_cls.field_names()}
    if name == "OneBitAdam":
        defaults["freeze_step"] = 20
    # JSON keys beat the environment, which beats the demo defaults
    from_json = config_cls.from_dict(params)  # validates the DeepSpeed block
    overrides = {k: v for k, v in defaults.items() if config_cls.ENV_PREFIX + k.upper() not in os.environ}
    overrides.update({k: getattr(from_json, k) for k in params})
    config = config_cls.from_env(**overrides)
    decay = [p for p in model.parameters() if p.dim() >= 2]  # nanoGPT's rule: matrices decay
    rest = [p for p in model.parameters() if p.dim() < 2]
    return cls([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], config)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    accelerator = Accelerator(cpu=args.cpu or None, mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum)

    torch.manual_seed(args.seed)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=args.vocab, n_positions=args.seq_len)
    model = GPT2LMHeadModel(config)
    optimizer = build_optimizer(args, model)
    num_seqs = args.batch_size * accelerator.num_processes * args.steps * args.grad_accum
    loader = DataLoader(TensorDataset(bigram_sequences(args.vocab, args.seq_len, num_seqs, args.seed)), batch_size=args.batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    first_step = 0
    if args.resume:
        accelerator.load_state(args.resume)
        first_step = optimizer.optimizer.schedule.step
        loader = accelerator.skip_first_batches(loader, first_step * args.grad_accum)

    losses, wire, kinds = [], [], []
    model.train()
    step = first_step
    for micro, (tokens,) in enumerate(loader):
        if micro % args.grad_accum == 0:
            kinds.append(optimizer.optimizer.schedule.next_kind().value)
        with accelerator.accumulate(model):
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step += 1
        # Mean loss over ranks, so every rank logs the same number.
        losses.append(accelerator.reduce(loss.detach().float(), reduction="mean").item())
        wire.append(accelerator.log_comm_stats(step))
        if accelerator.is_main_process and (step % 10 == 0 or step == args.steps):
            logger.info("step %d (%s) loss %.4f sent %d B", step, kinds[-1], losses[-1], wire[-1]["comm/sent_bytes"])
        if step == args.save_at:
            accelerator.save_state(args.ckpt)
        if step == args.steps:
            break
    result = {
        "losses": losses,
        "kinds": kinds,
        "wire_per_step": wire,
        "optimizer": type(optimizer.optimizer).__name__,
        "config": optimizer.optimizer.config.to_dict(),
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
    }
    if args.out and accelerator.is_main_process:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2, sort_keys=True)
    accelerator.end_training()
    return result


if __name__ == "__main__":
    main()
