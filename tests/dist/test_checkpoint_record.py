"""Checkpoints saved before the engine was restructured load, and training continues bit-identically.

The record (``tests/dist/checkpoint_record/``) was written by this file's ``--write`` mode on the commit
before the restructuring (499f9fa): per case and rank, the state saved after ``SAVE_AT`` steps (the
model's local tensors, the optimizer's ``state_dict()``, QSDP's ``state_dict()`` and error-feedback
buffers) and the model's local tensors after ``MORE`` further steps of that same run. The test builds
the run afresh on today's code, loads the saved state, trains ``MORE`` steps on the same batches and
must reach exactly the recorded tensors: the loaded state (seeds, error feedback, 0/1 Adam's frozen
variance, error buffers and schedule) means what it meant when it was written.

Cases on 2 gloo ranks: QSDP W4G4 with rotation and gradient error feedback (SGD, so the QSDP state is
all the state there is), 0/1 Adam and 1-bit Adam through the DDP hook.

The record was written with torch's AVX2 kernels, and bit-identical continuation holds only on the
same vector kernels: on an AVX-512 machine torch's own GPT-2 forward differs in the last bits (the
QSDP case left the record on every tensor), with qaccel's code unchanged. So the ranks run in fresh
processes with ``ATEN_CPU_CAPABILITY=avx2`` (every x86-64 CI machine has AVX2; elsewhere the test is
skipped, saying why), and ``--write`` records under the same setting.
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests._dist import run_ranks
from tests._record_models import Stack, stack_batch

RECORD = Path(__file__).with_name("checkpoint_record")
CASES = ("qsdp_w4g4_error_feedback", "zero_one_adam_ddp", "onebit_adam_ddp")
SAVE_AT, MORE = 4, 4
KERNELS = "avx2"  # torch's CPU kernels the record was written with (ATEN_CPU_CAPABILITY)
TINY_GPT2 = {
    "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 16, "bos_token_id": 0, "eos_token_id": 0,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}
QSDP = dict(
    weight_bits=4, grad_bits=4, weight_rotation="hadamard", grad_rotation="hadamard", grad_error_feedback=True,
    unit_min_numel=0, param_min_numel=0,
)
ZERO_ONE = dict(lr=2e-3, var_freeze_step=3, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)
ONEBIT = dict(lr=2e-3, freeze_step=2, eps=1e-4)


def _local(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for name, p in model.named_parameters()}


def _qsdp_run():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel.fsdp import QSDPConfig, install_qsdp

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**TINY_GPT2))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = install_qsdp(model, QSDPConfig(**QSDP), optimizers=[optimizer])

    def step(rank: int, index: int) -> None:
        tokens = torch.randint(0, TINY_GPT2["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(100 * index + rank))
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def save() -> dict:
        return {"model": _local(model), "qsdp": handle.state_dict(), "errors": {k: v.clone() for k, v in handle.error_state().items()}}

    def load(saved: dict) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.to_local().copy_(saved["model"][name])
        handle.load_state_dict(saved["qsdp"])
        handle.load_error_state(saved["errors"], saved["qsdp"]["world_size"])

    return model, step, save, load


def _onebit_run(which: str):
    from torch.nn.parallel import DistributedDataParallel

    from qaccel.optim import OneBitAdam, ZeroOneAdam, register_ddp_comm_hook

    torch.manual_seed(0)
    net = Stack()
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.004)
    cls, hyper = (ZeroOneAdam, ZERO_ONE) if which == "zero_one" else (OneBitAdam, ONEBIT)
    optimizer = cls(net.parameters(), **hyper)
    register_ddp_comm_hook(ddp, optimizer)

    def step(rank: int, index: int) -> None:
        idx, target = stack_batch(rank, index)
        nn.functional.mse_loss(ddp(idx), target).backward()
        optimizer.step()
        optimizer.zero_grad()

    def save() -> dict:
        return {"model": _local(net), "optimizer": optimizer.state_dict()}

    def load(saved: dict) -> None:
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])

    return net, step, save, load


def _build(case: str):
    return _qsdp_run() if case.startswith("qsdp") else _onebit_run("zero_one" if case.startswith("zero_one") else "onebit")


def _write(rank: int, world_size: int, folder: str) -> None:
    for case in CASES:
        model, step, save, _ = _build(case)
        for index in range(SAVE_AT):
            step(rank, index)
        saved = copy.deepcopy(save())  # state_dict() hands out live tensors that the next steps change in place
        for index in range(SAVE_AT, SAVE_AT + MORE):
            step(rank, index)
        torch.save({"saved": saved, "after": _local(model)}, Path(folder) / f"{case}_rank{rank}.pt")


def _resume(rank: int, world_size: int, case: str) -> dict:
    record = torch.load(RECORD / f"{case}_rank{rank}.pt", weights_only=False)
    model, step, _, load = _build(case)
    load(record["saved"])
    resumed = [all(torch.equal(a, record["saved"]["model"][n]) for n, a in _local(model).items())]
    for index in range(SAVE_AT, SAVE_AT + MORE):
        step(rank, index)
    now = _local(model)
    return {
        "kernels": torch.backends.cpu.get_cpu_capability(),
        "loaded_weights_equal": resumed[0],
        "differs": sorted(n for n, t in record["after"].items() if not torch.equal(now[n], t)),
        "moved": sorted(n for n, t in record["after"].items() if not torch.equal(t, record["saved"]["model"][n])),
    }


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_from_before_resumes_bit_identically(tmp_path, monkeypatch, case):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", KERNELS)  # read once per process: hence fresh ranks
    results = run_ranks(_resume, 2, tmp_path, case, fresh=True)
    if any(result["kernels"] != KERNELS.upper() for result in results):
        pytest.skip(f"the record needs torch's {KERNELS} CPU kernels; this machine ran {results[0]['kernels']}")
    for rank, result in enumerate(results):
        assert result["loaded_weights_equal"], (case, rank)
        assert result["moved"], f"{case}: the recorded continuation never changed the weights (the check could not fail)"
        assert result["differs"] == [], f"{case} rank {rank}: after resuming, these tensors left the recorded run: {result['differs'][:5]}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write the checkpoint record (run on the commit before a restructuring)")
    parser.add_argument("--write", required=True, help="folder to write into")
    parser.add_argument("--tmp", required=True)
    args = parser.parse_args()
    Path(args.write).mkdir(parents=True, exist_ok=True)
    os.environ["ATEN_CPU_CAPABILITY"] = KERNELS
    run_ranks(_write, 2, Path(args.tmp), args.write, timeout_s=600, fresh=True)
