"""0/1 Adam on HSDP shards through ``qaccel.Accelerator`` (4 CPU ranks as 2 nodes x 2 ranks).

Accelerate keeps one ``AcceleratorState`` per process, so each spawn runs one Accelerator with a
``QSDPPlugin`` (W8G8 inside a node) and ``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)``:

1. the uninterrupted run: the model is sharded on the intra-node mesh, every unit carries the 1-bit
   optimizer's all-reduce hook (not hierarchical QSDP's), the bytes across nodes are the optimizer's
   kinds, and the replicas of each shard are bit-identical after every full, 1-bit and sync step
   (compared between the two nodes' ranks in the test process), not after every local step;
   ``save_state`` runs after a local step (replicas differ, so each rank's own weights and error
   feedback must come back from its rank file);
2. a fresh run resumed from that checkpoint ends bit-identical, on every rank, to the uninterrupted run;
3. a resume whose rank file is missing stops on every rank with the file named, before training.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests._accelerate_runs import TINY, differing_params, full_params, run_step, set_rank_env, train_on
from tests._dist import run_ranks

SAVE_AFTER, END = 5, 9
HYPER = dict(lr=1e-3, var_freeze_step=2, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2, gradient_clipping=1.0)


def _prepared():
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel import Accelerator, QSDPPlugin
    from qaccel.optim import ZeroOneAdam

    plugin = QSDPPlugin(
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"], state_dict_type="SHARDED_STATE_DICT",
        weight_bits=8, grad_bits=8,
    )  # fmt: skip
    accelerator = Accelerator(fsdp_plugin=plugin, parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**TINY))
    model, optimizer = accelerator.prepare(model, ZeroOneAdam(model.parameters(), **HYPER))
    return accelerator, model, optimizer


def _train_worker(rank, world_size, ckpt_dir):
    set_rank_env(rank, world_size)
    from qaccel.fsdp import find_units

    accelerator, model, optimizer = _prepared()
    zoadam = optimizer.optimizer
    out = {
        "mesh": tuple(next(model.parameters()).device_mesh.mesh_dim_names),
        "hooks": sorted({unit.all_reduce_hook for unit in find_units(model)}),
        "kinds": [],
        "per_step": [],
    }
    for step in range(END):
        if step == SAVE_AFTER:
            out["steps_since_sync_at_save"] = zoadam.schedule.steps_since_sync
            accelerator.save_state(ckpt_dir)
        out["kinds"].append(zoadam.schedule.next_kind().value)
        run_step(accelerator, model, optimizer, rank, step)
        out["per_step"].append(full_params(model))
    out["stats"] = {kind: tally["sent_bytes"] for kind, tally in accelerator.comm_stats()["total"].items()}
    accelerator.end_training()
    return out


def _resume_worker(rank, world_size, ckpt_without_rank3, ckpt_dir):
    set_rank_env(rank, world_size)
    accelerator, model, optimizer = _prepared()
    out = {"error": None}
    try:  # refused in qaccel's load pre-hook, before Accelerate loads anything: the run can go on
        accelerator.load_state(ckpt_without_rank3)
    except FileNotFoundError as exc:
        out["error"] = str(exc)
    accelerator.load_state(ckpt_dir)
    return train_on(accelerator, model, optimizer, rank, range(SAVE_AFTER, END), out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import shutil

    tmp = tmp_path_factory.mktemp("zoadam_hsdp_accelerate")
    for name in "ab":  # one rendezvous folder per spawn
        (tmp / name).mkdir()
    ckpt, without_rank3 = str(tmp / "ckpt"), str(tmp / "ckpt_without_rank3")
    full = run_ranks(_train_worker, 4, tmp / "a", ckpt)
    shutil.copytree(ckpt, without_rank3)
    os.remove(os.path.join(without_rank3, "qaccel_zoadam_rank3.pt"))
    return {"full": full, "resumed": run_ranks(_resume_worker, 4, tmp / "b", without_rank3, ckpt)}


def test_sharded_zero_one_adam_through_accelerate(runs):
    full = runs["full"]
    assert full[0]["mesh"] == ("dp_shard_cp",)  # sharded within a node; the optimizer owns the replicas
    assert full[0]["hooks"] == ["OneBitReplicaHook"]
    stats = full[0]["stats"]
    assert stats["hsdp.replica_all_reduce"] > 0 and stats["hsdp.onebit.all_to_all"] > 0 and stats["qsdp.all_gather"] > 0
    assert not any(kind.startswith("qsdp.replica_") for kind in stats)
    kinds = full[0]["kinds"]
    assert {"init", "full", "onebit_gradient", "local", "sync"} <= set(kinds)
    # ranks 0 and 2 (1 and 3) hold the same shard on the two nodes
    for step, kind in enumerate(kinds):
        for a, b in ((0, 2), (1, 3)):
            differing = differing_params(full[a]["per_step"][step], full[b]["per_step"][step])
            if kind in ("full", "onebit_gradient", "sync"):
                assert differing == [], (step, kind)
            elif kind == "local":
                assert differing, (step, kind)  # replicas drift between syncs: the check above can fail


def test_resume_between_syncs_is_bit_identical(runs):
    assert runs["full"][0]["steps_since_sync_at_save"] > 0  # each replica's own weights must come back
    for full, again in zip(runs["full"], runs["resumed"], strict=True):
        assert differing_params(full["per_step"][-1], again["params_at_end"]) == []


def test_resume_without_a_rank_file_names_it_on_every_rank(runs):
    for out in runs["resumed"]:  # the same message everywhere: no rank is left waiting in a collective
        assert out["error"] and "missing qaccel_zoadam_rank3.pt" in out["error"]
