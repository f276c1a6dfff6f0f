"""``variance_bias_correction`` and the frozen-variance factor of 0/1 Adam and 1-bit Adam, in one process.

Oracles: the factor 1/sqrt(1 - beta2^k) worked out by hand; the variance updates counted by stepping the
schedules themselves; Adam with a variance frozen after k updates and corrected by 1 - beta2^k, written
here in plain torch; and a fresh GPT-2 whose loss, with DeepSpeed's numerics, climbs back to chance level
after an early freeze while the corrected run keeps descending.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from qaccel.optim import (
    OneBitAdam,
    OneBitAdamConfig,
    OneBitAdamSchedule,
    StepKind,
    ZeroOneAdam,
    ZeroOneAdamConfig,
    ZeroOneAdamSchedule,
    frozen_step_factor,
    frozen_variance_factor,
    frozen_variance_problem,
    smallest_safe_freeze_step,
    variance_updates_at_freeze,
)
from tests._deepspeed_zoadam_port import batch, loss_of, make_net

# -- the factor ------------------------------------------------------------------------------------


def test_the_factor_is_one_over_the_root_of_the_missing_correction():
    # by hand: 0.999^16 = exp(16 ln 0.999) = exp(-0.0160080) = 0.9841194; 1 - that = 0.0158806; sqrt = 0.126018
    assert frozen_step_factor(0.999, 16) == pytest.approx(1 / 0.126018, rel=1e-5)  # 7.935
    assert frozen_step_factor(0.999, 4) == pytest.approx(1 / math.sqrt(0.003994004), rel=1e-9)  # 15.82
    assert frozen_step_factor(0.95, 4) == pytest.approx(1 / math.sqrt(1 - 0.81450625), rel=1e-9)  # 2.32
    with pytest.raises(ValueError, match="variance_updates=0: must be >= 1"):
        frozen_step_factor(0.999, 0)


def _full_steps(schedule, steps: int) -> list[int]:
    """The schedule's own count of FULL steps after each of ``steps`` steps, and its property alongside."""
    counted, full = [], 0
    for _ in range(steps):
        kind = schedule.next_kind()
        full += kind is StepKind.FULL
        schedule.advance(kind)
        assert schedule.variance_updates == full
        counted.append(full)
    return counted


@pytest.mark.parametrize("kappa", [1, 3, 16])
@pytest.mark.parametrize("freeze", [0, 1, 4, 17, 50, 131])
def test_updates_at_the_freeze_are_the_schedules_variance_steps(freeze, kappa):
    run = max(freeze + 1, 2) + 5  # a few steps past the freeze: the count must stop there
    counted = _full_steps(ZeroOneAdamSchedule(freeze, kappa, 2, 4), run)
    k = variance_updates_at_freeze(ZeroOneAdamConfig(var_freeze_step=freeze, var_update_scaler=kappa))
    assert counted[max(freeze + 1, 2) - 1] == counted[-1] == k
    onebit = _full_steps(OneBitAdamSchedule(freeze), max(freeze, 2) + 5)
    assert onebit[-1] == variance_updates_at_freeze(OneBitAdamConfig(freeze_step=freeze)) == max(freeze, 2) - 1


def test_the_count_grows_with_the_log_of_a_late_freeze():
    # kappa 16: intervals 1, 2, .., 256 take 16 updates each (the last at 16 x 256 + .. = step 7936), then
    # interval 512 the multiples 8192, 8704, .., 12288 (9 of them) before step 12501 ends phase 1
    assert variance_updates_at_freeze(ZeroOneAdamConfig(var_freeze_step=12_500)) == 16 * 9 + 9
    assert frozen_variance_factor(ZeroOneAdamConfig(var_freeze_step=12_500)) < 4  # the paper's BERT schedule passes


