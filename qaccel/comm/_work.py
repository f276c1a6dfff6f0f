"""The work object qaccel's asynchronous collectives return: finish the transport, then decode."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["DecodeOnWait"]


class DecodeOnWait(dist.Work):
    """The work of an asynchronous collective: ``wait()`` finishes the transport, then decodes.

    FSDP2 waits on the work of a prefetched all-gather right before the unit's forward needs the
    weights, so the transport overlaps the compute in between and the decode runs once, on wait.
    ``collective`` names the ``torch.distributed`` function that started the transport: a failure
    surfaces here, outside that function, and error reports (``qaccel.training.faults``) name it.
    ``keep_alive`` holds the tensors the transport reads or writes in the background (a pooled send
    blob, FSDP2's pooled input) until ``wait()``: the transport's own references live in C++, where
    :class:`qaccel.comm.BufferPool` cannot see them, so without these the pool could hand such a
    buffer out again while gloo still reads it.
    """

    def __init__(
        self, transport: dist.Work, finish: Callable[[], None] | None, collective: str, keep_alive: tuple[torch.Tensor, ...] = ()
    ) -> None:
        super().__init__()
        self._transport = transport
        self._finish = finish
        self._keep_alive = keep_alive
        self._done = False
        self.collective = collective

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - torch's signature; the transport has its own
        if not self._done:
            self._transport.wait()
            if self._finish is not None:
                self._finish()
            self._done = True
            self._keep_alive = ()
        return True

    def is_completed(self) -> bool:
        return self._done
