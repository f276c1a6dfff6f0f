"""load_data: packed LM blocks are the token stream's prefix, MLM masking, balanced topics, caching."""

import dataclasses
import hashlib
import importlib
import inspect
import json
from collections import Counter

import numpy as np
import pytest
import torch

from qaccel.zoo import TOPIC_FAMILIES, build_topics, load_data, load_recipe, load_tokenizer
from qaccel.zoo.corpus import build_corpus, read_records
from qaccel.zoo.sources import MIN_TOPIC_WORDS


@pytest.fixture(scope="module", autouse=True)
def zoo_data(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "zoo-data"  # shared with the other zoo test modules
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QACCEL_DATA_DIR", str(root))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield root


@pytest.fixture(scope="module")
def gpt2_tiny():
    recipe = load_recipe("gpt2-tiny")
    tokenizer = load_tokenizer(recipe)
    return recipe, tokenizer, load_data(recipe, tokenizer)


def _col(dataset, name: str):
    """A whole column in the dataset's format (a tensor for equal-length rows)."""
    return dataset[:][name]


def _split_key(text: str) -> float:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64


def _stream(texts: list[str], tokenizer, append_eos: bool) -> list[int]:
    stream: list[int] = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        stream += ids + ([tokenizer.eos_token_id] if append_eos else [])
    return stream


def test_causal_blocks_are_the_prefix_of_the_eval_token_stream(gpt2_tiny):
    recipe, tokenizer, data = gpt2_tiny
    seq_len = recipe.dataset.seq_len
    with build_corpus().documents.open(encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for line in handle]
    eval_texts = sorted((t for t in texts if _split_key(t) < recipe.dataset.eval_fraction), key=_split_key)
    stream = _stream(eval_texts, tokenizer, append_eos=True)
    blocks = _col(data.eval, "input_ids")
    assert blocks.dtype == torch.int64 and blocks.shape == (len(stream) // seq_len, seq_len)
    assert blocks.flatten().tolist() == stream[: blocks.numel()]
    assert torch.equal(_col(data.eval, "labels"), blocks)
    assert bool((_col(data.eval, "attention_mask") == 1).all())
    n_train_docs = sum(1 for t in texts if _split_key(t) >= recipe.dataset.eval_fraction)
    assert data.info["train_documents"] == n_train_docs and data.info["eval_documents"] == len(eval_texts)
    assert _col(data.train, "input_ids").shape[1] == seq_len and len(data.train) > 5000


def test_causal_collator_keeps_labels_equal_to_inputs(gpt2_tiny):
    _, tokenizer, data = gpt2_tiny
    batch = data.collator([data.train[i] for i in range(4)])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert int((batch["labels"] == tokenizer.eos_token_id).sum()) > 0  # document ends are learned too


def test_loading_twice_gives_identical_tensors(gpt2_tiny):
    recipe, tokenizer, data = gpt2_tiny
    again = load_data(recipe, tokenizer)
    for split in ("train", "eval"):
        first, second = getattr(data, split), getattr(again, split)
        assert len(first) == len(second)
        for column in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(_col(first, column), _col(second, column))


def test_max_train_examples_is_a_prefix(gpt2_tiny):
    recipe, tokenizer, data = gpt2_tiny
    capped = dataclasses.replace(recipe, dataset=dataclasses.replace(recipe.dataset, max_train_examples=10))
    small = load_data(capped, tokenizer)
    assert len(small.train) == 10 and len(small.eval) == len(data.eval)
    assert torch.equal(_col(small.train, "input_ids"), _col(data.train, "input_ids")[:10])


def test_masked_lm_blocks_and_masking():
    recipe = load_recipe("bert-tiny")
    tokenizer = load_tokenizer(recipe)
    data = load_data(recipe, tokenizer)
    specials = {tokenizer.cls_token_id, tokenizer.sep_token_id}
    ids = _col(data.eval, "input_ids")
    assert torch.equal(_col(data.eval, "special_tokens_mask").bool(), torch.isin(ids, torch.tensor(sorted(specials))))
    with build_corpus().documents.open(encoding="utf-8") as handle:
        texts = sorted((t for t in (json.loads(line)["text"] for line in handle) if _split_key(t) < 0.02), key=_split_key)
    stream = _stream(texts, tokenizer, append_eos=False)  # [CLS] ... [SEP] per document, no eos
    assert ids.flatten().tolist() == stream[: ids.numel()]
    torch.manual_seed(0)
    batch = data.collator([data.train[i] for i in range(64)])
    original = torch.stack([data.train[i]["input_ids"] for i in range(64)])
    selected = batch["labels"] != -100
    assert torch.equal(batch["labels"][selected], original[selected])
    assert not bool(torch.isin(original[selected], torch.tensor(sorted(specials))).any())
    assert torch.equal(batch["input_ids"][~selected], original[~selected])
    rate = selected.sum().item() / (~torch.isin(original, torch.tensor(sorted(specials)))).sum().item()
    assert 0.13 < rate < 0.17  # mlm_probability 0.15 over ~8,000 tokens
    masked_share = (batch["input_ids"][selected] == tokenizer.mask_token_id).float().mean().item()
    assert 0.74 < masked_share < 0.86  # BERT's 80% [MASK]


def _resolve(module_name: str, qualname: str):
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def test_topics_are_balanced_and_labelled_by_their_source_package():
    topics = build_topics()
    records = read_records(topics.path)
    assert topics.meta["label_names"] == list(TOPIC_FAMILIES)
    counts = Counter(r["label"] for r in records)
    assert sorted(counts) == list(range(len(TOPIC_FAMILIES)))
    assert len(set(counts.values())) == 1, counts  # exactly balanced
    assert counts[0] == topics.meta["per_class"] == min(topics.meta["available_per_class"].values())
    assert len({r["text"] for r in records}) == len(records)
    verified = 0
    for record in records:
        path, qualname = record["id"].split(":", 1)
        assert path.split("/")[0] == TOPIC_FAMILIES[record["label"]]  # the label is the file's package
        assert len(record["text"].split()) >= MIN_TOPIC_WORDS
        if verified < 30 and qualname != "<module>":
            try:
                obj = _resolve(record["source"], qualname)
            except (ImportError, AttributeError):  # platform-specific modules, function-local classes
                continue
            assert inspect.cleandoc(obj.__doc__) == record["text"]
            verified += 1
    assert verified == 30


def test_classification_splits():
    recipe = load_recipe("minilm-finetune")
    tokenizer = load_tokenizer(recipe)
    data = load_data(recipe, tokenizer)
    assert data.label_names == list(TOPIC_FAMILIES) and data.id2label[0] == TOPIC_FAMILIES[0]
    records = read_records(build_topics().path)
    eval_texts = {r["text"] for r in records if r["split_key"] < recipe.dataset.eval_fraction}
    assert len(data.eval) == len(eval_texts) and len(data.train) == len(records) - len(eval_texts)
    train_labels = Counter(_col(data.train, "labels").tolist())
    assert max(train_labels.values()) - min(train_labels.values()) < 0.5 * max(train_labels.values())
    first = records[[r["split_key"] >= recipe.dataset.eval_fraction for r in records].index(True)]
    expected = tokenizer(first["text"], truncation=True, max_length=recipe.dataset.seq_len)["input_ids"]
    assert data.train[0]["input_ids"].tolist() == expected and int(data.train[0]["labels"]) == first["label"]
    assert max(len(row) for row in _col(data.train, "input_ids")) <= recipe.dataset.seq_len
    batch = data.collator([data.train[i] for i in range(8)])
    assert batch["input_ids"].shape == batch["attention_mask"].shape and batch["labels"].shape == (8,)


def test_local_text_files(tmp_path, gpt2_tiny):
    recipe, tokenizer, _ = gpt2_tiny
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": f"Line {i}: the quick brown fox jumps over the lazy dog."}) for i in range(300)) + "\n")
    (tmp_path / "b.txt").write_text("A whole file is one document.\nIt has two lines.")
    dataset = dataclasses.replace(recipe.dataset, name="local-text", data_files=(str(tmp_path / "*.jsonl"), str(tmp_path / "b.txt")), seq_len=16, eval_fraction=0.1)
    data = load_data(dataclasses.replace(recipe, dataset=dataset), tokenizer)
    texts = [json.loads(line)["text"] for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    texts.append("A whole file is one document.\nIt has two lines.")
    train_texts = sorted((t for t in texts if _split_key(t) >= 0.1), key=_split_key)
    stream = _stream(train_texts, tokenizer, append_eos=True)
    assert _col(data.train, "input_ids").flatten().tolist() == stream[: _col(data.train, "input_ids").numel()]
    assert len(data.train) == len(stream) // 16
    (tmp_path / "bad.jsonl").write_text('{"title": "no text"}\n')
    bad = dataclasses.replace(dataset, data_files=(str(tmp_path / "bad.jsonl"),))
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: expected a JSON object with a string 'text' field"):
        load_data(dataclasses.replace(recipe, dataset=bad), tokenizer)
    with pytest.raises(ValueError, match="matches no file"):
        load_data(dataclasses.replace(recipe, dataset=dataclasses.replace(dataset, data_files=(str(tmp_path / "none-*.jsonl"),))), tokenizer)


def test_pack_blocks_drops_only_the_remainder():
    from qaccel.zoo.data import pack_blocks

    blocks = pack_blocks([[1, 2, 3], [4], [5, 6, 7, 8, 9]], 4)
    assert blocks.dtype == np.int64 and blocks.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert pack_blocks([[1, 2]], 4).shape == (0, 4)
