"""``qaccel_state.json`` (qaccel.checkpoint): building, writing atomically, reading back; and the resume check (qaccel.training)."""

from __future__ import annotations

import json

import accelerate
import pytest
import torch
import transformers
from transformers import GenerationConfig, GPT2Config

import qaccel
from qaccel.checkpoint import (
    MODEL_FILES_DIR,
    RUN_STATE_FILE,
    build_run_state,
    read_run_state,
    save_checkpoint_metadata,
)
from qaccel.fsdp import QSDPConfig
from qaccel.optim import ZeroOneAdamConfig
from qaccel.training import check_resume


def _state(**overrides):
    values = dict(
        method="qsdp", method_config=QSDPConfig(weight_bits=4, grad_bits=8).to_dict(), recipe="gpt2-tiny", task="causal-lm",
        step=10, world_size=2, wire_bytes_total=123,
    )  # fmt: skip
    return build_run_state(**{**values, **overrides})


def test_build_records_versions_and_is_json_ready():
    state = _state(metrics={"eval_loss": 2.0}, extra={"betas": (0.9, 0.99)})
    assert state["versions"]["torch"] == torch.__version__
    assert state["versions"]["accelerate"] == accelerate.__version__
    assert state["versions"]["transformers"] == transformers.__version__
    assert state["qaccel_version"] == state["versions"]["qaccel"] == qaccel.__version__
    assert state["schema_version"] == 1 and state["created"].endswith("+00:00")
    assert state["method_config"]["weight_bits"] == 4 and state["extra"]["betas"] == [0.9, 0.99]  # as JSON reads it back
    assert json.loads(json.dumps(state)) == state


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"method": "qsdp2"}, ValueError, r"method='qsdp2': must be one of \['diloco', 'none', 'onebit_adam', 'qsdp', 'zero_one_adam'\]"),
        ({"task": "seq2seq"}, ValueError, r"task='seq2seq': must be one of"),
        ({"step": -1}, ValueError, r"step=-1: must be >= 0"),
        ({"world_size": 0}, ValueError, r"world_size=0: must be >= 1"),
        ({"wire_bytes_total": 1.5}, TypeError, r"wire_bytes_total=1.5: expected an int"),
        ({"method_config": [1]}, TypeError, r"method_config: expected a dict"),
        ({"metrics": {"loss": float("nan")}}, ValueError, r"not JSON-serializable"),
        ({"recipe": 3}, TypeError, r"recipe=3: expected a str or None"),
    ],
)
def test_build_rejects_bad_values(overrides, error, match):
    with pytest.raises(error, match=match):
        _state(**overrides)


def test_save_then_read_round_trips(tmp_path):
    state = _state()
    ckpt = tmp_path / "checkpoint-10"
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    save_checkpoint_metadata(ckpt, run_state=state, model_config=config, generation_config=GenerationConfig(max_new_tokens=7))
    assert read_run_state(ckpt) == state
    assert json.loads((ckpt / MODEL_FILES_DIR / "config.json").read_text())["n_embd"] == 32
    assert GenerationConfig.from_pretrained(ckpt / MODEL_FILES_DIR).max_new_tokens == 7
    # Written again (a resumed run saving the same step): replaced whole, no temporary files left.
    save_checkpoint_metadata(ckpt, run_state=_state(step=11), model_config=config)
    assert read_run_state(ckpt)["step"] == 11
    assert not (ckpt / MODEL_FILES_DIR / "generation_config.json").exists()
    assert sorted(p.name for p in ckpt.iterdir()) == [MODEL_FILES_DIR, RUN_STATE_FILE]


def test_save_refuses_what_is_not_a_config(tmp_path):
    with pytest.raises(TypeError, match="model_config must be a transformers PretrainedConfig, got dict"):
        save_checkpoint_metadata(tmp_path, run_state=_state(), model_config={"n_embd": 32})
    with pytest.raises(ValueError, match=r"run_state: missing keys \['step'\]"):
        save_checkpoint_metadata(tmp_path, run_state={k: v for k, v in _state().items() if k != "step"}, model_config=GPT2Config())
    assert list(tmp_path.iterdir()) == []


def test_read_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        read_run_state(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=rf"{RUN_STATE_FILE}: not found; .* is not a qaccel training checkpoint"):
        read_run_state(tmp_path)
    path = tmp_path / RUN_STATE_FILE
    path.write_text('{"schema_version": 1, "method": ')
    with pytest.raises(ValueError, match="not valid JSON .* truncated or corrupted"):
        read_run_state(tmp_path)
    path.write_text(json.dumps({**_state(), "schema_version": 99}))
    with pytest.raises(ValueError, match="schema_version=99; this qaccel .* reads up to 1"):
        read_run_state(tmp_path)
    path.write_text(json.dumps({k: v for k, v in _state().items() if k not in ("task", "world_size")}))
    with pytest.raises(ValueError, match=r"missing keys \['task', 'world_size'\]"):
        read_run_state(tmp_path)


