"""The small DDP model and its batches that the record tests (wire bytes, checkpoints) train with 0/1 Adam and 1-bit Adam.

Both records were written with exactly this model and data: changing either invalidates them.
"""

from __future__ import annotations

import torch
from torch import nn


class Stack(nn.Module):
    """An embedding table under three tanh layers and a 3-way head."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(8, 24)
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(3))
        self.head = nn.Linear(24, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.table(idx)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def stack_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: every table row twice, and regression targets."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randperm(16, generator=generator) % 8, torch.randn(16, 3, generator=generator)
