"""A user's dataset, loaded through ``datasets`` as a user's own script would, made model-ready.

Where the data comes from (``DataSource``), first match wins:

- ``train_file`` (and ``validation_file``): local files of a format ``datasets`` reads, picked by
  extension (``.csv``, ``.json``/``.jsonl``, ``.parquet``, ``.txt``, ``.arrow``), through
  ``load_dataset(<format>, data_files=...)``;
- ``dataset_name`` naming a local folder written by ``save_to_disk`` (it holds ``state.json`` or
  ``dataset_dict.json``): ``datasets.load_from_disk``;
- ``dataset_name`` naming any other local folder (laid out like a Hub dataset repository: data
  files, optionally a README with ``configs``): ``load_dataset(folder, config)``;
- ``dataset_name`` otherwise: a Hub dataset id, ``load_dataset(id, config, revision=...)``.

The validation set is the ``validation_split`` (or ``validation_file``), or, with
``validation_split_percentage``, that share of the train split drawn with the run's seed
(``train_test_split``, so the same seed gives the same rows on every process and every run;
with ``streaming``, the stream's first P% of documents: ``stream_holdout``).

Tasks, as Hugging Face's ``run_clm.py`` / ``run_mlm.py`` / ``run_glue.py`` prepare them:

- ``causal-lm`` / ``masked-lm``: the text column is tokenized (batched ``map``), an eos token
  closes each text when the tokenizer has one and did not add it, and each ``map`` batch of 1000
  texts is concatenated and cut into blocks of ``max_seq_length`` (``group_texts``: the remainder
  of each batch is dropped).
- ``sequence-classification``: the text column, or a pair of text columns, truncated to
  ``max_seq_length`` and padded per batch; labels may be integers, strings or a ``ClassLabel``.
  Their names, by label id, become the model's ``id2label`` (strings: sorted; integers: their
  decimal text; ``ClassLabel``: its names).

Every ``map`` carries a fingerprint from the raw table's, the tokenizer's digest and the settings,
so the datasets cache is reused by the other processes and by the next run.

With ``streaming`` (language models only) nothing is converted or cached: ``user_stream`` reads,
shuffles, shards, tokenizes and packs on the fly, and resumes at the same block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._settings import env_flag

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from .data import DataSplits
    from .recipes import Recipe

__all__ = ["FILE_BUILDERS", "GROUP_BATCH", "DEFAULT_TRAINING", "DEFAULT_LAUNCH_CONFIGS", "DataSource", "check_data_source", "load_raw_splits", "load_user_data", "default_recipe"]

# file extension -> the datasets builder that reads it
FILE_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow"}
GROUP_BATCH = 1000  # texts per group_texts batch, as run_clm
# The run without a recipe (--model_name_or_path, --task and a dataset): flags override these.
DEFAULT_TRAINING = {
    "max_steps": 100, "per_device_batch_size": 8, "gradient_accumulation_steps": 1, "learning_rate": 5e-5,
    "weight_decay": 0.0, "warmup_steps": 0, "lr_scheduler": "linear", "seed": 0, "mixed_precision": "no",
}  # fmt: skip
# method -> the shipped launch config (2 CPU processes; `qaccel train --launch_config` picks another)
DEFAULT_LAUNCH_CONFIGS = {"qsdp": "cpu_2proc_qsdp", "none": "cpu_2proc_qsdp", "zero_one_adam": "cpu_2proc_ddp", "onebit_adam": "cpu_2proc_ddp"}


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


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or any(env_flag(name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _offline_help(name: str) -> str:
    return (
        f"--dataset_name={name!r} is a Hugging Face Hub dataset id, and the Hub cannot be used here "
        "(HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set, or the Hub is unreachable). Pass local data instead: "
        "files with --train_file/--validation_file (csv, json/jsonl, parquet, txt, arrow), or a folder to "
        f"--dataset_name (one written by `datasets.load_dataset({name!r}).save_to_disk(DIR)` where there is network, "
        "or a copy of the dataset repository)"
    )


def _check_hub(source: DataSource) -> None:
    """Fail in seconds, before any collective, when a Hub dataset cannot be reached or does not exist."""
    name = source.dataset_name
    if _hub_offline():
        raise RuntimeError(_offline_help(name))
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        HfApi().dataset_info(name, revision=source.dataset_revision, timeout=10)
    except RepositoryNotFoundError:
        raise ValueError(f"--dataset_name={name!r}: no such dataset on the Hub (or it is private: log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise ValueError(f"--dataset_revision={source.dataset_revision!r}: no such revision of {name!r}") from None
    except OSError as err:  # requests' ConnectionError and timeouts are OSErrors
        raise RuntimeError(f"{_offline_help(name)} ({type(err).__name__}: {err})") from None


def _builder(path: str, flag: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FILE_BUILDERS:
        raise ValueError(f"{flag}={path!r}: unknown file type {suffix or '(none)'!r}; allowed: {', '.join(FILE_BUILDERS)}")
    if not Path(path).expanduser().is_file():
        raise ValueError(f"{flag}={path!r}: no such file")
    return FILE_BUILDERS[suffix]


def _load_dict(source: DataSource) -> datasets.DatasetDict | datasets.IterableDatasetDict:
    """The dataset's splits; with ``source.streaming`` as ``IterableDataset``s (nothing converted or cached)."""
    import datasets

    streaming = source.streaming

    kind = source.kind
    if kind == "files":
        files = {"train": source.train_file}
        if source.validation_file is not None:
            files["validation"] = source.validation_file
        builders = {flag: _builder(path, f"--{flag}_file") for flag, path in files.items()}
        if len(set(builders.values())) > 1:
            raise ValueError(f"--train_file and --validation_file: must be of one format, got {builders['train']} and {builders['validation']}")
        return datasets.load_dataset(builders["train"], data_files={k: str(Path(v).expanduser()) for k, v in files.items()}, streaming=streaming)
    if kind == "saved":
        loaded = datasets.load_from_disk(str(Path(source.dataset_name).expanduser()))
        tables = loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded})
        return datasets.IterableDatasetDict({name: table.to_iterable_dataset() for name, table in tables.items()}) if streaming else tables
    return datasets.load_dataset(source.dataset_name, source.dataset_config_name, revision=source.dataset_revision, streaming=streaming)


