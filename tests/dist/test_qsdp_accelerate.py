"""QSDP through ``qaccel.Accelerator`` on CPU processes: CPU FSDP2 switch, installer, checkpoints, resume.

Accelerate keeps one ``AcceleratorState`` per process, so one spawn runs one Accelerator:

1. world 2, uninterrupted: init (FSDP2 on CPU, bf16 policy), prepare (a comm on every FSDP
   module), training (bytes in ``comm_stats``), ``save_state`` after step 2, steps 2-4, then
   ``load_state`` (the seed step comes back) and the full state dict;
2. world 2, resumed: a fresh process loads that checkpoint and runs steps 2-4. Its parameters
   must be bit-identical to the uninterrupted run's (the oracle: run 1). As a control that the
   comparison can fail, it then reloads and runs the same steps with the seed step reset to 0:
   only the rounding noise differs, and the parameters must differ;
3. world 3, resumed from the world-2 checkpoint: QSDP keeps no per-rank state, so this must work
   and continue from the saved step, with the saved weights (uneven shards at world 3).
"""

import json
import os

import pytest
import torch

from qaccel import _torch_internals as torch_internals
from tests._accelerate_runs import TINY, differing_params, full_params, run_step, set_rank_env
from tests._dist import run_ranks

SAVE_AFTER = 2  # optimizer steps before save_state
END = 5  # steps SAVE_AFTER..END-1 run after the save


def _accelerator_and_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel import Accelerator, QSDPPlugin

    plugin = QSDPPlugin(
        weight_bits=8,
        grad_bits=8,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["GPT2Block"],
        state_dict_type="SHARDED_STATE_DICT",
    )
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**TINY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return accelerator, plugin, model, optimizer


def _uninterrupted_worker(rank, world_size, ckpt_dir):
    set_rank_env(rank, world_size)
    from accelerate.state import PartialState
    from torch.distributed.fsdp import FSDPModule
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel.fsdp import CountedAllGather, CountedReduceScatter, QuantizedAllGather, QuantizedReduceScatter
    from qaccel.integration.cpu_fsdp import enable_fsdp2_on_cpu

    out = {}
    accelerator, plugin, model, optimizer = _accelerator_and_model()
    # enable_fsdp2_on_cpu ran inside __init__: Accelerate's own view says FSDP2, in both states.
    out["types"] = (str(accelerator.distributed_type), str(PartialState().distributed_type), accelerator.is_fsdp2)
    policy = accelerator.state.fsdp_plugin.mixed_precision_policy
    out["policy"] = (str(policy.param_dtype), str(policy.reduce_dtype))
    out["callers_plugin_untouched"] = plugin.mixed_precision_policy is None and accelerator.state.fsdp_plugin is not plugin
    try:
        enable_fsdp2_on_cpu(accelerator, accelerator.state.fsdp_plugin)  # no longer MULTI_CPU: must refuse
        out["second_call"] = None
    except RuntimeError as exc:
        out["second_call"] = str(exc)

    data = torch.utils.data.TensorDataset(torch.randint(0, 512, (16, 16), generator=torch.Generator().manual_seed(1)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    prepared = accelerator.prepare(model, optimizer, loader)
    out["prepare_returns"] = type(prepared).__name__
    model, optimizer, loader = prepared
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    comms = [
        (type(g._all_gather_comm).__name__, type(g._reduce_scatter_comm).__name__)
        for m in fsdp_modules
        for g in torch_internals.param_groups(torch_internals.fsdp_state(m))
    ]
    out["fsdp_modules"] = len(fsdp_modules)
    out["comms"] = sorted(set(comms))
    out["quantized_units"] = sum(1 for u in accelerator.qsdp.describe() if u["weights_quantized"] and u["grads_quantized"])
    # Each unit's transport: quantized where describe() says so, FSDP2's own collective counted elsewhere.
    out["comm_classes_ok"] = all(
        isinstance(a, QuantizedAllGather if u["weights_quantized"] else CountedAllGather)
        and isinstance(r, QuantizedReduceScatter if u["grads_quantized"] else CountedReduceScatter)
        for a, r, u in zip(accelerator.qsdp.all_gathers, accelerator.qsdp.reduce_scatters, accelerator.qsdp.describe(), strict=True)
    )

    losses = []
    for step, (tokens,) in enumerate(loader):
        if step == SAVE_AFTER:
            break
        with accelerator.autocast():
            loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        logged = accelerator.log_comm_stats(step)
    out["losses"] = losses
    out["logged"] = logged
    out["stats"] = accelerator.comm_stats()
    out["step_at_save"] = accelerator.qsdp.seeds.step

    out["params_at_save"] = full_params(model)
    accelerator.save_state(ckpt_dir)
    for step in range(SAVE_AFTER, END):
        run_step(accelerator, model, optimizer, rank, step)
    out["step_at_end"] = accelerator.qsdp.seeds.step
    out["params_at_end"] = full_params(model)
    accelerator.load_state(ckpt_dir)
    out["step_after_load"] = accelerator.qsdp.seeds.step
    full = accelerator.get_state_dict(model)
    out["full_numel"] = sum(v.numel() for v in full.values()) if accelerator.is_main_process else None
    out["expected_numel"] = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(**TINY)).state_dict().values())
    accelerator.end_training()
    return out


