"""``--streaming --validation_split_percentage``: the stream's head held out for evaluation, never trained on.

References, written here independently of the code: a corpus of numbered documents; a word-level
tokenizer under which document ``i`` is exactly one block whose first token names ``i`` (so the
documents reaching evaluation or training are read off the blocks, whatever the shuffle); and, for
documents of varying length, the blocks packed here by hand (tokens, eos, cut into blocks).
Ranks are simulated with ``load_stream(rank=, world_size=)``, as the existing stream tests do.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json

import pytest

from qaccel.zoo import stream_holdout
from qaccel.zoo.user_data import DataSource, check_data_source
from qaccel.zoo.user_stream import load_stream

BLOCK = 8
DOCS = 40
FILLER = ["a", "b", "c", "d", "e", "f"]  # 1 id word + 6 fillers + eos = one block of 8
TEXTS = [" ".join([f"d{i}", *FILLER]) for i in range(DOCS)]


@pytest.fixture(scope="module")
def words():
    """Word-level tokenizer: ``d{i}`` is token ``i``; eos is appended by the packing, not the tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"d{i}": i for i in range(DOCS)} | {w: DOCS + j for j, w in enumerate(FILLER)}
    vocab |= {"<unk>": len(vocab), "<eos>": len(vocab) + 1, "<mask>": len(vocab) + 2}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>", mask_token="<mask>")


def _write(tmp_path, fmt: str, texts: list[str]) -> str:
    path = tmp_path / f"corpus.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    elif fmt == "csv":
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["id", "text"])
            writer.writerows(enumerate(texts))
    else:
        path.write_text("".join(t + "\n" for t in texts))
    return str(path)


def _source(path: str, **kw) -> DataSource:
    return DataSource(train_file=path, streaming=True, max_seq_length=BLOCK, **kw)


def _doc_ids(rows) -> list[int]:
    """The document each one-document block came from (its first token), checking it is whole."""
    ids = []
    for row in rows:
        tokens = [int(t) for t in row["input_ids"]]
        assert tokens[1:7] == list(range(DOCS, DOCS + 6)), tokens  # the block is one whole document
        ids.append(tokens[0])
    return ids


