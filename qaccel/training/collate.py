"""A collator whose random masking depends on the batch, not on where the global RNG happens to be.

Masked-LM collators draw their masks from torch's global RNG. Accelerate's dataloader collates one
batch ahead, so the RNG state a checkpoint records already includes the masks of the next batch,
and a resumed run would draw that batch's masks again from a different state: masks, and with
them dropout, would differ from the uninterrupted run. Seeding each batch's masking from (seed,
the batch's token ids) inside a forked RNG makes the masks a function of the batch alone and
leaves the global stream (dropout) untouched, so resumed and uninterrupted runs agree bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BatchSeededCollator"]


class BatchSeededCollator:
    """Wrap ``collator`` so each call runs with torch's RNG seeded from (seed, the batch's ids)."""

    def __init__(self, collator: Callable[[list], Any], seed: int) -> None:
        self.collator = collator
        self.seed = int(seed)

    def _batch_seed(self, examples: list) -> int:
        digest = hashlib.sha256(str(self.seed).encode())
        for example in examples:
            ids = example["input_ids"] if isinstance(example, dict) else example
            digest.update(torch.as_tensor(ids).to(torch.int64).numpy().tobytes())
        return int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)

    def __call__(self, examples: list) -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self._batch_seed(examples))
            return self.collator(examples)
