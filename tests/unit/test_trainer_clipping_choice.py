"""What ``qaccel.Trainer`` logs about a 1-bit optimizer's clipping and the backward overlap, per setting.

The expected rows are the table of ``docs/trainer.md`` ("Clipping and overlap"): clipping (from
``max_grad_norm`` or the optimizer's own ``gradient_clipping``) runs the 1-bit all-reduce after
backward, and that is a WARNING only where nothing else would have kept the overlap off.
``TrainingArguments`` is stood in for by the four fields the choice reads, so no process-wide
Accelerate state is set up.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from qaccel.integration._trainer_setup import clipping_choice, onebit_clipping
from qaccel.optim import OneBitAdam, ZeroOneAdam


def _args(max_grad_norm=1.0, world_size=2, device="cpu", fp16=False):
    return SimpleNamespace(max_grad_norm=max_grad_norm, world_size=world_size, device=torch.device(device), fp16=fp16)


def _choice(args, optimizer_cls=ZeroOneAdam, **optimizer_kwargs):
    optimizer = optimizer_cls([torch.nn.Parameter(torch.zeros(3))], **optimizer_kwargs)
    onebit_clipping(optimizer, args.max_grad_norm)  # what the Trainer does first
    return clipping_choice(optimizer, args)


def test_default_max_grad_norm_warns_that_clipping_turns_the_overlap_off():
    level, message = _choice(_args())
    assert level == logging.WARNING
    assert message.startswith("qaccel.Trainer: ZeroOneAdam clips at max_grad_norm=1.0")
    assert "no overlap with backward" in message and "set max_grad_norm=0 to overlap it" in message


def test_max_grad_norm_zero_says_the_all_reduce_overlaps_backward():
    level, message = _choice(_args(max_grad_norm=0.0), OneBitAdam)
    assert level == logging.INFO
    assert message.startswith("qaccel.Trainer: OneBitAdam does not clip (max_grad_norm=0.0")
    assert message.endswith("so its 1-bit all-reduce overlaps backward (overlap_comm)")


def test_the_optimizers_own_clipping_names_its_own_fix():
    level, message = _choice(_args(max_grad_norm=0.0), gradient_clipping=0.5)
    assert level == logging.WARNING
    assert "clips at its own gradient_clipping=0.5" in message
    assert "build the optimizer with gradient_clipping=0" in message and "max_grad_norm=0 to" not in message


@pytest.mark.parametrize(
    ("args", "optimizer_kwargs", "reason"),
    [
        (_args(), {"overlap_comm": False}, "overlap_comm=False"),
        (_args(world_size=1), {}, "one process"),
        (_args(device="cuda"), {}, "this run is on cuda"),
        (_args(fp16=True), {}, "fp16"),
    ],
    ids=["overlap_comm_off", "one_process", "cuda", "fp16"],
)
@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clipping", "no_clipping"])
def test_without_an_overlap_to_lose_the_choice_is_info_and_names_the_reason(args, optimizer_kwargs, reason, max_grad_norm):
    args.max_grad_norm = max_grad_norm
    level, message = _choice(args, **optimizer_kwargs)
    assert level == logging.INFO
    assert ("clips at max_grad_norm=1.0" in message) is (max_grad_norm > 0)
    assert "runs after backward" in message and reason in message and "overlaps backward" not in message
