"""``qaccel.Accelerator.clip_grad_norm_`` warns once when a 1-bit optimizer would clip rank-locally."""

import logging

import pytest
import torch
from accelerate.state import AcceleratorState

from qaccel import Accelerator
from qaccel.optim import ZeroOneAdam


@pytest.fixture
def accelerator():
    acc = Accelerator(cpu=True)
    yield acc
    AcceleratorState._reset_state(reset_partial_state=True)


def _clip_twice(acc, optimizer_cls, caplog):
    model = torch.nn.Linear(4, 2)
    optimizer = optimizer_cls(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    model(torch.randn(3, 4)).sum().backward()
    with caplog.at_level(logging.WARNING, logger="qaccel.integration._zero_one_adam"):
        norms = [acc.clip_grad_norm_(model.parameters(), 1.0) for _ in range(2)]
    return norms, [r for r in caplog.records if "clip_grad_norm_" in r.getMessage()]


def test_warns_once_with_zero_one_adam_and_still_clips(accelerator, caplog):
    norms, warnings = _clip_twice(accelerator, ZeroOneAdam, caplog)
    assert len(warnings) == 1 and "gradient_clipping" in warnings[0].getMessage()
    assert all(torch.isfinite(n) and n > 0 for n in norms)


def test_silent_with_adamw(accelerator, caplog):
    _, warnings = _clip_twice(accelerator, torch.optim.AdamW, caplog)
    assert warnings == []