def _train_ids(stream, n: int) -> list[int]:
    return _doc_ids(itertools.islice(iter(stream), n))


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "txt"])
@pytest.mark.parametrize("pct", [10.0, 25.0])
def test_eval_is_the_first_p_percent_and_no_rank_trains_on_it(tmp_path, words, fmt, pct):
    held = int(DOCS * pct / 100)  # 4 or 10: no rounding at stake
    source = _source(_write(tmp_path, fmt, TEXTS), validation_split_percentage=pct)
    check_data_source(source, "causal-lm")  # accepted before any process group
    seen: list[int] = []
    for rank in (0, 1):
        data = load_stream(source, "causal-lm", words, seed=5, rank=rank, world_size=2)
        assert _doc_ids(data.eval) == list(range(held))
        assert data.info["held_out_documents"] == held and data.info["holdout"] == "percentage"
        seen += _train_ids(data.train, (DOCS - held) // 2 * 3)  # three epochs of this rank's share
    per_epoch = sorted(seen[: (DOCS - held) // 2] + seen[3 * (DOCS - held) // 2 : 4 * (DOCS - held) // 2])
    assert per_epoch == list(range(held, DOCS))  # epoch 0 of both ranks: every other document once
    assert min(seen) == held


@pytest.mark.parametrize("pct", [25.0, 75.0], ids=["first-file", "across-files"])
def test_a_folder_of_files_holds_out_its_head_in_file_order(tmp_path, words, pct):
    """Two files and two ranks: datasets would split a skip() by files; the holdout must not."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for part in (0, 1):
        (folder / f"part-{part}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[20 * part : 20 * part + 20]))
    held = int(DOCS * pct / 100)
    source = DataSource(dataset_name=str(folder), streaming=True, max_seq_length=BLOCK, validation_split_percentage=pct)
    check_data_source(source, "causal-lm")
    seen: list[int] = []
    for rank in (0, 1):
        data = load_stream(source, "causal-lm", words, seed=0, rank=rank, world_size=2)
        assert _doc_ids(data.eval) == list(range(held))
        seen += _train_ids(data.train, (DOCS - held) // 2)
    assert sorted(seen) == list(range(held, DOCS))


def test_eval_blocks_are_the_head_documents_packed(tmp_path):
    """Documents of varying length: the eval set is run_clm's packing of exactly the first P% of them."""
    from qaccel.zoo.tokenizer import train_bpe

    texts = [f"document {i} says " + "word " * (i % 7) + f"end {i}" for i in range(50)]
    tokenizer = train_bpe(texts, 300)
    data = load_stream(_source(_write(tmp_path, "jsonl", texts), validation_split_percentage=20.0), "causal-lm", tokenizer, seed=0, rank=0, world_size=1)
    stream: list[int] = []
    for text in texts[:10]:
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    expected = [stream[i : i + BLOCK] for i in range(0, len(stream) - BLOCK + 1, BLOCK)]
    assert [row["input_ids"].tolist() for row in data.eval] == expected
    capped = load_stream(_source(_write(tmp_path, "jsonl", texts), validation_split_percentage=20.0, max_eval_samples=3), "causal-lm", tokenizer, seed=0, rank=0, world_size=1)
    assert [row["input_ids"].tolist() for row in capped.eval] == expected[:3]


@pytest.mark.parametrize("k", [0, 3, 18, 25], ids=["start", "mid-epoch", "epoch-end", "epoch-1"])
def test_a_resumed_held_out_stream_continues_exactly_and_still_excludes_the_head(tmp_path, words, k):
    source = _source(_write(tmp_path, "jsonl", TEXTS), validation_split_percentage=10.0)
    straight = _train_ids(load_stream(source, "masked-lm", words, seed=2, rank=1, world_size=2).train, k + 10)
    first = load_stream(source, "masked-lm", words, seed=2, rank=1, world_size=2).train
    _train_ids(first, k)
    state = json.loads(json.dumps(first.state_dict()))  # as it travels through the checkpoint
    restored = load_stream(source, "masked-lm", words, seed=2, rank=1, world_size=2).train
    restored.load_state_dict(state)
    after = _train_ids(restored, 10)
    assert after == straight[k:]
    assert not set(after) & set(range(4))


def test_unknown_size_holds_out_max_eval_samples_blocks_from_the_head(tmp_path, words, monkeypatch):
    monkeypatch.setattr(stream_holdout, "stream_size", lambda source, train: None)  # as a Hub stream without split info
    path = _write(tmp_path, "jsonl", TEXTS)
    with pytest.raises(ValueError, match=r"^--validation_split_percentage=10.0 with --streaming: the size of .* add --max_eval_samples N") as err:
        check_data_source(_source(path, validation_split_percentage=10.0), "causal-lm")
    assert "\n" not in str(err.value)
    source = _source(path, validation_split_percentage=10.0, max_eval_samples=6)
    check_data_source(source, "causal-lm")
    seen: list[int] = []
    for rank in (0, 1):
        data = load_stream(source, "causal-lm", words, seed=1, rank=rank, world_size=2)
        assert _doc_ids(data.eval) == list(range(6))
        assert (data.info["held_out_documents"], data.info["holdout"]) == (6, "blocks")
        seen += _train_ids(data.train, (DOCS - 6) // 2)
    assert sorted(seen) == list(range(6, DOCS))


def test_unknown_size_head_of_varying_documents(tmp_path, monkeypatch):
    """The fewest head documents whose packing gives N blocks: counted here by hand."""
    from qaccel.zoo.tokenizer import train_bpe

    monkeypatch.setattr(stream_holdout, "stream_size", lambda source, train: None)
    texts = [f"doc {i} " + "more " * (i % 5) for i in range(30)]
    texts[2] = ""  # an empty line: a row of the stream, no tokens
    tokenizer = train_bpe([t for t in texts if t], 300)
    tokens, documents = 0, 0
    while tokens < 4 * BLOCK:
        tokens += len(tokenizer(texts[documents])["input_ids"]) + 1 if texts[documents] else 0
        documents += 1
    source = _source(_write(tmp_path, "jsonl", texts), validation_split_percentage=50.0, max_eval_samples=4)
    data = load_stream(source, "causal-lm", tokenizer, seed=0, rank=0, world_size=1)
    assert data.info["held_out_documents"] == documents
    stream: list[int] = []
    for text in texts[:documents]:
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] if text else []
    assert [row["input_ids"].tolist() for row in data.eval] == [stream[i : i + BLOCK] for i in range(0, 4 * BLOCK, BLOCK)]


def test_stream_size_of_each_kind_of_source(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": TEXTS[:17]}), parquet)
    jsonl = tmp_path / "blank.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:9]) + "\n\n")  # blank lines are no rows
    for path, rows in ((parquet, 17), (jsonl, 9)):
        source = _source(str(path))
        train = datasets.load_dataset(path.suffix.lstrip(".").replace("jsonl", "json"), data_files=str(path), streaming=True, split="train")
        assert stream_holdout.stream_size(source, train) == rows
    hub = DataSource(dataset_name="someone/corpus", streaming=True)

    class Info:
        def __init__(self, splits):
            self.info = datasets.DatasetInfo(splits=splits)

    known = datasets.SplitDict()
    known.add(datasets.SplitInfo(name="train", num_examples=1234))
    assert stream_holdout.stream_size(hub, Info(known)) == 1234
    assert stream_holdout.stream_size(hub, Info(None)) is None


def test_bad_percentages_and_missing_validation_give_one_line_naming_the_flags(tmp_path, words):
    path = _write(tmp_path, "jsonl", TEXTS)
    cases = [
        (_source(path, validation_split_percentage=1.0), r"^--validation_split_percentage=1.0 with --streaming: 1.0% of the 40 documents .* is none; raise it to at least 2.5$"),
        (_source(path, validation_split_percentage=99.0), r"^--validation_split_percentage=99.0 with --streaming: holds out all 40 documents .*; lower it"),
        (_source(path), r"^--train_file='.*corpus.jsonl': has no validation set; pass --validation_file, or hold out the stream's first P% of documents with --validation_split_percentage P$"),
        (DataSource(train_file=path), r"^--train_file='.*': has no validation set; pass --validation_file, or carve a random P% out of the train split with --validation_split_percentage P$"),
    ]
    for source, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            check_data_source(source, "causal-lm")
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="--validation_split_percentage=99.0 with --streaming: holds out all 40"):
        load_stream(_source(path, validation_split_percentage=99.0), "causal-lm", words, seed=0, rank=0, world_size=1)


def test_the_flags_reach_a_streaming_holdout(tmp_path):
    from qaccel.train import data_source, parse_args

    path = _write(tmp_path, "jsonl", TEXTS)
    args = parse_args(["--output_dir", "x", "--model_name_or_path", "m", "--task", "causal-lm", "--train_file", path, "--streaming", "--validation_split_percentage", "10"])
    source = data_source(args, BLOCK)
    assert (source.streaming, source.validation_split_percentage) == (True, 10.0)
    assert dataclasses.asdict(source)["validation_split_percentage"] == 10.0  # recorded in the checkpoint, compared on resume
