"""0/1 Adam on real gloo processes (DDP + the qaccel comm hook) against an independent DeepSpeed port.

One spawned run per world size trains the tiny model three ways (granularity "tensor" with the mask,
granularity "group" with the mask, "tensor" without the mask) for 50 steps crossing both phases, and
records after every step: the parameters, whether parameters and variance are bit-identical on all ranks,
and the collectives issued (counted by wrapping ``torch.distributed``) next to the wire meter's records.

Parity tolerance: DeepSpeed's ``ZeroOneAdam`` (``tests/_deepspeed_zoadam_port.py``, N simulated ranks) and
qaccel use the same float32 operations in the same order; the port is fed the real all-reduced gradient
on variance steps (a 4-rank gloo all-reduce may sum in another order than a simulation, which is not the
optimizer's concern). Phase 1 therefore matches bit for bit. In phase 2 qaccel restarts each sync from
stored synced weights where DeepSpeed subtracts the accumulated update (a few ulps apart, and only equal
across DeepSpeed's ranks to those ulps), and the difference propagates through later gradients. Every
tensor must agree to 1e-6 of its largest magnitude at every step (bitwise in phase 1); a wrong sign,
scale, schedule or error buffer moves it by about lr = 2e-3, i.e. > 1e-3 relative. Against the port with
that one deviation switched on, every step must match bit for bit.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from qaccel.comm import WireMeter, onebit_layout, onebit_wire_bytes, ring_all_reduce_bytes
from qaccel.optim import StepKind, ZeroOneAdam, register_ddp_comm_hook
from tests._deepspeed_zoadam_port import USED_ROWS, batch, loss_of, make_net, param_group_dicts, run_port
from tests._dist import CollectiveRecorder, run_ranks

STEPS = 50
HYPER = {
    2: dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, var_freeze_step=12,
            var_update_scaler=2, local_step_scaler=2, local_step_clipper=4),
    4: dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, var_freeze_step=10,
            var_update_scaler=1, local_step_scaler=1, local_step_clipper=2),
}  # fmt: skip
RUNS = {
    "tensor": dict(granularity="tensor", mask=True),
    "group": dict(granularity="group", mask=True),
    "tensor_nomask": dict(granularity="tensor", mask=False),
}


def _train(rank, world, spec, hyper):
    net = make_net()
    ddp = DistributedDataParallel(net)
    meter = WireMeter()
    optimizer = ZeroOneAdam(
        param_group_dicts(net, hyper["weight_decay"], spec["mask"]),
        granularity=spec["granularity"],
        wire_meter=meter,
        **{k: v for k, v in hyper.items() if k != "weight_decay"},
    )
    register_ddp_comm_hook(ddp, optimizer)
    record = {"params": [], "kinds": [], "params_equal": [], "var_equal": [], "calls": [], "counted": [], "metered": [],
              "allreduced": []}  # fmt: skip
    for step in range(1, STEPS + 1):
        kind = optimizer.schedule.next_kind()
        counter = CollectiveRecorder()
        with counter.recording():
            optimizer.zero_grad(set_to_none=True)
            loss_of(ddp, batch(step, rank)).backward()
            grads = [p.grad.detach().clone() for p in net.parameters()] if kind is StepKind.FULL else None
            optimizer.step()
        tallies = meter.end_step()
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        var = torch.cat([optimizer.state[p]["exp_avg_sq"].reshape(-1) for p in optimizer.state])
        record["kinds"].append(kind.value)
        record["allreduced"].append(grads)
        record["params"].append([p.detach().clone() for p in net.parameters()])
        record["params_equal"].append(_same_on_all_ranks(flat, world))
        record["var_equal"].append(_same_on_all_ranks(var, world))
        record["calls"].append(dict(counter.op_counts()))
        record["counted"].append(counter.sent_bytes())
        record["metered"].append(sum(t.sent_bytes for t in tallies.values()))
    table_state = optimizer.state[net.table]
    record["table_exp_avg"] = table_state["exp_avg"].clone()
    return record


def _same_on_all_ranks(t: torch.Tensor, world: int) -> bool:
    gathered = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(gathered, t)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _parity_worker(rank, world):
    records = {name: _train(rank, world, spec, HYPER[world]) for name, spec in RUNS.items()}
    buffer = io.BytesIO()  # tensors by value: shared-memory handles die with the worker process
    torch.save(records, buffer)
    return buffer.getvalue()


def _max_rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def parity_run(request, tmp_path_factory):
    world = request.param
    payloads = run_ranks(_parity_worker, world, tmp_path_factory.mktemp(f"zoadam{world}"), timeout_s=300)
    return world, [torch.load(io.BytesIO(payload)) for payload in payloads]


def _expected_kinds(hyper: dict) -> list[str]:
    """Closed forms of docs/zero_one_adam.md ("Schedules"), written independently of qaccel's schedule."""
    F, kappa, alpha, H = (hyper[k] for k in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"))
    variance_steps, t, j = set(), 2, 0
    while t <= F + 1:
        variance_steps.add(t)
        j += 1
        interval = 2 ** (j // kappa)
        t = interval * (t // interval + 1)
    kinds = ["init"]
    for t in range(2, STEPS + 1):
        if t <= max(F + 1, 2):
            kinds.append("full" if t in variance_steps else "onebit_gradient")
        else:
            k = t - F - 1
            h = min(H, 2 ** ((k - 1) // alpha))
            kinds.append("sync" if t % h == 0 else "local")
    return kinds


@pytest.mark.parametrize("run", ["tensor", "group"])
def test_parameters_match_deepspeed_every_step(parity_run, run):
    world, results = parity_run
    hyper = HYPER[world]
    allreduced = results[0][run]["allreduced"]
    verbatim = run_port(world, STEPS, hyper, flat=run == "group", mask=True, allreduced_grads=allreduced)
    kinds = results[0][run]["kinds"]
    assert kinds == _expected_kinds(hyper)
    first_local_step = min(i for i, kind in enumerate(kinds) if kind in ("local", "sync"))
    for step in range(STEPS):
        for rank in range(world):
            for index, (actual, want) in enumerate(zip(results[rank][run]["params"][step], verbatim[step][rank], strict=True)):
                where = f"{run}: step {step + 1} ({kinds[step]}) rank {rank} param {index}"
                if step < first_local_step:
                    assert torch.equal(actual, want), f"{where}: phase 1 must match bit for bit"
                else:
                    rel = _max_rel(actual, want)
                    assert rel <= 1e-6, f"{where}: relative error {rel:.2e}"


@pytest.mark.parametrize("run", ["tensor", "group"])
def test_only_the_documented_sync_restart_differs_from_deepspeed(parity_run, run):
    """With the port switched to qaccel's one deliberate deviation (restart a sync from the stored synced
    weights instead of ``p - u``), qaccel matches DeepSpeed bit for bit at every step of both phases."""
    world, results = parity_run
    expected = run_port(
        world, STEPS, HYPER[world], flat=run == "group", mask=True,
        allreduced_grads=results[0][run]["allreduced"], restart_from_synced=True,
    )  # fmt: skip
    for step in range(STEPS):
        for rank in range(world):
            for index, (actual, want) in enumerate(zip(results[rank][run]["params"][step], expected[step][rank], strict=True)):
                assert torch.equal(actual, want), f"{run}: step {step + 1} rank {rank} param {index}"
    assert not torch.equal(results[0]["tensor"]["params"][-1][1], results[0]["group"]["params"][-1][1])  # granularity matters


def test_replicas_identical_after_phase1_and_sync_steps(parity_run):
    world, results = parity_run
    for run in RUNS:
        record = results[0][run]
        assert all(record["var_equal"]), f"{run}: variance differs between ranks"
        for step, (kind, equal) in enumerate(zip(record["kinds"], record["params_equal"], strict=True), start=1):
            if kind == "local":
                # replicas drift between syncs: every rank trains on its own data
                assert not equal, f"{run}: step {step} is a local step but all replicas are equal"
            else:
                assert equal, f"{run}: step {step} ({kind}) left replicas that differ"


def test_each_step_issues_exactly_its_collectives(parity_run):
    world, results = parity_run
    net = make_net()
    numel = sum(p.numel() for p in net.parameters())
    full_bytes = ring_all_reduce_bytes(4 * numel, world)  # one DDP bucket holds the whole tiny model
    tensor_bytes = onebit_wire_bytes([onebit_layout(p.numel(), world) for p in net.parameters()]).sent_bytes
    for rank in range(world):
        record = results[rank]["tensor"]
        for step, kind in enumerate(record["kinds"]):
            calls, counted, metered = record["calls"][step], record["counted"][step], record["metered"][step]
            assert counted == metered, f"rank {rank} step {step + 1}: meter {metered} B, wire {counted} B"
            if kind in ("init", "local"):
                assert calls == {} and metered == 0
            elif kind == "full":
                assert calls == {"all_reduce": 1} and metered == full_bytes
            else:  # onebit_gradient, sync: one all-to-all and one all-gather for all five tensors
                assert calls == {"all_to_all_single": 1, "all_gather": 1} and metered == tensor_bytes, (step, calls)


def test_mask_keeps_unused_rows_exactly(parity_run):
    """Masked rows never get a gradient: with the mask their momentum stays 0 and weights stay put;
    without it 1-bit noise moves them (so this test can fail, unlike DeepSpeed's)."""
    world, results = parity_run
    initial = make_net().table.detach()
    for rank in range(world):
        masked, unmasked = results[rank]["tensor"], results[rank]["tensor_nomask"]
        table_index = 0  # TinyNet registers the table first
        assert torch.equal(masked["params"][-1][table_index][USED_ROWS:], initial[USED_ROWS:])
        assert torch.count_nonzero(masked["table_exp_avg"][USED_ROWS:]) == 0
        assert not torch.equal(unmasked["params"][-1][table_index][USED_ROWS:], initial[USED_ROWS:])
        assert torch.count_nonzero(unmasked["table_exp_avg"][USED_ROWS:]) > 0
        assert StepKind.SYNC.value in masked["kinds"]