def test_smallest_safe_freeze_step_is_the_first_within_the_limit():
    # 1-bit Adam: k >= ln(15/16) / ln(0.999) = 64.5, so k = 65 updates, freeze_step 66
    assert smallest_safe_freeze_step(OneBitAdamConfig()) == 66
    # 0/1 Adam, kappa 16: the 65th update is the first multiple of 16 after step 241 (16 + 32 + 64 + 128 steps)
    assert smallest_safe_freeze_step(ZeroOneAdamConfig()) == 255
    for config, key in ((OneBitAdamConfig(betas=(0.9, 0.99)), "freeze_step"), (ZeroOneAdamConfig(var_update_scaler=3), "var_freeze_step")):
        safe = smallest_safe_freeze_step(config)
        before = dataclasses.replace(config, **{key: safe - 1})
        assert frozen_variance_factor(dataclasses.replace(config, **{key: safe})) <= 4 < frozen_variance_factor(before)


def test_the_problem_names_the_factor_the_cause_and_the_fixes():
    problem = frozen_variance_problem(ZeroOneAdamConfig(var_freeze_step=4))
    for fragment in ("ZeroOneAdamConfig.var_freeze_step=4", "after 4 update(s)", "no bias correction", "15.8x Adam's",
                     "var_freeze_step >= 255", "--zoadam_variance_bias_correction true"):  # fmt: skip
        assert fragment in problem, (fragment, problem)
    assert "freeze_step >= 66" in frozen_variance_problem(OneBitAdamConfig(freeze_step=16))
    assert frozen_variance_problem(ZeroOneAdamConfig(var_freeze_step=4, variance_bias_correction=True)) is None
    assert frozen_variance_problem(ZeroOneAdamConfig(var_freeze_step=4, betas=(0.9, 0.95))) is None  # 2.3x
    # a run that ends on the last variance step never takes a step on the frozen variance
    assert frozen_variance_problem(ZeroOneAdamConfig(var_freeze_step=4), max_steps=5) is None
    assert frozen_variance_problem(ZeroOneAdamConfig(var_freeze_step=4), max_steps=6) is not None
    assert frozen_variance_problem(ZeroOneAdamConfig()) is None  # DeepSpeed's defaults: 2.3x


# -- the setting -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cls, env", [(ZeroOneAdamConfig, "QACCEL_ZERO_ONE_ADAM_"), (OneBitAdamConfig, "QACCEL_ONEBIT_ADAM_")])
def test_the_setting_resolves_like_every_other_and_round_trips(cls, env):
    assert cls().variance_bias_correction is False
    name = env + "VARIANCE_BIAS_CORRECTION"
    assert cls.from_env({name: "yes"}).variance_bias_correction is True
    assert cls.from_env({name: "0"}, recipe={"variance_bias_correction": True}).variance_bias_correction is False  # env > recipe
    assert cls.from_env({}, recipe={"variance_bias_correction": True}).variance_bias_correction is True
    assert cls.from_env({name: "1"}, variance_bias_correction=False).variance_bias_correction is False  # argument > env
    with pytest.raises(ValueError, match=name):
        cls.from_env({name: "maybe"})
    with pytest.raises(TypeError, match="variance_bias_correction"):
        cls(variance_bias_correction=1)
    config = cls(variance_bias_correction=True)
    assert cls.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match="bias_correction=True: must be False"):  # DeepSpeed's key keeps its meaning
        cls(bias_correction=True)


def test_a_checkpoint_from_before_the_setting_resumes_and_a_changed_one_is_refused():
    from qaccel.checkpoint import build_run_state
    from qaccel.training import check_resume

    def state(config: dict) -> dict:
        return build_run_state(
            method="zero_one_adam", method_config=config, recipe="r", task="causal-lm", step=4, world_size=1,
            wire_bytes_total=0, metrics=None, base_model=None, dataset=None,
        )  # fmt: skip

    current = ZeroOneAdamConfig().to_dict()
    old = {k: v for k, v in current.items() if k != "variance_bias_correction"}
    assert check_resume(json.loads(json.dumps(state(old))), state(current)) == []
    corrected = ZeroOneAdamConfig(variance_bias_correction=True).to_dict()
    with pytest.raises(ValueError, match="variance_bias_correction: checkpoint false, this run true"):
        check_resume(json.loads(json.dumps(state(old))), state(corrected))


