"""Model-ready train/eval splits for a recipe: tokenized, packed or labelled, in torch format.

Language modelling (``stdlib-text``, ``local-text``): the documents of each split, ordered by
their split key (which mixes modules, so a ``max_train_examples`` prefix is representative), are
tokenized, each followed by the eos token when the tokenizer has one and did not add it, then
concatenated and cut into blocks of exactly ``seq_len`` tokens; the last partial block is
dropped. This is ``group_texts`` of Hugging Face's ``run_clm.py``, except that the remainder of
one chunk of documents is carried into the next instead of being dropped, so the blocks are
exactly a prefix of the split's whole token stream. A BERT-style tokenizer adds
``[CLS] ... [SEP]`` around each document, which then plays the separator's part.

Classification (``stdlib-topics``): one docstring per example, truncated to ``seq_len`` tokens.

The documents are read with ``datasets.load_dataset("json", ...)`` from the local cache, and
every derived table is cached by the datasets library under the source's folder with a
fingerprint computed from the source's SHA-256, the tokenizer and the settings, so a second
load is fast and gives identical tensors.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from .recipes import Recipe

__all__ = ["DataSplits", "load_data", "pack_blocks", "tokenize_documents"]


@dataclass(frozen=True)
class DataSplits:
    """The train and eval sets of a recipe and how to batch them.

    Attributes:
        train, eval: ``datasets.Dataset`` in torch format. Columns: ``input_ids``,
            ``attention_mask`` and ``labels`` (causal-lm: ``labels`` = ``input_ids``; masked-lm:
            ``special_tokens_mask`` instead, the collator draws the masked labels per batch;
            classification: also ``token_type_ids`` when the tokenizer makes them).
        collator: builds a batch from a list of rows (``default_data_collator`` for causal-lm,
            ``DataCollatorForLanguageModeling(mlm=True)`` for masked-lm, ``DataCollatorWithPadding``
            for classification).
        label_names: class names by label id (classification), else ``None``.
        info: sizes and provenance (source, its SHA-256, documents and tokens per split).
    """

    train: datasets.Dataset
    eval: datasets.Dataset
    collator: Callable[[list[dict[str, Any]]], dict[str, Any]]
    label_names: list[str] | None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def id2label(self) -> dict[int, str] | None:
        return None if self.label_names is None else dict(enumerate(self.label_names))


def pack_blocks(token_lists: list[list[int]], seq_len: int) -> np.ndarray:
    """Concatenate token lists and cut the stream into rows of ``seq_len``; drop the remainder.

    Returns:
        int64 array of shape ``(total_tokens // seq_len, seq_len)``.
    """
    lengths = [len(t) for t in token_lists]
    stream = np.fromiter((i for tokens in token_lists for i in tokens), dtype=np.int64, count=sum(lengths))
    n_blocks = stream.size // seq_len
    return stream[: n_blocks * seq_len].reshape(n_blocks, seq_len)  # (blocks, seq_len)


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:32]


def _documents(source) -> datasets.Dataset:
    import datasets

    return datasets.load_dataset("json", data_files=str(source.documents), split="train", cache_dir=str(source.directory / "hf_datasets"))


def _split(table: datasets.Dataset, eval_fraction: float, base: str) -> tuple[datasets.Dataset, datasets.Dataset]:
    eval_part = table.filter(lambda k: k < eval_fraction, input_columns="split_key", new_fingerprint=_fingerprint(base, "eval", eval_fraction))
    train_part = table.filter(lambda k: k >= eval_fraction, input_columns="split_key", new_fingerprint=_fingerprint(base, "train", eval_fraction))
    return train_part, eval_part


def tokenize_documents(texts: list[str], tokenizer) -> list[list[int]]:
    """Token ids of each text, each ending in the tokenizer's end-of-text token (when it has one), as packing needs."""
    ids = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is None:
        return ids
    return [row if row and row[-1] == eos else row + [eos] for row in ids]


def _lm_blocks(documents: datasets.Dataset, tokenizer, seq_len: int, masked: bool, chunk_docs: int = 1000) -> Iterator[dict[str, list[int]]]:
    """Rows of packed blocks over the documents in split-key order, carrying the remainder over.

    Documents are tokenized ``chunk_docs`` at a time, so memory stays bounded for a large corpus
    and the blocks are still exactly a prefix of the split's whole token stream.
    """
    keys = documents.with_format("numpy", columns=["split_key"])[:]["split_key"]  # one read, not per row
    order = np.argsort(keys, kind="stable")  # ties (repeated texts of a local corpus): file order
    special = sorted(set(tokenizer.all_special_ids))
    carry: list[int] = []
    for start in range(0, len(order), chunk_docs):
        texts = documents[order[start : start + chunk_docs].tolist()]["text"]
        for ids in tokenize_documents(texts, tokenizer):
            carry.extend(ids)
        blocks = pack_blocks([carry], seq_len)
        carry = carry[blocks.size :]
        for block in blocks:  # (seq_len,)
            row = {"input_ids": block.tolist(), "attention_mask": [1] * seq_len}
            if masked:  # the collator must never mask [CLS]/[SEP]/eos
                row["special_tokens_mask"] = np.isin(block, special).astype(np.int64).tolist()
            else:
                row["labels"] = row["input_ids"]
            yield row


def _lm_split(documents: datasets.Dataset, tokenizer, recipe: Recipe, base: str, cache_dir: str) -> datasets.Dataset:
    import datasets

    masked = recipe.task == "masked-lm"
    seq_len = recipe.dataset.seq_len
    columns = ["input_ids", "attention_mask", "special_tokens_mask" if masked else "labels"]
    features = datasets.Features({name: datasets.Sequence(datasets.Value("int64")) for name in columns})
    return datasets.Dataset.from_generator(
        _lm_blocks,
        features=features,
        cache_dir=cache_dir,
        gen_kwargs={"documents": documents, "tokenizer": tokenizer, "seq_len": seq_len, "masked": masked},
        fingerprint=_fingerprint(base, "packed", recipe.task, seq_len),
    )


def _topics_split(documents: datasets.Dataset, tokenizer, recipe: Recipe, base: str, cache_dir: str) -> datasets.Dataset:
    seq_len = recipe.dataset.seq_len

    def encode(batch: dict[str, list]) -> dict[str, Any]:
        encoded = tokenizer(batch["text"], truncation=True, max_length=seq_len)
        return {**encoded, "labels": batch["label"]}

    return documents.map(
        encode,
        batched=True,
        remove_columns=documents.column_names,
        new_fingerprint=_fingerprint(base, "encoded", seq_len),
        desc="tokenizing",
    )


def load_data(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> DataSplits:
    """The recipe's train and eval sets, tokenized with ``tokenizer``, and their collator.

    Builds the corpus on first use (seconds). In a multi-process run, calling this under
    ``accelerator.main_process_first()`` lets the other processes reuse the main one's caches.
    """
    import datasets
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, default_data_collator

    from .sources import build_topics, text_source
    from .tokenizer import tokenizer_digest

    spec = recipe.dataset
    if spec.source is not None:  # `dataset: {name: datasets, ...}`: files, folders or a Hub id, through datasets
        from .user_data import load_user_data

        mlm_probability = recipe.training.mlm_probability or 0.15
        return load_user_data(spec.source, recipe.task, tokenizer, seed=recipe.training.seed, mlm_probability=mlm_probability)
    source = text_source(spec.name, spec.data_files)
    label_names = None
    if recipe.task == "sequence-classification":
        topics = build_topics(source)
        label_names = list(topics.meta["label_names"])
        documents = datasets.load_dataset("json", data_files=str(topics.path), split="train", cache_dir=str(source.directory / "hf_datasets"))
        data_sha = hashlib.sha256(topics.path.read_bytes()).hexdigest()
    else:
        documents = _documents(source)
        data_sha = source.fingerprint
    base = _fingerprint(spec.name, data_sha, tokenizer_digest(tokenizer))
    train_docs, eval_docs = _split(documents, spec.eval_fraction, base)
    build = _topics_split if recipe.task == "sequence-classification" else _lm_split
    cache_dir = str(source.directory / "hf_datasets")
    train = build(train_docs, tokenizer, recipe, base + "train", cache_dir)
    evaluation = build(eval_docs, tokenizer, recipe, base + "eval", cache_dir)
    if spec.max_train_examples is not None and spec.max_train_examples < len(train):
        train = train.select(range(spec.max_train_examples), new_fingerprint=_fingerprint(base, "cap", spec.max_train_examples))
    train.set_format("torch")
    evaluation.set_format("torch")
    if recipe.task == "causal-lm":
        collator = default_data_collator  # run_clm's choice: blocks are full, labels = input_ids
    elif recipe.task == "masked-lm":
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=recipe.training.mlm_probability)
    else:
        collator = DataCollatorWithPadding(tokenizer)
    info = {
        "dataset": spec.name,
        "source_sha256": data_sha,
        "train_documents": len(train_docs),
        "eval_documents": len(eval_docs),
        "train_examples": len(train),
        "eval_examples": len(evaluation),
    }
    if recipe.task != "sequence-classification":
        info["train_tokens"] = len(train) * spec.seq_len
        info["eval_tokens"] = len(evaluation) * spec.seq_len
    return DataSplits(train=train, eval=evaluation, collator=collator, label_names=label_names, info=info)
