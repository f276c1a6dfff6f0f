"""The port of the 1-bit optimizers in one process: the placement is given once, the transport protocol is
implemented, and nothing outside the optimizer can change where it runs or its config in place."""

import dataclasses
import inspect

import pytest
import torch
from accelerate.state import AcceleratorState

from qaccel import Accelerator
from qaccel.comm import WireMeter, default_meter
from qaccel.optim import OneBitAdam, OneBitPlacement, OneBitPort, StepKind, ZeroOneAdam


def _optimizer(cls=OneBitAdam, **kwargs):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    return net, cls(net.parameters(), lr=1e-2, **kwargs)


def test_placement_is_frozen_and_checked():
    placement = OneBitPlacement()
    assert placement.wire_meter is default_meter and placement.kind_prefix == "onebit"
    with pytest.raises(dataclasses.FrozenInstanceError):
        placement.wire_meter = WireMeter()
    with pytest.raises(TypeError, match="wire_meter"):
        OneBitPlacement(wire_meter="meter")
    with pytest.raises(TypeError, match="overlap_comm"):
        OneBitPlacement(overlap_comm=1)


def test_attach_once_same_is_a_no_op_another_refused():
    _, opt = _optimizer()
    meter = WireMeter()
    assert not opt.comm_hook_installed and opt.wire_meter is default_meter  # the constructor's until attached
    first = OneBitPlacement(wire_meter=meter)
    opt.attach(first)
    assert opt.comm_hook_installed and opt.placement is first and opt.wire_meter is meter
    opt.attach(OneBitPlacement(wire_meter=meter))  # equal groups and the same meter: nothing changes
    assert opt.placement is first
    with pytest.raises(RuntimeError, match=r"OneBitAdam.attach: already runs on"):
        opt.attach(OneBitPlacement(wire_meter=WireMeter()))  # equal counts, but another meter
    assert opt.placement is first
    with pytest.raises(TypeError, match="OneBitPlacement"):
        opt.attach({"wire_meter": meter})


def test_where_it_runs_is_read_only():
    _, opt = _optimizer()
    for name in ("wire_meter", "process_group", "shard_group", "placement"):
        with pytest.raises(AttributeError):
            setattr(opt, name, None)
    for gone in ("set_process_group", "set_shard_group", "require_comm_hook", "disable_comm_overlap"):
        assert not hasattr(opt, gone), gone


def test_optimizer_implements_the_port():
    _, opt = _optimizer(ZeroOneAdam)
    members = [name for name in vars(OneBitPort) if not name.startswith("_")]
    members += list(OneBitPort.__annotations__)
    assert {"attach", "units", "unit_payload", "onebit_buffers", "overlap_blocker", "comm_plan"} <= set(members)
    for name in members:
        assert hasattr(opt, name), name
    for name in ("attach", "units", "unit_payload", "onebit_buffers", "overlap_blocker", "world_size"):
        ours = inspect.signature(getattr(type(opt), name)).parameters
        theirs = inspect.signature(getattr(OneBitPort, name)).parameters
        assert list(ours) == list(theirs), name


def test_unit_payload_is_the_momentum_update():
    # oracle: 1-bit Adam's payload m = b1 m + (1 - b1) g from fresh (zero) state, written out here
    net, opt = _optimizer(OneBitAdam, betas=(0.8, 0.999))
    unit = opt.units()[0]
    grad = torch.randn(unit.shape)
    payload = opt.unit_payload(StepKind.ONEBIT_MOMENTUM, unit, grad)
    torch.testing.assert_close(payload, 0.2 * grad, rtol=0, atol=0)
    assert payload is opt.state[unit.anchor]["exp_avg"]  # the state moved, as in the step
    assert [u.anchor for u in opt.units()] == list(net.parameters())


def test_onebit_buffers_pad_to_the_layout():
    _, opt = _optimizer(OneBitAdam, padding="minimal")
    units = opt.units()
    layouts, worker, server = opt.onebit_buffers(units)
    # one rank: minimal padding is a multiple of 8 * world_size = 8 elements
    assert [layout.padded_numel for layout in layouts] == [16, 8]  # weight 12 -> 16, bias 3 -> 8
    assert [w.numel() for w in worker] == [16, 8] and all(not s.any() for s in server)
    again = opt.onebit_buffers(units)
    assert all(a is b for a, b in zip(again[1], worker, strict=True))  # created once, then reused


def test_overlap_blocker_names_the_reason():
    _, opt = _optimizer()
    assert "one rank" in opt.overlap_blocker()


def test_set_gradient_clipping_replaces_the_config():
    _, opt = _optimizer(ZeroOneAdam)
    before = opt.config
    opt.set_gradient_clipping(2.5)
    assert opt.config is not before and before.gradient_clipping == 0.0 and opt.config.gradient_clipping == 2.5
    assert dataclasses.replace(before, gradient_clipping=2.5) == opt.config
    with pytest.raises(ValueError, match="gradient_clipping"):
        opt.set_gradient_clipping(-1.0)
    assert opt.config.gradient_clipping == 2.5


def test_accelerator_owns_one_wiring_object():
    accelerator = Accelerator(cpu=True)
    try:
        wiring = accelerator.onebit_wiring
        net, opt = _optimizer(ZeroOneAdam)
        accelerator.prepare(net, opt)
        accelerator.prepare(net)  # a second prepare call keeps the same object
        assert accelerator.onebit_wiring is wiring and wiring.optimizers() == [opt]
        assert not [name for name in vars(accelerator) if name.startswith("_qaccel")]
        assert not opt.comm_hook_installed  # one process: no DDP model, nothing attaches it
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
