"""Hierarchical QSDP through ``qaccel.Accelerator`` with Accelerate's own ``ParallelismConfig`` (4 CPU ranks as 2 x 2).

Accelerate keeps one ``AcceleratorState`` per process, so each spawn runs one Accelerator:

1. a ``QSDPPlugin`` whose codecs are all off with ``ParallelismConfig(dp_replicate_size=2,
   dp_shard_size=2)`` (possible on CPU through qaccel), next to the oracle in the same processes:
   stock HSDP, ``fully_shard`` on Accelerate's own 2-D mesh. Parameters bit-identical after every step
   (per-element sums and AdamW do not depend on how parameters are grouped into units);
2. W8G8 with ``replica_grad_bits=4``, saved after step 2 and run to the end;
3. a fresh 2 x 2 run resumed from that checkpoint: bit-identical to the uninterrupted run;
4. the same checkpoint resumed on one node of 4 ranks (1-D QSDP): it loads and trains on.
"""

from __future__ import annotations

import pytest
import torch

from tests._accelerate_runs import TINY, differing_params, full_params, run_step, set_rank_env, train_on
from tests._dist import run_ranks

SAVE_AFTER, END = 2, 4


def _accelerator(plugin, replicas):
    from accelerate.parallelism_config import ParallelismConfig

    from qaccel import Accelerator

    parallelism = ParallelismConfig(dp_replicate_size=replicas, dp_shard_size=4 // replicas) if replicas > 1 else None
    return Accelerator(fsdp_plugin=plugin, parallelism_config=parallelism)


def _model_and_optimizer():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**TINY))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _plugin(**qsdp):
    from qaccel import QSDPPlugin

    return QSDPPlugin(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"], state_dict_type="SHARDED_STATE_DICT", **qsdp)


def _stock_hsdp(mesh):
    from torch.distributed.fsdp import fully_shard

    model, optimizer = _model_and_optimizer()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_worker(rank, world_size, qsdp, ckpt_dir):
    set_rank_env(rank, world_size)
    accelerator = _accelerator(_plugin(**qsdp), replicas=2)
    model, optimizer = accelerator.prepare(*_model_and_optimizer())
    stock = _stock_hsdp(accelerator.torch_device_mesh[("dp_replicate", "dp_shard_cp")]) if ckpt_dir is None else None
    out = {"mesh": tuple(next(model.parameters()).device_mesh.mesh_dim_names), "per_step": [], "stock_per_step": []}
    for step in range(END):
        if step == SAVE_AFTER and ckpt_dir:
            accelerator.save_state(ckpt_dir)
        run_step(accelerator, model, optimizer, rank, step)
        out["per_step"].append(full_params(model))
        if stock is not None:
            run_step(accelerator, *stock, rank, step)
            out["stock_per_step"].append(full_params(stock[0]))
    out["stats"] = accelerator.comm_stats()["total"]
    out["describe"] = accelerator.qsdp.describe() if accelerator.qsdp else None
    accelerator.end_training()
    return out


def _resume_worker(rank, world_size, replicas, ckpt_dir):
    set_rank_env(rank, world_size)
    accelerator = _accelerator(_plugin(weight_bits=8, grad_bits=8, replica_grad_bits=4), replicas=replicas)
    model, optimizer = accelerator.prepare(*_model_and_optimizer())
    accelerator.load_state(ckpt_dir)
    out = {"step_after_load": accelerator.qsdp.seeds.step, "replicas": accelerator.qsdp.replicas}
    return train_on(accelerator, model, optimizer, rank, range(SAVE_AFTER, END), out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hqsdp_accelerate")
    for name in "bcde":  # one rendezvous folder per spawn
        (tmp / name).mkdir()
    ckpt = str(tmp / "ckpt")
    off = {"weight_bits": None, "grad_bits": None, "replica_grad_bits": None, "prefetch": False}
    return {
        "off": run_ranks(_train_worker, 4, tmp / "b", off, None),
        "w8g8r4": run_ranks(_train_worker, 4, tmp / "c", {"weight_bits": 8, "grad_bits": 8, "replica_grad_bits": 4}, ckpt),
        "ckpt": ckpt,
        "tmp": tmp,
    }


def test_accelerate_parallelism_config_with_qsdp_off_matches_stock_hsdp(runs):
    assert runs["off"][0]["mesh"] == ("dp_shard_cp",)  # hierarchical QSDP: the intra-node mesh
    for off in runs["off"]:
        for step in range(END):
            assert differing_params(off["stock_per_step"][step], off["per_step"][step]) == []
    assert "hsdp.replica_all_reduce" in runs["off"][0]["stats"]


def test_quantized_hierarchical_run_reports_bytes_per_level(runs):
    stats = runs["w8g8r4"][0]["stats"]
    assert stats["qsdp.replica_reduce_scatter"]["sent_bytes"] > 0 and stats["qsdp.replica_all_gather"]["sent_bytes"] > 0
    assert stats["qsdp.all_gather"]["sent_bytes"] > 0
    assert any(unit.get("replica_grads_quantized") for unit in runs["w8g8r4"][0]["describe"])
    # Its weights differ from stock HSDP's (it quantizes), so the comparison above could fail.
    assert differing_params(runs["off"][0]["stock_per_step"][-1], runs["w8g8r4"][0]["per_step"][-1])


def test_resume_is_bit_identical_and_a_resume_onto_one_node_trains_on(runs):
    resumed = run_ranks(_resume_worker, 4, runs["tmp"] / "d", 2, runs["ckpt"])
    for full, again in zip(runs["w8g8r4"], resumed, strict=True):
        assert again["step_after_load"] == SAVE_AFTER and again["replicas"] == 2
        assert differing_params(full["per_step"][-1], again["params_at_end"]) == []
    one_node = run_ranks(_resume_worker, 4, runs["tmp"] / "e", 1, runs["ckpt"])
    for out in one_node:
        assert out["step_after_load"] == SAVE_AFTER and out["replicas"] == 1
        assert all(torch.isfinite(torch.tensor(out["losses"])))
    # All four ranks of the 1-D run hold the same full model.
    assert all(differing_params(one_node[0]["params_at_end"], out["params_at_end"]) == [] for out in one_node)
