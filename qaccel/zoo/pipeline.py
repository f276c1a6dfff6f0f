"""The steps every dataset goes through between its source and the training loop.

One pipeline, arrows one way::

    source (qaccel.zoo.sources)  ->  columns  ->  tokenize  ->  pack (LMs) or encode (classes)  ->  collate
    raw splits                       text_columns  tokenize_documents  pack_table / carried_blocks   task_collator
                                                                      encode_classes

Its two implementations assemble the same steps: ``user_data`` over ``datasets.Dataset``
(map-style, converted and cached) and ``user_stream`` over ``datasets.IterableDataset`` (read,
packed and split across ranks on the fly); ``data`` does the same for the recipes' built-in
datasets. ``pack_table`` takes either kind of table, so a stream packs exactly as a table does.

Packing is Hugging Face ``run_clm.py``'s ``group_texts``: documents are tokenized, an eos token
closes each one when the tokenizer has one and did not add it, and each batch of ``GROUP_BATCH``
texts is concatenated and cut into blocks (the remainder of each batch is dropped).
``carried_blocks`` is the built-in datasets' variant, which carries the remainder into the next
chunk so that the blocks are exactly a prefix of the split's whole token stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from .data_source import DataSource

__all__ = [
    "GROUP_BATCH",
    "DataSplits",
    "tokenize_documents",
    "pack_blocks",
    "block_columns",
    "pack_table",
    "carried_blocks",
    "text_columns",
    "encode_classes",
    "task_collator",
]

GROUP_BATCH = 1000  # texts per group_texts batch, as run_clm


@dataclass(frozen=True)
class DataSplits:
    """The train and eval sets of a recipe and how to batch them.

    Attributes:
        train, eval: ``datasets.Dataset`` in torch format (with ``streaming``, ``train`` is a
            ``user_stream.StreamingBlocks``). Columns: ``input_ids``, ``attention_mask`` and
            ``labels`` (causal-lm: ``labels`` = ``input_ids``; masked-lm: ``special_tokens_mask``
            instead, the collator draws the masked labels per batch; classification: also
            ``token_type_ids`` when the tokenizer makes them).
        collator: builds a batch from a list of rows (``task_collator``).
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


