"""The pipeline's shared steps: one packing for tables and streams, the carried variant, the block columns.

References: run_clm's ``group_texts`` written out here from the tokenizer's own ids (each document's
ids, an eos appended where missing, each batch of ``GROUP_BATCH`` texts concatenated and cut, the
remainder dropped), and the concatenation of every document's tokens for the carried packing.
"""

from __future__ import annotations

import pytest

from qaccel.zoo.pipeline import GROUP_BATCH, block_columns, carried_blocks, pack_blocks, pack_table

BLOCK = 8
# more than one group_texts batch, with empty texts to drop and lengths that leave remainders
TEXTS = [("" if i % 97 == 0 else f"doc {i} " + "word " * (i % 7)) for i in range(GROUP_BATCH + 150)]


@pytest.fixture(scope="module")
def tokenizer():
    from qaccel.zoo.tokenizer import train_bpe

    tokenizer = train_bpe(TEXTS[:200], 300)
    assert tokenizer.eos_token_id is not None  # the reference below appends it
    return tokenizer


def _ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text)["input_ids"]
    return ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]


def _group_texts_reference(tokenizer, texts: list[str]) -> list[list[int]]:
    kept = [t for t in texts if t]
    blocks = []
    for start in range(0, len(kept), GROUP_BATCH):
        stream = [i for text in kept[start : start + GROUP_BATCH] for i in _ids(tokenizer, text)]
        blocks += [stream[j : j + BLOCK] for j in range(0, len(stream) - BLOCK + 1, BLOCK)]
    return blocks


def test_a_table_and_its_stream_pack_into_the_same_blocks_as_group_texts(tokenizer, tmp_path):
    import datasets

    table = datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))})
    expected = _group_texts_reference(tokenizer, TEXTS)
    packed = pack_table(table, "text", tokenizer, BLOCK, False, columns=table.column_names, fingerprint="pipeline-test")
    streamed = list(pack_table(table.to_iterable_dataset(), "text", tokenizer, BLOCK, False, columns=["text", "id"]))
    assert packed["input_ids"] == expected
    assert [row["input_ids"] for row in streamed] == expected
    assert packed["labels"] == expected and packed.column_names == ["input_ids", "attention_mask", "labels"]


def test_carried_blocks_are_the_prefix_of_the_whole_token_stream(tokenizer):
    texts = [t for t in TEXTS[:300] if t]
    chunks = [texts[i : i + 7] for i in range(0, len(texts), 7)]  # remainders at every chunk boundary
    stream = [i for text in texts for i in _ids(tokenizer, text)]
    rows = list(carried_blocks(iter(chunks), tokenizer, BLOCK, False))
    assert [row["input_ids"] for row in rows] == [stream[j : j + BLOCK] for j in range(0, len(stream) // BLOCK * BLOCK, BLOCK)]
    assert all(row["attention_mask"] == [1] * BLOCK and row["labels"] == row["input_ids"] for row in rows)


def test_masked_blocks_mark_exactly_the_special_tokens():
    blocks = pack_blocks([[5, 0, 7, 9], [2, 3, 0, 4]], 4)  # (2, 4)
    columns = block_columns(blocks, special_ids=[0, 2], masked=True)
    assert columns["special_tokens_mask"] == [[0, 1, 0, 0], [1, 0, 1, 0]]
    assert "labels" not in columns and columns["attention_mask"] == [[1] * 4, [1] * 4]
