"""ZeroOneAdam / OneBitAdam in one process (world size 1: the 1-bit all-reduce is the identity).

Oracles: straightforward reference loops of the algorithm written here (``docs/zero_one_adam.md``, "The algorithm", with
C = identity), torch's own clip_grad_norm_, and uninterrupted runs for the checkpoint round trip.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from qaccel.optim import OneBitAdam, StepKind, ZeroOneAdam, ZeroOneAdamConfig
from tests._deepspeed_zoadam_port import batch, loss_of, make_net, param_group_dicts

HYPER = dict(lr=5e-3, var_freeze_step=6, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)


def train(optimizer_cls, steps=24, dtype=torch.float32, net=None, start=1, optimizer=None, **kwargs):
    net = make_net(dtype=dtype) if net is None else net
    if optimizer is None:
        optimizer = optimizer_cls(param_group_dicts(net, 0.01, mask=False), **kwargs)
    kinds = []
    for step in range(start, start + steps):
        kinds.append(optimizer.schedule.next_kind())
        optimizer.zero_grad()
        loss_of(net, batch(step, 0)).backward()
        optimizer.step()
    return net, optimizer, kinds


def reference_zero_one_adam(steps, lr, betas, eps, wd_by_group, F, kappa, alpha, H):
    """0/1 Adam for one worker written from the algorithm table of docs/zero_one_adam.md: C is the identity, so m is always updated."""
    net = make_net()
    groups = [[p for p in g["params"]] for g in param_group_dicts(net, 0.0, mask=False)]
    params = [p for g in groups for p in g]
    wd = {id(p): wd_by_group[i] for i, g in enumerate(groups) for p in g}
    m = {id(p): torch.zeros_like(p) for p in params}
    v = {id(p): torch.zeros_like(p) for p in params}
    u = {id(p): torch.zeros_like(p) for p in params}
    synced = {}
    var_interval, var_counter, local_interval, local_counter, lrs, frozen = 1, 0, 1, 0, 0.0, False
    for t in range(1, steps + 1):
        net.zero_grad()
        loss_of(net, batch(t, 0)).backward()
        if t == 1:
            continue  # initialization step: gradient discarded
        with torch.no_grad():
            if not frozen:
                variance_step = t % var_interval == 0
                for p in params:
                    g = p.grad
                    if variance_step:
                        v[id(p)] = betas[1] * v[id(p)] + (1 - betas[1]) * g * g
                    m[id(p)] = betas[0] * m[id(p)] + (1 - betas[0]) * g
                    p -= lr * (m[id(p)] / (v[id(p)].sqrt() + eps) + wd[id(p)] * p)
                if variance_step:
                    var_counter += 1
                    if var_counter == kappa:
                        var_counter, var_interval = 0, 2 * var_interval
                if t > F:
                    frozen = True
                    synced = {id(p): p.detach().clone() for p in params}
            else:
                lrs += lr
                for p in params:
                    m[id(p)] = betas[0] * m[id(p)] + (1 - betas[0]) * p.grad
                    d = m[id(p)] / (v[id(p)].sqrt() + eps) + wd[id(p)] * p
                    p -= lr * d
                    u[id(p)] -= lr * d
                if t % local_interval == 0:
                    for p in params:
                        # the sync sends u (sqrt(v) + eps); m becomes its negated lr-weighted mean
                        m[id(p)] = -u[id(p)] * (v[id(p)].sqrt() + eps) / lrs
                        p.copy_(synced[id(p)] + u[id(p)])
                        synced[id(p)] = p.detach().clone()
                        u[id(p)].zero_()
                    lrs = 0.0
                local_counter += 1
                if local_counter == alpha:
                    local_counter, local_interval = 0, min(H, 2 * local_interval)
    return net


def reference_onebit_adam(steps, lr, betas, eps, wd_by_group, freeze_step):
    net = make_net()
    groups = [[p for p in g["params"]] for g in param_group_dicts(net, 0.0, mask=False)]
    params = [p for g in groups for p in g]
    wd = {id(p): wd_by_group[i] for i, g in enumerate(groups) for p in g}
    m = {id(p): torch.zeros_like(p) for p in params}
    v = {id(p): torch.zeros_like(p) for p in params}
    for t in range(1, steps + 1):
        net.zero_grad()
        loss_of(net, batch(t, 0)).backward()
        if t == 1:
            continue
        with torch.no_grad():
            for p in params:
                if t <= max(freeze_step, 2):
                    v[id(p)] = betas[1] * v[id(p)] + (1 - betas[1]) * p.grad * p.grad
                m[id(p)] = betas[0] * m[id(p)] + (1 - betas[0]) * p.grad
                p -= lr * (m[id(p)] / (v[id(p)].sqrt() + eps) + wd[id(p)] * p)
    return net


def assert_nets_close(actual, expected, rtol=1e-5):
    for a, e in zip(actual.parameters(), expected.parameters(), strict=True):
        rel = float((a.detach() - e.detach()).abs().max() / e.detach().abs().max())
        assert rel <= rtol, rel


@pytest.mark.parametrize("granularity", ["tensor", "group"])
def test_world1_zero_one_adam_matches_reference_with_identity_compression(granularity):
    net, _, kinds = train(ZeroOneAdam, granularity=granularity, **HYPER)
    assert {StepKind.FULL, StepKind.ONEBIT_GRADIENT, StepKind.LOCAL, StepKind.SYNC} <= set(kinds)
    expected = reference_zero_one_adam(24, 5e-3, (0.9, 0.999), 1e-8, [0.01, 0.0, 0.0], 6, 1, 2, 4)
    # The reference adds u at a sync where qaccel adds u (sqrt(v) + eps) / (sqrt(v) + eps), and the
    # fresh variance (one sample, no bias correction) amplifies such rounding; an algorithmic slip
    # (a missing momentum update, a wrong sync) moves the weights by O(1) relative.
    assert_nets_close(net, expected, rtol=1e-4)


def test_world1_onebit_adam_matches_reference():
    net, _, kinds = train(OneBitAdam, lr=5e-3, freeze_step=5)
    assert kinds.count(StepKind.ONEBIT_MOMENTUM) == 19
    assert_nets_close(net, reference_onebit_adam(24, 5e-3, (0.9, 0.999), 1e-8, [0.01, 0.0, 0.0], 5))


FIELD_CHANGES = {
    "lr": 1e-2, "betas": (0.5, 0.9), "eps": 1e-2, "weight_decay": 0.5, "var_freeze_step": 3,
    "var_update_scaler": 3, "local_step_scaler": 5, "local_step_clipper": 2, "gradient_clipping": 1e-3,
    "variance_bias_correction": True,
}  # fmt: skip
REJECTED_ELSEWHERE = {"bias_correction", "eps_inside_sqrt", "amsgrad", "max_grad_norm", "cuda_aware", "comm_backend_name"}
# act only with N > 1 (tests/dist); overlap_comm changes when the all-reduce runs, never the result
# (tests/dist/test_onebit_overlap.py checks both)
MULTI_RANK_ONLY = {"granularity", "padding", "replica_check_interval", "overlap_comm"}


def run_config(cfg):
    net = make_net()
    return train(ZeroOneAdam, net=net, optimizer=ZeroOneAdam(net.parameters(), cfg))[0]


def test_every_config_field_changes_behaviour_or_is_rejected():
    names = {f.name for f in dataclasses.fields(ZeroOneAdamConfig)}
    assert names == set(FIELD_CHANGES) | REJECTED_ELSEWHERE | MULTI_RANK_ONLY
    base_cfg = ZeroOneAdamConfig(weight_decay=0.01, **HYPER)
    base = [p.detach().clone() for p in run_config(base_cfg).parameters()]
    for field, value in FIELD_CHANGES.items():
        changed = run_config(dataclasses.replace(base_cfg, **{field: value}))
        assert any(not torch.equal(a, b) for a, b in zip(changed.parameters(), base, strict=True)), field
    _, group_opt, _ = train(ZeroOneAdam, steps=2, granularity="group", **HYPER)
    assert [s["exp_avg"].dim() for s in group_opt.state.values()] == [1, 1, 1]  # one flat buffer per group


def test_gradient_clipping_uses_the_global_norm_on_full_steps():
    net, clipped = make_net(), make_net()
    opt = ZeroOneAdam(param_group_dicts(net, 0.0, False), gradient_clipping=0.05, **HYPER)
    ref = ZeroOneAdam(param_group_dicts(clipped, 0.0, False), **HYPER)
    for step in (1, 2):  # init, then a FULL step
        for model, optimizer in ((net, opt), (clipped, ref)):
            optimizer.zero_grad()
            loss_of(model, batch(step, 0)).backward()
        norm = torch.nn.utils.clip_grad_norm_(clipped.parameters(), 0.05)
        opt.step()
        ref.step()
    assert opt.last_grad_norm == pytest.approx(float(norm), rel=1e-6)
    assert norm > 0.05  # the clip was active
    for a, b in zip(net.parameters(), clipped.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_bf16_parameters_keep_fp32_master_weights():
    """bf16 parameters: state and master weights stay fp32, the parameters are the rounded masters, and a
    step applies the update formula to the fp32 master with the bf16 gradient read as fp32."""
    net, opt, kinds = train(ZeroOneAdam, steps=5, dtype=torch.bfloat16, **HYPER)
    assert opt.schedule.next_kind() is StepKind.ONEBIT_GRADIENT
    opt.zero_grad()
    loss_of(net, batch(6, 0)).backward()
    before = {p: {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq", "master_weights")} for p in net.parameters()}
    grads = {p: p.grad.float() for p in net.parameters()}
    wd = {p: g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    opt.step()
    for p in net.parameters():
        state, old = opt.state[p], before[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == state["master_weights"].dtype == torch.float32
        m = 0.9 * old["exp_avg"] + 0.1 * grads[p]  # world size 1: C is the identity
        w = old["master_weights"] - 5e-3 * (m / (old["exp_avg_sq"].sqrt() + 1e-8) + wd[p] * old["master_weights"])
        torch.testing.assert_close(state["exp_avg"], m, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(state["master_weights"], w, rtol=1e-6, atol=1e-8)
        assert torch.equal(p.detach(), state["master_weights"].to(torch.bfloat16))
        assert not torch.equal(state["master_weights"], old["master_weights"])


@pytest.mark.parametrize("cls, kwargs", [(ZeroOneAdam, HYPER), (OneBitAdam, dict(lr=5e-3, freeze_step=5))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_resumes_exactly(cls, kwargs, dtype):
    straight, _, _ = train(cls, steps=20, dtype=dtype, **kwargs)
    net, opt, _ = train(cls, steps=11, dtype=dtype, **kwargs)  # stops between two 0/1 Adam syncs
    saved_model, saved_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    fresh = make_net(seed=1, dtype=dtype)
    fresh.load_state_dict(saved_model)
    fresh_opt = cls(param_group_dicts(fresh, 0.01, mask=False), **kwargs)
    fresh_opt.load_state_dict(saved_opt)
    assert all(s["exp_avg"].dtype == torch.float32 for s in fresh_opt.state.values())
    resumed, _, _ = train(cls, steps=9, net=fresh, start=12, optimizer=fresh_opt)
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_state_dict_rejects_foreign_states():
    net, opt, _ = train(ZeroOneAdam, steps=3, **HYPER)
    with pytest.raises(ValueError, match="saved by ZeroOneAdam"):
        OneBitAdam(param_group_dicts(net, 0.0, False)).load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="granularity='tensor'"):
        ZeroOneAdam(param_group_dicts(net, 0.0, False), granularity="group").load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="not a qaccel optimizer state"):
        ZeroOneAdam(param_group_dicts(net, 0.0, False)).load_state_dict(torch.optim.Adam(net.parameters()).state_dict())


def test_param_group_validation():
    net = make_net()
    with pytest.raises(ValueError, match="exactly one parameter"):
        ZeroOneAdam([{"params": [net.fc1.weight, net.fc1.bias], "exp_avg_mask": torch.ones(120)}])
    with pytest.raises(ValueError, match="exp_avg_mask has 5 elements"):
        ZeroOneAdam([{"params": [net.table], "exp_avg_mask": torch.ones(5)}])
    with pytest.raises(NotImplementedError, match="non_freeze"):
        OneBitAdam([{"params": [net.table], "non_freeze": True}])
    with pytest.raises(ValueError, match=r"param group 1: lr=-1"):
        ZeroOneAdam([{"params": [net.table]}, {"params": [net.fc1.bias], "lr": -1}])


def test_frozen_empty_and_gradless_parameters():
    net = make_net()
    empty = torch.nn.Parameter(torch.zeros(0, 3))
    frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    unused = torch.nn.Parameter(torch.ones(5))
    opt = ZeroOneAdam([{"params": list(net.parameters()) + [empty, frozen, unused]}], **HYPER)
    for step in range(1, 15):
        opt.zero_grad()
        (loss_of(net, batch(step, 0)) + empty.sum()).backward()
        opt.step()
    assert torch.equal(frozen, torch.ones(4)) and frozen not in opt.state
    assert torch.equal(unused, torch.ones(5))  # never had a gradient: skipped, as torch optimizers do
    assert all(torch.isfinite(p).all() for p in net.parameters())


@pytest.mark.parametrize("cls, kwargs", [(ZeroOneAdam, HYPER), (OneBitAdam, dict(lr=5e-3, freeze_step=3))])
@pytest.mark.parametrize("granularity", ["tensor", "group"])
def test_step_never_reads_a_tensor_value_on_the_host(cls, kwargs, granularity):
    """A host read (``.item()``, ``float(t)``, ``bool(t)``) stalls a CUDA stream every step. Meta tensors have
    no values, so any such read raises here; every step kind runs, with clipping on."""
    params = [torch.nn.Parameter(torch.empty(5, 3, device="meta")), torch.nn.Parameter(torch.empty(7, device="meta"))]
    opt = cls(params, gradient_clipping=1.0, granularity=granularity, **kwargs)
    kinds = set()
    for _ in range(12):
        kinds.add(opt.schedule.next_kind())
        for p in params:
            p.grad = torch.empty_like(p)
        opt.step()
    expected = {StepKind.INIT, StepKind.FULL}
    expected |= {StepKind.ONEBIT_GRADIENT, StepKind.LOCAL, StepKind.SYNC} if cls is ZeroOneAdam else {StepKind.ONEBIT_MOMENTUM}
    assert kinds == expected
    assert opt.state[params[0]]["exp_avg"].device.type == "meta"
