"""Registration of the 1-bit optimizers on 2 real gloo processes: the placement is handed over once.

- a second ``register_ddp_comm_hook`` on the same model is refused by DDP (one hook per model), and the
  optimizer keeps its placement and its overlap;
- the same optimizer on another process group is refused before that model gets a hook;
- under ``qaccel.Accelerator`` a step before the DDP model is prepared is refused, and once it is, the
  optimizer runs on the model's group with the accelerator's meter (its 1-bit bytes land there).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests._deepspeed_zoadam_port import batch, loss_of, make_net
from tests._dist import run_ranks


def _attempt(call) -> str:
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    return ""


def _ddp_twice(rank: int) -> dict:
    from qaccel.comm import WireMeter
    from qaccel.optim import OneBitAdam, register_ddp_comm_hook

    net = make_net()
    ddp = DistributedDataParallel(net)
    opt = OneBitAdam(net.parameters(), lr=1e-3, freeze_step=2, wire_meter=WireMeter())
    register_ddp_comm_hook(ddp, opt)
    placement, overlap = opt.placement, opt.comm_overlap
    out = {"same_model": _attempt(lambda: register_ddp_comm_hook(ddp, opt))}
    out["kept"] = opt.placement is placement and opt.comm_overlap is overlap and overlap is not None
    out["on_ddp_group"] = placement.process_group is ddp.process_group
    other = DistributedDataParallel(make_net(), process_group=dist.new_group([0, 1]))
    out["other_group"] = _attempt(lambda: register_ddp_comm_hook(other, opt))
    for step in range(1, 5):  # the first registration still trains: replicas stay identical
        opt.zero_grad()
        loss_of(ddp, batch(step, rank)).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    out["replicas_equal"] = torch.equal(gathered[0], gathered[1])
    out["onebit_calls"] = placement.wire_meter.totals()["onebit.all_to_all"].calls
    return out


def _accelerator_late_model(rank: int, world: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from qaccel import Accelerator
    from qaccel.comm import WireMeter
    from qaccel.optim import OneBitAdam

    accelerator = Accelerator(cpu=True, wire_meter=WireMeter())
    net = make_net()
    optimizer = accelerator.prepare(OneBitAdam(net.parameters(), lr=1e-3, freeze_step=2))
    out = {"early_step": _attempt(optimizer.step)}
    model = accelerator.prepare(net)
    for step in range(1, 5):
        optimizer.zero_grad()
        accelerator.backward(loss_of(model, batch(step, rank)))
        optimizer.step()
    inner = optimizer.optimizer
    out["meter"] = inner.wire_meter is accelerator.wire_meter
    out["group"] = inner.process_group is model.process_group
    out["onebit_calls"] = accelerator.wire_meter.totals()["onebit.all_to_all"].calls
    return out


def _worker(rank: int, world: int) -> dict:
    return {"ddp": _ddp_twice(rank), "accelerator": _accelerator_late_model(rank, world)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, 2, tmp_path_factory.mktemp("port"), timeout_s=240)


def test_second_registration_on_the_same_model_is_refused_by_ddp(results):
    for out in results:
        ddp = out["ddp"]
        assert "already has a communication hook" in ddp["same_model"]
        assert ddp["kept"] and ddp["on_ddp_group"]


def test_another_group_is_refused_and_the_first_keeps_training(results):
    for out in results:
        ddp = out["ddp"]
        assert "OneBitAdam.attach: already runs on" in ddp["other_group"]
        # steps 1 (init) and 2 (warm-up) send nothing 1-bit; 3 and 4 one call each
        assert ddp["replicas_equal"] and ddp["onebit_calls"] == 2


def test_accelerator_refuses_steps_until_the_model_is_prepared(results):
    for out in results:
        acc = out["accelerator"]
        assert "no DDP model holding these parameters was prepared" in acc["early_step"]
        assert acc["meter"] and acc["group"] and acc["onebit_calls"] == 2
