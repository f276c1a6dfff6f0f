"""A user's dataset, map-style: loaded through ``datasets`` as a user's own script would, made model-ready.

The pipeline (``qaccel.zoo.pipeline``) over ``datasets.Dataset`` tables: the raw splits of a
``DataSource`` (``qaccel.zoo.sources``: files, a folder or a Hub id), their columns, then per task,
as Hugging Face's ``run_clm.py`` / ``run_mlm.py`` / ``run_glue.py`` prepare them:

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

With ``streaming`` (language models only) nothing is converted or cached: ``load_user_data`` and
``check_data_source`` hand the source to ``user_stream``, the same steps over a stream, which
reads, shuffles, shards, tokenizes and packs on the fly, and resumes at the same block.

``DataSource`` and ``FILE_BUILDERS`` (``data_source``), ``load_raw_splits`` (``sources``),
``GROUP_BATCH`` (``pipeline``) and the run without a recipe (``recipes``) are re-exported here,
where the training script has always found them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._datasets_internals import table_fingerprint
from .data_source import FILE_BUILDERS, DataSource
from .pipeline import GROUP_BATCH, DataSplits, encode_classes, pack_table, task_collator, text_columns
from .recipes import (
    DEFAULT_LAUNCH_CONFIGS,
    DEFAULT_MLM_PROBABILITY,
    DEFAULT_RECIPE_PATH,
    DEFAULT_TRAINING,
    default_recipe,
)
from .sources import check_hub_dataset, fingerprint, load_raw_splits
from .tokenizer import tokenizer_digest
from .user_stream import check_stream, load_stream

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "FILE_BUILDERS",
    "GROUP_BATCH",
    "DEFAULT_TRAINING",
    "DEFAULT_LAUNCH_CONFIGS",
    "DEFAULT_RECIPE_PATH",
    "DataSource",
    "check_data_source",
    "load_raw_splits",
    "load_user_data",
    "default_recipe",
]


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
        check_hub_dataset(source)
        return
    if source.streaming:  # the first rows only: a corpus is never converted whole
        check_stream(source, task)
        return
    train, validation = load_raw_splits(source, seed=0)
    roles = text_columns(source, task, train.features)
    if task == "sequence-classification":
        _label_names(train, validation, roles["label"])  # float or negative labels: refused now, not on one rank later
    missing = set(train.column_names) - set(validation.column_names)
    if missing:
        raise ValueError(f"--validation_file={source.validation_file!r}: lacks the train columns {', '.join(sorted(missing))}; its columns: {', '.join(validation.column_names)}")


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


def load_user_data(source: DataSource, task: str, tokenizer: PreTrainedTokenizerBase, *, seed: int, mlm_probability: float = DEFAULT_MLM_PROBABILITY) -> DataSplits:
    """The train and eval sets of ``source`` for ``task``, tokenized, in torch format, and their collator.

    Call it under ``accelerator.main_process_first()`` in a multi-process run, so the other
    processes reuse the main one's caches. With ``source.streaming``, ``train`` is this rank's
    share of the stream (``user_stream.StreamingBlocks``), ``eval`` the first validation blocks.

    Raises:
        ValueError: a missing split or column, or too little text for one block.
        TypeError: labels that are neither integers, strings nor a ``ClassLabel``.
    """
    if source.streaming:
        return load_stream(source, task, tokenizer, seed=seed, mlm_probability=mlm_probability)
    train_raw, eval_raw = load_raw_splits(source, seed=seed)
    roles = text_columns(source, task, train_raw.features)
    digest = tokenizer_digest(tokenizer)
    block = source.max_seq_length
    label_names, label_ids = _label_names(train_raw, eval_raw, roles["label"]) if task == "sequence-classification" else (None, None)
    splits = []
    for name, table in (("train", train_raw), ("eval", eval_raw)):
        key = fingerprint(table_fingerprint(table), digest, task, roles, block, name)
        if task == "sequence-classification":
            splits.append(encode_classes(table, roles, tokenizer, block, fingerprint=key, label_ids=label_ids))
        else:
            splits.append(pack_table(table, roles["text"], tokenizer, block, task == "masked-lm", columns=table.column_names, fingerprint=key))
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
