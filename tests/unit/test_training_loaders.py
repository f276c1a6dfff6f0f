"""The train loaders: a resumed run gets exactly the batches an uninterrupted one gets after the same number.

Map-style: the reference is the same data through a plain prepared DataLoader, read epoch after epoch
(``set_epoch``) without any skipping. Streaming: the reference is the rows in file order, endlessly
(one process, no shuffle), and ``qaccel_stream_state.json`` as written out by hand.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader

from qaccel import Accelerator
from qaccel.training import MapStyleTrainLoader, StreamingTrainLoader, build_train_loader

ROWS, BATCH, SEED = 10, 3, 7  # 3 batches per epoch, the last row dropped
ROW_IDS = [{"input_ids": torch.tensor([i])} for i in range(ROWS)]


def collate(examples: list[dict]) -> dict:
    return {"input_ids": torch.stack([e["input_ids"] for e in examples])}


def ids(batch: dict) -> list[int]:
    return batch["input_ids"].flatten().tolist()


@pytest.fixture
def accelerator():
    torch.manual_seed(0)  # Accelerate's seedable sampler starts from torch's initial seed
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    yield acc
    AcceleratorState._reset_state(reset_partial_state=True)


def _model_and_optimizer():
    model = torch.nn.Linear(1, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _take(train_data, count: int) -> list[list[int]]:
    """``count`` batches as the loop reads them: from ``position()``, pass after pass."""
    epoch, skip = train_data.position()
    batches: list[list[int]] = []
    while len(batches) < count:
        batches += [ids(b) for b in itertools.islice(train_data.loader(epoch, skip), count - len(batches))]
        epoch, skip = epoch + 1, 0
    return batches


def _reference_batches(accelerator, epochs: int) -> list[list[int]]:
    plain = DataLoader(ROW_IDS, batch_size=BATCH, shuffle=True, drop_last=True, collate_fn=collate, generator=torch.Generator().manual_seed(SEED))
    plain = accelerator.prepare(plain)
    batches = []
    for epoch in range(epochs):
        plain.set_epoch(epoch)
        batches += [ids(b) for b in plain]
    return batches


@pytest.mark.parametrize("done", [0, 2, 3, 4, 7])
def test_map_style_resume_yields_what_an_uninterrupted_loader_yields_after_those_batches(accelerator, done, tmp_path):
    reference = _reference_batches(accelerator, epochs=5)
    assert reference[0:3] != reference[3:6]  # shuffled anew each epoch: skipping into the wrong epoch would show
    train_data = build_train_loader(ROW_IDS, accelerator, batch_size=BATCH, collator=collate, seed=SEED, streaming=False)
    assert isinstance(train_data, MapStyleTrainLoader)
    train_data.prepare(*_model_and_optimizer())
    train_data.resume(tmp_path, done)  # no file of its own: the checkpoint's step says where
    assert train_data.state_dict() == {"epoch": done // 3, "skip": done % 3}
    assert _take(train_data, 6) == reference[done : done + 6]


def test_map_style_state_follows_the_batches_handed_out(accelerator):
    train_data = build_train_loader(ROW_IDS, accelerator, batch_size=BATCH, collator=collate, seed=SEED, streaming=False)
    train_data.prepare(*_model_and_optimizer())
    batches = train_data.loader(0, 0)
    next(batches), next(batches)
    assert train_data.state_dict() == {"epoch": 0, "skip": 2} and train_data.position() == (0, 2)
    next(batches)
    assert next(batches, None) is None and train_data.position() == (1, 0)


def _stream():
    datasets = pytest.importorskip("datasets")
    from qaccel.zoo.user_stream import StreamingBlocks

    rows = datasets.Dataset.from_dict({"input_ids": [[i] for i in range(ROWS)]}).to_iterable_dataset().with_format("torch")
    return StreamingBlocks(rows, rank=0, world_size=1, where="rows")


def test_streaming_resume_continues_at_the_block_after_the_checkpoint(accelerator, tmp_path):
    first = build_train_loader(_stream(), accelerator, batch_size=BATCH, collator=collate, seed=SEED, streaming=True)
    assert isinstance(first, StreamingTrainLoader)
    first.prepare(*_model_and_optimizer())
    endless = [[(k * BATCH + j) % ROWS for j in range(BATCH)] for k in range(8)]  # file order, epoch after epoch
    assert _take(first, 4) == endless[:4]  # 12 blocks: all of epoch 0 and 2 of epoch 1
    first.checkpoint_writer()(tmp_path)
    assert json.loads((tmp_path / "qaccel_stream_state.json").read_text()) == [{"epoch": 1, "blocks": 2, "rank": 0, "world_size": 1}]

    resumed = build_train_loader(_stream(), accelerator, batch_size=BATCH, collator=collate, seed=SEED, streaming=True)
    resumed.prepare(*_model_and_optimizer())
    resumed.resume(tmp_path, micro_steps_done=4)
    assert resumed.position() == (0, 0)
    assert _take(resumed, 4) == endless[4:8]


def test_a_stream_is_one_endless_pass(accelerator):
    train_data = build_train_loader(_stream(), accelerator, batch_size=BATCH, collator=collate, seed=SEED, streaming=True)
    with pytest.raises(ValueError, match=r"loader\(epoch=1\): a stream is one endless pass"):
        train_data.loader(1, 0)
    assert [ids(b) for b in itertools.islice(train_data.loader(0, 2), 2)] == [[6, 7, 8], [9, 0, 1]]  # skip: two batches
