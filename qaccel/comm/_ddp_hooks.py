"""A DDP communication hook that is stock averaging plus exact byte accounting.

Plain DDP (AdamW, no compression) is the baseline every 1-bit optimizer is compared with, so its
traffic goes through the same :class:`WireMeter` as ours. The hook changes nothing numerically: it
records the ring all-reduce bytes of the bucket and hands over to torch's own ``allreduce_hook``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ._accounting import WireMeter, ring_all_reduce_bytes

__all__ = ["metered_allreduce_hook"]


def metered_allreduce_hook(meter: WireMeter, process_group: dist.ProcessGroup | None = None) -> Callable:
    """A hook for ``DistributedDataParallel.register_comm_hook(None, hook)`` that meters stock averaging.

    Bytes are recorded under the kind ``"ddp.all_reduce"`` as a ring all-reduce of the bucket,
    ``2 (N-1)/N`` of its size, which is what gloo's and NCCL's ring algorithms send per rank.
    """

    # Unannotated on purpose: DDP inspects the hook's annotations and rejects the strings that
    # `from __future__ import annotations` would leave there.
    def hook(state, bucket):  # noqa: ANN001, ANN202
        buffer = bucket.buffer()
        world_size = dist.get_world_size(process_group)
        nbytes = ring_all_reduce_bytes(buffer.numel() * buffer.element_size(), world_size)
        meter.record("ddp.all_reduce", sent_bytes=nbytes, recv_bytes=nbytes)
        return allreduce_hook(process_group, bucket)

    return hook
