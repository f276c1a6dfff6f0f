"""The offline bigram data: shape, determinism, and at most 4 successors per token."""

import torch

from qaccel.zoo import bigram_sequences


def test_bigram_sequences_follow_a_fixed_chain():
    a = bigram_sequences(vocab=50, seq_len=40, num_seqs=64, seed=3)
    assert a.shape == (64, 40) and a.dtype == torch.int64
    assert torch.equal(a, bigram_sequences(vocab=50, seq_len=40, num_seqs=64, seed=3))
    assert not torch.equal(a, bigram_sequences(vocab=50, seq_len=40, num_seqs=64, seed=4))
    assert int(a.min()) >= 0 and int(a.max()) < 50
    successors: dict[int, set[int]] = {}
    for row in a.tolist():
        for prev, nxt in zip(row[:-1], row[1:], strict=True):
            successors.setdefault(prev, set()).add(nxt)
    assert max(len(s) for s in successors.values()) <= 4
    assert max(len(s) for s in successors.values()) >= 2  # not a deterministic chain
