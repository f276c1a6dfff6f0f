"""End to end: scripts/train.py on 2 CPU processes, through `accelerate launch` and plain `torchrun`.

Each run is a real job: the recipe's model, tokenizer and offline data, the real method, real
checkpoints. The checks use independent references: the stock run's bytes from the same job
with compression off, the ring all-reduce formula from the model's parameter count, and an
uninterrupted run for resume.
"""

from __future__ import annotations

import json

import pytest

from tests._launch import QSDP_CONFIG, REPO, launch, metrics, torchrun

REQUIRED = {"step", "loss", "learning_rate", "wire_bytes", "wire_bytes_total", "step_seconds"}
GPT2_QSDP = ["--recipe", "gpt2-tiny", "--eval_steps", "3", "--save_steps", "3"]  # W8G8: the recipe's bits


@pytest.fixture(scope="module")
def gpt2_qsdp_six_steps(tmp_path_factory):
    """gpt2-tiny under QSDP W8G8 for 6 steps, evaluated and saved every 3: the compressed run of the first
    test and the uninterrupted reference of the resume test (one launch for both)."""
    out = tmp_path_factory.mktemp("gpt2_qsdp") / "run"
    launch(QSDP_CONFIG, *GPT2_QSDP, "--max_steps", "6", "--output_dir", str(out))
    return out


BERT_ZOADAM = ["--recipe", "bert-tiny", "--eval_steps", "5", "--save_steps", "5", "--zoadam_var_freeze_step", "4", "--zoadam_local_step_scaler", "2"]


@pytest.fixture(scope="module")
def bert_zoadam_ten_steps(tmp_path_factory):
    """bert-tiny under 0/1 Adam for 10 steps (variance frozen after 4, local steps from then on), evaluated and
    saved every 5, under plain torchrun: the run of the DDP comparison and the reference of the resume test."""
    out = tmp_path_factory.mktemp("bert_zoadam") / "run"
    torchrun(*BERT_ZOADAM, "--max_steps", "10", "--output_dir", str(out))
    return out


def test_gpt2_tiny_qsdp_and_stock_fsdp2_through_accelerate_launch(tmp_path, gpt2_qsdp_six_steps):
    launch(QSDP_CONFIG, *GPT2_QSDP, "--max_steps", "6", "--output_dir", str(tmp_path / "stock"), "--method", "none")
    qsdp, stock = metrics(gpt2_qsdp_six_steps), metrics(tmp_path / "stock")
    for rows in (qsdp, stock):
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
        assert all(REQUIRED <= set(r) for r in rows)
        assert [r["step"] for r in rows if "eval_perplexity" in r] == [3, 6]
        assert all(r["wire_bytes"] > 0 for r in rows)
        assert rows[-1]["wire_bytes_total"] == sum(r["wire_bytes"] for r in rows)
    # Same job, compression off vs W8G8: the big units travel at about 1/4 of fp32.
    ratio = qsdp[-1]["wire_bytes_total"] / stock[-1]["wire_bytes_total"]
    assert 0.2 < ratio < 0.45, ratio
    # Same seed and data: W8G8 noise moves the losses only a little (smoke, 6 steps).
    assert abs(qsdp[-1]["eval_loss"] - stock[-1]["eval_loss"]) < 0.05 * stock[-1]["eval_loss"]
    for run, folder in (("qsdp", gpt2_qsdp_six_steps), ("none", tmp_path / "stock")):
        for step in (3, 6):
            ckpt = folder / f"checkpoint-{step}"
            state = json.loads((ckpt / "qaccel_state.json").read_text())
            assert state["step"] == step and state["world_size"] == 2
            assert state["method"] == run
            assert (ckpt / "pytorch_model_fsdp_0").is_dir() and (ckpt / "manifest.json").is_file()


def test_resume_from_latest_matches_an_uninterrupted_run_bit_for_bit(tmp_path, gpt2_qsdp_six_steps):
    """Stopped after step 3 (evaluated and saved there), resumed to 6: the same run as one without a stop."""
    launch(QSDP_CONFIG, *GPT2_QSDP, "--max_steps", "3", "--output_dir", str(tmp_path / "resumed"))
    launch(QSDP_CONFIG, *GPT2_QSDP, "--max_steps", "6", "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", "latest")
    straight, resumed = metrics(gpt2_qsdp_six_steps), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["wire_bytes"] for r in resumed] == [r["wire_bytes"] for r in straight]
    assert [r.get("eval_loss") for r in resumed] == [r.get("eval_loss") for r in straight]
    # Final parameters: the sharded weight files of step 6 are byte-identical.
    for shard in sorted((gpt2_qsdp_six_steps / "checkpoint-6" / "pytorch_model_fsdp_0").glob("*.distcp")):
        assert shard.read_bytes() == (tmp_path / "resumed" / "checkpoint-6" / "pytorch_model_fsdp_0" / shard.name).read_bytes()


