"""The training batches of one rank: one interface (:class:`TrainLoader`), a map-style and a streaming implementation.

The loop asks for ``loader(epoch, skip)`` (the device batches of pass ``epoch`` after its first
``skip``), then for the next pass, starting at ``position()``. How the batches are prepared, what a
checkpoint records of the position and how a resumed run finds it again is each implementation's:

- :class:`MapStyleTrainLoader`: a dataset with a length, ``accelerator.prepare``'d: Accelerate splits
  it across ranks and shuffles it with a sampler seeded per epoch, so the order is a function of
  (seed, epoch) and the position is the number of micro-batches trained on, which the checkpoint's
  step says. A resumed run skips the batches already seen (``skip_first_batches``), as Accelerate's
  ``examples/by_feature/checkpointing.py`` does.
- :class:`StreamingTrainLoader`: a stream already split per rank (``--streaming``). It is not prepared
  (Accelerate would dispatch an iterable's batches from rank 0) and reads in this process; it never
  ends (the stream starts its next epoch itself), and its position is each rank's stream state,
  gathered to the main process into the checkpoint's ``qaccel_stream_state.json``.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.data import DataLoader

from .collate import BatchSeededCollator

if TYPE_CHECKING:
    from ..integration import Accelerator

__all__ = ["MapStyleTrainLoader", "ResumableStream", "StreamingTrainLoader", "TrainLoader", "build_train_loader"]


class ResumableStream(Protocol):
    """An endless iterable dataset that can say and take its position (``qaccel.zoo``'s ``StreamingBlocks``)."""

    def __iter__(self) -> Iterator[Any]: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...


class TrainLoader(abc.ABC):
    """This rank's training batches, pass after pass, resumable where a checkpoint left them.

    Args:
        dataloader: the batches, on the host; the implementation decides how they reach the device.
        accelerator: the run's ``qaccel.Accelerator``.
    """

    def __init__(self, dataloader: DataLoader, accelerator: Accelerator) -> None:
        self.dataloader = dataloader
        self.accelerator = accelerator

    @abc.abstractmethod
    def prepare(self, model: Any, optimizer: Any, *others: Any) -> list[Any]:
        """``accelerator.prepare`` the model, its optimizer (FSDP2 needs both in one call) and ``others``,
        with this loader as it needs; returns ``[model, optimizer, *others]`` prepared."""

    @abc.abstractmethod
    def loader(self, epoch: int, skip: int) -> Iterator[Any]:
        """The device batches of pass ``epoch``, after its first ``skip``."""

    @abc.abstractmethod
    def position(self) -> tuple[int, int]:
        """The ``(epoch, skip)`` of the next :meth:`loader` call: where the next batch comes from."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, int]:
        """This rank's position, as JSON values."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state`` (from :meth:`state_dict`)."""

    @abc.abstractmethod
    def resume(self, folder: Path, micro_steps_done: int) -> None:
        """After ``accelerator.load_state(folder)``: continue after the ``micro_steps_done`` batches
        (this rank's) that the checkpoint's run trained on."""

    @abc.abstractmethod
    def checkpoint_writer(self) -> Callable[[Path], None]:
        """Collective, on every rank before a checkpoint: what writes the position into the checkpoint folder (main process)."""


class MapStyleTrainLoader(TrainLoader):
    """A dataset with a length: prepared by Accelerate, reshuffled per epoch, resumed by skipping batches.

    ``state_dict()`` is ``{"epoch", "skip"}``: the pass and the batches of it handed out. A checkpoint
    holds no file of it: the order is a function of (seed, epoch), so the step it records says where.
    """

    def __init__(self, dataloader: DataLoader, accelerator: Accelerator) -> None:
        super().__init__(dataloader, accelerator)
        self.epoch, self.skip = 0, 0

    def prepare(self, model: Any, optimizer: Any, *others: Any) -> list[Any]:
        model, optimizer, self.dataloader, *others = self.accelerator.prepare(model, optimizer, self.dataloader, *others)
        return [model, optimizer, *others]

    def loader(self, epoch: int, skip: int) -> Iterator[Any]:
        self.dataloader.set_epoch(epoch)  # the sampler's seed for this pass
        batches = self.accelerator.skip_first_batches(self.dataloader, skip) if skip else self.dataloader
        self.epoch, self.skip = epoch, skip
        for batch in batches:
            self.skip += 1
            yield batch
        self.epoch, self.skip = epoch + 1, 0

    def position(self) -> tuple[int, int]:
        return self.epoch, self.skip

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "skip": self.skip}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.skip = int(state["epoch"]), int(state["skip"])

    def resume(self, folder: Path, micro_steps_done: int) -> None:
        """The checkpoint's step says where: ``divmod(micro_steps_done, batches per pass)`` (prepare first)."""
        epoch, skip = divmod(micro_steps_done, len(self.dataloader))  # the prepared loader: this rank's batches
        self.load_state_dict({"epoch": epoch, "skip": skip})

    def checkpoint_writer(self) -> Callable[[Path], None]:
        return lambda folder: None  # the checkpoint's step is the position