def load_raw_splits(source: DataSource, *, seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """The raw train and validation tables of ``source`` (columns as the data has them).

    With ``source.streaming`` they are ``datasets.IterableDataset``s, and with
    ``validation_split_percentage`` the validation table is ``None``: ``user_stream`` holds out the head.

    Raises:
        ValueError: a missing file or split (naming the splits there are).
        RuntimeError: a Hub id while offline.
    """
    if source.kind == "hub" and _hub_offline():
        raise RuntimeError(_offline_help(source.dataset_name))
    tables = _load_dict(source)
    train_split = "train" if source.kind == "files" else source.train_split
    where = source.train_file or source.dataset_name
    if train_split not in tables:
        raise ValueError(f"--train_split={train_split!r}: no such split in {where!r}; its splits: {', '.join(tables)}")
    train = tables[train_split]
    if source.validation_split_percentage is not None:
        if source.streaming:  # run_clm's `train[:P%]`: needs the stream's size or the tokenizer (stream_holdout)
            return train, None
        parts = train.train_test_split(test_size=source.validation_split_percentage / 100, seed=seed, shuffle=True)
        return parts["train"], parts["test"]
    validation_split = "validation" if source.kind == "files" else source.validation_split
    if validation_split not in tables:
        splits = f"--validation_split={validation_split!r}: no such split in {where!r}; its splits: {', '.join(tables)}. Pick one with --validation_split,"
        what = f"--train_file={where!r}: has no validation set;" if source.kind == "files" else splits
        carve = "hold out the stream's first P% of documents" if source.streaming else "carve a random P% out of the train split"
        raise ValueError(f"{what} pass --validation_file, or {carve} with --validation_split_percentage P")
    return train, tables[validation_split]


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
    """Resolve and check the column mapping against the dataset's features: role -> column."""
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


def check_data_source(source: DataSource, task: str) -> None:
    """Check ``source`` before any process group: files, splits and columns; a Hub id's reachability.

    Local data (files and folders) is loaded to read its columns (``datasets`` converts it once
    and caches it; the training run reuses the cache). A Hub dataset is only looked up
    (``dataset_info``, seconds): its columns are checked when the data is loaded.

    Raises:
        ValueError: a missing file, split or column (naming those the data has), negative labels.
        TypeError: labels that are neither integers, strings nor a ``ClassLabel``.
        RuntimeError: a Hub id while offline or with the Hub unreachable (naming HF_HUB_OFFLINE /
            HF_DATASETS_OFFLINE and how to pass local data).
    """
    if source.streaming and task == "sequence-classification":
        raise NotImplementedError("--streaming: for --task causal-lm and masked-lm; sequence-classification data is loaded whole (drop --streaming)")
    if source.kind == "hub":
        _check_hub(source)
        return
    if source.streaming:  # the first rows only: a corpus is never converted whole
        from .user_stream import check_stream

        check_stream(source, task)
        return
    train, validation = load_raw_splits(source, seed=0)
    roles = text_columns(source, task, train.features)
    if task == "sequence-classification":
        _label_names(train, validation, roles["label"])  # float or negative labels: refused now, not on one rank later
    missing = set(train.column_names) - set(validation.column_names)
    if missing:
        raise ValueError(f"--validation_file={source.validation_file!r}: lacks the train columns {', '.join(sorted(missing))}; its columns: {', '.join(validation.column_names)}")


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:32]


