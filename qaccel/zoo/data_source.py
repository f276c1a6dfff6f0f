"""Where a user's dataset comes from: ``DataSource`` (the training script's data flags) and the file formats.

A leaf of the data layer: ``recipes`` checks a ``dataset: {name: datasets}`` section into a
``DataSource``, ``sources`` loads its raw splits and ``user_data`` / ``user_stream`` prepare them
(``qaccel.zoo.pipeline``), so the recipes never import a loader and no loader imports the recipes' parser.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FILE_BUILDERS", "DataSource"]

# file extension -> the datasets builder that reads it
FILE_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow"}


@dataclass(frozen=True, kw_only=True)
class DataSource:
    """Where a user's dataset comes from and which columns to use (the training script's flags).

    Attributes:
        dataset_name: a Hub dataset id, a ``save_to_disk`` folder or a folder laid out like a Hub
            dataset repository (``--dataset_name``). Exclusive with ``train_file``.
        dataset_config_name: the dataset's configuration, e.g. ``mrpc`` of ``nyu-mll/glue``.
        dataset_revision: a branch, tag or commit of a Hub dataset.
        train_split, validation_split: split names (default ``train`` / ``validation``).
        train_file, validation_file: local files (``FILE_BUILDERS`` lists the formats).
        text_column: the text (default: ``text`` if present, else ``sentence``, else the first string column).
        text_pair_column: the second text of a pair (classification only).
        label_column: the class (classification; default ``label``).
        validation_split_percentage: carve this percentage (0 < p < 100) of the train split out as
            the validation set, with the run's seed.
        max_seq_length: tokens per example (classification: truncation) or per block (LM).
        max_eval_samples: evaluate on at most this many examples (blocks for LMs), the first ones
            of the validation set (default: all; streaming: 1000, the first blocks of the stream).
        streaming: read the train split as a stream (``load_dataset(..., streaming=True)``):
            causal-lm and masked-lm only; see ``qaccel.zoo.user_stream``.
        streaming_shuffle_buffer: documents in the stream's shuffle buffer (with ``streaming``
            only; default ``DEFAULT_SHUFFLE_BUFFER``, 10000; 1 keeps the file order).
    """

    dataset_name: str | None = None
    dataset_config_name: str | None = None
    dataset_revision: str | None = None
    train_split: str = "train"
    validation_split: str = "validation"
    train_file: str | None = None
    validation_file: str | None = None
    text_column: str | None = None
    text_pair_column: str | None = None
    label_column: str | None = None
    validation_split_percentage: float | None = None
    max_seq_length: int = 128
    max_eval_samples: int | None = None
    streaming: bool = False
    streaming_shuffle_buffer: int | None = None

    def __post_init__(self) -> None:
        if (self.dataset_name is None) == (self.train_file is None):
            raise ValueError("--dataset_name / --train_file: give exactly one (a Hub id or local folder, or local files)")
        if self.validation_file is not None and self.train_file is None:
            raise ValueError(f"--validation_file={self.validation_file!r}: needs --train_file (with --dataset_name, pick a split with --validation_split)")
        if self.validation_file is not None and self.validation_split_percentage is not None:
            raise ValueError("--validation_file and --validation_split_percentage: give at most one")
        pct = self.validation_split_percentage
        if pct is not None and not 0 < pct < 100:
            raise ValueError(f"--validation_split_percentage={pct}: must be a number in (0, 100)")
        if self.max_seq_length < 8:
            raise ValueError(f"--max_seq_length={self.max_seq_length}: must be >= 8")
        if self.max_eval_samples is not None and self.max_eval_samples < 1:
            raise ValueError(f"--max_eval_samples={self.max_eval_samples}: must be >= 1")
        if not self.streaming and self.streaming_shuffle_buffer is not None:
            raise ValueError(f"--streaming_shuffle_buffer={self.streaming_shuffle_buffer}: applies with --streaming only")
        if self.streaming_shuffle_buffer is not None and self.streaming_shuffle_buffer < 1:
            raise ValueError(f"--streaming_shuffle_buffer={self.streaming_shuffle_buffer}: must be >= 1 (1: no shuffling)")

    @property
    def kind(self) -> str:
        """``files``, ``saved`` (a save_to_disk folder), ``folder`` (a Hub-style local folder) or ``hub``."""
        if self.train_file is not None:
            return "files"
        folder = Path(self.dataset_name).expanduser()
        if (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file():
            return "saved"
        return "folder" if folder.is_dir() else "hub"

    @property
    def hub_id(self) -> str | None:
        """The Hub dataset id (for a model card's ``datasets:``), or ``None`` for local data."""
        return self.dataset_name if self.kind == "hub" else None

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values (recorded in checkpoints, compared on resume)."""
        return dataclasses.asdict(self)
