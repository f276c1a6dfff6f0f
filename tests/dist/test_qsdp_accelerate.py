"""QSDP through ``qaccel.Accelerator`` on 2 CPU processes: CPU FSDP2 switch, installer, checkpoints.

Accelerate keeps one ``AcceleratorState`` per process, so one spawn runs one Accelerator and
checks every stage of its life: init (FSDP2 on CPU, bf16 policy), prepare (a comm on every
FSDP module), training (bytes in ``comm_stats``), and ``save_state`` / ``load_state`` (the seed
step comes back) plus the full state dict.
"""

import os

import torch

from tests._dist import run_ranks

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 32}


def _accelerate_worker(rank, world_size, ckpt_dir):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # unused: the group already exists (FileStore rendezvous)
    )
    from accelerate.state import PartialState
    from torch.distributed.fsdp import FSDPModule
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel import Accelerator, QSDPPlugin
    from qaccel.fsdp import QuantizedAllGather, QuantizedReduceScatter
    from qaccel.integration.cpu_fsdp import enable_fsdp2_on_cpu

    out = {}
    plugin = QSDPPlugin(
        weight_bits=8,
        grad_bits=8,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["GPT2Block"],
        state_dict_type="SHARDED_STATE_DICT",
    )
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")
    # enable_fsdp2_on_cpu ran inside __init__: Accelerate's own view says FSDP2, in both states.
    out["types"] = (str(accelerator.distributed_type), str(PartialState().distributed_type), accelerator.is_fsdp2)
    policy = accelerator.state.fsdp_plugin.mixed_precision_policy
    out["policy"] = (str(policy.param_dtype), str(policy.reduce_dtype))
    try:
        enable_fsdp2_on_cpu(accelerator, plugin)  # no longer MULTI_CPU: must refuse
        out["second_call"] = None
    except RuntimeError as exc:
        out["second_call"] = str(exc)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**TINY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randint(0, 512, (16, 16), generator=torch.Generator().manual_seed(1)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    prepared = accelerator.prepare(model, optimizer, loader)
    out["prepare_returns"] = type(prepared).__name__
    model, optimizer, loader = prepared
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    comms = [
        (type(g._all_gather_comm).__name__, type(g._reduce_scatter_comm).__name__)
        for m in fsdp_modules
        for g in m._get_fsdp_state()._fsdp_param_groups
    ]
    out["fsdp_modules"] = len(fsdp_modules)
    out["comms"] = sorted(set(comms))
    out["quantized_units"] = sum(1 for u in accelerator.qsdp.describe() if u["weights_quantized"] and u["grads_quantized"])
    out["comm_classes_ok"] = all(isinstance(a, QuantizedAllGather) and isinstance(r, QuantizedReduceScatter)
                                 for a, r in zip(accelerator.qsdp.all_gathers, accelerator.qsdp.reduce_scatters, strict=True))

    losses = []
    for step, (tokens,) in enumerate(loader):
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
    out["step_after_training"] = accelerator.qsdp.seeds.step

    accelerator.save_state(ckpt_dir)
    tokens = next(iter(loader))[0]
    accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
    optimizer.step()
    out["step_after_extra"] = accelerator.qsdp.seeds.step
    accelerator.load_state(ckpt_dir)
    out["step_after_load"] = accelerator.qsdp.seeds.step
    full = accelerator.get_state_dict(model)
    out["full_state_dict"] = sorted(full)[:3] if accelerator.is_main_process else None
    out["full_numel"] = sum(v.numel() for v in full.values()) if accelerator.is_main_process else None
    out["expected_numel"] = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(**TINY)).state_dict().values())
    return out


def test_qsdp_through_accelerate_on_cpu(tmp_path):
    results = run_ranks(_accelerate_worker, 2, tmp_path, str(tmp_path / "ckpt"))
    for out in results:
        assert out["types"] == ("DistributedType.FSDP", "DistributedType.FSDP", True)
        # bf16 mixed precision: bf16 weights on the wire, fp32 gradients into the codec.
        assert out["policy"] == ("torch.bfloat16", "torch.float32")
        assert "needs a MULTI_CPU state" in out["second_call"]
        assert out["prepare_returns"] == "list"
        # Every FSDP module got both comms: the setters do not recurse, the installer does.
        assert out["comms"] == [("QuantizedAllGather", "QuantizedReduceScatter")]
        assert out["fsdp_modules"] >= 4 and out["quantized_units"] >= 3 and out["comm_classes_ok"]
        assert len(out["losses"]) == 2 and all(torch.isfinite(torch.tensor(out["losses"])))
        total = out["stats"]["total"]
        assert total["qsdp.all_gather"]["sent_bytes"] > 0 and total["qsdp.reduce_scatter"]["sent_bytes"] > 0
        assert out["stats"]["steps"] == 2
        assert out["logged"]["comm/sent_bytes"] == sum(t["sent_bytes"] for t in out["stats"]["last_step"].values())
        assert (out["step_after_training"], out["step_after_extra"], out["step_after_load"]) == (2, 3, 2)
    rank0 = results[0]
    assert rank0["full_numel"] == rank0["expected_numel"]
