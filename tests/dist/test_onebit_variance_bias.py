"""``variance_bias_correction`` through the 1-bit all-reduce on 2 gloo ranks (DDP hook, overlap on).

With world size 2 the averages are really compressed, so the single-process reference of
``tests/unit/test_onebit_variance_bias.py`` does not apply; the oracle here is the update rule itself,
with the correction sqrt(1 - beta2^k) computed from a hand count of the variance steps:

- 1-bit Adam, every step after the freeze: ``w' = w - lr (m' / (sqrt(v) / c + eps) + wd w)`` with the
  averaged momentum ``m'`` the step left in the state;
- 0/1 Adam, every sync: the weights restart from the synced point plus the averaged payload over the
  corrected denominator, and the momentum is rebuilt from the same payload, so
  ``(w' - w_sync) (sqrt(v) / c + eps) = -m' lrs``: a denominator that differed between the payload and its
  inverse (or lacked the correction on one side) breaks it by the factor 1 / c.
"""

from __future__ import annotations

import math

import torch
from torch.nn.parallel import DistributedDataParallel

from qaccel.optim import OneBitAdam, StepKind, ZeroOneAdam, register_ddp_comm_hook
from tests._deepspeed_zoadam_port import batch, loss_of, make_net
from tests._dist import run_ranks

LR, WD, BETA2 = 2e-3, 0.01, 0.999
EPS = 1e-4  # the table's unused rows keep v = 0: their 1-bit share of the payload is divided by eps
STEPS = 14


def _onebit_adam(rank: int, world_size: int) -> int:
    net = make_net()
    ddp = DistributedDataParallel(net)
    optimizer = OneBitAdam(net.parameters(), lr=LR, eps=EPS, weight_decay=WD, freeze_step=4, variance_bias_correction=True, replica_check_interval=1)
    register_ddp_comm_hook(ddp, optimizer)
    checked = 0
    for t in range(1, STEPS + 1):
        kind = optimizer.schedule.next_kind()
        before = [p.detach().clone() for p in net.parameters()]
        optimizer.zero_grad()
        loss_of(ddp, batch(t, rank)).backward()
        optimizer.step()
        if kind is not StepKind.ONEBIT_MOMENTUM:
            continue
        c = math.sqrt(1 - BETA2**3)  # the variance steps were 2, 3 and 4
        for p, w in zip(net.parameters(), before, strict=True):
            state = optimizer.state[p]
            expected = w - LR * (state["exp_avg"] / (state["exp_avg_sq"].sqrt() / c + EPS) + WD * w)
            torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7)
        checked += 1
    return checked


def _zero_one_adam(rank: int, world_size: int) -> int:
    net = make_net()
    ddp = DistributedDataParallel(net)
    optimizer = ZeroOneAdam(
        net.parameters(), lr=LR, eps=EPS, weight_decay=WD, var_freeze_step=4, var_update_scaler=2, local_step_scaler=2,
        local_step_clipper=4, variance_bias_correction=True, replica_check_interval=1,
    )  # fmt: skip
    register_ddp_comm_hook(ddp, optimizer)
    checked = 0
    for t in range(1, STEPS + 1):
        kind = optimizer.schedule.next_kind()
        params = list(net.parameters())
        synced = [optimizer.state[p]["synced_weights"].clone() if "synced_weights" in optimizer.state[p] else None for p in params]
        lrs = [optimizer.state[p].get("lrs", 0.0) + LR for p in params]
        optimizer.zero_grad()
        loss_of(ddp, batch(t, rank)).backward()
        optimizer.step()
        if kind is not StepKind.SYNC:
            continue
        # kappa 2: variance steps 2, 3 (interval 1), then 4 (interval 2); step 5 is the last of phase 1
        c = math.sqrt(1 - BETA2**3)
        for p, w_sync, lr_sum in zip(params, synced, lrs, strict=True):
            state = optimizer.state[p]
            denominator = state["exp_avg_sq"].sqrt() / c + EPS
            torch.testing.assert_close((p.detach() - w_sync) * denominator, -state["exp_avg"] * lr_sum, rtol=1e-4, atol=1e-9)
        checked += 1
    return checked


def test_onebit_adam_applies_the_corrected_frozen_variance_on_every_compressed_step(tmp_path):
    # steps 5..14 run on the frozen variance; the replica check (every step) raises if the ranks drift apart
    assert run_ranks(_onebit_adam, 2, tmp_path) == [STEPS - 4] * 2


def test_zero_one_adam_syncs_invert_the_corrected_payload(tmp_path):
    checked = run_ranks(_zero_one_adam, 2, tmp_path)
    assert checked == [4, 4]  # syncs at steps 6, 7, 8 (interval 1, 1, 2) and 12 (interval 4)
