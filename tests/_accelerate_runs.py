"""Pieces of the tests that train a tiny GPT-2 through ``qaccel.Accelerator`` inside the ranks of ``run_ranks``.

Accelerate reads the launcher's variables (``RANK``, ``WORLD_SIZE``, ...) to build its state; inside a rank the
process group already exists (FileStore rendezvous), so :func:`set_rank_env` sets them to match it.
"""

from __future__ import annotations

import os

import torch

__all__ = ["TINY", "differing_params", "full_params", "run_step", "set_rank_env", "train_on"]

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def set_rank_env(rank: int, world_size: int) -> None:
    """The launcher's variables for this rank, as ``torchrun`` would set them."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # unused: the group already exists (FileStore rendezvous)
    )


def run_step(accelerator, model, optimizer, rank: int, step: int) -> float:
    """One optimizer step on data fixed by (step, rank), independent of any data loader state; the loss."""
    tokens = torch.randint(0, TINY["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(100 * step + rank))
    with accelerator.autocast():
        loss = model(input_ids=tokens, labels=tokens).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def train_on(accelerator, model, optimizer, rank: int, steps: range, out: dict) -> dict:
    """Run ``steps`` (a range of step numbers), then end training; ``out`` gains the losses and final parameters."""
    out["losses"] = [run_step(accelerator, model, optimizer, rank, number) for number in steps]
    out["params_at_end"] = full_params(model)
    accelerator.end_training()
    return out


def full_params(model) -> dict[str, bytes]:
    """Full parameters as raw bytes: exact, and picklable back to the test process without shared memory."""
    return {name: param.full_tensor().detach().contiguous().numpy().tobytes() for name, param in model.named_parameters()}


def differing_params(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    """Names of the parameters whose bits differ."""
    assert a.keys() == b.keys()
    return sorted(name for name in a if a[name] != b[name])
