"""Train a small GPT-2 with ``qaccel.Trainer``: QSDP on FSDP2, or 0/1 Adam / 1-bit Adam on DDP.

The model is built from a config and the data is a synthetic next-token task (a fixed random bigram
chain, best loss ln 4 = 1.386), so nothing is downloaded. Run it on 2 CPU processes (no GPU needed;
the Trainer switches ``TrainingArguments`` to ``use_cpu=True`` when there is no GPU)::

    torchrun --nproc_per_node 2 scripts/trainer_example.py --method qsdp --steps 40
    torchrun --nproc_per_node 2 scripts/trainer_example.py --method qsdp --weight_bits 4 --grad_bits 4
    torchrun --nproc_per_node 2 scripts/trainer_example.py --method zoadam --steps 60 --save_steps 30
    torchrun --nproc_per_node 2 scripts/trainer_example.py --method zoadam --steps 60 --resume trainer_out/checkpoint-30

``--method onebit`` uses 1-bit Adam, ``--method adamw`` the Trainer's own AdamW on DDP (for comparison).
Every log line carries ``wire_bytes`` (bytes this rank sent since the previous line), ``wire_bytes/<kind>``
and ``wire_bytes_total``. On GPUs: ``torchrun --nproc_per_node 8 scripts/trainer_example.py ...``.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import qaccel
from qaccel.optim import OneBitAdam, ZeroOneAdam
from qaccel.zoo import bigram_sequences


class BigramData(Dataset):
    """Causal-LM examples: the labels are the inputs (the model shifts them)."""

    def __init__(self, vocab: int, seq_len: int, num_seqs: int, seed: int) -> None:
        self.tokens = bigram_sequences(vocab, seq_len, num_seqs, seed)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=("qsdp", "zoadam", "onebit", "adamw"), default="qsdp")
    parser.add_argument("--weight_bits", type=int, default=8, help="QSDP bits on the weight all-gather")
    parser.add_argument("--grad_bits", type=int, default=8, help="QSDP bits on the gradient reduce-scatter")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per process per step")
    parser.add_argument("--output_dir", default="trainer_out")
    parser.add_argument("--save_steps", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--resume", default=None, help="a checkpoint-<step> folder to resume from")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=32, n_embd=128, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
    )
    args = TrainingArguments(
        output_dir=options.output_dir,
        max_steps=options.steps,
        per_device_train_batch_size=options.batch_size,
        learning_rate=options.lr,
        lr_scheduler_type="constant",  # 0/1 Adam's schedules count steps, not lr; keep the lr fixed here
        logging_steps=5,
        save_strategy="steps" if options.save_steps else "no",
        save_steps=options.save_steps or 500,
        report_to="none",
    )
    extra = {}
    if options.method == "qsdp":
        extra["qsdp"] = qaccel.QSDPConfig(weight_bits=options.weight_bits, grad_bits=options.grad_bits)
    elif options.method == "zoadam":
        # Short-run schedule: variance frozen after 20 steps, then syncs every 1, 2, 4 ... (at most 8) steps.
        extra["optimizers"] = (ZeroOneAdam(model.parameters(), lr=options.lr, var_freeze_step=20, var_update_scaler=4,
                                           local_step_scaler=10, local_step_clipper=8), None)  # fmt: skip
    elif options.method == "onebit":
        extra["optimizers"] = (OneBitAdam(model.parameters(), lr=options.lr, freeze_step=20), None)
    trainer = qaccel.Trainer(model=model, args=args, train_dataset=BigramData(64, 32, 4096, seed=1), **extra)
    trainer.train(resume_from_checkpoint=options.resume)
    last = next(entry for entry in reversed(trainer.state.log_history) if "loss" in entry)
    sent = trainer.accelerator.comm_stats()["total_sent_bytes"]
    trainer.accelerator.print(
        f"{options.method}: loss {last['loss']:.3f} at step {last['step']}; this rank sent {sent:,} bytes in qaccel collectives"
    )
    trainer.accelerator.end_training()  # frees FSDP/gloo state in order, then destroys the process group


if __name__ == "__main__":
    main()