def test_resume_with_the_same_settings_is_silent():
    saved = json.loads(json.dumps(_state(step=10)))  # as read from disk
    assert check_resume(saved, _state(step=0)) == []


def test_resume_refuses_another_method():
    with pytest.raises(ValueError, match="trained with method 'qsdp', this run uses 'zero_one_adam'"):
        check_resume(_state(), _state(method="zero_one_adam", method_config=ZeroOneAdamConfig().to_dict()))


def test_resume_refuses_another_config_naming_each_key():
    current = _state(method_config=QSDPConfig(weight_bits=8, grad_bits=8, rounding="nearest").to_dict())
    with pytest.raises(ValueError) as info:
        check_resume(_state(), current)
    message = str(info.value)
    assert "the qsdp config differs" in message
    assert "weight_bits: checkpoint 4, this run 8" in message and 'rounding: checkpoint "stochastic", this run "nearest"' in message
    assert "grad_bits" not in message


def test_resume_compares_config_values_as_json():
    # betas is a tuple in the config object and a list once read from JSON: the same value.
    config = ZeroOneAdamConfig(betas=(0.8, 0.99)).to_dict()
    saved = json.loads(json.dumps(_state(method="zero_one_adam", method_config=config)))
    assert check_resume(saved, _state(method="zero_one_adam", method_config={**config, "betas": (0.8, 0.99)})) == []
    with pytest.raises(ValueError, match=r"betas: checkpoint \[0.8, 0.99\], this run \[0.9, 0.99\]"):
        check_resume(saved, _state(method="zero_one_adam", method_config={**config, "betas": (0.9, 0.99)}))


@pytest.mark.parametrize(("key", "value"), [("task", "masked-lm"), ("recipe", "bert-mlm"), ("base_model", "gpt2")])
def test_resume_refuses_another_model_task_or_recipe(key, value):
    with pytest.raises(ValueError, match=rf"{key} differs: checkpoint .*, this run '{value}'"):
        check_resume(_state(), _state(**{key: value}))


@pytest.mark.parametrize(
    ("method", "config", "expected"),
    [
        ("qsdp", QSDPConfig().to_dict(), ["keeps no per-rank state", "re-sharded on load", "seed step counter continues", "rounding noise differ"]),
        ("qsdp", QSDPConfig(grad_bits=2, grad_error_feedback="float32").to_dict(), ["error-feedback buffers", "restart from zero", "re-sharded on load"]),
        ("zero_one_adam", ZeroOneAdamConfig().to_dict(), ["error-feedback buffers", "reset to zero", "averaged in full precision"]),
        ("onebit_adam", {"freeze_step": 100}, ["error-feedback buffers", "reset to zero"]),
        ("none", {"parallelism": "ddp"}, ["global batch changes"]),
    ],
)
def test_resume_on_another_world_size_warns_what_changes(method, config, expected):
    warnings = check_resume(_state(method=method, method_config=config, world_size=2), _state(method=method, method_config=config, world_size=4))
    assert len(warnings) == 1 and warnings[0].startswith("world size 2 -> 4: ")
    for phrase in expected:
        assert phrase in warnings[0]


def test_resume_may_change_speed_only_settings_such_as_prefetch():
    # Prefetch is bit-identical on and off (tests/dist/test_qsdp_fast_path.py): not a different run.
    saved = json.loads(json.dumps(_state(method_config=QSDPConfig(weight_bits=4, grad_bits=8, prefetch=True).to_dict())))
    assert check_resume(saved, _state(method_config=QSDPConfig(weight_bits=4, grad_bits=8, prefetch=False).to_dict())) == []
    old = dict(saved)
    old["method_config"] = {k: v for k, v in saved["method_config"].items() if k != "prefetch"}  # a checkpoint from before the field
    assert check_resume(old, _state()) == []


def test_names_that_moved_out_of_qaccel_hub_still_import_and_warn_once():
    import warnings

    import qaccel.hub
    import qaccel.training

    with pytest.warns(DeprecationWarning, match=r"qaccel\.hub\.check_resume moved to qaccel\.training\.check_resume"):
        assert qaccel.hub.check_resume is qaccel.training.check_resume
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second use does not warn again
        from qaccel.hub import check_resume as again
    assert again is check_resume
    with pytest.raises(AttributeError, match="module 'qaccel.hub' has no attribute 'nope'"):
        qaccel.hub.nope  # noqa: B018