def tokenize_documents(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of each text, each ending in the tokenizer's end-of-text token (when it has one), as packing needs."""
    ids = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is None:
        return ids
    return [row if row and row[-1] == eos else row + [eos] for row in ids]


def pack_blocks(token_lists: list[list[int]], seq_len: int) -> np.ndarray:
    """Concatenate token lists and cut the stream into rows of ``seq_len``; drop the remainder.

    Returns:
        int64 array of shape ``(total_tokens // seq_len, seq_len)``.
    """
    lengths = [len(t) for t in token_lists]
    stream = np.fromiter((i for tokens in token_lists for i in tokens), dtype=np.int64, count=sum(lengths))
    n_blocks = stream.size // seq_len
    return stream[: n_blocks * seq_len].reshape(n_blocks, seq_len)  # (blocks, seq_len)


def block_columns(blocks: np.ndarray, special_ids: list[int], masked: bool) -> dict[str, list[list[int]]]:
    """The columns of packed blocks (``(blocks, seq_len)``): every token attended, labels or the special-token mask.

    Args:
        blocks: int64 array of shape ``(blocks, seq_len)`` (``pack_blocks``).
        special_ids: the tokenizer's special token ids.
        masked: masked-lm: ``special_tokens_mask`` (the collator draws the labels, and must never
            mask [CLS]/[SEP]/eos); causal-lm: ``labels`` = ``input_ids``.
    """
    input_ids = blocks.tolist()
    columns = {"input_ids": input_ids, "attention_mask": np.ones_like(blocks).tolist()}
    if masked:
        columns["special_tokens_mask"] = np.isin(blocks, special_ids).astype(np.int64).tolist()
    else:
        columns["labels"] = input_ids
    return columns


def pack_table(table: Any, text: str, tokenizer: PreTrainedTokenizerBase, block: int, masked: bool, *, columns: list[str], fingerprint: str | None = None) -> Any:
    """run_clm's ``group_texts`` over a ``datasets.Dataset`` or ``IterableDataset``: empty texts dropped, then batches packed.

    Args:
        table: the raw table or stream.
        text: its text column.
        block: tokens per block.
        masked: masked-lm (see ``block_columns``).
        columns: the table's columns, all replaced by the block columns (a stream may only know
            them from its first row).
        fingerprint: the datasets cache key of a map-style table (a stream has no cache).

    Returns:
        The same kind of table, one row per block.
    """
    special = sorted(set(tokenizer.all_special_ids))

    def group_texts(batch: dict[str, list]) -> dict[str, Any]:
        return block_columns(pack_blocks(tokenize_documents(batch[text], tokenizer), block), special, masked)

    cached = fingerprint is not None  # only a map-style table takes a fingerprint and a progress bar
    nonempty = {"new_fingerprint": fingerprint + "-nonempty"} if cached else {}
    packed = {"new_fingerprint": fingerprint, "desc": f"tokenizing and packing into blocks of {block}"} if cached else {}
    table = table.filter(lambda t: bool(t), input_columns=text, **nonempty)
    return table.map(group_texts, batched=True, batch_size=GROUP_BATCH, remove_columns=columns, **packed)


def carried_blocks(texts: Iterator[list[str]], tokenizer: PreTrainedTokenizerBase, seq_len: int, masked: bool) -> Iterator[dict[str, list[int]]]:
    """Rows of packed blocks over chunks of texts, the remainder of each chunk carried into the next.

    The blocks are exactly a prefix of the whole token stream (the last partial block dropped),
    while only one chunk is tokenized at a time, so memory stays bounded for a large corpus.
    """
    special = sorted(set(tokenizer.all_special_ids))
    carry: list[int] = []
    for chunk in texts:
        for ids in tokenize_documents(chunk, tokenizer):
            carry.extend(ids)
        blocks = pack_blocks([carry], seq_len)  # (blocks, seq_len)
        carry = carry[blocks.size :]
        columns = block_columns(blocks, special, masked)
        for i in range(len(blocks)):
            yield {name: values[i] for name, values in columns.items()}


def _text_column(source: DataSource, columns: dict[str, Any]) -> str:
    if source.text_column is not None:
        return source.text_column
    for name in ("text", "sentence"):
        if name in columns:
            return name
    strings = [name for name, feature in columns.items() if getattr(feature, "dtype", None) in ("string", "large_string")]
    if not strings:
        raise ValueError(f"--text_column: not given, and the dataset has no string column; its columns: {', '.join(columns)}")
    return strings[0]


def text_columns(source: DataSource, task: str, features: dict[str, Any]) -> dict[str, str]:
    """Resolve and check the column mapping against the dataset's features: role -> column.

    Raises:
        ValueError: a column the data lacks (naming those it has), or a pair or label column for a
            language model.
    """
    classify = task == "sequence-classification"
    roles = {"text": _text_column(source, features)}
    if source.text_pair_column is not None:
        if not classify:
            raise ValueError(f"--text_pair_column={source.text_pair_column!r}: only for --task sequence-classification (sentence pairs), not {task!r}")
        roles["text_pair"] = source.text_pair_column
    if classify:
        roles["label"] = source.label_column or "label"
    elif source.label_column is not None:
        raise ValueError(f"--label_column={source.label_column!r}: only for --task sequence-classification, not {task!r}")
    for role, column in roles.items():
        if column not in features:
            flag = f"--{role}_column" if role != "label" or source.label_column else "--label_column (default 'label')"
            where = source.train_file or source.dataset_name
            raise ValueError(f"{flag}={column!r}: no such column in {where!r}; its columns: {', '.join(features)}")
    return roles


def encode_classes(
    table: datasets.Dataset, roles: dict[str, str], tokenizer: PreTrainedTokenizerBase, max_length: int, *, fingerprint: str, label_ids: dict[Any, int] | None = None
) -> datasets.Dataset:
    """run_glue's preprocessing: the text (or text pair) truncated to ``max_length`` tokens, and the label id.

    Args:
        table: a map-style table with the ``roles`` columns (``text``, optional ``text_pair``, ``label``).
        label_ids: label value -> id, when the values are not ids already (string labels).
        fingerprint: the datasets cache key of the result.
    """
    text, pair, label = roles["text"], roles.get("text_pair"), roles["label"]

    def encode(batch: dict[str, list]) -> dict[str, Any]:
        encoded = tokenizer(batch[text], batch[pair] if pair else None, truncation=True, max_length=max_length)
        labels = batch[label] if label_ids is None else [label_ids[value] for value in batch[label]]
        return {**encoded, "labels": labels}

    return table.map(encode, batched=True, remove_columns=table.column_names, new_fingerprint=fingerprint, desc="tokenizing")


def task_collator(task: str, tokenizer: PreTrainedTokenizerBase, mlm_probability: float | None) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """How a task's rows become a batch (padding classes; masking for masked-lm, at ``mlm_probability``)."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, default_data_collator

    if task == "causal-lm":
        return default_data_collator  # run_clm's choice: blocks are full, labels = input_ids
    if task == "masked-lm":
        return DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=mlm_probability)
    return DataCollatorWithPadding(tokenizer)