def _resumed_worker(rank, world_size, ckpt_dir, control):
    set_rank_env(rank, world_size)
    accelerator, _, model, optimizer = _accelerator_and_model()
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(ckpt_dir)
    out = {"step_after_load": accelerator.qsdp.seeds.step, "params_after_load": full_params(model)}
    out["losses"] = [run_step(accelerator, model, optimizer, rank, step) for step in range(SAVE_AFTER, END)]
    out["step_at_end"] = accelerator.qsdp.seeds.step
    out["params_at_end"] = full_params(model)
    if control:
        accelerator.load_state(ckpt_dir)
        accelerator.qsdp.seeds.step = 0  # as if the seed state had been lost: other rounding noise
        for step in range(SAVE_AFTER, END):
            run_step(accelerator, model, optimizer, rank, step)
        out["params_control"] = full_params(model)
    accelerator.end_training()
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("qsdp_accelerate")
    ckpt = str(tmp_path / "ckpt")
    return run_ranks(_uninterrupted_worker, 2, tmp_path, ckpt), ckpt


def test_qsdp_through_accelerate_on_cpu(uninterrupted):
    results, _ = uninterrupted
    for out in results:
        assert out["types"] == ("DistributedType.FSDP", "DistributedType.FSDP", True)
        # bf16 mixed precision: bf16 weights on the wire, fp32 gradients into the codec.
        assert out["policy"] == ("torch.bfloat16", "torch.float32")
        assert out["callers_plugin_untouched"]
        assert "needs a MULTI_CPU state" in out["second_call"]
        assert out["prepare_returns"] == "list"
        # Every FSDP module got both comms: the setters do not recurse, the installer does. With the
        # overlapped reduce-scatter on (the default) FSDP2 calls the wrappers around the transports.
        assert out["comms"] == [("SettlingAllGather", "OverlappedReduceScatter")]
        assert out["fsdp_modules"] >= 4 and out["quantized_units"] >= 3 and out["comm_classes_ok"]
        assert len(out["losses"]) == SAVE_AFTER and all(torch.isfinite(torch.tensor(out["losses"])))
        total = out["stats"]["total"]
        assert total["qsdp.all_gather"]["sent_bytes"] > 0 and total["qsdp.reduce_scatter"]["sent_bytes"] > 0
        assert out["stats"]["steps"] == SAVE_AFTER
        assert out["logged"]["comm/sent_bytes"] == sum(t["sent_bytes"] for t in out["stats"]["last_step"].values())
        assert (out["step_at_save"], out["step_at_end"], out["step_after_load"]) == (SAVE_AFTER, END, SAVE_AFTER)
    assert results[0]["full_numel"] == results[0]["expected_numel"]


def test_resumed_run_is_bit_identical_to_the_uninterrupted_one(uninterrupted, tmp_path):
    results, ckpt = uninterrupted
    rank0 = results[0]
    resumed = run_ranks(_resumed_worker, 2, tmp_path, ckpt, True)
    for out in resumed:
        assert out["step_after_load"] == SAVE_AFTER and out["step_at_end"] == END
        assert differing_params(out["params_after_load"], rank0["params_at_save"]) == []
        # Resumed and uninterrupted runs end bit-identical: same weights, optimizer state and noise.
        assert differing_params(out["params_at_end"], rank0["params_at_end"]) == []
        # Control: the same resume with other rounding noise ends elsewhere, so the check can fail.
        assert differing_params(out["params_control"], rank0["params_at_end"]) != []


def test_resume_on_another_world_size(uninterrupted, tmp_path):
    results, ckpt = uninterrupted
    with open(os.path.join(ckpt, "qaccel_qsdp.json")) as fh:  # JSON: nothing is unpickled on resume
        saved = json.load(fh)
    assert saved["seeds"]["step"] == SAVE_AFTER and saved["world_size"] == 2
    resumed = run_ranks(_resumed_worker, 3, tmp_path, ckpt, False)
    for out in resumed:
        assert out["step_after_load"] == SAVE_AFTER and out["step_at_end"] == END
        # Every rank of the 3-rank run (uneven shards) sees exactly the weights the 2-rank run saved.
        assert differing_params(out["params_after_load"], results[0]["params_at_save"]) == []
        assert all(torch.isfinite(torch.tensor(out["losses"])))
