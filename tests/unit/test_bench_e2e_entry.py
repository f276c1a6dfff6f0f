"""``qaccel bench e2e``'s methods as the training entry's flags (``_e2e_entry``), checked by the entry itself.

Every row of the method table goes through ``qaccel.train``'s own ``parse_args`` and ``check_inputs`` (no process
group, no model) with the launch it gets in the bench; the resolved plan must be what the table says, written out
here by hand. A flag the entry does not know, or a combination it refuses, fails here instead of in a bench run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qaccel import train as entry
from qaccel.bench import _e2e_entry
from qaccel.bench._e2e_methods import METHODS, onebit_probe
from qaccel.bench._e2e_probe import CountedStepMeter

# method -> (train method, parallelism, (weight_bits, grad_bits) or None, replica_grad_bits, mixed precision, comm options);
# a flat qsdp row keeps QSDPConfig's replica_grad_bits default, 4, which a 1-D mesh never uses
EXPECTED = {
    "fsdp2-fp32": ("none", "fsdp2", (None, None), None, "no", {}),
    "fsdp2-fp32-a2a": ("none", "fsdp2", (None, None), None, "no", {"fsdp_reduce_scatter": "alltoall"}),
    "fsdp2-bf16": ("none", "fsdp2", (None, None), None, "bf16", {}),
    "qsdp-off": ("qsdp", "fsdp2", (None, None), 4, "no", {}),
    "qsdp-w8g8": ("qsdp", "fsdp2", (8, 8), 4, "no", {}),
    "qsdp-w8g8-bf16": ("qsdp", "fsdp2", (8, 8), 4, "bf16", {}),
    "qsdp-w4g4": ("qsdp", "fsdp2", (4, 4), 4, "no", {}),
    "qsdp-w8g8-rs-serial": ("qsdp", "fsdp2", (8, 8), 4, "no", {}),
    "qsdp-w4g4-rs-serial": ("qsdp", "fsdp2", (4, 4), 4, "no", {}),
    "qsdp-w4g4-bf16": ("qsdp", "fsdp2", (4, 4), 4, "bf16", {}),
    "ddp-adamw": ("none", "ddp", None, None, "no", {}),
    "ddp-powersgd": ("none", "ddp", None, None, "no", {"ddp_comm_hook": "powersgd", "powersgd_start_iter": 2}),
    "ddp-bf16": ("none", "ddp", None, None, "no", {"ddp_comm_hook": "bf16"}),
    "onebit-adam": ("onebit_adam", "ddp", None, None, "no", {}),
    "zero-one-adam": ("zero_one_adam", "ddp", None, None, "no", {}),
    "onebit-adam-serial": ("onebit_adam", "ddp", None, None, "no", {}),
    "onebit-adam-4mb": ("onebit_adam", "ddp", None, None, "no", {"ddp_bucket_cap_mb": 4.0}),
    "zero-one-adam-4mb": ("zero_one_adam", "ddp", None, None, "no", {"ddp_bucket_cap_mb": 4.0}),
    "zero-one-adam-serial": ("zero_one_adam", "ddp", None, None, "no", {}),
    "hsdp-fp32": ("none", "fsdp2", (None, None), None, "no", {}),
    "hqsdp-w8g8-r8": ("qsdp", "fsdp2", (8, 8), 8, "no", {}),
    "hqsdp-w8g8-r4": ("qsdp", "fsdp2", (8, 8), 4, "no", {}),
    "hqsdp-off-r4": ("qsdp", "fsdp2", (None, None), 4, "no", {}),
    "hsdp-zero-one-adam": ("zero_one_adam", "fsdp2", (None, None), None, "no", {}),
    "hsdp-onebit-adam": ("onebit_adam", "fsdp2", (None, None), None, "no", {}),
    "hqsdp-w8g8-zero-one-adam": ("zero_one_adam", "fsdp2", (8, 8), None, "no", {}),
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("QACCEL_", "ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")):
            monkeypatch.delenv(name)


def test_every_method_of_the_table_is_expected_here():
    assert set(EXPECTED) == set(METHODS)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_each_method_is_the_entrys_run_the_table_describes(method, prefetch, tmp_path):
    train_method, parallelism, bits, replica_bits, precision, comm = EXPECTED[method]
    probe = onebit_probe(method, 2)[0] if METHODS[method].schedule_weighted else None
    flags, fsdp = _e2e_entry.entry_flags(method, prefetch, "gpt2-17m", probe)
    recipe = _e2e_entry.write_recipe("gpt2-17m", tmp_path, steps=7, lr=1e-4)
    argv = _e2e_entry.train_argv(recipe, flags, tmp_path / "run", steps=7, timeout_s=600)
    launch = ("hsdp" if METHODS[method].needs_nodes else "fsdp2") if fsdp else None
    inputs = entry.check_inputs(entry.parse_args(argv), launch_parallelism=launch, world_size=4)
    plan = inputs.plan
    assert (plan.method, plan.parallelism, inputs.settings.mixed_precision, inputs.settings.max_steps) == (train_method, parallelism, precision, 7)
    assert fsdp == (parallelism == "fsdp2")
    if bits is None:
        assert plan.qsdp is None
    else:
        assert (plan.qsdp.weight_bits, plan.qsdp.grad_bits, plan.qsdp.replica_grad_bits) == (*bits, replica_bits)
        assert plan.qsdp.prefetch is prefetch
        assert plan.qsdp.overlap_reduce_scatter is not method.endswith("-rs-serial")
    for name, value in comm.items():
        assert getattr(plan.comm, name) == value
    if method == "ddp-powersgd":  # one bucket that holds the 17.4M-parameter model's fp32 gradients (66 MB)
        assert plan.comm.ddp_bucket_cap_mb >= 17.4e6 * 4 / 2**20
    if probe is not None:  # the probe schedule and the overlap switch reach the optimizer's config
        assert {key: getattr(plan.onebit, key) for key in probe} == probe
        assert plan.onebit.overlap_comm is not method.endswith("-serial")


def test_the_recipe_is_the_bench_models_shape(tmp_path):
    from qaccel.zoo import load_recipe

    recipe = load_recipe(str(_e2e_entry.write_recipe("gpt2-17m", tmp_path, steps=7, lr=1e-4)))
    assert recipe.model.config == {"model_type": "gpt2", "n_layer": 8, "n_embd": 384, "n_head": 6, "n_positions": 128}
    assert (recipe.tokenizer.vocab_size, recipe.dataset.seq_len, recipe.training.per_device_batch_size) == (8192, 128, 4)
    assert (recipe.method.name, recipe.training.learning_rate, recipe.training.warmup_steps) == ("none", 1e-4, 0)


def _probe_row(step: int, rank: int, wire: int, inter: int, counters: dict) -> dict:
    return {"step": step, "wire_bytes": wire, "wire_bytes_inter_node": inter, "counters": counters, "wire_bytes_by_kind": {"k": wire}}


def test_read_run_sums_the_nodes_counters_and_splits_the_meter_by_level(tmp_path, monkeypatch):
    out = tmp_path / "run"
    (out / "checkpoint-3").mkdir(parents=True)
    rows = [{"step": s, "loss": 1.0, "learning_rate": 0.1, "wire_bytes": 100, "wire_bytes_inter_node": 30, "wire_bytes_total": 100 * s,
             "step_seconds": 0.5 + s} for s in (1, 2, 3)]  # fmt: skip
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    node = [{"lo": 1000, "inter_tx": 300, "inter_rx": 250}, {"lo": 900, "inter_tx": 200, "inter_rx": 350}]
    for rank in range(4):
        counters = node[rank // 2] if rank % 2 == 0 else {}
        lines = [json.dumps(_probe_row(s, rank, 100, 30, counters)) for s in (1, 2, 3)]
        (out / f"probe.rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    state = {"method_config": {"grad_bits": 8}, "extra": {"parallelism": "fsdp2"}}
    (out / "checkpoint-3" / "qaccel_state.json").write_text(json.dumps(state))
    # the checkpoint reader is the library's (its schema checks are tested with it): here, what it would return
    monkeypatch.setattr(_e2e_entry, "_run_info", lambda output_dir, step: {"method_config": state["method_config"], "parallelism": "fsdp2"})
    hier = _e2e_entry.read_run(out, "hqsdp-w8g8-r4", 4, 1, None, nproc_per_node=2)
    flat = _e2e_entry.read_run(out, "fsdp2-fp32", 4, 1, None, nproc_per_node=2)
    step = hier["steps"][1]
    assert (hier["nodes"], hier["nproc_per_node"], step["steady"], hier["steps"][0]["steady"]) == (2, 2, True, False)
    assert (step["intra_node_bytes"], step["inter_node_bytes"], step["inter_node_busiest_direction_bytes"]) == (1900, 500, 350)
    assert step["link_bytes"] == 2400 and step["seconds"] == 2.5
    assert step["meter_by_level_per_rank"] == [{"intra_node": 70, "inter_node": 30}] * 4
    # a flat method's collectives span the nodes: all its bytes are inter-node
    assert flat["steps"][1]["meter_by_level_per_rank"] == [{"intra_node": 0, "inter_node": 100}] * 4


def test_the_probe_hands_the_entry_its_counted_step_meter(monkeypatch, tmp_path):
    from qaccel.training.run_log import StepMeter

    assert issubclass(CountedStepMeter, StepMeter)
    calls = []
    monkeypatch.setattr(entry, "cli", lambda argv, *, step_meter: calls.append((argv, step_meter)) or 0)
    monkeypatch.setenv("RANK", "3")
    spec = tmp_path / "probe.json"
    spec.write_text(json.dumps({"nproc_per_node": 2, "node_counters": [{"lo": "a"}, {"lo": "b"}], "output_dir": str(tmp_path)}))
    from qaccel.bench import _e2e_probe

    assert _e2e_probe.main([str(spec), "--", "--recipe", "x"]) == 0
    [(argv, meter)] = calls
    assert argv == ["--recipe", "x"] and meter.func is CountedStepMeter
    # rank 3 is the second rank of node 1: it reads no counters, and writes its own probe file
    assert meter.keywords == {"counters": {}, "out": Path(tmp_path) / "probe.rank3.jsonl"}
