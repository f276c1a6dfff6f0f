"""The training guards on 2 real gloo ranks: non-finite values and replica checks under DDP, QSDP and 0/1 Adam.

Faults are put in by hand on one rank only, where the real failure would appear: a NaN in rank 1's
gradient after the all-reduce (or in its own shard / local step, where nothing spreads it), a
weight changed on rank 1 only, a rank-dependent error in the gathered weights of one FSDP unit.
The references are independent: the poisoned parameter's name, parameters compared across ranks
with a plain all-gather, a stock ``torch.amp.GradScaler`` run without the guard.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks

GPT2_TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def _launch_env(rank, world_size):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _raised(fn, *args):
    """The message of the guard error ``fn(*args)`` raised, or None."""
    from qaccel.training import NonFiniteError, ReplicaMismatchError

    try:
        fn(*args)
    except (NonFiniteError, ReplicaMismatchError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _ddp_worker(rank, world_size):
    _launch_env(rank, world_size)
    from qaccel import Accelerator
    from qaccel.training import NonFiniteGuard, ReplicaGuard

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard, replicas = NonFiniteGuard(model), ReplicaGuard(model, optimizer, 1)
    out = {}

    def backward(step):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()

    backward(1)
    out["finite"] = guard.check(1)
    optimizer.step()
    optimizer.zero_grad()
    out["replicas_ok"] = _raised(replicas.after_step, 1)
    # A weight changed on rank 1 only (what a lost update or a bad restore leaves behind).
    weight = model.module[2].weight
    if rank == 1:
        with torch.no_grad():
            weight[0, 0] += 1e-3
    out["replicas_differ"] = _raised(replicas.after_step, 2)
    out["equal_by_hand"] = _same_on_all_ranks(weight.detach())
    # A NaN in rank 1's gradient after DDP's all-reduce: only rank 1 holds it.
    backward(3)
    if rank == 1:
        model.module[0].bias.grad[3] = float("nan")
    out["nonfinite"] = _raised(guard.check, 3)
    optimizer.zero_grad()
    return out


def _scaler_worker(rank, world_size, use_guard):
    _launch_env(rank, world_size)
    from qaccel import Accelerator
    from qaccel.training import NonFiniteGuard

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    guard = NonFiniteGuard(model, scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    scaler.scale(model(x).square().mean()).backward()
    if rank == 1:
        model.module[2].weight.grad[1, 2] = float("inf")  # an overflow on rank 1 only, after the all-reduce
    skipped = guard.check(1) if use_guard else None
    scaler.step(optimizer)
    scaler.update()
    return {
        "skipped": skipped,
        "unchanged": all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True)),
        "scale": scaler.get_scale(),
        "replicas_equal": _same_on_all_ranks(torch.cat([p.detach().reshape(-1) for p in model.parameters()])),
    }


def _qsdp_worker(rank, world_size):
    _launch_env(rank, world_size)
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel import Accelerator, QSDPPlugin
    from qaccel.training import NonFiniteGuard, ReplicaGuard

    plugin = QSDPPlugin(weight_bits=8, grad_bits=8, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"])
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT2_TINY))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    corrupt = {"on": False}
    block = model.transformer.h[1]

    def corrupt_rank1(module, args):  # runs after FSDP2's unshard: a rank-dependent decode error
        if corrupt["on"] and rank == 1:
            with torch.no_grad():
                module.mlp.c_fc.weight[0, 0] += 1e-2

    block.register_forward_pre_hook(corrupt_rank1)
    guard, replicas = NonFiniteGuard(model), ReplicaGuard(model, optimizer, 2)
    out = {"units": [name for name, _ in replicas.units], "raised": {}}
    for step in range(1, 5):
        corrupt["on"] = step == 4
        tokens = torch.randint(0, GPT2_TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
        if step == 3 and rank == 1:  # rank 1's own gradient shard: the reduce-scatter gave it to rank 1 alone
            model.transformer.h[0].attn.c_attn.weight.grad.to_local()[0, 0] = float("nan")
        out["raised"][f"nonfinite {step}"] = _raised(guard.check, step)
        if step != 3:
            optimizer.step()
        optimizer.zero_grad()
        out["raised"][f"replicas {step}"] = _raised(replicas.after_step, step)
    return out


def _zoadam_worker(rank, world_size):
    _launch_env(rank, world_size)
    from qaccel import Accelerator
    from qaccel.optim import ZeroOneAdam
    from qaccel.training import NonFiniteGuard, ReplicaGuard

    accelerator = Accelerator(cpu=True)
    net = _net()
    optimizer = ZeroOneAdam(net.parameters(), lr=5e-3, var_freeze_step=3, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)
    model, optimizer = accelerator.prepare(net, optimizer)
    schedule = optimizer.optimizer.schedule
    guard, replicas = NonFiniteGuard(model), ReplicaGuard(model, optimizer, 1)
    rows = []
    for step in range(1, 15):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        accelerator.backward(model(x).square().mean())
        if step == 14 and rank == 1:  # a local step: nothing would carry the NaN to rank 0 before the next sync
            net[0].weight.grad[2, 5] = float("nan")
        nonfinite = _raised(guard.check, step)
        if step == 14:
            rows.append({"step": step, "kind": schedule.next_kind().value, "nonfinite": nonfinite})
            break
        optimizer.step()
        optimizer.zero_grad()
        if step == 12 and rank == 1:  # a sync step (var_freeze_step 3, intervals 1, 1, 2, 2, 4): must agree
            with torch.no_grad():
                net[2].bias[0] += 1e-3
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        rows.append(
            {
                "step": step,
                "synced": schedule.steps_since_sync == 0,
                "equal": _same_on_all_ranks(flat),
                "replicas": _raised(replicas.after_step, step),
                "nonfinite": nonfinite,
            }
        )
    return rows


def test_ddp_guards_name_the_rank_the_step_and_the_parameter(tmp_path):
    for rank, out in enumerate(run_ranks(_ddp_worker, 2, tmp_path)):
        assert out["finite"] is False and out["replicas_ok"] is None
        assert out["equal_by_hand"] is False  # the reference: the replicas really differ
        assert out["replicas_differ"].startswith("ReplicaMismatchError: step 2: ranks [1] of 2 differ from rank 0")
        assert "'module.2.weight'" in out["replicas_differ"]
        assert out["nonfinite"].startswith("NonFiniteError: step 3: non-finite gradient on rank(s) [1] of 2, first 'module.0.bias'"), (rank, out)
        assert "--allow_nonfinite" in out["nonfinite"]


@pytest.mark.parametrize("use_guard", [True, False])
def test_with_a_loss_scaler_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path, use_guard):
    results = run_ranks(_scaler_worker, 2, tmp_path, use_guard)
    if use_guard:
        assert [r["skipped"] for r in results] == [True, True]
        assert all(r["unchanged"] for r in results)
        assert [r["scale"] for r in results] == [512.0, 512.0]  # both scalers backed off together
        assert all(r["replicas_equal"] for r in results)
    else:  # control, stock GradScaler: rank 0 steps, rank 1 skips, and the replicas split
        assert [r["unchanged"] for r in results] == [False, True]
        assert [r["scale"] for r in results] == [1024.0, 512.0]
        assert not any(r["replicas_equal"] for r in results)


@pytest.mark.slow
def test_qsdp_guards_catch_a_nan_in_one_shard_and_a_rank_dependent_gathered_unit(tmp_path):
    for out in run_ranks(_qsdp_worker, 2, tmp_path):
        raised = out["raised"]
        assert "transformer.h.1" in out["units"]
        assert raised["nonfinite 1"] is None and raised["nonfinite 2"] is None and raised["nonfinite 4"] is None
        assert raised["nonfinite 3"].startswith(
            "NonFiniteError: step 3: non-finite gradient on rank(s) [1] of 2, first 'transformer.h.0.attn.c_attn.weight'"
        ), raised["nonfinite 3"]
        assert raised["replicas 1"] is None and raised["replicas 2"] is None and raised["replicas 3"] is None
        assert raised["replicas 4"].startswith("ReplicaMismatchError: step 4: ranks [1] of 2 differ from rank 0 in the gathered weights of FSDP unit 'transformer.h.1'"), raised["replicas 4"]


def test_zero_one_adam_replicas_are_checked_only_where_they_must_agree(tmp_path):
    for rows in run_ranks(_zoadam_worker, 2, tmp_path):
        by_step = {row["step"]: row for row in rows}
        checked = [row for row in rows if "synced" in row and row["step"] < 12]
        # The reference (a plain all-gather) agrees with the schedule: equal at synced points, and
        # the local steps really do differ, so checking them would be a false alarm.
        assert all(row["equal"] for row in checked if row["synced"])
        assert any(not row["equal"] for row in checked if not row["synced"])
        assert all(row["replicas"] is None for row in checked)
        step12 = by_step[12]
        assert step12["synced"] and not step12["equal"]
        assert step12["replicas"].startswith("ReplicaMismatchError: step 12: ranks [1] of 2 differ from rank 0 in the parameter 'module.2.bias'"), step12
        assert by_step[14]["kind"] == "local"
        assert all(row["nonfinite"] is None for row in rows if row["step"] < 14)
        assert by_step[14]["nonfinite"].startswith("NonFiniteError: step 14: non-finite gradient on rank(s) [1] of 2, first 'module.0.weight'")
