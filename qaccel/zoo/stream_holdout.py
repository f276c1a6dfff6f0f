"""A held-out head of one stream: ``--streaming --validation_split_percentage P`` on a single corpus.

Hugging Face's ``run_clm.py`` carves its validation set as the train split's first P%
(``split=f"train[:{P}%]"``, the rest ``train[{P}%:]``); a stream does the same, in the raw
stream's order (file order, before any shuffling or sharding):

- the size is known: ``round(N * P / 100)`` of its ``N`` documents (rows) are held out, rounded as
  ``datasets``' percent slicing rounds (``arrow_reader._pct_to_abs_closest``). A local source is
  counted: a parquet file from its metadata, anything else by one pass over its Arrow batches (no
  tokenizing, once per process). A Hub dataset's size is its split info's ``num_examples``;
- the size is not known (a Hub dataset without split info): the fewest head documents whose
  packing gives ``--max_eval_samples`` blocks are held out (packed as the eval path packs them:
  empty texts dropped, ``group_texts`` per 1000 texts). ``P`` alone is refused, naming that flag.

The held-out documents are packed into the eval set (its first ``--max_eval_samples`` blocks,
default 1000), and the train stream is ``skip(documents)`` of the raw stream, taken before the
shuffle, so every rank, every epoch and every replayed resume excludes the same documents.
``datasets``' ``skip`` is not file-shardable (``split_dataset_by_node`` would split the count among
the files: ``SkipExamplesIterable.shard_data_sources``) and keeps the file order fixed, so such a
stream is split between ranks by blocks: each rank reads it whole and keeps every
``world_size``-th block (``StreamingBlocks(stride=True)``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .pipeline import GROUP_BATCH, tokenize_documents

if TYPE_CHECKING:
    import datasets

    from .data_source import DataSource

__all__ = ["Holdout", "check_holdout", "holdout", "stream_size"]

_COUNT_BATCH = 65_536  # rows per Arrow batch of the count pass
_HEAD_BATCH = 64  # documents tokenized at a time while finding the head of the unknown-size rule
_COUNTS: dict[tuple[str, tuple[int, int]], int] = {}  # check_inputs and load_stream run in one process: count once


@dataclass(frozen=True)
class Holdout:
    """The stream's head kept for evaluation.

    Attributes:
        documents: raw rows (documents) at the head of the stream, never trained on.
        rule: ``percentage`` (``P`` of a known size) or ``blocks`` (``max_eval_samples`` blocks).
        size: the stream's rows, when known.
    """

    documents: int
    rule: str
    size: int | None


def _signature(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def stream_size(source: DataSource, train: datasets.IterableDataset) -> int | None:
    """The number of rows (documents) of the raw train stream, or ``None`` where it is not known.

    Args:
        source: the data's ``DataSource``.
        train: its raw, unshuffled train stream (``load_raw_splits``).
    """
    if source.kind == "hub":
        splits = train.info.splits if train.info is not None else None
        info = splits.get(source.train_split) if splits else None
        return int(info.num_examples) if info is not None and info.num_examples else None
    path = Path(source.train_file or source.dataset_name).expanduser()
    key = (json.dumps(source.to_dict(), sort_keys=True), _signature(path))
    if key not in _COUNTS:
        if path.suffix.lower() == ".parquet" and path.is_file():
            import pyarrow.parquet as pq

            _COUNTS[key] = pq.ParquetFile(path).metadata.num_rows
        else:  # Arrow batches: the builders' own parsing, so a row here is a row of the stream
            _COUNTS[key] = sum(len(table) for table in train.with_format("arrow").iter(batch_size=_COUNT_BATCH))
    return _COUNTS[key]


def _percentage_rows(source: DataSource, size: int) -> int:
    pct = source.validation_split_percentage
    rows = int(round(pct * size / 100.0))  # datasets' `train[:P%]` rounding
    where = source.train_file or source.dataset_name
    if rows == 0:
        raise ValueError(f"--validation_split_percentage={pct} with --streaming: {pct}% of the {size} documents of {where!r} is none; raise it to at least {100 / size:.3g}")
    if rows >= size:
        raise ValueError(f"--validation_split_percentage={pct} with --streaming: holds out all {size} documents of {where!r}; lower it so that some remain to train on")
    return rows


def _unknown_size(source: DataSource) -> str:
    where = source.hub_id or source.train_file or source.dataset_name
    return (
        f"--validation_split_percentage={source.validation_split_percentage} with --streaming: the size of {where!r} is not known (its split info "
        "has no num_examples), so its first P% cannot be counted; add --max_eval_samples N to hold out the stream's first N blocks, "
        "or evaluate on a split (--validation_split) or --validation_file"
    )


def check_holdout(source: DataSource, train: datasets.IterableDataset) -> None:
    """Refuse, before any process group, a holdout that cannot be honoured.

    Raises:
        ValueError: ``P`` of an unknown size without ``--max_eval_samples``; ``P`` that holds out
            no document or every document.
    """
    size = stream_size(source, train)
    if size is None:
        if source.max_eval_samples is None:
            raise ValueError(_unknown_size(source))
        return
    _percentage_rows(source, size)


def _head_documents(train: datasets.IterableDataset, text: str, tokenizer: Any, block: int, blocks_wanted: int, where: str) -> int:
    """The fewest head rows whose packing (empty texts dropped, group_texts per 1000 texts) gives ``blocks_wanted`` blocks."""
    rows = done_blocks = batch_tokens = batch_texts = 0
    for batch in train.iter(batch_size=_HEAD_BATCH):
        texts = batch[text]
        lengths = iter(len(ids) for ids in tokenize_documents([t for t in texts if t], tokenizer))
        for value in texts:
            rows += 1
            if not value:  # filtered out before packing: no tokens, not in a group_texts batch
                continue
            batch_tokens, batch_texts = batch_tokens + next(lengths), batch_texts + 1
            if done_blocks + batch_tokens // block >= blocks_wanted:
                return rows
            if batch_texts == GROUP_BATCH:  # group_texts drops each batch's remainder
                done_blocks, batch_tokens, batch_texts = done_blocks + batch_tokens // block, 0, 0
    raise ValueError(f"--max_eval_samples={blocks_wanted} with --streaming: all of {where!r} gives fewer blocks of {block} tokens; lower it or --max_seq_length")


def holdout(source: DataSource, train: datasets.IterableDataset, text: str, tokenizer: Any) -> Holdout:
    """The head of ``train`` held out for evaluation (see the module docstring for the rules).

    Args:
        source: a streaming ``DataSource`` with ``validation_split_percentage``.
        train: its raw, unshuffled train stream.
        text: the text column.
        tokenizer: the run's tokenizer (the unknown-size rule counts blocks).

    Raises:
        ValueError: as ``check_holdout``; a stream too short for ``max_eval_samples`` blocks.
    """
    size = stream_size(source, train)
    if size is not None:
        return Holdout(documents=_percentage_rows(source, size), rule="percentage", size=size)
    if source.max_eval_samples is None:
        raise ValueError(_unknown_size(source))
    where = source.hub_id or source.train_file or source.dataset_name
    documents = _head_documents(train, text, tokenizer, source.max_seq_length, source.max_eval_samples, where)
    return Holdout(documents=documents, rule="blocks", size=None)
