"""A pre-training corpus as a stream: read, shuffled, sharded, tokenized and packed on the fly; resumable.

``DataSource(streaming=True)`` (``--streaming``) for ``causal-lm`` and ``masked-lm``. The train split
is opened with ``load_dataset(..., streaming=True)`` (a ``save_to_disk`` folder through
``to_iterable_dataset``), so nothing is converted or cached, and goes through:

1. ``shuffle(seed, buffer_size=streaming_shuffle_buffer)``: the shard order and a buffer of
   documents; ``set_epoch(e)`` reseeds both for epoch ``e``;
2. a filter of empty texts and run_clm's ``group_texts`` as a batched ``map`` (1000 texts per batch):
   ``pipeline.pack_table``, the same step as the map-style path's;
3. ``datasets.distributed.split_dataset_by_node``: with a number of files (shards) divisible by the
   world size each rank reads its own files; otherwise every rank reads the whole stream and keeps
   every ``world_size``-th block (disjoint, but each rank tokenizes everything).

``StreamingBlocks`` hands this rank's blocks to a ``DataLoader`` and never ends: when the stream
is exhausted it starts epoch ``e + 1``. Its state is ``(epoch, blocks handed out in that epoch)``.

Exact resume, and its cost: ``datasets`` 5.2's ``IterableDataset.state_dict()`` does not hold the
shuffle buffer's contents (on load it refills the buffer from the saved position, so the order
after a resume differs from an uninterrupted run). So the resume is a deterministic replay: the
same stream (same seed, epoch, rank and world size) is rebuilt and the blocks already handed out in
the current epoch are skipped. That is exact, and costs re-reading and re-tokenizing the part of the
current epoch already trained on (no model compute); the loader must read in the training process
(``num_workers=0``) so that "handed out" is "trained on". The state of every rank goes into the
checkpoint as ``STREAM_STATE_FILE`` (listed in its manifest like every other file).

The validation set is the first ``max_eval_samples`` blocks (default 1000) of the validation split
(or ``validation_file``), unshuffled, held in memory and sharded for evaluation like any eval set.
With ``validation_split_percentage`` it is the stream's held-out head instead, never trained on
(``stream_holdout``); such a stream is split between ranks by blocks, not files.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint import STREAM_STATE_FILE, atomic_write_json, read_json
from .data_source import DataSource
from .pipeline import DataSplits, pack_table, task_collator, text_columns
from .recipes import DEFAULT_MLM_PROBABILITY
from .sources import load_raw_splits
from .stream_holdout import check_holdout, holdout

if TYPE_CHECKING:
    import datasets

__all__ = ["DEFAULT_SHUFFLE_BUFFER", "DEFAULT_STREAM_EVAL_BLOCKS", "STREAM_STATE_FILE", "StreamingBlocks", "check_stream", "check_stream_resume", "load_stream", "read_stream_state", "write_stream_state"]

DEFAULT_SHUFFLE_BUFFER = 10_000  # documents; the datasets default is 1000, too few to mix a web corpus's files
DEFAULT_STREAM_EVAL_BLOCKS = 1000
logger = logging.getLogger(__name__)


def _features(table: datasets.IterableDataset) -> dict[str, Any]:
    """The stream's columns; json and csv streams only know them after the first row."""
    import datasets
    import pyarrow as pa

    if table.features is not None:
        return dict(table.features)
    first = next(iter(table.take(1)), None)
    if first is None:
        return {}
    return dict(datasets.Features.from_arrow_schema(pa.Table.from_pylist([first]).schema))


def check_stream(source: DataSource, task: str) -> None:
    """Check a local stream's splits and columns from its first rows, and a holdout's size (``check_data_source`` calls it).

    Raises:
        ValueError: a missing file, split or column (naming those the data has); a
            ``validation_split_percentage`` that cannot be honoured (``stream_holdout.check_holdout``).
    """
    train, validation = load_raw_splits(source, seed=0)
    text_columns(source, task, _features(train))
    if validation is None:  # the stream's head is held out
        check_holdout(source, train)
    else:
        text_columns(source, task, _features(validation))


