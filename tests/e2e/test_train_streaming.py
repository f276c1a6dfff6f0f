"""End to end: ``--streaming`` causal-LM from a local jsonl / parquet corpus on 2 processes.

The references: (1) the blocks each rank must train on, packed here from the corpus with the
model's tokenizer (in file order, with a shuffle buffer of 1: rank r takes blocks r, r + 2, ...),
and the step-1 loss a dropout-free model gives on them, computed here with transformers; (2) an
uninterrupted run with the same flags, which a run killed (SIGKILL of one rank) or stopped mid-stream
and resumed with ``--resume_from_checkpoint latest`` must match bit for bit (losses and weights).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests._launch import QSDP_CONFIG, REPO, SCRIPT, env, launch, metrics, torchrun, torchrun_cmd, wait_for_steps

BLOCK = 16
TEXTS = [f"doc {i}: the quick brown fox jumps over the lazy dog number {i % 7} and {i % 3}" for i in range(40)]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))  # env() passes it on to the ranks


def _tiny_gpt2(folder: Path) -> str:
    """A 2-layer GPT-2 with its own BPE tokenizer and no dropout (so a loss can be recomputed here)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel.zoo.tokenizer import train_bpe

    tokenizer = train_bpe(TEXTS, 400)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _oracle_blocks(model: str, texts: list[str]) -> list[list[int]]:
    """The corpus packed as run_clm does: every text + eos, concatenated, cut into BLOCK-token rows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    stream: list[int] = []
    for ids in tokenizer(texts)["input_ids"]:
        stream += ids if ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]
    return [stream[i : i + BLOCK] for i in range(0, len(stream) - BLOCK + 1, BLOCK)]


def _loss(model_dir: str, blocks: list[list[int]]) -> float:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    ids = torch.tensor(blocks)
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_two_ranks_train_on_disjoint_halves_of_the_stream_and_wrap_into_the_next_epoch(tmp_path):
    model = _tiny_gpt2(tmp_path / "gpt2")
    out = tmp_path / "run"
    blocks = _oracle_blocks(model, TEXTS)
    shares = [blocks[0::2], blocks[1::2]]  # one file, two ranks: every other block (split_dataset_by_node)
    steps = len(shares[1]) // 2 + 1  # enough steps that each rank's share runs out and epoch 1 starts
    torchrun(
        "--model_name_or_path", model, "--task", "causal-lm", "--method", "zero_one_adam", "--streaming",
        "--streaming_shuffle_buffer", "1", "--train_file", _jsonl(tmp_path / "train.jsonl", TEXTS),
        "--validation_file", _jsonl(tmp_path / "dev.jsonl", TEXTS[:8]), "--max_eval_samples", "3",
        "--max_seq_length", str(BLOCK), "--per_device_batch_size", "2", "--max_steps", str(steps),
        "--save_steps", "0", "--eval_steps", "0", "--output_dir", str(out),
    )  # fmt: skip
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # Step 1's loss is the mean of each rank's loss on its own first two blocks, before any update.
    expected = (_loss(model, shares[0][:2]) + _loss(model, shares[1][:2])) / 2
    assert rows[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert rows[0]["loss"] != pytest.approx(_loss(model, blocks[:2]), rel=1e-3)  # not both ranks on the same blocks
    # Evaluation ran on the first 3 blocks of the validation file: a perplexity, not NaN.
    assert rows[-1]["eval_perplexity"] > 1.0
    # Each rank's stream state: 2 * steps blocks handed out, wrapped around its share's length.
    states = json.loads((out / f"checkpoint-{steps}" / "qaccel_stream_state.json").read_text())
    assert states == [
        {"epoch": 2 * steps // len(share), "blocks": 2 * steps % len(share), "rank": rank, "world_size": 2} for rank, share in enumerate(shares)
    ]
    assert states[1]["epoch"] == 1  # the stream restarted itself (no len(), no StopIteration)


def _weights(checkpoint: Path) -> list[bytes]:
    shards = sorted((checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert shards, f"no FSDP weight shards in {checkpoint}"
    return [shard.read_bytes() for shard in shards]


@pytest.mark.slow  # three launches, over a minute on 2 cores
def test_parquet_stream_stopped_mid_epoch_resumes_bit_exactly(tmp_path):
    """Stop at step 3 (mid-epoch, a shuffle buffer part-filled), resume to 6, match an uninterrupted 6-step run."""
    import pandas as pd

    corpus = TEXTS[:14]  # 15 blocks: shares of 8 and 7, so 3 steps of 2 are mid-epoch and 6 steps wrap
    pd.DataFrame({"text": corpus}).to_parquet(tmp_path / "corpus.parquet")
    pd.DataFrame({"text": TEXTS[:8]}).to_parquet(tmp_path / "dev.parquet")
    model = _tiny_gpt2(tmp_path / "gpt2")
    common = [
        "--model_name_or_path", model, "--task", "causal-lm", "--streaming", "--streaming_shuffle_buffer", "8",
        "--train_file", str(tmp_path / "corpus.parquet"), "--validation_file", str(tmp_path / "dev.parquet"),
        "--max_seq_length", str(BLOCK), "--per_device_batch_size", "2", "--lr_scheduler", "constant",
        "--save_steps", "3", "--eval_steps", "0", "--max_eval_samples", "2",
    ]  # fmt: skip
    for folder, steps, extra in (("straight", 6, []), ("resumed", 3, []), ("resumed", 6, ["--resume_from_checkpoint", "latest"])):
        launch(QSDP_CONFIG, *common, "--max_steps", str(steps), "--output_dir", str(tmp_path / folder), *extra)
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert _weights(tmp_path / "resumed" / "checkpoint-6") == _weights(tmp_path / "straight" / "checkpoint-6")
    # The resume point was mid-epoch 0 and both shares wrapped into epoch 1 after it (the block
    # count of a share does not depend on the shuffle: one packing batch, every other block).
    blocks = len(_oracle_blocks(model, corpus))
    shares = [(blocks + 1) // 2, blocks // 2]
    for step, folder in ((3, "resumed/checkpoint-3"), (6, "straight/checkpoint-6")):
        states = json.loads((tmp_path / folder / "qaccel_stream_state.json").read_text())
        assert [(s["epoch"], s["blocks"]) for s in states] == [divmod(2 * step, share) for share in shares]
    assert all(2 * 3 < share < 2 * 6 for share in shares)


@pytest.mark.slow
def test_jsonl_stream_with_a_rank_killed_resumes_from_latest_bit_exactly(tmp_path):
    """SIGKILL rank 1 mid-stream; resume from `latest`; match an uninterrupted run of as many steps."""
    model = _tiny_gpt2(tmp_path / "gpt2")
    common = [
        "--model_name_or_path", model, "--task", "causal-lm", "--streaming", "--streaming_shuffle_buffer", "8",
        "--train_file", _jsonl(tmp_path / "train.jsonl", TEXTS), "--validation_file", _jsonl(tmp_path / "dev.jsonl", TEXTS[:8]),
        "--max_seq_length", str(BLOCK), "--per_device_batch_size", "2", "--lr_scheduler", "constant",
        "--save_steps", "2", "--eval_steps", "0", "--max_eval_samples", "2",
    ]  # fmt: skip

    out = tmp_path / "run"
    with open(tmp_path / "job.log", "w") as log:
        job = subprocess.Popen(torchrun_cmd(str(SCRIPT), *common, "--max_steps", "500", "--output_dir", str(out)), env=env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_steps(job, out, 3, tmp_path / "job.log", timeout_s=300)
            os.kill(int((out / "pids" / "rank1.pid").read_text().split()[0]), signal.SIGKILL)
            assert job.wait(timeout=120) != 0
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
    latest = max(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert latest >= 2
    steps = latest + 4  # past the resume point, into the next epoch of each share
    for folder, extra in ((out, ["--resume_from_checkpoint", "latest"]), (tmp_path / "straight", [])):
        torchrun(*common, "--max_steps", str(steps), "--output_dir", str(folder), *extra)
    straight, resumed = metrics(tmp_path / "straight"), metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert _weights(out / f"checkpoint-{steps}") == _weights(tmp_path / "straight" / f"checkpoint-{steps}")