def _label_names(train: datasets.Dataset, validation: datasets.Dataset, column: str) -> tuple[list[str], dict[Any, int] | None]:
    """Class names by id, and the value -> id map when the values are not ids already (strings)."""
    import datasets

    feature = train.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return list(feature.names), None
    dtype = getattr(feature, "dtype", None)
    values = set(train.unique(column)) | set(validation.unique(column))
    if dtype in ("string", "large_string"):
        if None in values:
            raise ValueError(f"--label_column={column!r}: has empty (null) labels")
        names = sorted(values)
        return names, {name: i for i, name in enumerate(names)}
    if dtype is not None and dtype.startswith(("int", "uint")):
        if min(values) < 0:
            raise ValueError(f"--label_column={column!r}: has the label {min(values)}; integer labels must be >= 0 (an unlabelled test split has -1)")
        return [str(i) for i in range(max(values) + 1)], None
    raise TypeError(f"--label_column={column!r}: has {dtype or type(feature).__name__} values; sequence-classification needs integer, string or ClassLabel labels")


def _classification(table: datasets.Dataset, roles: dict[str, str], label_ids: dict | None, tokenizer, max_length: int, fingerprint: str) -> datasets.Dataset:
    text, pair, label = roles["text"], roles.get("text_pair"), roles["label"]

    def encode(batch: dict[str, list]) -> dict[str, Any]:
        encoded = tokenizer(batch[text], batch[pair] if pair else None, truncation=True, max_length=max_length)
        labels = batch[label] if label_ids is None else [label_ids[value] for value in batch[label]]
        return {**encoded, "labels": labels}

    return table.map(encode, batched=True, remove_columns=table.column_names, new_fingerprint=fingerprint, desc="tokenizing")


def packing_map(text: str, tokenizer, block: int, masked: bool) -> Any:
    """run_clm's ``group_texts``: a batched ``map`` function packing a batch of texts into blocks."""
    from .data import pack_blocks, tokenize_documents

    special = sorted(set(tokenizer.all_special_ids))

    def group_texts(batch: dict[str, list]) -> dict[str, Any]:
        blocks = pack_blocks(tokenize_documents(batch[text], tokenizer), block)  # (blocks, block)
        rows: dict[str, Any] = {"input_ids": blocks.tolist(), "attention_mask": [[1] * block for _ in range(len(blocks))]}
        if masked:  # the collator must never mask [CLS]/[SEP]/eos
            rows["special_tokens_mask"] = [[int(t in special) for t in row] for row in rows["input_ids"]]
        else:
            rows["labels"] = rows["input_ids"]
        return rows

    return group_texts


def _language_model(table: datasets.Dataset, text: str, tokenizer, block: int, masked: bool, fingerprint: str) -> datasets.Dataset:
    table = table.filter(lambda t: bool(t), input_columns=text, new_fingerprint=fingerprint + "-nonempty")
    group_texts = packing_map(text, tokenizer, block, masked)
    return table.map(
        group_texts, batched=True, batch_size=GROUP_BATCH, remove_columns=table.column_names, new_fingerprint=fingerprint, desc=f"tokenizing and packing into blocks of {block}"
    )


def task_collator(task: str, tokenizer, mlm_probability: float) -> Any:
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, default_data_collator

    if task == "causal-lm":
        return default_data_collator  # run_clm's choice: blocks are full, labels = input_ids
    if task == "masked-lm":
        return DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=mlm_probability)
    return DataCollatorWithPadding(tokenizer)