# -- the update ------------------------------------------------------------------------------------

LR, BETAS, EPS, WD = 5e-3, (0.9, 0.999), 1e-8, 0.01


def reference_onebit_adam(steps: int, freeze_step: int, corrected: bool) -> torch.nn.Module:
    """Adam whose variance stops after step max(freeze_step, 2), divided by 1 - beta2^k (k: its updates) if ``corrected``."""
    net = make_net()
    params = list(net.parameters())
    m, v, k = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params], 0
    for t in range(1, steps + 1):
        net.zero_grad()
        loss_of(net, batch(t, 0)).backward()
        if t == 1:
            continue  # the initialization step discards its gradient
        k += t <= max(freeze_step, 2)
        correction = 1 - BETAS[1] ** k if corrected else 1.0
        with torch.no_grad():
            for i, p in enumerate(params):
                if t <= max(freeze_step, 2):
                    v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * p.grad**2
                m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * p.grad
                p -= LR * (m[i] / ((v[i] / correction).sqrt() + EPS) + WD * p)
    return net


def reference_zero_one_adam(steps: int, freeze: int, kappa: int, alpha: int, clipper: int, corrected: bool) -> torch.nn.Module:
    """0/1 Adam on one worker (the 1-bit average is the identity) with the same corrected variance."""
    net = make_net()
    params = list(net.parameters())
    m, v, u = ([torch.zeros_like(p) for p in params] for _ in range(3))
    k, var_interval, var_counter, local_interval, local_counter, lrs, synced = 0, 1, 0, 1, 0, 0.0, None
    for t in range(1, steps + 1):
        net.zero_grad()
        loss_of(net, batch(t, 0)).backward()
        if t == 1:
            continue
        variance_step = synced is None and t % var_interval == 0
        k += variance_step
        correction = 1 - BETAS[1] ** k if corrected else 1.0
        with torch.no_grad():
            for i, p in enumerate(params):
                if variance_step:
                    v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * p.grad**2
                m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * p.grad
                step = LR * (m[i] / ((v[i] / correction).sqrt() + EPS) + WD * p)
                p -= step
                if synced is not None:
                    u[i] -= step
            if synced is None:  # phase 1: the variance schedule, then the freeze after step F + 1
                var_counter += variance_step
                if var_counter == kappa:
                    var_counter, var_interval = 0, 2 * var_interval
                if t > freeze:
                    synced = [p.detach().clone() for p in params]
                continue
            lrs += LR
            if t % local_interval == 0:  # a sync: the momentum becomes -u (sqrt(v_hat) + eps) / lrs; u is applied
                for i, p in enumerate(params):
                    m[i] = -u[i] * ((v[i] / correction).sqrt() + EPS) / lrs
                    p.copy_(synced[i] + u[i])
                    synced[i] = p.detach().clone()
                    u[i].zero_()
                lrs = 0.0
            local_counter += 1
            if local_counter == alpha:
                local_counter, local_interval = 0, min(clipper, 2 * local_interval)
    return net


def _train(cls, steps: int, **settings) -> tuple[torch.nn.Module, list[StepKind]]:
    net, kinds = make_net(), []
    optimizer = cls(net.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **settings)
    for t in range(1, steps + 1):
        kinds.append(optimizer.schedule.next_kind())
        optimizer.zero_grad()
        loss_of(net, batch(t, 0)).backward()
        optimizer.step()
    return net, kinds


def _max_relative_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((x.detach() - y.detach()).abs().max() / y.detach().abs().max()) for x, y in pairs)


