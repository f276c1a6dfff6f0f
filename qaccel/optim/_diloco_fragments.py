"""DiLoCo's fragments (Streaming DiLoCo, arXiv 2501.18512): parts of the model that sync in turn.

The trainable parameters, in model order, are cut into F contiguous fragments of about equal size
(by each parameter's full size, so every rank of an HSDP model cuts alike). Fragment ``f`` syncs
when the inner step count is ``(f + 1) * H / F`` modulo H: with F = 1 that is every H steps, with
more each fragment keeps period H, staggered by H / F, so a sync moves about 1/F of the model. Each
fragment owns its global weights, its outer SGD (the momentum of one fragment never moves on
another's sync) and its outer all-reduce (its own rounding seeds and error feedback).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..comm import WireCodec, WireMeter, ring_all_reduce_bytes
from ..fsdp import QuantizedReplicaAllReduce, SeedSchedule, UnitPlan, merge_segments
from ._diloco_islands import Islands
from .diloco_config import DiLoCoConfig

__all__ = ["OuterFragment", "split_fragments", "fragment_offset"]


def split_fragments(sizes: list[int], count: int) -> list[list[int]]:
    """Parameter indices per fragment: contiguous runs, a fragment closing once the values so far reach its share.

    Raises:
        ValueError: fewer parameters than fragments.
    """
    if len(sizes) < count:
        raise ValueError(f"DiLoCo fragments={count}: the model has {len(sizes)} trainable parameters; at most that many fragments")
    total, fragments, current, seen = sum(sizes), [], [], 0
    for index, size in enumerate(sizes):
        current.append(index)
        seen += size
        left_params, left_fragments = len(sizes) - index - 1, count - len(fragments) - 1
        share_reached = seen * count >= total * (len(fragments) + 1)
        if left_fragments and (share_reached or left_params == left_fragments):
            fragments.append(current)
            current = []
    fragments.append(current)
    return fragments


def fragment_offset(index: int, count: int, sync_every: int) -> int:
    """The inner step, modulo ``sync_every``, at which fragment ``index`` of ``count`` syncs."""
    return (index + 1) * (sync_every // count) % sync_every


class OuterFragment:
    """One fragment's global weights, outer Nesterov SGD and outer all-reduce over the islands.

    Args:
        index: the fragment's number (its seed stream's unit).
        params: indices of its parameters in the model's trainable parameters.
        islands: the run's islands.
        config: DiLoCo's settings.
        seeds: the run's rounding seeds.
        meter: where the outer collectives record their bytes.
        kinds: the meter's kinds: (fp32 all-reduce, quantized reduce-scatter, quantized all-gather).
    """

    def __init__(
        self, index: int, params: list[int], islands: Islands, config: DiLoCoConfig, seeds: SeedSchedule, meter: WireMeter, kinds: tuple[str, str, str]
    ) -> None:
        self.index, self.params, self.islands, self.seeds, self.meter, self.kinds = index, params, islands, seeds, meter, kinds
        local = self.local_tensors()
        self.numels = [t.numel() for t in local]
        self.global_weights = torch.cat([t.detach().reshape(-1).float() for t in local])
        momentum = config.outer_momentum
        self.outer_optimizer = torch.optim.SGD([self.global_weights], lr=config.outer_lr, momentum=momentum, nesterov=momentum > 0)
        self.synced_at = 0  # the inner step of its last sync (0: none yet)
        self.quantized = self._quantized_all_reduce(config) if config.outer_bits is not None and islands.count > 1 else None

    def local_tensors(self) -> list[torch.Tensor]:
        """This rank's values of the fragment's parameters (views that write through)."""
        tensors = self.islands.local_tensors()
        return [tensors[i] for i in self.params]

    def _quantized_all_reduce(self, config: DiLoCoConfig) -> QuantizedReplicaAllReduce:
        bits = config.outer_bits
        quantizable = self.islands.quantizable()
        segments = merge_segments((numel, quantizable[i]) for numel, i in zip(self.numels, self.params, strict=True))
        plan = UnitPlan(index=self.index, name=f"diloco.fragment{self.index}", segments=segments, enabled=True)
        codec = WireCodec(bits=bits, bucket_size=1024 if bits == 8 else 128)
        return QuantizedReplicaAllReduce(
            plan, codec, self.seeds, self.meter, self.islands.group, dist.get_rank(), kinds=self.kinds[1:], error_feedback=config.outer_error_feedback
        )

    @torch.no_grad()
    def sync(self, inner_step: int) -> None:
        """Average the fragment's pseudo-gradient over the islands, take its outer step, and write it into every island."""
        tensors = self.local_tensors()
        delta = self.global_weights - torch.cat([t.detach().reshape(-1).float() for t in tensors])
        islands = self.islands.count
        if self.quantized is not None:
            self.quantized(delta)
            self.seeds.advance()
        elif islands > 1:
            nbytes = ring_all_reduce_bytes(delta.numel() * delta.element_size(), islands)
            self.meter.record(self.kinds[0], sent_bytes=nbytes, recv_bytes=nbytes)
            dist.all_reduce(delta, op=dist.ReduceOp.SUM, group=self.islands.group)
        self.global_weights.grad = delta.div_(islands)
        self.outer_optimizer.step()
        self.global_weights.grad = None
        for tensor, values in zip(tensors, self.global_weights.split(self.numels), strict=True):
            tensor.copy_(values.view_as(tensor))
        self.synced_at = inner_step

    def state_dict(self) -> dict[str, Any]:
        """Its global weights, outer optimizer, last sync, and this rank's error-feedback buffers (with outer bits)."""
        errors = [] if self.quantized is None else [t.clone() for pair in self.quantized.errors.values() for t in pair]
        return {
            "global_weights": self.global_weights.detach().clone(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "synced_at": self.synced_at,
            "errors": errors,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the size is checked; the error buffers by the quantized all-reduce)."""
        weights = state["global_weights"]
        if weights.numel() != self.global_weights.numel():
            raise ValueError(
                f"DiLoCo checkpoint: fragment {self.index} has {weights.numel()} global weights but the model's has "
                f"{self.global_weights.numel()} trainable values"
            )
        with torch.no_grad():
            self.global_weights.copy_(weights)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.synced_at = int(state["synced_at"])
        if state["errors"]:  # the fragment's flat fp32 buffer: (sent chunks, own summed chunk)
            self.quantized.load_errors(self.global_weights.numel(), torch.float32, *state["errors"])