def load_user_data(source: DataSource, task: str, tokenizer: PreTrainedTokenizerBase, *, seed: int, mlm_probability: float = 0.15) -> DataSplits:
    """The train and eval sets of ``source`` for ``task``, tokenized, in torch format, and their collator.

    Call it under ``accelerator.main_process_first()`` in a multi-process run, so the other
    processes reuse the main one's caches. With ``source.streaming``, ``train`` is this rank's
    share of the stream (``user_stream.StreamingBlocks``), ``eval`` the first validation blocks.

    Raises:
        ValueError: a missing split or column, or too little text for one block.
        TypeError: labels that are neither integers, strings nor a ``ClassLabel``.
    """
    from .data import DataSplits
    from .tokenizer import tokenizer_digest

    if source.streaming:
        from .user_stream import load_stream

        return load_stream(source, task, tokenizer, seed=seed, mlm_probability=mlm_probability)
    train_raw, eval_raw = load_raw_splits(source, seed=seed)
    roles = text_columns(source, task, train_raw.features)
    digest = tokenizer_digest(tokenizer)
    block = source.max_seq_length
    label_names, label_ids = _label_names(train_raw, eval_raw, roles["label"]) if task == "sequence-classification" else (None, None)
    splits = []
    for name, table in (("train", train_raw), ("eval", eval_raw)):
        fingerprint = _fingerprint(table._fingerprint, digest, task, roles, block, name)
        if task == "sequence-classification":
            splits.append(_classification(table, roles, label_ids, tokenizer, block, fingerprint))
        else:
            splits.append(_language_model(table, roles["text"], tokenizer, block, task == "masked-lm", fingerprint))
    train, evaluation = splits
    for name, table, raw in (("train", train, train_raw), ("validation", evaluation, eval_raw)):
        if len(table) == 0:
            raise ValueError(f"the {name} set of {source.train_file or source.dataset_name!r}: {len(raw)} rows give no example of {block} tokens; add text or lower --max_seq_length")
    if source.max_eval_samples is not None:  # run_clm's --max_eval_samples: the first ones
        evaluation = evaluation.select(range(min(source.max_eval_samples, len(evaluation))))
    train.set_format("torch")
    evaluation.set_format("torch")
    collator = task_collator(task, tokenizer, mlm_probability)
    info = {
        "dataset": source.hub_id or source.train_file or source.dataset_name,
        "columns": roles,
        "train_documents": len(train_raw),
        "eval_documents": len(eval_raw),
        "train_examples": len(train),
        "eval_examples": len(evaluation),
    }
    return DataSplits(train=train, eval=evaluation, collator=collator, label_names=label_names, info=info)


# The path of a run without a recipe: no card behind it, and its checkpoints record no recipe name.
DEFAULT_RECIPE_PATH = Path("<defaults>")


def default_recipe(model_name_or_path: str, task: str, *, method: str = "qsdp", max_seq_length: int = 128) -> Recipe:
    """The recipe of a run without one: the pretrained model, ``DEFAULT_TRAINING``, ``method``.

    The FSDP2 wrap unit is the model's repeated block (``detect_layer_cls``), the tokenizer the
    model's own, the method settings their config defaults, the launch config
    ``DEFAULT_LAUNCH_CONFIGS[method]``; evaluation and a checkpoint at the end. Its name is
    ``custom`` and its dataset ``user`` (the data comes from a ``DataSource``).
    """
    from .._resources import launch_config_path
    from .models import detect_layer_cls
    from .recipes import DatasetSpec, LaunchSpec, MethodSpec, ModelSpec, Recipe, TokenizerSpec, TrainingSpec

    training = TrainingSpec(
        **DEFAULT_TRAINING,
        eval_steps=DEFAULT_TRAINING["max_steps"],
        save_steps=DEFAULT_TRAINING["max_steps"],
        mlm_probability=0.15 if task == "masked-lm" else None,
    )
    launch = launch_config_path(DEFAULT_LAUNCH_CONFIGS[method])
    return Recipe(
        name="custom",
        summary=f"{model_name_or_path} for {task} on a user's dataset",
        task=task,
        model=ModelSpec(name_or_path=model_name_or_path, config=None, transformer_layer_cls=detect_layer_cls(model_name_or_path, task)),
        tokenizer=TokenizerSpec(name_or_path=None, kind=None, vocab_size=None),
        dataset=DatasetSpec(name="user", seq_len=max_seq_length, eval_fraction=0.0),
        training=training,
        method=MethodSpec(name=method, qsdp={}, zero_one_adam={}, onebit_adam={}),
        launch=LaunchSpec(config=f"launch_configs/{launch.name}", num_processes=2),
        expected={},
        card_body="",
        path=DEFAULT_RECIPE_PATH,
    )
