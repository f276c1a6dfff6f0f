"""The DDP hook and rank-consistency features on 3 real gloo processes (a world size that is not a power
of two, where DeepSpeed's padding multiple N * lcm(N, 8) = 72 differs from the minimal 8N = 24):

- fp16 overflow agreement: one rank's inf on a local-gradient step makes every rank's GradScaler skip;
- gradient clipping: the norm is the same on every rank on steps that compress the gradient, equal to
  sqrt(mean_r ||g_r||^2) computed here from each rank's own gradient;
- bf16 parameters: replicas bit-identical after every non-local step;
- ``padding`` changes the error-buffer layout and the result;
- ``replica_check_interval`` catches one rank drifting by one ulp, on every rank;
- no host read of a tensor value (``.item()``, ``float(t)``, ``bool(t)``: a stream stall on CUDA) in the
  hook or the step, with clipping and the overflow agreement on.
"""

from __future__ import annotations

import contextlib
import io
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from qaccel.comm import WireMeter
from qaccel.optim import OneBitAdam, StepKind, ZeroOneAdam, register_ddp_comm_hook
from tests._deepspeed_zoadam_port import batch, loss_of, make_net, param_group_dicts
from tests._dist import run_ranks

WORLD = 3
HYPER = dict(lr=2e-3, var_freeze_step=5, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _make(rank, dtype=torch.float32, **kwargs):
    net = make_net(dtype=dtype)
    ddp = DistributedDataParallel(net)
    meter = WireMeter()
    opt = ZeroOneAdam(param_group_dicts(net, 0.01, mask=True), wire_meter=meter, **{**HYPER, **kwargs})
    return net, ddp, opt, meter


def _overflow(rank):
    net = make_net()
    ddp = DistributedDataParallel(net)
    meter = WireMeter()
    opt = OneBitAdam(param_group_dicts(net, 0.0, mask=False), lr=2e-3, freeze_step=2, wire_meter=meter)
    register_ddp_comm_hook(ddp, opt, agree_on_overflow=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    out = {"kinds": [], "params_changed": [], "steps": []}
    for step in range(1, 6):
        kind = opt.schedule.next_kind()
        before = [p.detach().clone() for p in net.parameters()]
        opt.zero_grad()
        loss = loss_of(ddp, batch(step, rank))
        if step == 4 and rank == 1:  # a local-gradient step (1-bit Adam after the freeze): rank 1 overflows
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out["kinds"].append(kind.value)
        out["params_changed"].append(any(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True)))
        out["steps"].append(opt.schedule.step)
    out["flag_calls"] = meter.totals()["ddp.overflow_flag_all_reduce"].calls
    return out


def _clipping(rank):
    net, ddp, opt, _ = _make(rank, gradient_clipping=1e-3)
    register_ddp_comm_hook(ddp, opt)
    out = {"kinds": [], "norms": [], "expected": []}
    for step in range(1, 12):
        kind = opt.schedule.next_kind()
        opt.zero_grad()
        loss_of(ddp, batch(step, rank)).backward()
        own = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in net.parameters()]))
        opt.step()
        out["kinds"].append(kind.value)
        out["norms"].append([float(n) for n in _gather(torch.tensor([opt.last_grad_norm or 0.0], dtype=torch.float64))])
        mean_square = sum(float(n) ** 2 for n in _gather(own.reshape(1))) / WORLD
        out["expected"].append({"own": float(own), "rms": mean_square**0.5})
    return out


def _bf16_and_padding(rank):
    out = {}
    net, ddp, opt, _ = _make(rank, dtype=torch.bfloat16)
    register_ddp_comm_hook(ddp, opt)
    kinds, equal = [], []
    for step in range(1, 14):
        kinds.append(opt.schedule.next_kind().value)
        opt.zero_grad()
        loss_of(ddp, batch(step, rank)).backward()
        opt.step()
        flat = torch.cat([p.detach().float().reshape(-1) for p in net.parameters()])
        equal.append(all(torch.equal(g, flat) for g in _gather(flat)))
    out["bf16"] = {"kinds": kinds, "equal": equal, "dtype": str(opt.state[net.table]["exp_avg"].dtype)}
    for padding in ("deepspeed", "minimal"):
        net, ddp, opt, _ = _make(rank, padding=padding)
        register_ddp_comm_hook(ddp, opt)
        for step in range(1, 5):
            opt.zero_grad()
            loss_of(ddp, batch(step, rank)).backward()
            opt.step()
        out[padding] = {
            "table": net.table.detach().clone(),
            "worker_error_numel": opt.state[net.table]["worker_error"].numel(),
        }
    return out


