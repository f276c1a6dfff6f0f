"""End to end: ``qaccel.train --method diloco`` on 2 DDP processes (torchrun) and on 2 x 2 HSDP shards (accelerate launch).

References: the uninterrupted run (a run resumed from its mid-run checkpoint must end with bit-identical
weights, inner optimizer state and DiLoCo state), and the bytes of one fp32 ring all-reduce of the
trainable values each rank holds, computed from the recipe's model config with transformers: the
inter-node bytes of a sync step; every other step sends nothing between islands.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests._launch import REPO, free_port, metrics, run_job, torchrun_cmd

STEPS, H = 4, 2
FLAGS = ("--recipe", "gpt2-tiny", "--method", "diloco", "--max_steps", str(STEPS), "--diloco_sync_every", str(H),
         "--save_steps", str(H), "--eval_steps", str(H), "--per_device_batch_size", "4")  # fmt: skip


def _gpt2_tiny_shapes() -> list[torch.Size]:
    """The trainable parameters' shapes of the recipe's model (tied embeddings counted once), from transformers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel.zoo import load_recipe

    config = load_recipe("gpt2-tiny").model.config
    model = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in config.items() if k != "model_type"}, vocab_size=4096))
    return [p.shape for p in model.parameters()]


def _ring(nbytes: int, ranks: int) -> int:
    return 2 * (ranks - 1) * nbytes // ranks


def _train_and_resume(tmp: Path, launcher: list[str]) -> tuple[Path, Path]:
    """The straight run, and a second run resumed from the first one's checkpoint at step H."""
    straight, resumed = tmp / "straight", tmp / "resumed"
    run_job([*launcher, *FLAGS, "--output_dir", str(straight)], timeout=600)
    resumed.mkdir()
    shutil.copytree(straight / f"checkpoint-{H}", resumed / f"checkpoint-{H}")
    run_job([*launcher, *FLAGS, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"], timeout=600)
    return straight, resumed


def _rank_files_equal(a: Path, b: Path, ranks: int) -> bool:
    for rank in range(ranks):
        left, right = (torch.load(folder / f"qaccel_diloco_rank{rank}.pt", weights_only=True) for folder in (a, b))
        flat = lambda payload: [  # noqa: E731
            *(f["global_weights"] for f in payload["diloco"]["fragments"]), *(t for state in payload["inner_optimizer"] for t in state.values())
        ]
        if not all(torch.equal(x, y) for x, y in zip(flat(left), flat(right), strict=True)):
            return False
    return True


def _check_inter_node_bytes(out: Path, per_sync: int) -> None:
    for row in metrics(out):
        expected = per_sync if row["step"] % H == 0 else 0
        assert row["wire_bytes_inter_node"] == expected, row


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    return _train_and_resume(tmp_path_factory.mktemp("diloco_ddp"), torchrun_cmd("-m", "qaccel.train"))


def test_ddp_a_resumed_run_ends_bit_identical_to_the_uninterrupted_one(ddp_runs):
    from safetensors.torch import load_file

    straight, resumed = (out / f"checkpoint-{STEPS}" for out in ddp_runs)
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _rank_files_equal(straight, resumed, 2)
    assert metrics(ddp_runs[0])[-1]["eval_loss"] == metrics(ddp_runs[1])[-1]["eval_loss"]


def test_ddp_islands_send_one_fp32_ring_all_reduce_per_sync_and_nothing_between(ddp_runs):
    numel = sum(shape.numel() for shape in _gpt2_tiny_shapes())
    _check_inter_node_bytes(ddp_runs[0], _ring(4 * numel, 2))


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory):
    config = REPO / "launch_configs" / "cpu_2x2_hqsdp.yaml"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port", str(free_port()), "-m", "qaccel.train"]
    return _train_and_resume(tmp_path_factory.mktemp("diloco_hsdp"), launcher)


def _dcp_model(folder: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp / f"{folder.parent.name}.pt"
    dcp_to_torch_save(folder / "pytorch_model_fsdp_0", target)
    return torch.load(target, weights_only=True)["model"]  # Accelerate saves {"model": state_dict}


def test_hsdp_islands_resume_bit_identical_and_only_the_outer_all_reduce_crosses_nodes(hsdp_runs, tmp_path):
    straight, resumed = (out / f"checkpoint-{STEPS}" for out in hsdp_runs)
    a, b = _dcp_model(straight, tmp_path), _dcp_model(resumed, tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _rank_files_equal(straight, resumed, 4)
    # rank 0 holds the first ceil(rows / 2) rows of every parameter (FSDP2's dim-0 chunks over 2 shards)
    shard = sum(-(-shape[0] // 2) * (shape.numel() // shape[0]) for shape in _gpt2_tiny_shapes())
    _check_inter_node_bytes(hsdp_runs[0], _ring(4 * shard, 2))


def test_ddp_fragments_sync_in_turn_and_the_last_step_syncs_the_rest(tmp_path):
    out = tmp_path / "fragments"
    flags = ("--recipe", "gpt2-tiny", "--method", "diloco", "--max_steps", "4", "--diloco_sync_every", "2", "--diloco_fragments", "2",
             "--save_steps", "0", "--eval_steps", "0", "--per_device_batch_size", "4", "--output_dir", str(out))  # fmt: skip
    run_job([*torchrun_cmd("-m", "qaccel.train"), *flags], timeout=600)
    sizes = [shape.numel() for shape in _gpt2_tiny_shapes()]
    first = sizes[0]  # the token embedding holds over half of the values: fragment 0 alone
    assert first * 2 >= sum(sizes)
    rest = sum(sizes) - first
    expected = {1: _ring(4 * first, 2), 2: _ring(4 * rest, 2), 3: _ring(4 * first, 2), 4: _ring(4 * rest, 2) + _ring(4 * first, 2)}
    assert {row["step"]: row["wire_bytes_inter_node"] for row in metrics(out)} == expected