def _packed(table: datasets.IterableDataset, source: DataSource, task: str, tokenizer: Any) -> datasets.IterableDataset:
    features = _features(table)
    text = text_columns(source, task, features)["text"]
    return pack_table(table, text, tokenizer, source.max_seq_length, task == "masked-lm", columns=list(features))


class StreamingBlocks(torch.utils.data.IterableDataset):
    """This rank's packed blocks of a stream, epoch after epoch, resumable at the same block.

    Args:
        blocks: this rank's stream (after ``split_dataset_by_node``), in torch format; with
            ``stride``, the whole stream, of which this rank keeps every ``world_size``-th block
            from block ``rank`` on (as ``split_dataset_by_node`` does for a stream it cannot split by files).
        rank, world_size: this process's place (recorded in the state, checked on load).
        where: the data's name, for messages.

    Iterating never ends: epoch ``e`` is ``blocks.set_epoch(e)``; then ``e + 1``. ``state_dict()``
    is ``{"epoch", "blocks", "rank", "world_size"}``: ``blocks`` handed out in ``epoch`` so far.
    """

    def __init__(self, blocks: datasets.IterableDataset, *, rank: int, world_size: int, where: str, stride: bool = False) -> None:
        self.blocks = blocks
        self.rank, self.world_size, self.where = rank, world_size, where
        self.step = world_size if stride else 1
        self.epoch, self.position = 0, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            self.blocks.set_epoch(self.epoch)
            # Replay the epoch and drop what was already handed out: exact (see the module docstring).
            start = self.position * self.step + (self.rank if self.step > 1 else 0)
            for row in itertools.islice(iter(self.blocks), start, None, self.step):
                self.position += 1
                yield row
            if self.position == 0:
                raise ValueError(f"--streaming: rank {self.rank} of {self.world_size} got no block from {self.where!r} in epoch {self.epoch}; add text or lower --max_seq_length")
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """Where this rank's stream stands: JSON values, for ``write_stream_state``."""
        return {"epoch": self.epoch, "blocks": self.position, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state`` (from ``read_stream_state``): the next block is the one after it.

        Raises:
            ValueError: a state of another rank or world size (the shards would differ).
        """
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"--streaming resume: the checkpoint's stream state is rank {state['rank']} of {state['world_size']}, this process is rank "
                f"{self.rank} of {self.world_size}; a stream resumes on the same number of processes"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["blocks"])


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def load_stream(
    source: DataSource, task: str, tokenizer: Any, *, seed: int, mlm_probability: float = DEFAULT_MLM_PROBABILITY, rank: int | None = None, world_size: int | None = None
) -> DataSplits:
    """This rank's train stream and the first validation blocks of ``source`` (``load_user_data`` with ``streaming``).

    Args:
        source: a ``DataSource`` with ``streaming=True``.
        task: ``causal-lm`` or ``masked-lm``.
        seed: the shuffle's seed (epoch ``e`` shuffles with ``seed`` and ``e``).
        rank, world_size: this process's share; default: the process group's (one process without one).

    Returns:
        ``DataSplits`` whose ``train`` is a ``StreamingBlocks`` (no length) and ``eval`` a
        ``datasets.Dataset`` of at most ``max_eval_samples`` blocks (of the validation split, or
        of the held-out head with ``validation_split_percentage``; ``info["held_out_documents"]``).

    Raises:
        ValueError: a missing split or column; a validation split too short for one block; a
            holdout that cannot be honoured (``stream_holdout.holdout``).
        NotImplementedError: ``sequence-classification``.
    """
    import datasets
    from datasets.distributed import split_dataset_by_node

    if task not in ("causal-lm", "masked-lm"):
        raise NotImplementedError(f"--streaming: for --task causal-lm and masked-lm, not {task!r} (drop --streaming)")
    if rank is None or world_size is None:
        rank, world_size = _rank_and_world()
    where = source.train_file or source.dataset_name
    train_raw, eval_raw = load_raw_splits(source, seed=seed)
    held = None
    if eval_raw is None:  # --validation_split_percentage: the stream's head, skipped before the shuffle
        held = holdout(source, train_raw, text_columns(source, task, _features(train_raw))["text"], tokenizer)
        train_raw, eval_raw = train_raw.skip(held.documents), train_raw.take(held.documents)
        if rank == 0 and held.rule == "blocks":
            logger.warning("--streaming: the size of %r is not known; held out its first %d documents (--max_eval_samples blocks), not --validation_split_percentage=%s", where, held.documents, source.validation_split_percentage)
    buffer = source.streaming_shuffle_buffer or DEFAULT_SHUFFLE_BUFFER
    train = _packed(train_raw.shuffle(seed=seed, buffer_size=buffer), source, task, tokenizer)
    if held is None:  # a held-out stream is split by blocks (StreamingBlocks' stride): skip() cannot be split by files
        train = split_dataset_by_node(train, rank=rank, world_size=world_size)
    train = train.with_format("torch")
    eval_blocks = source.max_eval_samples or DEFAULT_STREAM_EVAL_BLOCKS
    rows = list(_packed(eval_raw, source, task, tokenizer).take(eval_blocks))
    if not rows:
        raise ValueError(f"the validation set of {where!r}: gives no block of {source.max_seq_length} tokens; add text or lower --max_seq_length")
    evaluation = datasets.Dataset.from_list(rows).with_format("torch")
    info = {
        "dataset": source.hub_id or where,
        "streaming": True,
        "shuffle_buffer": buffer,
        "train_shards": train_raw.num_shards,
        "eval_examples": len(evaluation),
        **({"held_out_documents": held.documents, "holdout": held.rule} if held is not None else {}),
    }
    blocks = StreamingBlocks(train, rank=rank, world_size=world_size, where=where, stride=held is not None)
    return DataSplits(train=blocks, eval=evaluation, collator=task_collator(task, tokenizer, mlm_probability), label_names=None, info=info)


def write_stream_state(folder: str | Path, states: list[dict[str, int]]) -> None:
    """Write every rank's ``StreamingBlocks.state_dict()`` (in rank order) into a checkpoint folder."""
    atomic_write_json(Path(folder) / STREAM_STATE_FILE, states)


def check_stream_resume(folder: str | Path, *, streaming: bool, world_size: int) -> None:
    """Refuse, before any process group, a resume whose checkpoint does not match ``--streaming``.

    Raises:
        ValueError: ``--streaming`` and the checkpoint has no stream state, or one of another world
            size (each rank's shard depends on it); no ``--streaming`` and it has one.
    """
    path = Path(folder) / STREAM_STATE_FILE
    if not streaming:
        if path.is_file():
            raise ValueError(f"--resume_from_checkpoint={str(folder)!r}: written by a --streaming run (it holds {STREAM_STATE_FILE}); resume it with --streaming")
        return
    states = read_json(path) if path.is_file() else None
    if not isinstance(states, list):
        raise ValueError(f"--resume_from_checkpoint={str(folder)!r} with --streaming: the checkpoint has no {STREAM_STATE_FILE} (it was not written by a --streaming run)")
    if len(states) != world_size:
        raise ValueError(
            f"--resume_from_checkpoint={str(folder)!r} with --streaming: written by {len(states)} processes, this run has {world_size}; "
            "a stream resumes exactly only on the same number of processes (each rank's share depends on it)"
        )


def read_stream_state(folder: str | Path, rank: int) -> dict[str, int]:
    """Rank ``rank``'s stream state from a checkpoint folder.

    Raises:
        ValueError: the checkpoint has no stream state (it was not a ``--streaming`` run) or none
            for this rank.
    """
    path = Path(folder) / STREAM_STATE_FILE
    if not path.is_file():
        raise ValueError(f"--resume_from_checkpoint={str(folder)!r} with --streaming: the checkpoint has no {STREAM_STATE_FILE} (it was not written by a --streaming run)")
    states = read_json(path)
    if not isinstance(states, list) or not 0 <= rank < len(states):
        raise ValueError(f"{path}: holds the stream states of {len(states) if isinstance(states, list) else 0} ranks, not of rank {rank}: {json.dumps(states)[:200]}")
    return states[rank]