def test_zero_one_adam_masked_lm_resume_matches_an_uninterrupted_run(tmp_path, bert_zoadam_ten_steps):
    """0/1 Adam (error buffers, schedule, local steps) and random MLM masks, resumed mid-run."""
    from safetensors.torch import load_file

    torchrun(*BERT_ZOADAM, "--max_steps", "5", "--output_dir", str(tmp_path / "resumed"))
    torchrun(*BERT_ZOADAM, "--max_steps", "10", "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", "latest")
    straight, resumed = metrics(bert_zoadam_ten_steps), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r.get("eval_loss") for r in resumed] == [r.get("eval_loss") for r in straight]
    # Bytes match too, except the first step after the resume: it also carries the optimizer's
    # one-time cross-rank checksum of the restored state (a few KB).
    sent_resumed, sent_straight = [r["wire_bytes"] for r in resumed], [r["wire_bytes"] for r in straight]
    assert sent_resumed[:5] + sent_resumed[6:] == sent_straight[:5] + sent_straight[6:]
    assert 0 <= sent_resumed[5] - sent_straight[5] < 16_384
    a = load_file(bert_zoadam_ten_steps / "checkpoint-10" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "checkpoint-10" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_bert_tiny_zero_one_adam_and_stock_ddp_under_plain_torchrun(tmp_path, bert_zoadam_ten_steps):
    from qaccel.zoo import load_model, load_recipe, load_tokenizer

    torchrun(*BERT_ZOADAM, "--max_steps", "10", "--output_dir", str(tmp_path / "ddp"), "--method", "none")
    zoadam, ddp = metrics(bert_zoadam_ten_steps), metrics(tmp_path / "ddp")
    assert [r["step"] for r in zoadam] == list(range(1, 11)) and "eval_perplexity" in zoadam[-1]
    # Stock DDP sends a ring all-reduce of every fp32 gradient per step: 2 (N-1)/N * 4 bytes * numel.
    recipe = load_recipe("bert-tiny")
    numel = sum(p.numel() for p in load_model(recipe, load_tokenizer(recipe)).parameters() if p.requires_grad)
    assert all(r["wire_bytes"] == 4 * numel for r in ddp), (ddp[0]["wire_bytes"], 4 * numel)
    # 0/1 Adam: the first step sends nothing (initialisation), later steps far less than DDP's.
    assert zoadam[0]["wire_bytes"] == 0
    assert zoadam[-1]["wire_bytes_total"] < ddp[-1]["wire_bytes_total"]
    state = json.loads((bert_zoadam_ten_steps / "checkpoint-10" / "qaccel_state.json").read_text())
    assert state["method"] == "zero_one_adam" and state["method_config"]["var_freeze_step"] == 4  # the flag, not the recipe's
    assert recipe.method.zero_one_adam["var_freeze_step"] != 4


def test_one_bit_optimizer_under_a_1d_fsdp_launch_config_fails_fast_with_the_fix(tmp_path):
    # A 1-bit optimizer runs on FSDP only as HSDP shards (replicas to compress across); a 1-D mesh has none.
    proc = launch(QSDP_CONFIG, "--recipe", "bert-tiny", "--output_dir", str(tmp_path / "x"), check=False)
    assert proc.returncode != 0
    assert "cpu_2proc_ddp" in proc.stderr and "--launch_config cpu_2x2_hqsdp" in proc.stderr and "dp_replicate_size >= 2" in proc.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


@pytest.mark.parametrize("recipe, config", [("gpt2-tiny", "cpu_2proc_qsdp.yaml"), ("bert-tiny", "cpu_2proc_ddp.yaml")])
def test_qaccel_train_dry_run_uses_the_recipe_launch_config(recipe, config, capsys):
    from qaccel.cli import main

    status, err = main(["train", "--recipe", recipe, "--dry_run", "--output_dir", "runs/x", "--max_steps", "5"]), capsys.readouterr().err
    assert status == 0, err
    line = err.strip().splitlines()[-1]
    assert f"--config_file {REPO / 'launch_configs' / config}" in line
    assert line.endswith(f"-m qaccel.train --recipe {recipe} --output_dir runs/x --max_steps 5")
