"""``qaccel.Accelerator.clip_grad_norm_`` warns once when a 1-bit optimizer would clip rank-locally, and still
returns and applies the true norm (checked against a float64 sum over the gradients)."""

import logging
import math

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
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = optimizer_cls(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    (10 * model(torch.randn(3, 4)).sum()).backward()
    grads = [p.grad.detach().double().clone() for p in model.parameters()]
    with caplog.at_level(logging.WARNING, logger="qaccel.integration._zero_one_adam"):
        norms = [acc.clip_grad_norm_(model.parameters(), 1.0) for _ in range(2)]
    clipped = [p.grad.detach().double() for p in model.parameters()]
    return norms, grads, clipped, [r for r in caplog.records if "clip_grad_norm_" in r.getMessage()]


def test_warns_once_with_zero_one_adam_and_still_clips(accelerator, caplog):
    norms, grads, clipped, warnings = _clip_twice(accelerator, ZeroOneAdam, caplog)
    assert len(warnings) == 1 and "gradient_clipping" in warnings[0].getMessage()
    # oracle: the L2 norm over every gradient element, in float64, before clipping
    expected = math.sqrt(sum(float((g * g).sum()) for g in grads))
    assert expected > 1.0  # the clip is active
    assert float(norms[0]) == pytest.approx(expected, rel=1e-6)
    # after clipping to 1.0 the gradients are the originals scaled by 1 / norm, and the second call sees 1.0
    for g, c in zip(grads, clipped, strict=True):
        torch.testing.assert_close(c, g / expected, rtol=1e-5, atol=0)
    assert float(norms[1]) == pytest.approx(1.0, rel=1e-5)


def test_silent_with_adamw(accelerator, caplog):
    *_, warnings = _clip_twice(accelerator, torch.optim.AdamW, caplog)
    assert warnings == []