def test_onebit_adam_with_the_correction_is_adam_on_a_corrected_frozen_variance():
    corrected, kinds = _train(OneBitAdam, 20, freeze_step=4, variance_bias_correction=True)
    assert kinds.count(StepKind.FULL) == 3 and kinds.count(StepKind.ONEBIT_MOMENTUM) == 16
    assert _max_relative_difference(corrected, reference_onebit_adam(20, 4, corrected=True)) < 1e-5
    # the oracle tells the two numerics apart: DeepSpeed's run sits far from it, on its own reference
    deepspeed, _ = _train(OneBitAdam, 20, freeze_step=4, variance_bias_correction=False)
    assert _max_relative_difference(deepspeed, reference_onebit_adam(20, 4, corrected=False)) < 1e-5
    assert _max_relative_difference(deepspeed, reference_onebit_adam(20, 4, corrected=True)) > 1e-2


def test_zero_one_adam_with_the_correction_is_adam_on_a_corrected_frozen_variance():
    schedule = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
    corrected, kinds = _train(ZeroOneAdam, 24, variance_bias_correction=True, **schedule)
    assert {StepKind.FULL, StepKind.ONEBIT_GRADIENT, StepKind.LOCAL, StepKind.SYNC} <= set(kinds)
    # the reference applies u at a sync where qaccel applies u (sqrt(v_hat) + eps) / (sqrt(v_hat) + eps): rounding only
    assert _max_relative_difference(corrected, reference_zero_one_adam(24, 6, 2, 2, 4, corrected=True)) < 1e-4
    deepspeed, _ = _train(ZeroOneAdam, 24, variance_bias_correction=False, **schedule)
    assert _max_relative_difference(deepspeed, reference_zero_one_adam(24, 6, 2, 2, 4, corrected=False)) < 1e-4
    assert _max_relative_difference(deepspeed, reference_zero_one_adam(24, 6, 2, 2, 4, corrected=True)) > 1e-2


def test_the_default_is_deepspeeds_numerics_bit_for_bit():
    schedule = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
    explicit, _ = _train(ZeroOneAdam, 24, variance_bias_correction=False, **schedule)
    implicit, _ = _train(ZeroOneAdam, 24, **schedule)
    assert all(torch.equal(a, b) for a, b in zip(explicit.parameters(), implicit.parameters(), strict=True))


# -- the divergence case ---------------------------------------------------------------------------

VOCAB = 512


def _gpt2_losses(cls, corrected: bool, steps: int = 16) -> list[float]:
    """A fresh 2-layer GPT-2 of width 256 fitting one fixed batch, lr 3e-4 without warm-up, freeze step 4."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = GPT2Config(
            n_layer=2, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(1))
    freeze = {"var_freeze_step": 4} if cls is ZeroOneAdam else {"freeze_step": 4}
    optimizer = cls(model.parameters(), lr=3e-4, variance_bias_correction=corrected, **freeze)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        losses.append(float(loss.detach()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        losses.append(float(model(input_ids=tokens, labels=tokens).loss))
    return losses


@pytest.mark.parametrize("cls", [ZeroOneAdam, OneBitAdam], ids=["zero_one_adam", "onebit_adam"])
def test_an_early_freeze_undoes_training_without_the_correction_and_trains_with_it(cls):
    chance = math.log(VOCAB)  # 6.24: the loss of a uniform guess
    deepspeed = _gpt2_losses(cls, corrected=False)
    lowest = min(range(len(deepspeed)), key=deepspeed.__getitem__)
    # measured: 6.30 -> 3.63 at step 6 (the large uncorrected warm-up steps), then 15.8x (18.3x) Adam's steps on
    # the frozen variance throw it back to about chance level (6.34 at step 10, 5.63 at the end)
    assert deepspeed[lowest] < 4.3 and lowest < 8
    assert max(deepspeed[lowest:]) > chance - 0.5 and deepspeed[-1] > deepspeed[lowest] + 1.3
    corrected = _gpt2_losses(cls, corrected=True)
    # measured: 6.30 -> 3.36 (3.77 for 1-bit Adam), never rising by more than 0.07 in a step
    assert all(math.isfinite(x) for x in corrected)
    assert corrected[-1] < corrected[0] - 2.0
    assert all(b < a + 0.15 for a, b in zip(corrected, corrected[1:], strict=False))
