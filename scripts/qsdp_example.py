"""Train a small GPT-2 with QSDP (quantized FSDP2) through ``qaccel.Accelerator``.

The model is built from a config and the data is a synthetic next-token task (a fixed random
bigram chain), so nothing is downloaded. QSDP settings come from ``QACCEL_QSDP_*`` variables or a
recipe file; FSDP settings from the Accelerate config (``FSDP_*``) or the defaults below.

Run it on 2 CPU processes (no GPU needed)::

    torchrun --nproc_per_node 2 scripts/qsdp_example.py --steps 30
    accelerate launch --config_file launch_configs/cpu_2proc_qsdp.yaml scripts/qsdp_example.py
    QACCEL_QSDP_WEIGHT_BITS=4 QACCEL_QSDP_GRAD_BITS=4 torchrun --nproc_per_node 2 scripts/qsdp_example.py
    torchrun --nproc_per_node 2 scripts/qsdp_example.py --qaccel_config recipe.yaml

``--stock`` runs the same job on plain FSDP2 (both QSDP paths off) for comparison; ``--out``
writes losses and per-step wire bytes as JSON (main process).
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from qaccel import Accelerator, QSDPPlugin
from qaccel.zoo import bigram_sequences

logger = logging.getLogger("qsdp_example")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # typos are errors
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per process per step")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed")
    parser.add_argument("--mixed_precision", default=None, help="no|bf16 (default: Accelerate's setting)")
    parser.add_argument("--qaccel_config", default=None, help="QSDP recipe file (YAML/JSON with a 'qsdp' section)")
    parser.add_argument("--stock", action="store_true", help="plain FSDP2: both QSDP paths off")
    parser.add_argument("--out", default=None, help="write losses and wire bytes here (JSON)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    fsdp_kwargs: dict = {}
    if "FSDP_AUTO_WRAP_POLICY" not in os.environ:  # not given by an Accelerate config: wrap blocks
        fsdp_kwargs = {"auto_wrap_policy": "transformer_based_wrap", "transformer_cls_names_to_wrap": ["GPT2Block"]}
    qsdp_kwargs = {"weight_bits": None, "grad_bits": None} if args.stock else {}
    plugin = QSDPPlugin(recipe=args.qaccel_config, **qsdp_kwargs, **fsdp_kwargs)
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision=args.mixed_precision)

    torch.manual_seed(args.seed)
    config = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4, vocab_size=args.vocab, n_positions=args.seq_len)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    num_seqs = args.batch_size * accelerator.num_processes * args.steps
    data = TensorDataset(bigram_sequences(args.vocab, args.seq_len, num_seqs, args.seed))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, wire = [], []
    model.train()
    for step, (tokens,) in enumerate(loader):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        # Mean loss over ranks, so every rank logs the same number.
        losses.append(accelerator.reduce(loss.detach().float(), reduction="mean").item())
        wire.append(accelerator.log_comm_stats(step))
        if accelerator.is_main_process and (step % 5 == 0 or step == args.steps - 1):
            logger.info("step %d loss %.4f sent %d B", step, losses[-1], wire[-1]["comm/sent_bytes"])
    result = {
        "losses": losses,
        "wire_per_step": wire,
        "qsdp": plugin.qsdp_config.to_dict(),
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
