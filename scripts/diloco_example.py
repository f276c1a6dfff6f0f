"""Train a small GPT-2 with DiLoCo on DDP through ``qaccel.Accelerator``: each process an island, synced every H steps.

The model is built from a config and the data is a synthetic next-token task (a fixed random bigram
chain), so nothing is downloaded. Each process trains its own copy with AdamW on its own batches;
every ``--sync_every`` optimizer steps the islands average their pseudo-gradients (fp32, or
``--outer_bits`` with error feedback) and take an outer Nesterov step (``docs/diloco.md``).

Run it on 2 CPU processes (no GPU needed)::

    torchrun --nproc_per_node 2 scripts/diloco_example.py --cpu --steps 60 --sync_every 10 --outer_bits 4

On GPUs drop ``--cpu``. ``--out`` writes the losses, the wire bytes per step by kind, and whether the
islands ended with identical weights, as JSON (main process).
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from qaccel import Accelerator
from qaccel.optim import DiLoCo
from qaccel.zoo import bigram_sequences

logger = logging.getLogger("diloco_example")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # typos are errors
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--sync_every", type=int, default=10, help="H: optimizer steps between outer syncs")
    parser.add_argument("--outer_bits", type=int, default=None, help="bits of the pseudo-gradient on the wire (2..8; default fp32)")
    parser.add_argument("--outer_lr", type=float, default=0.7)
    parser.add_argument("--outer_momentum", type=float, default=0.9)
    parser.add_argument("--lr", type=float, default=1e-3, help="the inner AdamW's learning rate")
    parser.add_argument("--grad_accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per process per micro-step")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed")
    parser.add_argument("--cpu", action="store_true", help="train on CPU (gloo); needed for multi-process CPU runs")
    parser.add_argument("--out", default=None, help="write losses and wire bytes here (JSON)")
    return parser.parse_args(argv)


def _islands_identical(model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    if not dist.is_initialized():
        return True
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    accelerator = Accelerator(cpu=args.cpu or None, gradient_accumulation_steps=args.grad_accum)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=args.vocab, n_positions=args.seq_len))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    num_seqs = args.batch_size * accelerator.num_processes * args.steps * args.grad_accum
    loader = DataLoader(TensorDataset(bigram_sequences(args.vocab, args.seq_len, num_seqs, args.seed)), batch_size=args.batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, wire, step = [], [], 0
    settings = {"sync_every": args.sync_every, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum, "outer_bits": args.outer_bits}
    with DiLoCo(accelerator, model, meter=accelerator.wire_meter, **settings) as diloco:
        for tokens, in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=tokens, labels=tokens).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            diloco.step()
            if not accelerator.sync_gradients:
                continue
            step += 1
            losses.append(accelerator.reduce(loss.detach().float(), reduction="mean").item())  # the islands' mean
            wire.append(accelerator.log_comm_stats(step))
            if accelerator.is_main_process and (step % 10 == 0 or step == args.steps):
                logger.info("step %d loss %.4f sent %d B (syncs so far: %d)", step, losses[-1], wire[-1]["comm/sent_bytes"], diloco.syncs)
            if step == args.steps:
                break
    result = {"losses": losses, "wire_per_step": wire, "syncs": diloco.syncs, "islands_identical": _islands_identical(model),
              "world_size": accelerator.num_processes, "settings": settings,
              "trainable_values": sum(p.numel() for p in model.parameters() if p.requires_grad)}  # fmt: skip
    if args.out and accelerator.is_main_process:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2, sort_keys=True)
    accelerator.end_training()
    return result


if __name__ == "__main__":
    main()
