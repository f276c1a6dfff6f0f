"""Model-ready train/eval splits for a recipe: tokenized, packed or labelled, in torch format.

``load_data`` is the recipe's data: a ``dataset: {name: datasets, ...}`` section is a user's
``DataSource`` (``user_data.load_user_data``, or ``user_stream`` with ``streaming``); the
built-in datasets go through the same pipeline steps (``qaccel.zoo.pipeline``) here.

Language modelling (``stdlib-text``, ``local-text``): the documents of each split, ordered by
their split key (which mixes modules, so a ``max_train_examples`` prefix is representative), are
tokenized, each followed by the eos token when the tokenizer has one and did not add it, then
concatenated and cut into blocks of exactly ``seq_len`` tokens; the last partial block is
dropped. This is ``group_texts`` of Hugging Face's ``run_clm.py``, except that the remainder of
one chunk of documents is carried into the next instead of being dropped
(``pipeline.carried_blocks``), so the blocks are exactly a prefix of the split's whole token
stream. A BERT-style tokenizer adds ``[CLS] ... [SEP]`` around each document, which then plays
the separator's part.

Classification (``stdlib-topics``): one docstring per example, truncated to ``seq_len`` tokens.

The documents are read with ``datasets.load_dataset("json", ...)`` from the local cache
(``sources.builtin_documents``), and every derived table is cached by the datasets library under
the source's folder with a fingerprint computed from the source's SHA-256, the tokenizer and the
settings, so a second load is fast and gives identical tensors.

``DataSplits``, ``pack_blocks`` and ``tokenize_documents`` (``pipeline``) are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from .pipeline import DataSplits, carried_blocks, encode_classes, pack_blocks, task_collator, tokenize_documents
from .recipes import DEFAULT_MLM_PROBABILITY
from .sources import builtin_documents, fingerprint, split_by_key
from .tokenizer import tokenizer_digest
from .user_data import load_user_data

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from .recipes import Recipe

__all__ = ["DataSplits", "load_data", "pack_blocks", "tokenize_documents"]


def _lm_blocks(documents: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, seq_len: int, masked: bool, chunk_docs: int = 1000) -> Iterator[dict[str, list[int]]]:
    """Rows of packed blocks over the documents in split-key order, ``chunk_docs`` tokenized at a time."""
    keys = documents.with_format("numpy", columns=["split_key"])[:]["split_key"]  # one read, not per row
    order = np.argsort(keys, kind="stable")  # ties (repeated texts of a local corpus): file order
    chunks = (documents[order[start : start + chunk_docs].tolist()]["text"] for start in range(0, len(order), chunk_docs))
    yield from carried_blocks(chunks, tokenizer, seq_len, masked)


def _lm_split(documents: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, base: str, cache_dir: str) -> datasets.Dataset:
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
        fingerprint=fingerprint(base, "packed", recipe.task, seq_len),
    )


def _topics_split(documents: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, recipe: Recipe, base: str, cache_dir: str) -> datasets.Dataset:
    seq_len = recipe.dataset.seq_len
    roles = {"text": "text", "label": "label"}
    return encode_classes(documents, roles, tokenizer, seq_len, fingerprint=fingerprint(base, "encoded", seq_len))


def load_data(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> DataSplits:
    """The recipe's train and eval sets, tokenized with ``tokenizer``, and their collator.

    Builds the corpus on first use (seconds). In a multi-process run, calling this under
    ``accelerator.main_process_first()`` lets the other processes reuse the main one's caches.
    """
    spec = recipe.dataset
    if spec.source is not None:  # `dataset: {name: datasets, ...}`: files, folders or a Hub id, through datasets
        mlm_probability = recipe.training.mlm_probability or DEFAULT_MLM_PROBABILITY
        return load_user_data(spec.source, recipe.task, tokenizer, seed=recipe.training.seed, mlm_probability=mlm_probability)
    documents = builtin_documents(spec.name, spec.data_files, recipe.task)
    data_sha = documents.sha256
    base = fingerprint(spec.name, data_sha, tokenizer_digest(tokenizer))
    train_docs, eval_docs = split_by_key(documents.table, spec.eval_fraction, base)
    build = _topics_split if recipe.task == "sequence-classification" else _lm_split
    train = build(train_docs, tokenizer, recipe, base + "train", documents.cache_dir)
    evaluation = build(eval_docs, tokenizer, recipe, base + "eval", documents.cache_dir)
    if spec.max_train_examples is not None and spec.max_train_examples < len(train):
        train = train.select(range(spec.max_train_examples), new_fingerprint=fingerprint(base, "cap", spec.max_train_examples))
    train.set_format("torch")
    evaluation.set_format("torch")
    collator = task_collator(recipe.task, tokenizer, recipe.training.mlm_probability)
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
    return DataSplits(train=train, eval=evaluation, collator=collator, label_names=documents.label_names, info=info)
