"""Convergence smoke test on 2 gloo ranks: 0/1 Adam and 1-bit Adam against DDP AdamW.

Task: a 3-layer GELU MLP (5,768 parameters) regresses a fixed random tanh teacher; each rank draws its own
batches of 32; the same 300 steps, lr 2e-3, no weight decay, for all three optimizers. 0/1 Adam uses
F = 50 (the end of a short warm-up), kappa = 4, alpha = 50, H = 8, so the run has full-precision, 1-bit
gradient, local and sync steps; 1-bit Adam freezes at step 60 (20% of the run, the tutorial's range).

Tolerance: the held-out loss after 300 steps must be at most 1.25x AdamW's (measured on this machine:
AdamW 1.8e-3, 0/1 Adam 1.6e-3, 1-bit Adam 1.5e-3), and at most 1/20 of the untrained loss (7.4e-2).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from qaccel.optim import OneBitAdam, StepKind, ZeroOneAdam, register_ddp_comm_hook
from tests._dist import run_ranks

STEPS = 300
LR = 2e-3
ZOADAM = dict(var_freeze_step=50, var_update_scaler=4, local_step_scaler=50, local_step_clipper=8)
ONEBIT = dict(freeze_step=60)


def _teacher() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(123)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _student() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)
        )


def _data(teacher, step, rank, n=32):
    gen = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(n, 16, generator=gen)
    with torch.no_grad():
        return x, teacher(x)


def _train(rank, name):
    teacher, net = _teacher(), _student()
    ddp = DistributedDataParallel(net)
    if name == "AdamW":
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    else:
        cls, kwargs = (ZeroOneAdam, ZOADAM) if name == "ZeroOneAdam" else (OneBitAdam, ONEBIT)
        optimizer = cls(net.parameters(), lr=LR, **kwargs)
        register_ddp_comm_hook(ddp, optimizer)
    x_eval, y_eval = _data(teacher, 99_999, 0, n=512)
    with torch.no_grad():
        losses, kinds = [float(((net(x_eval) - y_eval) ** 2).mean())], set()
    for step in range(1, STEPS + 1):
        if name != "AdamW":
            kinds.add(optimizer.schedule.next_kind().value)
        x, y = _data(teacher, step, rank)
        optimizer.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        optimizer.step()
        if step % 25 == 0:
            with torch.no_grad():
                losses.append(float(((net(x_eval) - y_eval) ** 2).mean()))
    return {"losses": losses, "kinds": sorted(kinds)}


def _worker(rank, world):
    return {name: _train(rank, name) for name in ("AdamW", "ZeroOneAdam", "OneBitAdam")}


@pytest.mark.slow  # 300 steps of three optimizers on 2 ranks: a convergence run
def test_one_bit_optimizers_reach_adamw_loss(tmp_path):
    results = run_ranks(_worker, 2, tmp_path, timeout_s=300)[0]
    adamw = results["AdamW"]["losses"][-1]
    assert results["ZeroOneAdam"]["kinds"] == sorted(k.value for k in (StepKind.INIT, StepKind.FULL, StepKind.ONEBIT_GRADIENT, StepKind.LOCAL, StepKind.SYNC))
    for name in ("ZeroOneAdam", "OneBitAdam"):
        losses = results[name]["losses"]
        assert losses[-1] <= 1.25 * adamw, f"{name}: final loss {losses[-1]:.2e} vs AdamW {adamw:.2e}"
        assert losses[-1] <= losses[0] / 20, f"{name}: loss went from {losses[0]:.2e} to {losses[-1]:.2e}"