def _replica_check(rank):
    net, ddp, opt, meter = _make(rank, replica_check_interval=2)
    register_ddp_comm_hook(ddp, opt)
    out = {"error": None}
    for step in range(1, 11):
        if step == 8 and rank == 1:  # one ulp of drift in one rank's variance
            v = opt.state[net.fc1.weight]["exp_avg_sq"]
            v[0, 0] = torch.nextafter(v[0, 0], torch.tensor(1.0))
        opt.zero_grad()
        loss_of(ddp, batch(step, rank)).backward()
        try:
            opt.step()
        except RuntimeError as err:
            out["error"], out["step"] = str(err), step
            break
    out["checks"] = meter.totals()["onebit.replica_check"].calls
    return out


@contextlib.contextmanager
def _host_reads_raise():
    """Make every Python-level read of a tensor value raise (the C++ reducer and gloo are unaffected)."""

    def host_read(*args, **kwargs):
        raise RuntimeError("host read of a tensor value")

    names = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(torch.Tensor, name, host_read))
        yield


def _no_host_sync(rank):
    net, ddp, opt, _ = _make(rank, gradient_clipping=1e-3)
    register_ddp_comm_hook(ddp, opt, agree_on_overflow=True)
    out = {"kinds": [], "error": None}
    for step in range(1, 12):
        out["kinds"].append(opt.schedule.next_kind().value)
        opt.zero_grad()
        loss = loss_of(ddp, batch(step, rank))
        try:
            with _host_reads_raise():
                loss.backward()
                opt.step()
        except RuntimeError as err:
            out["error"] = f"step {step}: {err}"
            break
    return out


def _worker(rank, world):
    result = {"overflow": _overflow(rank), "clipping": _clipping(rank), "bf16_padding": _bf16_and_padding(rank),
              "replica_check": _replica_check(rank), "no_host_sync": _no_host_sync(rank)}  # fmt: skip
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    return [torch.load(io.BytesIO(p)) for p in run_ranks(_worker, WORLD, tmp_path_factory.mktemp("w3"), timeout_s=300)]


def test_one_ranks_overflow_makes_every_rank_skip(world3):
    for rank, result in enumerate(world3):
        out = result["overflow"]
        assert out["kinds"] == ["init", "full", "onebit_momentum", "onebit_momentum", "onebit_momentum"]
        assert out["params_changed"] == [False, True, True, False, True], rank  # step 4 skipped everywhere
        assert out["steps"] == [1, 2, 3, 3, 4], rank  # the schedule did not advance on the skipped step
        assert out["flag_calls"] == 4  # init + three local-gradient backwards; none on the FULL step


def test_clipping_norm_is_rank_consistent_where_gradients_are_compressed(world3):
    kinds = world3[0]["clipping"]["kinds"]
    assert {"full", "onebit_gradient", "local"} <= set(kinds)
    for step, kind in enumerate(kinds):
        norms = world3[0]["clipping"]["norms"][step]
        if kind == "init":
            continue
        if kind in ("full", "onebit_gradient"):
            assert norms == [norms[0]] * WORLD, (step, kind, norms)
        for rank in range(WORLD):
            expected = world3[rank]["clipping"]["expected"][step]
            want = expected["rms"] if kind == "onebit_gradient" else expected["own"]
            assert norms[rank] == pytest.approx(want, rel=1e-5), (step, kind, rank)
        if kind == "local":
            assert len(set(norms)) == WORLD  # phase 2: each rank clips its own gradient


def test_bf16_replicas_identical_except_between_syncs(world3):
    out = world3[0]["bf16_padding"]["bf16"]
    assert out["dtype"] == "torch.float32"
    assert StepKind.SYNC.value in out["kinds"] and StepKind.LOCAL.value in out["kinds"]
    assert out["equal"] == [kind != "local" for kind in out["kinds"]]


def test_padding_changes_layout_and_result_at_world_3(world3):
    result = world3[0]["bf16_padding"]
    assert result["deepspeed"]["worker_error_numel"] == 72  # 40 elements padded to N * lcm(N, 8) = 72
    assert result["minimal"]["worker_error_numel"] == 48  # ... or to 8N = 24
    assert not torch.equal(result["deepspeed"]["table"], result["minimal"]["table"])


def test_replica_check_catches_one_ulp_of_drift_on_every_rank(world3):
    for rank, result in enumerate(world3):
        out = result["replica_check"]
        assert out["step"] == 8 and out["checks"] == 4, (rank, out)  # steps 2, 4, 6 passed; step 8 caught it
        assert "ranks [1] of 3" in out["error"] and "at step 8" in out["error"]


def test_hook_and_step_never_read_a_tensor_value_on_the_host(world3):
    for rank, result in enumerate(world3):
        out = result["no_host_sync"]
        assert out["error"] is None, (rank, out["error"])
        assert set(out["kinds"]) == {"init", "full", "onebit_gradient", "local", "sync"}, out["kinds"]
