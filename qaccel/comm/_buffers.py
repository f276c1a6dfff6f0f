"""Communication buffers that live across steps instead of being allocated per collective.

On CPU every multi-MB ``torch.empty`` is a fresh ``mmap`` whose pages fault in on first touch, and
a QSDP step allocates several per unit and direction (FSDP2's flat buffers through
``Comm.allocate``, plus our encoded blobs). :class:`BufferPool` hands out buffers that are reused
once nobody holds them any more: a pooled tensor is free when its storage has no other user (no
tensor or view of it is alive outside the pool), which is exact whatever FSDP2 keeps or drops.

On CUDA the pool hands out plain ``torch.empty`` tensors: PyTorch's caching allocator already
reuses device memory, and it also knows on which streams a block is still in use, which a
reference count cannot see.
"""

from __future__ import annotations

import sys

import torch

from .._torch_internals import storage_use_count

__all__ = ["BufferPool"]

# sys.getrefcount(entry[0]) when only the pool's entry list refers to the tensor object: the list
# plus getrefcount's own argument.
_IDLE_PY_REFS = 2


def _idle(entry: list) -> bool:
    """No Python reference to the pooled tensor object and no other tensor (view) on its storage."""
    return sys.getrefcount(entry[0]) == _IDLE_PY_REFS and storage_use_count(entry[0]) == entry[1]


class BufferPool:
    """Reusable flat buffers keyed by ``(numel, dtype, device)``.

    Args:
        max_per_key: at most this many buffers of one key are kept (a key whose buffers are all
            in use gets a fresh, unpooled tensor beyond that).
    """

    def __init__(self, max_per_key: int = 4) -> None:
        self.max_per_key = max_per_key
        self._pools: dict[tuple, list[list]] = {}  # key -> [[tensor, storage users when idle], ...]
        self.hits = 0
        self.misses = 0

    def get(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A flat tensor of ``numel`` elements whose contents are undefined (like ``torch.empty``)."""
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        key = (numel, dtype, device)
        entries = self._pools.setdefault(key, [])
        for entry in entries:
            if _idle(entry):
                self.hits += 1
                return entry[0]
        self.misses += 1
        tensor = torch.empty(numel, dtype=dtype, device=device)
        if len(entries) < self.max_per_key:
            # Storage users with only the pool holding it, measured the way _idle measures it.
            entries.append([tensor, storage_use_count(tensor)])
        return tensor

    def nbytes(self) -> int:
        """Bytes held by the pool."""
        return sum(e[0].numel() * e[0].element_size() for entries in self._pools.values() for e in entries)

    def clear(self) -> None:
        self._pools.clear()
