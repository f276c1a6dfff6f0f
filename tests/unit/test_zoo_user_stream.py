"""``--streaming`` pieces in one process: the per-rank split, the replay resume, the refusals.

References: the blocks packed here from the corpus (file order, shuffle buffer 1), and an
uninterrupted iteration of the same stream, which a stream restored from its state must continue.
"""

from __future__ import annotations

import itertools
import json

import pytest

from qaccel.zoo.user_data import DataSource, check_data_source
from qaccel.zoo.user_stream import (
    StreamingBlocks,
    check_stream_resume,
    load_stream,
    read_stream_state,
    write_stream_state,
)

BLOCK = 8
TEXTS = [f"doc {i}: a stream of words number {i % 5} and {i % 3}" for i in range(30)]


@pytest.fixture
def tokenizer():
    from qaccel.zoo.tokenizer import train_bpe

    tokenizer = train_bpe(TEXTS, 300)
    tokenizer.add_special_tokens({"mask_token": "<mask>"})  # masked-lm's collator needs one
    return tokenizer


@pytest.fixture
def corpus(tmp_path) -> DataSource:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:6]))
    return DataSource(train_file=str(tmp_path / "train.jsonl"), validation_file=str(tmp_path / "dev.jsonl"), streaming=True, max_seq_length=BLOCK)


def _ids(stream: StreamingBlocks, n: int) -> list[list[int]]:
    return [row["input_ids"].tolist() for row in itertools.islice(iter(stream), n)]


def _packed(tokenizer) -> list[list[int]]:
    stream: list[int] = []
    for ids in tokenizer(TEXTS)["input_ids"]:
        stream += ids + [tokenizer.eos_token_id]
    return [stream[i : i + BLOCK] for i in range(0, len(stream) - BLOCK + 1, BLOCK)]


def test_ranks_get_every_other_block_of_the_file_order_stream(corpus, tokenizer):
    import dataclasses

    source = dataclasses.replace(corpus, streaming_shuffle_buffer=1)
    blocks = _packed(tokenizer)
    for rank in (0, 1):
        data = load_stream(source, "causal-lm", tokenizer, seed=0, rank=rank, world_size=2)
        share = blocks[rank::2]
        assert _ids(data.train, len(share)) == share


def test_shuffled_shares_partition_the_single_process_stream(corpus, tokenizer):
    """Every block of the one-process stream (same seed) goes to exactly one rank, alternately."""
    blocks = _packed(tokenizer)
    whole = _ids(load_stream(corpus, "causal-lm", tokenizer, seed=3, rank=0, world_size=1).train, len(blocks))
    assert whole != blocks  # the buffer shuffled the documents
    for rank in (0, 1):
        data = load_stream(corpus, "causal-lm", tokenizer, seed=3, rank=rank, world_size=2)
        share = _ids(data.train, len(blocks[rank::2]))
        assert share == whole[rank::2]
        assert data.train.state_dict() == {"epoch": 0, "blocks": len(share), "rank": rank, "world_size": 2}


@pytest.mark.parametrize("position", [0, 5, 14, 17], ids=["start", "mid-epoch", "end-of-epoch", "epoch-1"])
def test_a_restored_stream_continues_where_the_uninterrupted_one_does(corpus, tokenizer, position):
    straight = load_stream(corpus, "masked-lm", tokenizer, seed=1, rank=1, world_size=2).train
    expected = _ids(straight, position + 6)
    first = load_stream(corpus, "masked-lm", tokenizer, seed=1, rank=1, world_size=2).train
    _ids(first, position)
    state = json.loads(json.dumps(first.state_dict()))  # as it travels through the checkpoint
    restored = load_stream(corpus, "masked-lm", tokenizer, seed=1, rank=1, world_size=2).train
    restored.load_state_dict(state)
    assert _ids(restored, 6) == expected[position:]


def test_state_files_round_trip_and_refuse_other_world_sizes(tmp_path, corpus, tokenizer):
    states = [{"epoch": 1, "blocks": 3, "rank": r, "world_size": 2} for r in (0, 1)]
    write_stream_state(tmp_path, states)
    assert read_stream_state(tmp_path, 1) == states[1]
    check_stream_resume(tmp_path, streaming=True, world_size=2)
    with pytest.raises(ValueError, match="written by 2 processes, this run has 4"):
        check_stream_resume(tmp_path, streaming=True, world_size=4)
    with pytest.raises(ValueError, match="resume it with --streaming"):
        check_stream_resume(tmp_path, streaming=False, world_size=2)
    with pytest.raises(ValueError, match="has no qaccel_stream_state.json"):
        check_stream_resume(tmp_path / "elsewhere", streaming=True, world_size=2)
    blocks = load_stream(corpus, "causal-lm", tokenizer, seed=0, rank=0, world_size=1).train
    with pytest.raises(ValueError, match="rank 1 of 2, this process is rank 0 of 1"):
        blocks.load_state_dict(states[1])


def test_eval_is_the_first_max_eval_samples_blocks_of_the_validation_file(corpus, tokenizer):
    import dataclasses

    data = load_stream(dataclasses.replace(corpus, max_eval_samples=2), "causal-lm", tokenizer, seed=0, rank=0, world_size=2)
    stream: list[int] = []
    for ids in tokenizer(TEXTS[:6])["input_ids"]:
        stream += ids + [tokenizer.eos_token_id]
    assert [row["input_ids"].tolist() for row in data.eval] == [stream[:BLOCK], stream[BLOCK : 2 * BLOCK]]


def test_refused_combinations(tmp_path, corpus):
    import dataclasses

    with pytest.raises(ValueError, match="--streaming_shuffle_buffer=100: applies with --streaming only"):
        DataSource(train_file=corpus.train_file, streaming_shuffle_buffer=100)
    with pytest.raises(ValueError, match="--streaming_shuffle_buffer=0: must be >= 1"):
        DataSource(train_file=corpus.train_file, streaming=True, streaming_shuffle_buffer=0)
    with pytest.raises(NotImplementedError, match="sequence-classification data is loaded whole"):
        check_data_source(corpus, "sequence-classification")
    with pytest.raises(ValueError, match="--text_column='body': no such column .* its columns: text"):
        check_data_source(dataclasses.replace(corpus, text_column="body"), "causal-lm")
    check_data_source(corpus, "causal-lm")  # a good stream passes (from its first rows)


def test_the_train_flags_reach_the_data_source(corpus):
    from qaccel._errors import UsageError
    from qaccel.train import data_source, parse_args

    base = ["--output_dir", "x", "--model_name_or_path", "m", "--task", "causal-lm"]
    args = parse_args([*base, "--train_file", corpus.train_file, "--streaming", "--streaming_shuffle_buffer", "64", "--max_eval_samples", "5"])
    source = data_source(args, 32)
    assert (source.streaming, source.streaming_shuffle_buffer, source.max_eval_samples, source.max_seq_length) == (True, 64, 5, 32)
    assert source.to_dict()["streaming"] is True  # recorded in the checkpoint's run state
    for flags in (["--streaming"], ["--streaming_shuffle_buffer", "8"]):
        with pytest.raises(UsageError, match="applies to a dataset given with --dataset_name or --train_file"):
            data_source(parse_args(["--output_dir", "x", "--recipe", "gpt2-tiny", *flags]), 32)
