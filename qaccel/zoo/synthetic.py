"""Synthetic, learnable token data that needs no download (examples, tests, smoke runs)."""

from __future__ import annotations

import torch

__all__ = ["bigram_sequences"]


def bigram_sequences(vocab: int, seq_len: int, num_seqs: int, seed: int) -> torch.Tensor:
    """Sequences from a fixed random bigram chain with 4 equally likely successors per token.

    The best achievable next-token loss is ln 4, so a model's progress is easy to read.

    Returns:
        int64 tensor of shape ``(num_seqs, seq_len)``.
    """
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=gen)  # (vocab, 4)
    tokens = torch.empty(num_seqs, seq_len, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (num_seqs,), generator=gen)
    for t in range(1, seq_len):
        choice = torch.randint(0, 4, (num_seqs,), generator=gen)
        tokens[:, t] = successors[tokens[:, t - 1], choice]
    return tokens