class StreamingTrainLoader(TrainLoader):
    """A stream split per rank (``dataloader.dataset`` a :class:`ResumableStream`): one endless pass, resumed from its state.

    ``state_dict()`` is the stream's (``{"epoch", "blocks", "rank", "world_size"}``), written for every
    rank into ``qaccel_stream_state.json`` by ``qaccel.zoo``'s ``write_stream_state``.
    """

    def __init__(self, dataloader: DataLoader, accelerator: Accelerator) -> None:
        super().__init__(dataloader, accelerator)
        self.stream: ResumableStream = dataloader.dataset

    def prepare(self, model: Any, optimizer: Any, *others: Any) -> list[Any]:
        return list(self.accelerator.prepare(model, optimizer, *others))  # the stream is this rank's share already

    def loader(self, epoch: int, skip: int) -> Iterator[Any]:
        """The stream's batches from its position on, after ``skip`` more; ``epoch`` must be 0 (one endless pass)."""
        from accelerate.utils import send_to_device  # importing qaccel.training stays free of accelerate

        if epoch != 0:
            raise ValueError(f"StreamingTrainLoader.loader(epoch={epoch}): a stream is one endless pass (epoch 0); its own epochs follow from its state")
        batches = (send_to_device(batch, self.accelerator.device) for batch in self.dataloader)
        return itertools.islice(batches, skip, None)

    def position(self) -> tuple[int, int]:
        return 0, 0  # the stream's state holds the place

    def state_dict(self) -> dict[str, int]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.stream.load_state_dict(state)

    def resume(self, folder: Path, micro_steps_done: int) -> None:
        """This rank's stream state from the checkpoint (``qaccel_stream_state.json``): the block after the last one trained on."""
        from ..zoo.user_stream import read_stream_state  # the zoo loads datasets: on first use

        self.load_state_dict(read_stream_state(folder, self.accelerator.process_index))

    def checkpoint_writer(self) -> Callable[[Path], None]:
        from accelerate.utils import gather_object

        from ..zoo.user_stream import write_stream_state

        states = gather_object([self.state_dict()])  # every rank's position, to the main one
        return lambda folder: write_stream_state(folder, states)


def build_train_loader(
    dataset: Any, accelerator: Accelerator, *, batch_size: int, collator: Callable[[list], Any], seed: int, streaming: bool
) -> TrainLoader:
    """The training batches of ``dataset``: a :class:`StreamingTrainLoader` for a stream, else a :class:`MapStyleTrainLoader`.

    Args:
        dataset: a map-style dataset, or with ``streaming`` a :class:`ResumableStream` (this rank's share).
        batch_size: examples per micro-batch on this rank; a last incomplete batch is dropped.
        collator: turns examples into a batch; wrapped in a :class:`BatchSeededCollator` (masked-LM
            masks drawn per batch, not from the global RNG's position: exact resumes).
        seed: the collator's and the shuffle's seed.
    """
    dataloader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=not streaming,  # a stream is shuffled by its buffer
        drop_last=True,
        collate_fn=BatchSeededCollator(collator, seed),
        # The loader's own generator: creating an iterator draws its base seed from it, not from the
        # global RNG that dropout uses, so a resumed run's new iterator cannot shift dropout.
        generator=torch.Generator().manual_seed(seed),
    )
    return StreamingTrainLoader(dataloader, accelerator) if streaming else MapStyleTrainLoader(dataloader, accelerator)
