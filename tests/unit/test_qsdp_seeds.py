"""Seed schedule and QSDP checkpoint state: which codec calls share noise, and what a resume restores.

The distributed consequences (micro-batch rounding errors uncorrelated, resumed runs bit-identical)
are checked on real processes in ``tests/dist/test_qsdp_comms.py`` and ``test_qsdp_accelerate.py``.
"""

import json

import pytest

from qaccel.fsdp import QSDPConfig, QSDPHandle, SeedSchedule


def grad_seeds_of_one_call(seeds, unit, owner, world):
    call = seeds.next_grad_call(unit)
    return [seeds.grad_seed(unit, owner, dest, call) for dest in range(world)]


def test_weight_seed_is_fixed_within_a_step_and_fresh_across_steps_units_owners():
    seeds = SeedSchedule(7)
    first = seeds.weight_seed(unit=1, owner=0)
    grad_seeds_of_one_call(seeds, 1, 0, 2)  # a reduce-scatter in between changes nothing for weights
    assert seeds.weight_seed(1, 0) == first  # forward and backward re-gathers decode the same weights
    others = {seeds.weight_seed(1, 1), seeds.weight_seed(2, 0), SeedSchedule(8).weight_seed(1, 0)}
    seeds.advance()
    others.add(seeds.weight_seed(1, 0))
    assert first not in others and len(others) == 4


def test_every_reduce_scatter_call_of_a_step_draws_fresh_gradient_seeds():
    seeds = SeedSchedule(0)
    calls = [grad_seeds_of_one_call(seeds, unit=0, owner=1, world=4) for _ in range(3)]
    flat = [s for call in calls for s in call]
    assert len(set(flat)) == len(flat) == 12  # per call and per destination
    assert [seeds.grad_calls(0), seeds.grad_calls(1)] == [3, 0]  # counted per unit
    seeds.advance()
    assert seeds.grad_calls(0) == 0
    after_step = grad_seeds_of_one_call(seeds, 0, 1, 4)
    assert not set(after_step) & set(flat)


def test_state_round_trips_through_json_and_resumes_mid_accumulation():
    uninterrupted = SeedSchedule(3)
    uninterrupted.advance()
    grad_seeds_of_one_call(uninterrupted, 0, 0, 2)
    state = json.loads(json.dumps(uninterrupted.state_dict()))  # Trainer checkpoints use JSON
    resumed = SeedSchedule(3)
    resumed.load_state_dict(state)
    assert (resumed.step, resumed.grad_calls(0)) == (1, 1)
    assert grad_seeds_of_one_call(resumed, 0, 0, 2) == grad_seeds_of_one_call(uninterrupted, 0, 0, 2)
    with pytest.raises(ValueError, match=r"seed=3 but this run has QSDPConfig\.seed=4"):
        SeedSchedule(4).load_state_dict(state)


def handle(config, world_size):
    return QSDPHandle(config, [], [], [], [], SeedSchedule(config.seed), world_size)


def test_checkpoint_restores_the_step_on_another_world_size():
    saved = handle(QSDPConfig(seed=2), world_size=2)
    for _ in range(5):
        saved.after_optimizer_step()
    resumed = handle(QSDPConfig(seed=2), world_size=3)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.seeds.step == 5
    assert resumed.seeds.weight_seed(0, 0) == saved.seeds.weight_seed(0, 0)


def test_changed_config_on_resume_names_saved_and_current_values():
    saved = handle(QSDPConfig(weight_bits=8, grad_bits=4), world_size=2).state_dict()
    with pytest.raises(ValueError, match=r"grad_bits: saved 4, now 8; .*rounding: saved 'stochastic', now 'nearest'"):
        handle(QSDPConfig(weight_bits=8, grad_bits=8, rounding="nearest"), world_size=2).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"weight_bits: saved 8, now None"):
        handle(QSDPConfig(weight_bits="off", grad_bits=4), world_size=2).load_state_dict(saved)
